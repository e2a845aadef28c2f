"""A script that is not a package module (launch/*.py, docs/lesson/*.py) loaded as a module,
so a test calls its functions directly:

    bench = load_script(ROOT / "launch" / "bench_host.py")
    gc = load_script(ROOT / "launch" / "gpu_check.py", register=True)

`register`: kept in sys.modules under the file's name (the one already there is reused), as a
script needs whose dataclasses look their module up, or whose functions rank processes
unpickle by that name; otherwise every call loads a fresh copy.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path, register: bool = False):
    name = Path(path).stem
    if register and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
