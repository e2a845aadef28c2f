"""reference/torch_train.py as a user runs it: the PyTorch reference writes the trainer's
run folder (same summary keys, "library": "torch"), and refuses what FSDP2 has no setting
for in one line. Two subprocesses started side by side, one process each."""
from __future__ import annotations

import json
import os
import subprocess

from tests.tools.test_train import KEYS, PY, ROOT, SMALL, _env


def test_torch_reference_run_folder_and_refusal(tmp_path):
    script = os.path.join(ROOT, "reference", "torch_train.py")
    ok = subprocess.Popen([PY, script, "--stage", "3", "--save-dir", str(tmp_path / "run")] + SMALL + ["--num-samples", "0"], cwd=tmp_path,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bad = subprocess.run([PY, script, "--stage", "1", "--save-dir", str(tmp_path / "bad")] + SMALL, cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=240)
    out, _ = ok.communicate(timeout=240)
    assert ok.returncode == 0, out[-3000:]
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert list(summary) == KEYS and summary["library"] == "torch" and summary["stage"] == 3
    assert summary["memory_moments"]["after_step"][0]["optimizer_states"] > 0
    assert os.path.exists(tmp_path / "run" / "metrics.csv")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["reference/torch_train.py: error: FSDP2 has no ZeRO-1 setting "
                                               "(optimizer state sharded, parameters and gradients whole): use "
                                               "--stage 0 (DDP), 2 or 3 (FSDP2)"]
