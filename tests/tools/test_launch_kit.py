"""launch/kit.py, what the launch scripts share: the step statistics, the tables, one-line
flag errors and the machine line. Nothing here launches ranks (the benchmarks' tests do)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
if str(LAUNCH) not in sys.path:
    sys.path.insert(0, str(LAUNCH))
kit = load_script(LAUNCH / "kit.py", register=True)   # the one the benchmarks' `import kit` gives, if loaded


def test_step_time_is_the_slowest_rank_per_step():
    med, low = kit.step_ms([[0.1, 0.3, 0.2], [0.2, 0.1, 0.5]])   # slowest per step: 0.2, 0.3, 0.5
    assert med == pytest.approx(300.0) and low == pytest.approx(200.0)
    assert kit.samples_per_s(250.0, 4) == pytest.approx(16.0)
    assert kit.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert kit.spread([]) is None


def test_md_table_and_fmt():
    t = kit.md_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]
    assert kit.md_table(["x"], [["a | b"]]).splitlines()[2] == "| a \\| b |"
    with pytest.raises(ValueError):
        kit.md_table(["a", "b"], [["1"]])
    assert kit.fmt(None) == "-" and kit.fmt(float("nan")) == "-" and kit.fmt(1.25, ".1f") == "1.2"
    assert kit.ms(123.4) == "123" and kit.ms(1.234) == "1.23" and kit.ms(None) == "-"


def test_comma_lists_and_counts_give_one_line():
    assert kit.comma_list("3,0,3", (0, 1, 2, 3), "stages", int) == [0, 3]
    for bad in ("5", "x", ""):
        with pytest.raises(kit.BenchError, match="--stages"):
            kit.comma_list(bad, (0, 1, 2, 3), "stages", int)
    args = type("A", (), {"reps": 0, "warmup": 0})()
    kit.at_least(args, 0, ("warmup",))
    with pytest.raises(kit.BenchError, match="--reps must be >= 1, got 0"):
        kit.at_least(args, 1, ("reps",))
    with pytest.raises(kit.BenchError, match="unrecognized arguments"):
        kit.OneLineParser(prog="x").parse_args(["--bogus"])


def test_model_flags_shrink_the_preset_and_refuse_what_it_cannot_build():
    args = type("A", (), {"model": "tutorial", "n_embd": 16, "n_layer": None, "n_head": None, "seq": 63})()
    kw = kit.model_kw(args)
    assert kw["n_embd"] == 16 and kw["block_size"] == 63 and kw["attn_pdrop"] == 0.0
    args.model = "huge"
    with pytest.raises(kit.BenchError, match="unknown model preset"):
        kit.model_kw(args)


def test_machine_names_the_cpu_flags_that_decide_bf16():
    line = kit.machine()
    assert line.startswith("CPU: ") or " x " in line
    if line.startswith("CPU: "):
        assert "cores;" in line
