"""End-to-end: the training scripts' command lines, on CPU.

Every configuration is launched once (module-scoped fixtures) and all its checks read the
files it wrote: one single-process run (continued with --resume, next to a straight run), one
2-rank launch per ZeRO stage, one DeepSpeed reference run, and four bad-input runs.

A fresh interpreter costs 5-10 s of imports (torch, dynamo, DeepSpeed) per process on this
2-core machine, so the command lines run as each program's main(argv) on ranks forked from
the tests' preloaded forkserver, with torchrun's environment where torchrun would start them
(tests/support/command_runs.py), stage 3's 2-rank launch as well: torchrun itself, starting
minizero.train's ranks and meeting them, is tested where it is the point, and there alone
(tests/tools/test_two_nodes.py: the README's two-node command, two real torchruns of
`-m minizero.train --stage 3` to a completed run; tests/tools/test_run_folder.py: a failed
rank's line as the Root Cause of torchrun's report; tests/tools/test_preflight.py:
`torchrun --standalone`).
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys

import pytest

from minizero.comm import free_port
from tests.support.command_runs import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
# micro model, 8x8 images, a few hundred synthetic images, 3 steps.
SMALL = ["--model", "micro", "--image-size", "8", "--synthetic-train", "256", "--synthetic-test", "64",
         "--max-steps", "3", "--num-samples", "4"]
COLUMNS = ["step", "epoch", "loss", "lr", "loss_scale", "samples_per_s", "tokens_per_s", "mem_mb",
           "peak_mem_mb", "elapsed_s"]
KEYS = ["library", "status", "stage", "dtype", "world_size", "model", "params", "steps", "losses", "final_loss",
        "test_loss", "model_state_bytes", "peak_mem_mb", "samples_per_s", "comm_wire_bytes_per_step",
        "comm_inter_node_bytes_per_step", "ranks_per_node",
        "skipped_steps", "memory_moments", "config"]


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _ok(p):
    assert p.returncode == 0, f"{' '.join(p.args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def _torchrun(nproc):
    return [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))   # shared: the codebook is computed once


def _check_run(save_dir, library, stage, world_size, steps=3):
    with open(os.path.join(save_dir, "metrics.csv")) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == COLUMNS
    assert rows and int(rows[-1]["step"]) == steps
    assert all(math.isfinite(float(r["loss"])) and float(r["samples_per_s"]) > 0 for r in rows)

    with open(os.path.join(save_dir, "summary.json")) as f:
        s = json.load(f)
    assert list(s) == KEYS
    assert (s["library"], s["status"], s["stage"], s["dtype"], s["world_size"], s["steps"]) == \
        (library, "completed", stage, "fp32", world_size, steps)
    assert len(s["losses"]) == steps and all(math.isfinite(x) for x in s["losses"])
    assert s["final_loss"] == s["losses"][-1] and math.isfinite(s["test_loss"])
    assert len(s["model_state_bytes"]) == world_size and len(s["peak_mem_mb"]) == world_size
    assert s["model_state_bytes"][0]["params"] > 0
    assert s["params"] > 1000   # counted before the engine: ZeRO-3 leaves the module's parameters empty
    assert s["config"]["zero_optimization"]["stage"] == stage

    from PIL import Image
    with Image.open(os.path.join(save_dir, "samples.png")) as im:
        im.verify()
        assert im.size[0] > 0 and im.size[1] > 0
    return s


# ----------------------------------------------------------------------------- minizero

@pytest.fixture(scope="module")
def single_run(tmp_path_factory, data_dir):
    save = str(tmp_path_factory.mktemp("single"))
    # A constant lr (no config scheduler): the resume test compares with a straight 5-step
    # run, and minGPT's token schedule would stretch with --max-steps.
    p = _ok(run_command("minizero.train", [*SMALL, "--lr-schedule", "config", "--data-dir", data_dir,
                                           "--save-dir", save]))
    return save, p


def test_single_process(single_run):
    save, p = single_run
    s = _check_run(save, "minizero", 0, 1)
    assert s["comm_wire_bytes_per_step"]["total"] == 0    # one process: nothing on the wire
    assert "step=   3 loss=" in p.stdout                   # the metrics line
    assert os.path.isfile(os.path.join(save, "latest"))    # checkpoint at the end


def test_resume_is_exact(single_run, tmp_path, data_dir):
    """3 steps + --resume to 5 == 5 steps straight, bit for bit (weights, Adam state, data
    position, dropout RNG all restored)."""
    save, _ = single_run
    five = [a if a != "3" else "5" for a in SMALL] + ["--lr-schedule", "config", "--data-dir", data_dir]
    runs = {"resumed": ["--resume", save], "straight": []}
    for k, extra in runs.items():
        p = run_command("minizero.train", [*five, "--save-dir", str(tmp_path / k), *extra])
        assert p.returncode == 0, f"{k}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    resumed = _check_run(str(tmp_path / "resumed"), "minizero", 0, 1, steps=5)
    straight = _check_run(str(tmp_path / "straight"), "minizero", 0, 1, steps=5)
    with open(os.path.join(save, "summary.json")) as f:
        assert resumed["losses"][:3] == json.load(f)["losses"]   # history carried over
    assert resumed["losses"] == straight["losses"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torchrun_two_ranks(stage, tmp_path, data_dir):
    save, trace = str(tmp_path / f"z{stage}"), str(tmp_path / f"trace{stage}")
    argv = [*SMALL, "--stage", str(stage), "--data-dir", data_dir, "--save-dir", save, "--trace", trace,
            "--comms-logger"]
    p = _ok(run_command("minizero.train", argv, nproc=2))
    # the trainer finds its tracer: it says where the trace goes, and prints the step's table
    assert f"tracing step 2 into {trace}" in p.stdout + p.stderr and "collectives of step 2 on rank 0 of 2" in p.stdout
    s = _check_run(save, "minizero", stage, 2)
    comm = s["comm_wire_bytes_per_step"]
    assert comm["total"] > 0
    if stage == 0:
        assert comm["all_reduce"] > 0 and comm["all_gather"] == 0
    if stage >= 1:
        assert comm["all_gather"] > 0
    # --trace: step 2 by default, one file per rank, the merged file and the picture; each
    # op's events sum to the ledger's bytes over that step (tests/tools/test_trace.py checks the
    # ledger against engine.comm_stats())
    assert sorted(os.listdir(trace)) == ["rank0.json", "rank1.json", "replay.html", "timeline.png", "trace.json"]
    for rank in (0, 1):
        with open(os.path.join(trace, f"rank{rank}.json")) as f:
            doc = json.load(f)
        assert doc["otherData"]["steps"] == [2]
        events = [e for e in doc["traceEvents"] if e.get("cat") in ("collectives", "copies")]
        for op, counts in doc["otherData"]["ledger"]["2"].items():
            assert sum(e["args"]["bytes"] for e in events if e["args"]["op"] == op) == counts["bytes"]
            assert sum(1 for e in events if e["args"]["op"] == op) == counts["calls"]
    # --comms-logger: DeepSpeed's table, and its numbers
    with open(os.path.join(save, "comms_summary.txt")) as f:
        assert f.readline().split()[:5] == ["Comm.", "Op", "Message", "Size", "Count"]
    with open(os.path.join(save, "comms_summary.json")) as f:
        summary = json.load(f)
    assert ("all_reduce" if stage == 0 else "all_gather_into_tensor") in summary


# ----------------------------------------------------------------------------- DeepSpeed

def test_reference_deepspeed(tmp_path, data_dir):
    pytest.importorskip("deepspeed")
    save = str(tmp_path / "ds")
    _ok(run_command("reference/train.py", [*SMALL, "--data-dir", data_dir, "--save-dir", save]))
    s = _check_run(save, "deepspeed", 0, 1)
    assert s["config"]["optimizer"]["params"]["torch_adam"] is True


# ----------------------------------------------------------------------------- bad input

def test_bad_input_one_clear_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_cfg = tmp_path / "bad.json"
    bad_cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_cliping": 1.0,
                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    cases = {
        "cifar": (["--dataset", "cifar10", "--data-dir", str(empty)], [str(empty), "--dataset synthetic"]),
        "config": (["--config", str(bad_cfg)], ["gradient_cliping"]),
        "resume": (["--resume", str(empty)], [str(empty), "no checkpoint found"]),
        "trace": (["--trace", str(tmp_path / "t"), "--trace-steps", "5"], ["--trace-steps 5", "--max-steps 3"]),
    }
    for k, (extra, _) in cases.items():
        p = run_command("minizero.train", [*SMALL, "--save-dir", str(tmp_path / k), *extra], timeout=180)
        out, err = p.stdout, p.stderr
        assert p.returncode != 0, f"{k}: exited 0\n{out}\n{err}"
        assert "Traceback" not in err, f"{k}:\n{err}"
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert len(lines) == 1, f"{k}: expected one error line, got:\n{err}"
        for needle in cases[k][1]:
            assert needle in lines[0], f"{k}: {needle!r} not in {lines[0]!r}"


def test_resume_from_another_model_is_one_clear_line(single_run):
    """A checkpoint of the micro model resumed into the tiny model: one line, no traceback."""
    save, _ = single_run
    args = [a if a != "micro" else "tiny" for a in SMALL]
    p = run_command("minizero.train", [*args, "--resume", save, "--save-dir", save + "-tiny"], timeout=180)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "different model" in lines[0], p.stderr
