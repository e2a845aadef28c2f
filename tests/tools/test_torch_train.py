"""reference/torch_train.py: the PyTorch reference writes the trainer's run folder (same
summary keys, "library": "torch"), and refuses what FSDP2 has no setting for in one line.

The refusal runs as a user types it, a fresh `python reference/torch_train.py` (the script
starting from its own path, its one line on stderr, exit 1). The training run is the
script's main(argv) on a rank forked from the tests' preloaded forkserver
(tests/support/command_runs.py): what it checks is the run folder the script writes, not
the interpreter's start, and forked it does not import torch, FSDP2 and dynamo again."""
from __future__ import annotations

import json
import os
import subprocess

from tests.support.command_runs import run_command
from tests.tools.test_train import KEYS, PY, ROOT, SMALL, _env


def test_torch_reference_run_folder_and_refusal(tmp_path):
    script = os.path.join(ROOT, "reference", "torch_train.py")
    bad = subprocess.Popen([PY, script, "--stage", "1", "--save-dir", str(tmp_path / "bad")] + SMALL, cwd=tmp_path,
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ok = run_command("reference/torch_train.py", ["--stage", "3", "--save-dir", str(tmp_path / "run"), *SMALL,
                                                  "--num-samples", "0", "--data-dir", str(tmp_path / "data")], nproc=1)
    _, bad_err = bad.communicate(timeout=240)
    assert ok.returncode == 0, (ok.stdout[-2000:], ok.stderr[-3000:])
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert list(summary) == KEYS and summary["library"] == "torch" and summary["stage"] == 3
    assert summary["memory_moments"]["after_step"][0]["optimizer_states"] > 0
    assert os.path.exists(tmp_path / "run" / "metrics.csv")
    assert bad.returncode == 1 and "Traceback" not in bad_err
    assert bad_err.strip().splitlines() == ["reference/torch_train.py: error: FSDP2 has no ZeRO-1 setting "
                                            "(optimizer state sharded, parameters and gradients whole): use "
                                            "--stage 0 (DDP), 2 or 3 (FSDP2)"]
