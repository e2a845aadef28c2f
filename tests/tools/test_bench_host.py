"""launch/bench_host.py, the host-time benchmark: its schedule, its split of a step, bad flags,
and one tiny run with a column from "another" checkout (this one, run through --worker as an
older checkout would be). Timing itself is not tested; the counts of Python calls and tensor
ops are exact, so the same code must give the same counts in both columns."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.script_main import run_script_main
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "bench_host.py"

bench = load_script(SCRIPT)


def args_of(argv):
    args = bench.parse_args(argv)
    bench.check_args(args, cuda=False, gpus=0)
    return args


def test_schedule_runs_every_column_per_cell_torch_only_where_it_maps():
    args = args_of(["--libs", "minizero,torch", "--stages", "0,1,3", "--dtypes", "bf16,fp16", "--world-sizes", "2,1",
                    "--minizero-checkout", str(ROOT)])
    assert args.world_sizes == [1, 2] and args.checkouts == [{"column": f"minizero@{ROOT.name}", "root": str(ROOT)}]
    runs = bench.schedule(args)
    cells = {(r["world"], r["dtype"], r["stage"]) for r in runs}
    assert len(cells) == 2 * 2 * 3
    torch = {(r["dtype"], r["stage"]) for r in runs if r["lib"] == "torch"}
    assert torch == {("bf16", 0), ("bf16", 3)}                         # DDP / FSDP2: no ZeRO-1, no fp16
    firsts = [next(r["column"] for r in runs if (r["world"], r["dtype"], r["stage"]) == c)
              for c in sorted(cells, key=[(r["world"], r["dtype"], r["stage"]) for r in runs].index)]
    assert len(set(firsts)) == 3                                       # every column goes first somewhere
    cfg = runs[0]["config"]
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 500_000 and cfg["optimizer"]["params"]["torch_adam"]


def test_split_adds_up_to_the_step():
    """compute + hooks + collectives + step + else = the rank's median step (one step here);
    the added CPU ms is the median of the per-step differences, averaged over ranks."""
    rank = {"wall_s": [0.100], "phase_s": {"forward": [0.020], "backward": [0.050], "step": [0.025]},
            "comm_s": [{"backward": 0.010, "step": 0.005}], "plain_s": {"forward": 0.012, "backward": 0.030},
            "added_cpu_s": [0.004], "bare_optimizer_s": 0.003, "flat_floor_s": 0.002, "python_calls": 1000.0, "tensor_ops": 500.0}
    other = {**rank, "added_cpu_s": [0.001, 0.002, 0.009]}
    s = bench.split([rank])
    assert s["added_cpu_ms"] == pytest.approx(4) and bench.split([rank, other])["added_cpu_ms"] == pytest.approx(3)
    assert s["bare_optimizer_cpu_ms"] == pytest.approx(3) and s["flat_floor_cpu_ms"] == pytest.approx(2)
    assert s["compute"] == pytest.approx(42) and s["forward_hooks"] == pytest.approx(8)
    assert s["backward_hooks"] == pytest.approx(10) and s["collectives"] == pytest.approx(15)
    assert s["optimizer_step"] == pytest.approx(20) and s["else"] == pytest.approx(5)
    assert sum(s[p] for p in bench.PHASES) == pytest.approx(s["host_ms"]) == pytest.approx(100)


def test_counting_sees_python_calls_and_tensor_ops_of_forward_and_backward():
    import torch
    lin = torch.nn.Linear(3, 2)

    def f():
        lin(torch.ones(4, 3)).sum().backward()
    assert bench.count_tensor_ops(f) >= 4            # addmm, sum, and their backward
    assert bench.count_python_calls(lambda: [bench.fmt(1.0) for _ in range(7)]) >= 7


@pytest.mark.parametrize("argv, says", [
    (["--libs", "minizero,jax"], "--libs"),
    (["--world-sizes", "0"], "--world-sizes"),
    (["--world-sizes", "a"], "--world-sizes"),
    (["--minizero-checkout", "/nonexistent/before"], "no minizero package there"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_give_one_line(argv, says, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_host: error:") and says in err[0], err


def test_tiny_run_with_a_column_from_another_checkout(tmp_path, monkeypatch):
    js = tmp_path / "host.json"
    argv = ["--libs", "minizero", "--minizero-checkout", str(ROOT), "--model", "micro", "--n-embd", "21", "--seq", "16",
            "--micro-batch", "2", "--stages", "3", "--dtypes", "fp32", "--world-sizes", "1", "--warmup", "2",
            "--steps", "2", "--count-steps", "1", "--json", str(js)]
    monkeypatch.chdir(tmp_path)
    r = run_script_main(SCRIPT, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    other = f"minizero@{ROOT.name}"
    tables = [t.splitlines() for t in r.stdout.split("\n\n") if t.startswith("|")]
    assert len(tables) == 3   # wall ms, added CPU ms, the split
    head = [c.strip() for c in tables[0][0].strip("|").split("|")]
    assert head == ["ranks", "dtype", "stage", "minizero ms", f"{other} ms", f"minizero / {other}"]
    assert [c.strip() for c in tables[1][0].strip("|").split("|")] == head + ["bare AdamW + clip ms", "flat step floor ms"]
    results = {x["column"]: x for x in json.loads(js.read_text())["results"]}
    assert set(results) == {"minizero", other}
    for x in results.values():
        assert x["host_ms"] > 0 and x["compute"] > 0 and x["python_calls"] > 100 and x["tensor_ops"] > 100
        assert x["host_ms"] == pytest.approx(sum(x[p] for p in bench.PHASES), rel=1e-6)
        assert x["added_cpu_ms"] < x["host_ms"]   # the library's own CPU time, without the model's
        assert 0 < x["bare_optimizer_cpu_ms"] < x["host_ms"] and 0 < x["flat_floor_cpu_ms"] < x["host_ms"]
    # the same checkout in both columns: the same calls and ops, exactly
    assert results["minizero"]["python_calls"] == results[other]["python_calls"]
    assert results["minizero"]["tensor_ops"] == results[other]["tensor_ops"]
