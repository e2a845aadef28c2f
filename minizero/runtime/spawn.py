"""Start N ranks on this host, run one function on each, return what each rank returned.

The one way minizero's own tools start ranks without torchrun: the tests
(tests/support/launcher.py), the benchmarks (launch/bench_*.py), the measured memory table
(`python -m minizero.memory_table --nproc`) and the install check (`python -m minizero.selftest`).

    from minizero.runtime.spawn import run_ranks
    per_rank = run_ranks(fn, world_size=2, args=(...))     # [rank 0's return value, rank 1's, ...]

Why not torchrun: a fresh interpreter per rank imports torch (and DeepSpeed) again, seconds
per rank per launch. On a CPU the ranks are forked from one forkserver that imported
torch and the `preload`ed modules once, so a launch costs a fraction of a second; each
launch still gets fresh processes, so nothing one run patches (DeepSpeed's ZeRO-3 replaces
`F.linear`) leaks into the next. Where CUDA is used the ranks are spawned instead: a forked
CUDA runtime is not safe.

Each rank gets torchrun's environment (`single_host_env`), one thread per rank as torchrun
gives, and its process group started before `fn` runs (when world_size > 1). Results travel
by value (torch.save bytes): a tensor put on a queue as is would be shared through a file
descriptor that dies with the rank. A rank that raises is reported as `RankError` with its
rank and one line (the traceback is kept in `.detail`); a rank that dies without a word
(a signal, os._exit) is noticed within a second, not after the whole timeout.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback

from minizero.process_group import free_port, single_host_env

# torch._dynamo: torch.optim's constructor imports it (sympy and more), ~2.5 s per rank per
# launch if the forkserver has not already paid for it.
# minizero.observe.switches: minizero.initialize imports it (and the trace, comms logger and
# desync check behind it); torch.utils.serialization: the first torch.save in a process (each
# rank's result travels as torch.save bytes) imports it. Both are paid once here instead.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.utils.serialization", "minizero",
            "minizero.engine", "minizero.observe.switches", "minizero.gpt.model", "minizero.runtime.spawn"]
_forkserver = None


class RankError(RuntimeError):
    """A rank failed (or never reported). str(): "rank R: <one line>"; .detail: its traceback."""

    def __init__(self, rank: int | None, line: str, detail: str = ""):
        super().__init__(f"rank {rank}: {line}" if rank is not None else line)
        self.rank, self.line, self.detail = rank, line, detail


def preload(*modules: str) -> bool:
    """Have the forkserver import `modules` too, so every rank starts with them loaded.
    Returns False (and changes nothing) once the forkserver has started: ranks then import
    them themselves, which is only slower."""
    if _forkserver is not None:
        return False
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    return True


def context(cuda: bool = False):
    """The multiprocessing context ranks start from: spawn where CUDA will be used, else the
    preloaded forkserver (started on first use; one per process)."""
    global _forkserver
    if cuda:
        return mp.get_context("spawn")
    if _forkserver is None:
        _forkserver = mp.get_context("forkserver")
        _forkserver.set_forkserver_preload(_PRELOAD)
    return _forkserver


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__


def _rank_main(rank, world_size, port, fn, args, kwargs, env, threads, backend, group, results):
    # A forked rank inherits the forkserver's Python objects (torch's, DeepSpeed's: ~436,000).
    # A full garbage collection walks them all and, by touching each, copies every page they
    # live on out of the shared fork: 0.26 s per gc.collect() in a fresh rank, 0.17 s after.
    # DeepSpeed's ZeRO-3 calls gc.collect() twice at initialize (runtime/zero/utils.py,
    # defragment): 19 s of the test suite's CPU time (py-spy). Frozen, the inherited objects
    # are left out of every collection (gc.freeze: Python's own advice for pre-fork servers);
    # a collection then costs 0.2 ms. They are long-lived module state, never garbage.
    import gc
    gc.freeze()
    os.environ.update(env)
    os.environ.update(single_host_env(rank, world_size, port), OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist

    from minizero import process_group
    torch.set_num_threads(threads)
    try:
        if group:
            process_group.init_distributed(backend)
        out = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report it, do not leave the parent waiting
        results.put((rank, False, (_one_line(e), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _silent_exit(procs, pending, results, detail: str = "", wait: float = 0.0) -> RankError | None:
    """The error for the first pending rank that has exited with no report left to read, or
    None: looked for once (the parent's queue read timed out), or for up to `wait` s after
    another rank reported an error. A rank that dies silently (os._exit, a signal, glibc's
    abort) leaves its peers failing with "Connection reset by peer", often read before the
    parent has noticed the death: the rank that exited is the cause to name."""
    deadline = time.monotonic() + wait
    while True:
        gone = [r for r in sorted(pending) if procs[r].exitcode is not None]
        if gone and results.empty():
            time.sleep(0.2)      # a report may still be in the pipe behind the exit
            if not results.empty():
                return None
            return RankError(gone[0], f"exited with code {procs[gone[0]].exitcode} before reporting", detail)
        if time.monotonic() >= deadline or not results.empty():
            return None
        time.sleep(0.05)


def run_ranks(fn, world_size: int = 2, args=(), kwargs=None, *, env=None, threads: int = 1,
              backend: str | None = None, group: bool | None = None, cuda: bool = False,
              timeout: float = 300.0) -> list:
    """Run fn(*args, **kwargs) on `world_size` fresh ranks; return the per-rank results.

    fn must be importable at module level (pickled by reference). env: extra environment
    variables for the ranks. backend: None is process_group's choice (NCCL with CUDA, else
    gloo). group: start the default process group (default: when world_size > 1).
    Raises RankError for the first rank that fails (a rank that exited without a report
    rather than the peer it left failing: `_silent_exit`), or when no rank reports in `timeout` s."""
    ctx = context(cuda)
    results = ctx.Queue()
    port = free_port()
    group = world_size > 1 if group is None else group
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, kwargs or {}, dict(env or {}),
                                                  threads, backend, group, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, error, pending = [None] * world_size, None, set(range(world_size))
    deadline = time.monotonic() + timeout
    try:
        while pending and error is None:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                error = _silent_exit(procs, pending, results)
                if error is None and time.monotonic() > deadline:
                    error = RankError(None, f"ranks {sorted(pending)} did not report within {timeout:.0f} s")
                continue
            pending.discard(rank)
            if ok:
                import torch
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                # the report may be the symptom of a silent exit: then that exit is the cause
                error = (_silent_exit(procs, pending, results, f"rank {rank} then failed: {payload[0]}\n{payload[1]}",
                                      wait=0.5) or RankError(rank, *payload))
    finally:
        # After a failure the others may wait forever on a peer that is gone: end them now.
        for p in procs:
            p.join(timeout=0 if error else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        raise error
    return out
