"""Run a training command line on N ranks from the tests' preloaded forkserver, as torchrun would.

    p = run_command("minizero.train", [...argv...], nproc=2)    # p.returncode, p.stdout, p.stderr

What `torchrun --nproc-per-node N -m minizero.train ARGV` does for a test, without its cost:
a fresh `torchrun` is three interpreters (the launcher and two ranks) each importing torch,
dynamo and DeepSpeed, 4-8 s apiece on this loaded 2-core machine, before the run's own
second or two of work. Here every rank is forked from the forkserver of
minizero.runtime.spawn that imported all of that once for the whole test session, gets
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ... and one thread), and runs the
program's own main(ARGV) from the repository root; the program starts and ends its process
group itself, as it does under torchrun. Each run is fresh processes, so nothing one run
patches (DeepSpeed's module globals, ZeRO-3's F.linear) leaks into the next.

Each rank's file descriptors 1 and 2 go to a file, so what C++ prints (gloo) is caught as
well as Python's prints; stdout and stderr are the ranks' outputs one after the other,
rank 0 first (torchrun interleaves them; the tests count and search lines, never their
order across ranks). The exit status is the first nonzero rank's (each rank's is in
`.rank_returncodes`), as torchrun reports a
failed rank (an uncaught exception prints its traceback and exits 1, as the interpreter does).

Tests whose point is the launcher itself (torchrun's own handling, `python -m` as a user
types it) keep running the real command in a subprocess.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import traceback

from minizero.runtime import spawn
from tests.support.script_runs import PROGRAMS, ROOT

# Not reference.train nor reference.torch_train: importing either wraps torch.distributed's
# collectives process-wide (its CommCounter), which would then be in every rank of every test.
# A run of it imports it on its own rank (DeepSpeed itself is preloaded: tests/support/ds_preload.py).
# torchvision.utils: rank 0 of every training run draws samples.png with it
# (minizero/train/runlog.py imports it there), 0.6-0.9 s of import per run (cProfile of a
# 2-step run's rank 0); preloaded, it is paid once per test session. It starts no thread.
# matplotlib.pyplot: the same for every run with --trace (its timeline.png: observe/timeline.py)
# and minizero.compare's pictures, 0.55 s of import each (`python -X importtime`); a py-spy
# profile of tests/core and tests/tools put 2% of all the suite's CPU samples in that import.
# It picks no backend at import (timeline.py and compare/render.py then choose Agg).
spawn.preload("tests.support.command_runs", "torchvision.utils", "matplotlib.pyplot",
              *(m for m in PROGRAMS.values() if m not in ("reference.train", "reference.torch_train")))


def _rank(program: str, argv: list[str], folder: str, launcher: bool, rank_env: list | None) -> int:
    """On each rank: run program's main(argv) with fds 1 and 2 in folder/<rank>.out/.err."""
    import importlib
    rank = os.environ["RANK"]
    if not launcher:   # `python -m ...` alone, not under torchrun: no launcher's variables
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
    if rank_env:       # what another launcher (srun) would set for this rank
        os.environ.update(rank_env[int(rank)])
    os.chdir(ROOT)
    # A rank that fails in silence waits for rank 0's line to get out before a launcher kills
    # it (3 s); here no launcher kills a rank, run_ranks waits for every rank to end.
    from minizero.train import train_args
    train_args.SILENT_RANK_PAUSE_S = 0.0
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, ext in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(folder, f"{rank}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    try:
        rc = importlib.import_module(PROGRAMS.get(program, program)).main(argv) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:   # what the interpreter would have printed before exiting 1
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    return rc


def run_command(program: str, argv: list[str], nproc: int = 1, *, launcher: bool | None = None,
                env: dict | None = None, rank_env: list[dict] | None = None, timeout: float = 400.0) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m program argv` (launcher=True, the default for
    nproc > 1) or `python -m program argv` (nproc 1, launcher False), run on forked ranks.
    program is spelled as in tests.support.script_runs.PROGRAMS ("minizero.train",
    "reference/train.py", ...), or is any module with a main(argv). env: extra variables
    for the ranks; rank_env: one dict per rank, set last (srun's SLURM_PROCID and the like,
    with launcher=False)."""
    launcher = nproc > 1 if launcher is None else launcher
    with tempfile.TemporaryDirectory(prefix="command_runs-") as folder:
        rcs = spawn.run_ranks(_rank, nproc, args=(program, list(argv), folder, launcher, rank_env), env=env,
                              group=False, timeout=timeout)

        def read(ext):
            return [open(os.path.join(folder, f"{r}.{ext}")).read() for r in range(nproc)]
        outs, errs = read("out"), read("err")
    rc = next((c for c in rcs if c != 0), 0)
    args = (["torchrun", "--nproc-per-node", str(nproc)] if launcher else ["python"]) + ["-m", program, *argv]
    done = subprocess.CompletedProcess(args, rc, "".join(outs), "".join(errs))
    done.rank_returncodes = rcs     # each rank's own, where a test asserts them all
    done.rank_stdout, done.rank_stderr = outs, errs   # each rank's own output (one "node" each: python_m.py)
    return done


def from_torchrun(cmd: list[str]) -> tuple[str, list[str], int]:
    """(program, argv, nproc) of `python -m torch.distributed.run [--opt value ...] (-m MODULE | SCRIPT) ARGS`,
    the command line a tool (python -m minizero.compare) builds; SCRIPT relative to the repository."""
    i, nproc = cmd.index("torch.distributed.run") + 1, 1
    while cmd[i].startswith("--"):
        opt, _, value = cmd[i].partition("=")
        if opt == "--standalone" or value:
            i += 1
        else:
            value, i = cmd[i + 1], i + 2
        if opt in ("--nproc-per-node", "--nproc_per_node"):
            nproc = int(value)
    if cmd[i] == "-m":
        return cmd[i + 1], cmd[i + 2:], nproc
    return os.path.relpath(cmd[i], ROOT), cmd[i + 1:], nproc


def _forked(cmd) -> tuple[str, list[str], int, bool] | None:
    """(program, argv, nproc, launcher) when cmd is a command line run_command can take:
    `python -m torch.distributed.run ...`, or `python -m PROGRAM ARGS` for a program of
    script_runs.PROGRAMS (its main(argv) in a forked process); else None."""
    if not isinstance(cmd, (list, tuple)):
        return None
    cmd = [str(c) for c in cmd]
    if "torch.distributed.run" in cmd:
        return (*from_torchrun(cmd), True)
    if len(cmd) > 2 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in PROGRAMS:
        return cmd[2], cmd[3:], 1, False
    return None


def _deliver(stream, text: str, as_text: bool, own):
    """What subprocess.run makes of a child's output for its stdout/stderr argument: None
    (the caller's own stream), PIPE (returned), DEVNULL (dropped), or a file object."""
    if stream is None:
        own.write(text)
    elif stream == subprocess.PIPE:
        return text if as_text else text.encode()
    elif stream != subprocess.DEVNULL:
        stream.write(text)
        stream.flush()
    return None


@contextlib.contextmanager
def torchrun_on_forked_ranks():
    """While open, subprocess.run of a `python -m torch.distributed.run ...` command line
    (or of `python -m PROGRAM ...`, PROGRAM one of script_runs.PROGRAMS) runs it with
    run_command instead, honouring stdout/stderr (None, PIPE, DEVNULL, a file; stderr=STDOUT),
    capture_output, text and check as subprocess.run does; every other command line runs as
    it would. For a tool that launches its commands itself (minizero.compare,
    docs/lesson/lesson_numbers.py), run in this process. cwd is not passed on (the ranks run
    from the repository root); of env, the variables that differ from the test session's
    are set on the ranks."""
    real = subprocess.run

    def run(cmd, *args, stdout=None, stderr=None, capture_output=False, check=False, text=None,
            universal_newlines=None, **kw):
        forked = _forked(cmd)
        if forked is None:
            return real(cmd, *args, stdout=stdout, stderr=stderr, capture_output=capture_output, check=check,
                        text=text, universal_newlines=universal_newlines, **kw)
        program, argv, nproc, launcher = forked
        env = kw.get("env")   # what the caller sets beyond this process's own (MINIZERO_RANKS_PER_NODE, ...)
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v} if env is not None else None
        p = run_command(program, argv, nproc, launcher=launcher, env=extra)
        if capture_output:
            stdout = stderr = subprocess.PIPE
        as_text = bool(text or universal_newlines)
        if stderr == subprocess.STDOUT:
            out, err = _deliver(stdout, p.stdout + p.stderr, as_text, sys.stdout), None
        else:
            out, err = _deliver(stdout, p.stdout, as_text, sys.stdout), _deliver(stderr, p.stderr, as_text, sys.stderr)
        done = subprocess.CompletedProcess(cmd, p.returncode, out, err)
        if check:
            done.check_returncode()
        return done
    subprocess.run = run
    try:
        yield
    finally:
        subprocess.run = real
