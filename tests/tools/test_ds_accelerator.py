"""reference/ds_run.py tells DeepSpeed to use its CPU accelerator only where there is no GPU.

Before, importing it set DS_ACCELERATOR=cpu on any machine: a GPU run that imported it
before deepspeed would have run DeepSpeed on the CPU accelerator (the GPU entry points
happened to import deepspeed first). A fresh interpreter, so nothing has chosen yet.
"""
from __future__ import annotations

import json
import subprocess

from tests.tools.test_train import PY, ROOT, _env

PROBE = """
import importlib, json, os, sys
import torch
seen = []
for machine, preset in json.loads(sys.argv[1]):
    torch.cuda.is_available = lambda: machine == "gpu"
    os.environ.pop("DS_ACCELERATOR", None)
    if preset is not None:
        os.environ["DS_ACCELERATOR"] = preset
    if "reference.ds_run" in sys.modules:
        importlib.reload(sys.modules["reference.ds_run"])   # runs its import-time code again
    else:
        import reference.ds_run
    seen.append(os.environ.get("DS_ACCELERATOR"))
print(json.dumps(seen))
"""


def test_ds_run_sets_the_cpu_accelerator_only_without_a_gpu():
    cases = [("gpu", None), ("cpu", None), ("cpu", "cuda"), ("gpu", "cpu")]
    p = subprocess.run([PY, "-c", PROBE, json.dumps(cases)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    # a GPU: DeepSpeed picks cuda itself; no GPU: cpu; a choice already made is kept
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [None, "cpu", "cuda", "cpu"], p.stdout
