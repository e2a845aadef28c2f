"""Run a function on N gloo ranks, fast: the tests' door to minizero.runtime.spawn.

Every rank is forked from one forkserver that imported torch, minizero and (when installed)
deepspeed once for the whole test session, so a case costs a fraction of a second rather
than a fresh `torchrun`. Each run gets its own free port and its own fresh processes (so
DeepSpeed's process-wide patches, e.g. ZeRO-3's replacement of `F.linear`, never leak into
the next case), and returns each rank's return value to the test.

Usage (the function must be importable at module level, i.e. picklable by reference):

    results = run_ranks(fn, world_size=2, args=(...))   # -> [rank0_result, rank1_result]
    a, b = side_by_side((fn, 2, dict(args=(...))), (fn, 2, dict(args=(...))))   # both at once

A module whose functions the ranks run can call `preload(__name__)` at import, so the
forkserver imports it once too (only possible before the forkserver starts).
A failing rank raises RuntimeError with its traceback, for the test's report.
"""
from __future__ import annotations

import importlib.util

from minizero.comm import free_port  # noqa: F401  (tests import it from here too)
from minizero.runtime import spawn
from minizero.runtime.spawn import preload  # noqa: F401  (test modules call launcher.preload)

spawn.preload("tests.support.launcher")
if importlib.util.find_spec("deepspeed") is not None:   # deepspeed is an optional (dev) dependency
    spawn.preload("tests.support.ds_preload")
# What nearly every rank imports on its first run, after the fork: minizero.initialize's
# checkpoint_io (and its package), the runs' memory readers (minizero.train.runlog; for DeepSpeed
# reference.ds_memory). Imported in each forked rank they cost 0.03-0.07 s of CPU per rank per
# launch (sys.modules before and after one run of tests/support/engine_runs.train_run,
# harness.run_minizero, reference/ds_run.run_deepspeed); here once per test session. None
# starts a thread or patches anything.
spawn.preload("minizero.checkpoint_files.checkpoint_io", "minizero.train.runlog", "reference.ds_memory")


def run_ranks(fn, world_size: int = 2, args=(), kwargs=None, env=None, timeout: float = 300.0):
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results.
    env MINIZERO_FORCE_PG=1 starts a process group even for one rank."""
    env = dict(env or {})
    try:
        return spawn.run_ranks(fn, world_size, args, kwargs, env=env, backend="gloo", timeout=timeout,
                               group=world_size > 1 or bool(env.get("MINIZERO_FORCE_PG")))
    except spawn.RankError as e:
        raise RuntimeError(f"distributed run failed\n{e}\n{e.detail}") from None


def side_by_side(*launches):
    """run_ranks(*launch) for each launch, all at once (a thread each), in order. For launches
    that mostly wait out a timeout: the waits overlap instead of adding up, and each launch
    has its own ranks, port and flag file, so none sees another."""
    from concurrent.futures import ThreadPoolExecutor

    spawn.context()   # the forkserver, started once before the threads use it
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = [pool.submit(run_ranks, *launch[:-1], **launch[-1]) for launch in launches]
        return [f.result() for f in futures]
