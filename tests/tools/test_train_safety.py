"""A run never loses its results, and says what went wrong in one line (the command line, as a user runs it).

- a diverged bf16/fp32 run stops after --max-nonfinite-steps bad steps; fp16 stops at its
  minimum loss scale; either way metrics.csv and summary.json are written, and `latest`
  never names a checkpoint with non-finite weights;
- a save folder holding another run is refused (results never overwritten), and one in
  use by a running run is refused (no interleaving);
- --resume without `latest` lists the complete checkpoints; --tag picks one; resuming
  keeps the lr schedule it was saved with, so stop + resume == uninterrupted, bit for bit;
- argparse errors are printed by one rank under torchrun;
- one metrics line per logged step (the engine's own step line is off).
"""
from __future__ import annotations

import csv
import glob
import hashlib
import json
import math
import os
import subprocess

import pytest
import torch

from tests.support.command_runs import run_command
from tests.tools.test_train import ROOT, SMALL, _env, _torchrun

BASE = [a for a in SMALL if a not in ("--max-steps", "3")]


def _train(args, timeout=240):
    """`python -m minizero.train ARGS` -> (exit status, stdout, stderr), run as the program's
    main(argv) in a process forked from the tests' preloaded forkserver (no 5-10 s of imports
    per run: tests/support/command_runs.py). The torchrun case below runs torchrun itself."""
    p = run_command("minizero.train", args, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ": error:" in ln]


def _summary(d):
    with open(os.path.join(d, "summary.json")) as f:
        return json.load(f)


def _config(tmp_path, name, **sections):
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1000.0, "torch_adam": True}}, **sections}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _weights_finite(tag_dir) -> bool:
    ok = True
    for f in glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        ok &= all(bool(torch.isfinite(t).all()) for t in sd["masters"] + sd["shards"])
    return ok


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """lr 1000 in bf16 and in fp16."""
    tmp = tmp_path_factory.mktemp("diverge")
    runs = {
        "bf16": [*BASE, "--config", _config(tmp, "bf16", bf16={"enabled": True}), "--max-steps", "60"],
        "fp16": [*BASE, "--config", _config(tmp, "fp16", fp16={"enabled": True}), "--max-steps", "60"],
    }
    return {k: (str(tmp / k), *_train([*a, "--save-every", "2", "--save-dir", str(tmp / k)])) for k, a in runs.items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_diverged_run_stops_with_one_line_and_keeps_its_results(diverged, dtype):
    save, rc, out, err = diverged[dtype]
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and "training diverged" in lines[0], err[-3000:]
    assert ("minimum loss scale" in lines[0]) == (dtype == "fp16")
    assert "lower learning rate" in lines[0] and "--resume" in lines[0]
    s = _summary(save)
    assert s["status"] == "diverged" and s["steps"] < 60
    with open(os.path.join(save, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert rows and int(rows[-1]["step"]) <= s["steps"]
    assert not os.path.exists(os.path.join(save, "samples.png"))
    with open(os.path.join(save, "latest")) as f:
        tag = f.read().strip()
    assert _weights_finite(os.path.join(save, tag))
    if dtype == "bf16":
        # stopped at the third bad step in a row; no checkpoint was taken at a bad step
        assert "--max-nonfinite-steps 3" in lines[0]
        n = s["steps"]
        assert f"at steps {n - 2}-{n} (3 steps in a row" in lines[0] and len(s["losses"]) == n
        assert all(_weights_finite(d) for d in glob.glob(os.path.join(save, "global_step*")))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished")
    save = str(tmp / "run")
    from minizero.train.train_args import DEFAULT_CONFIG
    cfg = tmp / "print3.json"
    cfg.write_text(json.dumps(dict(DEFAULT_CONFIG, steps_per_print=3)))
    rc, out, err = _train([*BASE, "--config", str(cfg), "--max-steps", "6", "--save-every", "3",
                           "--save-dir", save])
    assert rc == 0, err[-3000:]
    return save, out, err


def _digest(d):
    h = {}
    for root, _, files in os.walk(d):
        for f in files:
            if f != ".minizero.lock":
                with open(os.path.join(root, f), "rb") as fh:
                    h[os.path.relpath(os.path.join(root, f), d)] = hashlib.sha256(fh.read()).hexdigest()
    return h


def test_existing_run_is_never_overwritten(finished):
    save, _, _ = finished
    before = _digest(save)
    rc, out, err = _train([*BASE, "--max-steps", "2", "--save-dir", save])
    assert rc == 1 and "Traceback" not in err
    lines = _error_lines(err)
    assert len(lines) == 1 and "already holds a run" in lines[0] and f"--resume {save}" in lines[0]
    assert _digest(save) == before


def test_folder_in_use_is_refused(tmp_path):
    from minizero.train.rundir import RunDirLock
    save = str(tmp_path / "busy")
    with RunDirLock(save):           # a run that is still going (this process holds the lock)
        rc, out, err = _train([*BASE, "--max-steps", "2", "--save-dir", save])
    assert rc == 1 and "Traceback" not in err
    lines = _error_lines(err)
    assert len(lines) == 1 and "in use by a run that is still going" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert not os.path.exists(os.path.join(save, "metrics.csv"))


def test_resume_without_latest_lists_checkpoints_and_tag_picks_one(finished, tmp_path):
    save, _, _ = finished
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", save, str(copy)], check=True)
    os.remove(copy / "latest")
    rc, out, err = _train([*BASE, "--max-steps", "6", "--resume", str(copy)])
    lines = _error_lines(err)
    assert rc == 1 and len(lines) == 1, err[-3000:]
    assert "'latest' is missing" in lines[0] and "global_step3, global_step6" in lines[0] and "--tag" in lines[0]
    rc, out, err = _train([*BASE, "--max-steps", "6", "--resume", str(copy), "--tag", "global_step9"])
    assert rc == 1 and "no complete checkpoint 'global_step9'" in _error_lines(err)[0]


def test_resume_from_an_older_tag_into_the_same_folder_is_refused(finished):
    save, _, _ = finished
    rc, out, err = _train([*BASE, "--max-steps", "6", "--resume", save, "--tag", "global_step3"])
    lines = _error_lines(err)
    assert rc == 1 and len(lines) == 1 and "would overwrite" in lines[0] and "global_step6" in lines[0], err


def test_resume_from_a_tag_equals_the_uninterrupted_run(finished, tmp_path):
    """The README's resume tour: steps 4-6 resumed from global_step3 == the straight run's, bit for bit
    (minGPT's lr schedule included: it is saved with its shape, not rebuilt)."""
    save, _, _ = finished
    rc, out, err = _train([*BASE, "--max-steps", "6", "--resume", save, "--tag", "global_step3",
                           "--save-dir", str(tmp_path / "resumed")])
    assert rc == 0, err[-3000:]
    assert _summary(str(tmp_path / "resumed"))["losses"] == _summary(save)["losses"]


def test_resume_with_a_longer_run_keeps_the_saved_schedule(finished, tmp_path):
    save, _, _ = finished
    rc, out, err = _train([*BASE, "--max-steps", "8", "--resume", save, "--save-dir", str(tmp_path / "longer")])
    assert rc == 0, err[-3000:]
    assert "keeping the saved lr schedule (minGPT cosine ending at step 6)" in out
    with open(tmp_path / "longer" / "metrics.csv") as f:
        lrs = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    # minGPT floors at 10% of the peak after its final token; the rebuilt schedule would
    # have been mid-cosine at step 8 (the resume tour's jump from 3.0e-4 to 1.4e-3).
    assert lrs[8] == 3e-3 * 0.1     # the same float expression MinGPTSchedule computes


def test_one_metrics_line_per_logged_step(finished):
    _, out, err = finished
    assert "[minizero] step=" not in out + err       # the engine's DeepSpeed-style line is off
    for step in (3, 6):
        assert sum(f"step={step:>4d} loss=" in ln for ln in (out + err).splitlines()) == 1


def test_argparse_error_printed_by_one_rank(tmp_path):
    p = subprocess.run([*_torchrun(2), "-m", "minizero.train", "--stage", "7"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    assert len([ln for ln in text.splitlines() if "minizero.train: error:" in ln]) == 1, text
    assert text.count("usage:") == 1
