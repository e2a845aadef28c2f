"""launch/bench_offload.py, the ZeRO-Offload benchmark: its arithmetic, its flags, and one tiny run.

Timing is not tested (a shared CPU makes it noise); what is: the breakdown charges every
profiler range to the right part of a step, bad flags give one line, and a two-step
minizero run at stage 3 prints the tables with the copies offload must make per step:
offload_optimizer copies the gradient shard down and the parameter shard up (equal bytes);
offload_param adds one host -> device copy of the shard per gather (forward and backward)
and the optimizer writes the shard on the host, so h2d = 2 x d2h.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.script_main import run_script_main
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "bench_offload.py"

bench = load_script(SCRIPT)


# ----------------------------------------------------------------------------- pure helpers

def test_range_kind_names_every_part():
    assert bench.range_kind("minizero::forward") == "forward"
    assert bench.range_kind("minizero::step") == "step"
    assert bench.range_kind("minizero::all_gather::block3.params") == "collectives"
    assert bench.range_kind("minizero::reduce_scatter") == "collectives"
    assert bench.range_kind("minizero::d2h::root.grads") == "d2h"
    assert bench.range_kind("minizero::h2d::block0.params") == "h2d"
    assert bench.range_kind("Optimizer.step#AdamW.step") == "adam"
    assert bench.range_kind("aten::mm") is None
    assert bench.range_kind("minizero::something_else") is None


def test_breakdown_charges_ranges_inside_the_step_to_the_step():
    # one step of 100 us: forward 0-30 (a 5 us gather, a 2 us h2d copy inside), backward 30-70
    # (a 10 us reduce-scatter inside), step 70-95 (1 d2h of 3, Adam 10, an all-gather of 4, an h2d of 2)
    ranges = [("minizero::forward", 0, 30), ("minizero::h2d::b.params", 1, 3), ("minizero::all_gather::b.params", 3, 8),
              ("minizero::backward", 30, 70), ("minizero::reduce_scatter::b.grads", 50, 60),
              ("minizero::step", 70, 95), ("minizero::d2h::b.grads", 71, 74), ("Optimizer.step#AdamW.step", 75, 85),
              ("minizero::h2d::b.params", 85, 87), ("minizero::all_gather::b.params", 88, 92),
              ("aten::mm", 10, 20)]
    b = bench.breakdown(ranges, wall_us=100.0, steps=1)
    ms = lambda us: us / 1000.0
    assert b["fwd_bwd"] == pytest.approx(ms(30 + 40 - 5 - 2 - 10))
    assert b["collectives"] == pytest.approx(ms(5 + 10 + 4))
    assert b["d2h"] == pytest.approx(ms(3)) and b["h2d"] == pytest.approx(ms(2 + 2))
    assert b["adam"] == pytest.approx(ms(10))
    assert b["step_other"] == pytest.approx(ms(25 - 3 - 10 - 2 - 4))
    assert b["loop"] == pytest.approx(ms(100 - 30 - 40 - 25))
    assert b["total"] == pytest.approx(ms(100))
    # the parts add up to the wall time
    assert sum(b[p] for p in bench.PARTS) == pytest.approx(b["total"])
    assert bench.dominant(b) == ("fwd+bwd compute", pytest.approx(53 / 100))


def test_breakdown_per_step_and_without_minizero_ranges():
    # DeepSpeed: only Adam is labelled; everything else is "loop"
    b = bench.breakdown([("Optimizer.step#AdamW.step", 10, 40), ("Optimizer.step#AdamW.step", 110, 130)],
                        wall_us=200.0, steps=2)
    assert b["adam"] == pytest.approx(0.025) and b["loop"] == pytest.approx(0.075) and b["total"] == pytest.approx(0.1)
    assert b["fwd_bwd"] == 0 and b["step_other"] == 0


def test_adam_table_for_loop_is_its_own_reference():
    rows = bench.adam_table(1000, "cpu", steps=2, warmup=1)
    assert [r["impl"] for r in rows] == ["for-loop", "foreach", "fused"]
    assert rows[0]["bitwise_equal_for_loop"] and rows[0]["speedup"] == 1.0 and rows[0]["max_abs_diff_param"] == 0.0
    assert all(r["ms"] > 0 for r in rows)


def test_configs_cover_the_cases_and_offload_param_only_at_stage_3():
    args = bench.parse_args(["--libs", "minizero,minizero-fused,deepspeed"])
    bench.check_args(args, cuda=False, gpus=0)
    jobs = [j for launch in bench.jobs_for(args) for j in launch]
    assert {(j["stage"], j["offload"]) for j in jobs} == set(bench.CASES)
    assert all(j["stage"] == 3 for j in jobs if "offload_param" in j["config"]["zero_optimization"])
    assert not any(j["lib"] == "minizero-fused" and j["offload"] == "none" for j in jobs)
    for j in jobs:
        assert j["config"]["optimizer"]["params"]["torch_adam"] is (j["lib"] != "minizero-fused")
        assert j["config"]["bf16"] == {"enabled": True}


def test_nvme_path_adds_the_nvme_rows_each_in_its_own_folder(tmp_path):
    """--nvme-path: the offloads again with "device": "nvme", one swap folder per run (each
    run locks its folder), and the note names the disk behind the path."""
    args = bench.parse_args(["--libs", "minizero,deepspeed", "--nvme-path", str(tmp_path)])
    bench.check_args(args, cuda=False, gpus=0)
    jobs = [j for launch in bench.jobs_for(args) for j in launch]
    nvme = [j for j in jobs if j["offload"].startswith("nvme:")]
    assert {(j["stage"], j["offload"]) for j in nvme} == set(bench.NVME_CASES)
    folders = []
    for j in nvme:
        paths = {sec["nvme_path"] for sec in j["config"]["zero_optimization"].values()
                 if isinstance(sec, dict) and sec.get("device") == "nvme"}
        assert paths == {str(tmp_path / f'{j["lib"]}-s{j["stage"]}-{j["offload"][5:]}')}
        folders += paths
    assert len(folders) == len(set(folders)) == 8
    assert "mounted at" in bench.disk_of(str(tmp_path / "not-yet"))


@pytest.mark.parametrize("argv, says", [
    (["--libs", "minizero,torchzero"], "--libs"),
    (["--stages", "0"], "--stages"),
    (["--stages", "x"], "--stages"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--model", "huge"], "unknown model preset"),
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--dtype", "fp8"], "--dtype"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_give_one_line(argv, says, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_offload: error:") and says in err[0], err


def test_world_size_beyond_the_gpus_is_refused():
    args = bench.parse_args(["--world-size", "4"])
    with pytest.raises(bench.BenchError, match="one rank per GPU"):
        bench.check_args(args, cuda=True, gpus=2)


# ----------------------------------------------------------------------------- a tiny run

def test_the_command_starts_from_any_folder(tmp_path):
    """`python3 launch/bench_offload.py` from another folder finds minizero (its sys.path
    line) and gives its one line on a bad flag, before torch is imported."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("bench_offload: error: --steps"), err


def test_tiny_minizero_run_prints_the_tables(tmp_path, monkeypatch):
    """main(argv) here, its ranks forked from the tests' preloaded forkserver
    (tests/support/script_main.py): a fresh interpreter and a forkserver of its own saved."""
    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    argv = ["--libs", "minizero", "--stages", "3", "--steps", "2", "--warmup", "1",
           "--profile-steps", "1", "--n-layer", "2", "--n-embd", "32", "--seq", "16", "--micro-batch", "1",
           "--no-adam", "--out", str(md), "--json", str(js)]
    monkeypatch.chdir(tmp_path)
    r = run_script_main(SCRIPT, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == md.read_text().strip()
    assert "## Step time" in r.stdout and "## Where the step goes" in r.stdout
    for offload in ("none", "optimizer", "optimizer+param"):
        assert f"| 3 | {offload} |" in r.stdout
    assert "dominates" in r.stdout
    res = {x["offload"]: x for x in json.loads(js.read_text())["results"]}
    assert res["none"]["copies_per_step"] == {"d2h": 0, "h2d": 0, "wire": res["none"]["copies_per_step"]["wire"]}
    opt, both = res["optimizer"]["copies_per_step"], res["optimizer+param"]["copies_per_step"]
    assert opt["d2h"] > 0 and opt["h2d"] == opt["d2h"]          # gradient shard down, parameter shard up
    assert both["d2h"] == opt["d2h"] and both["h2d"] == 2 * both["d2h"]
    # offload_optimizer takes 12 bytes per shard element off the device (bf16: d2h is 2 per element)
    dev = lambda x: sum(res[x]["memory"]["device"].values())
    assert dev("none") - dev("optimizer") == 6 * opt["d2h"]
