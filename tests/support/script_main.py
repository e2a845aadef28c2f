"""Run a launch/ script's main(argv) in the test process, as `python launch/SCRIPT ARGV` would:

    r = run_script_main(ROOT / "launch" / "bench_overlap.py", [...argv...])   # r.returncode, r.stdout, r.stderr

Why: the benchmarks (launch/bench_*.py) start their ranks with minizero.runtime.spawn. As a
command, that is a fresh interpreter importing torch and then a forkserver of its own
importing torch, minizero and DeepSpeed again: 4-6 s on this 2-core machine before a tiny
run's second of work. Here main(argv) runs in the test process and its ranks fork from the
tests' preloaded forkserver (tests/support/launcher.py), each launch still fresh processes.

What the script does to its own process is undone after it: the environment variables it
sets (DS_ACCELERATOR, OMP_NUM_THREADS, KINETO_LOG_LEVEL) are restored, and launch/ leaves
sys.path again if it was not there. The script is imported by its name from launch/ (not
loaded from its path under another name), because its ranks unpickle its functions by that
name: they get the test process's sys.path when they start.

Not for a test whose point is the command itself (`python launch/X.py` from any folder):
those run it in a subprocess.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

from minizero.runtime import spawn
from tests.support import launcher  # noqa: F401  (registers the forkserver's preloads: torch, DeepSpeed)


def run_script_main(script: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """script's main(argv) here, its stdout and stderr caught; exit status as the command's."""
    folder = str(Path(script).parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    env = dict(os.environ)
    # The tests' forkserver, chosen before the script's spawn.preload("__main__", ...): that
    # call then changes nothing (the server already has torch, minizero and DeepSpeed).
    spawn.context()
    out, err = io.StringIO(), io.StringIO()
    try:
        module = importlib.import_module(Path(script).stem)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = module.main(list(argv)) or 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(env)
        if added:
            sys.path.remove(folder)
    return subprocess.CompletedProcess(["python", str(script), *argv], rc, out.getvalue(), err.getvalue())
