"""Run several of the project's command lines one after another in one process:

    python -m tests.support.script_runs PLAN.json

PLAN.json is a list of {"name": ..., "cmd": [program, *args]}, program one of
`python -m minizero.train`, `reference/train.py`, `python -m minizero.export_deepspeed`,
`python -m minizero.reshard`, `python -m minizero.memory_table` (spelled as in PROGRAMS). Each command line goes to that
program's own main(), exactly as its command would pass it, with its stdout and stderr
captured; its exit status is what the process would have exited with. The results are
written to PLAN.json's folder as <name>.rc, <name>.out and <name>.err.

The tests start it with tests/support/command_runs.run_command("tests.support.script_runs",
[PLAN.json]): a process forked from their preloaded forkserver, so not even this process
pays the imports.

Why one process: a chain of checkpoint hand-overs (DeepSpeed saves, minizero resumes,
minizero exports, DeepSpeed resumes the export) is a dozen single-rank runs of a few
seconds each, and each fresh interpreter would spend most of its time importing torch,
dynamo and DeepSpeed. This process imports them once and forks a child for every run, so
each run still starts from its command line with nothing set up (DeepSpeed keeps its
process groups in module globals: two runs in one process would share them). Nothing
carries from one run to the next but the files they write.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAMS = {   # as a user types it -> the module whose main(argv) it runs
    "minizero.train": "minizero.train.train",
    "reference/train.py": "reference.train",
    "reference/torch_train.py": "reference.torch_train",
    "minizero.export_deepspeed": "minizero.checkpoint_files.export_deepspeed",
    "minizero.reshard": "minizero.checkpoint_files.reshard",
    "minizero.memory_table": "minizero.observe.memory_table",
}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run_here(program: str, argv: list[str], prefix: str) -> int:
    """In the forked child: run one command line, its stdout and stderr into prefix.out/.err."""
    for k in LAUNCHER_VARS:   # reference/train.py makes itself a world of one when none is set
        os.environ.pop(k, None)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = importlib.import_module(PROGRAMS[program]).main(argv) or 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:   # what the process would have printed before dying
            traceback.print_exc()
            rc = 1
    for ext, text in (("out", out.getvalue()), ("err", err.getvalue())):
        with open(f"{prefix}.{ext}", "w") as f:
            f.write(text)
    return rc


def run_one(program: str, argv: list[str], prefix: str) -> int:
    """The exit status of one command line, run in a forked child of this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            rc = _run_here(program, argv, prefix)
        finally:
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(argv=None) -> None:
    """argv: [PLAN.json], as on the command line."""
    plan_path = (sys.argv[1:] if argv is None else list(argv))[0]
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    folder = os.path.dirname(os.path.abspath(plan_path))
    with open(plan_path) as f:
        plan = json.load(f)
    for module in PROGRAMS.values():   # imported once, before the forks
        importlib.import_module(module)
    for step in plan:
        prefix = os.path.join(folder, step["name"])
        rc = run_one(step["cmd"][0], step["cmd"][1:], prefix)
        with open(f"{prefix}.rc", "w") as f:
            f.write(str(rc))
        print(f"{step['name']}: exit {rc}", flush=True)


if __name__ == "__main__":
    main()
