"""A training state carried across the three libraries through PyTorch's Distributed Checkpoint,
as a user types it (the command lines, forked from the test session's preloaded ranks):

    DeepSpeed ZeRO-3, 2 ranks, 4 steps, a checkpoint at step 2          reference/train.py
      -> python -m minizero.export_dcp ds ds-dcp --tag global_step2     (DeepSpeed's folder read by minizero, written as DCP)
      -> FSDP2 resumes it, steps 3-4                                    reference/torch_train.py --resume ds-dcp
    FSDP2, 2 ranks, 4 steps, a DCP checkpoint at step 2                 reference/torch_train.py
      -> python -m minizero.export_deepspeed pt pt-ds --tag global_step2   (DCP read by minizero, written as DeepSpeed's)
      -> DeepSpeed resumes it, steps 3-4                                reference/train.py --resume pt-ds

Each continued run's losses equal the uninterrupted runs' bit for bit, and the two uninterrupted
runs equal each other: fp32, 2 ranks, every sum of two terms (a + b = b + a exactly), the same
operations in the same order in both libraries (tests/agreement/test_agreement_torch.py,
minizero against each, tolerance 0), the trainer's dropout RNG and minGPT schedule in the
client_state the conversions carry. The gradient clipping the tutorial config turns on (1.0)
would part them by the ulps of the two norms' arithmetic if it fired on these steps; it does not
(the losses are equal), so the test says so if that changes.

Costs 7-10 s of the suite's two-worker run: two DeepSpeed runs, two FSDP2 runs, two conversions.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.support.command_runs import run_command

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.filterwarnings("ignore")


def _run(prog: str, args: list[str], nproc: int = 1) -> str:
    p = run_command(prog, args, nproc=nproc)
    assert p.returncode == 0, (prog, args, p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout + p.stderr


def test_deepspeed_to_fsdp2_and_fsdp2_to_deepspeed_continue_bitwise(tmp_path):
    w = str(tmp_path)
    train = ["--model", "micro", "--image-size", "8", "--synthetic-train", "64", "--synthetic-test", "16",
             "--num-samples", "0", "--data-dir", f"{w}/data", "--stage", "3", "--max-steps", "4"]
    _run("reference/train.py", train + ["--save-every", "2", "--save-dir", f"{w}/ds"], 2)
    # the PyTorch reference reads DCP only: DeepSpeed's folder is one line naming the conversion
    p = run_command("reference/torch_train.py", train + ["--resume", f"{w}/ds"], nproc=1)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"reference/torch_train.py: error: --resume {w}/ds: global_step4 is a DeepSpeed checkpoint, which PyTorch "
        f"cannot read; convert it first: python -m minizero.export_dcp {w}/ds {w}/ds-dcp --tag global_step4, then "
        f"--resume {w}/ds-dcp"], p.stderr
    said = _run("minizero.export_dcp", [f"{w}/ds", f"{w}/ds-dcp", "--tag", "global_step2"])
    assert "DeepSpeed: 2 ranks, ZeRO stage 3" in said
    assert "at step 2" in _run("reference/torch_train.py", train + ["--resume", f"{w}/ds-dcp"], 2)

    _run("reference/torch_train.py", train + ["--save-every", "2", "--save-dir", f"{w}/pt"], 2)
    assert os.path.isfile(f"{w}/pt/global_step2/.metadata")   # FSDP2's own checkpoint is a DCP folder
    _run("minizero.export_deepspeed", [f"{w}/pt", f"{w}/pt-ds", "--tag", "global_step2"])
    assert "at step 2" in _run("reference/train.py", train + ["--resume", f"{w}/pt-ds"], 2)

    summary = {d: json.load(open(f"{w}/{d}/summary.json")) for d in ("ds", "ds-dcp", "pt", "pt-ds")}
    assert [summary[d]["library"] for d in summary] == ["deepspeed", "torch", "torch", "deepspeed"]
    losses = {d: s["losses"] for d, s in summary.items()}
    assert len(losses["ds"]) == 4
    assert losses["ds-dcp"] == losses["ds"], losses      # DeepSpeed's steps 1-2, then FSDP2's 3-4
    assert losses["pt-ds"] == losses["pt"], losses       # FSDP2's steps 1-2, then DeepSpeed's 3-4
    assert losses["pt"] == losses["ds"], losses
    assert summary["ds-dcp"]["test_loss"] == summary["ds"]["test_loss"]
    assert summary["pt-ds"]["test_loss"] == summary["pt"]["test_loss"]
