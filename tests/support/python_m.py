"""`python -m MODULE ARGS`, one command line per process, on processes forked from the tests'
preloaded forkserver, for launchers that a test starts side by side (two "nodes"):

    p = run_command("tests.support.python_m", [json.dumps(lines)], nproc=2, launcher=False,
                    rank_env=[{python_m.INDEX_ENV: "0", ...}, {python_m.INDEX_ENV: "1", ...}])
    # lines: [["torch.distributed.run", "--nnodes", "2", ...], ["minizero.preflight", ...]]
    # p.rank_stdout[i], p.rank_stderr[i], p.rank_returncodes[i]: what command line i printed, its exit status

Process i runs lines[i] as `python -m` runs a module: as `__main__` (runpy), with sys.argv
[MODULE's path, *ARGS], so the module's own `if __name__ == "__main__"` (torchrun's main(),
minizero.preflight's __main__.py) reads its command line as it would from a shell. What a
fresh interpreter adds is the import of torch before it, 2-4 s of CPU per launcher on this
machine; forked, that import was paid once by the forkserver. The processes a launcher
starts itself (torchrun's ranks, the preflight's torchrun) are still its own fresh
subprocesses, as a user's are.

Each process's exit status is the module's SystemExit code, or 1 with the traceback printed
for an uncaught exception (tests/support/command_runs.py), as the interpreter does.
"""
from __future__ import annotations

import json
import os
import runpy
import sys

INDEX_ENV = "TESTS_PYTHON_M_INDEX"   # which of the command lines this process runs (its rank_env)


def main(argv: list[str]) -> int:
    lines = json.loads(argv[0])
    module, *args = lines[int(os.environ.pop(INDEX_ENV, "0"))]
    sys.argv = [module, *args]      # runpy's alter_sys puts the module's file in sys.argv[0]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
