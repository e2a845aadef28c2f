"""Run a function on N gloo ranks, fast.

A new `torchrun` per test case would pay ~10 s of imports (torch.distributed, DeepSpeed)
per rank per case. Instead every rank is forked from one forkserver that imported torch,
minizero and (when installed) deepspeed once for the whole test session. Each run gets
its own free port, its own fresh processes (so DeepSpeed's process-wide patches, e.g.
ZeRO-3's replacement of `F.linear`, never leak into the next case), and returns each
rank's return value to the test.

Usage (the function must be importable at module level, i.e. picklable by reference):

    results = run_ranks(fn, world_size=2, args=(...))   # -> [rank0_result, rank1_result]

A module whose functions the ranks run can call `preload(__name__)` at import, so the
forkserver imports it once too (only possible before the forkserver starts).
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import traceback

from minizero.comm import free_port  # noqa: F401  (tests import it from here too)
from minizero.runtime.process_group import single_host_env

# torch._dynamo: torch.optim's constructor imports it (sympy and more), ~2.5 s per rank
# per run if the forkserver has not already paid for it.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minizero", "minizero.engine",
            "minizero.gpt.model", "tests.support.launcher"]
try:  # deepspeed is an optional (dev) dependency
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        _PRELOAD.append("tests.support.ds_preload")
except Exception:  # pragma: no cover
    pass

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def preload(module: str) -> bool:
    """Have the forkserver import `module` too, so every rank starts with it loaded.
    Returns False (and changes nothing) once the forkserver has started: ranks then import
    it themselves, which is only slower."""
    if _ctx is not None:
        return False
    if module not in _PRELOAD:
        _PRELOAD.append(module)
    return True


def _worker(rank, world_size, port, fn, args, kwargs, env, queue):
    os.environ.update(env)
    os.environ.update(single_host_env(rank, world_size, port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun does; DeepSpeed facts were measured this way
    try:
        if world_size > 1 or env.get("MINIZERO_FORCE_PG"):
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(*args, **kwargs)
        # Serialise by value: a tensor put on the queue directly would be shared through a
        # file descriptor that dies with this process before the parent reads it.
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException as e:  # report, don't hang the other ranks' test
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size: int = 2, args=(), kwargs=None, env=None, timeout: float = 300.0):
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs or {}, env, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, ok, out = queue.get(timeout=timeout)
            if ok:
                import torch
                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank}: {out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return results
