"""The configurations of the agreement tests (minizero against DeepSpeed, number for
number) and their session cache. The runs themselves are tests/support/harness.py's: `run_minizero`
mirrors reference/ds_run.py's `run_deepspeed`.

Same model (`torch.manual_seed(seed)` right before `model_fn()`), same param groups with
the weight decay DeepSpeed would apply (`default_weight_decay`), same JSON config (both
libraries get `prepare_ds_config(config)`: torch_adam inside optimizer.params, ZeRO-3
memory_efficient_linear off), same batches (`get_batch`), same loss bookkeeping (mean over
micro-batches, fp64 all_reduce, divided by the world size).

The test modules share one cache (`cached_ds`, `cached_mz`, a dict in this module that
lives for the whole pytest session), so each configuration is trained once per library, every
configuration of one library in one launch of two ranks (`prefetch_mz`, `prefetch_ds`).
Under pytest-xdist (the README's test command runs two workers) each worker has its own
dict, so the runs are also shared through files (`_shared`): the first worker to need a
run trains it while holding that run's lock, a worker needing it meanwhile waits on the
lock and then loads it.

    DS_ACCELERATOR=cpu .venv/bin/python -m tests.support.agreement      # prints docs/agreement.md's tables
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from minizero.gpt.model import get_preset  # noqa: E402
from tests.support import harness  # noqa: E402
from tests.support.harness import (SyntheticBatches, max_abs_diff, max_list_diff,  # noqa: E402,F401
                           run_minizero)

N = 2
# 10 optimizer steps: every step of a run takes the same path in both libraries (clipping at
# 1.0 never fires, no fp16 overflow, no skipped step, the loss scale never moves: it would
# after 1000 clean steps), and a step is bitwise equal when its inputs are, so further steps
# repeat the same operations on equal state. Step 0 starts from the initial weights and empty
# Adam moments, step 1 is the first from updated weights and moments, the state of every
# later step. The runs at gradient_clipping 0.5 clip on steps 0-8 and not on step 9, so both
# branches of the clip factor are in them. docs/agreement.md's numbers are these runs'.
STEPS = 10
MICRO_BS = 4
LR = 1e-3
BUCKET = 20_000          # reduce_bucket_size: keeps DS's ZeRO-3 bucket (allocated at init) small
ENV = {"DS_ACCELERATOR": "cpu"}
STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")

MODEL_CFG = get_preset("tiny")  # 108,801 params, dropout 0.1 everywhere (on: RNG must replay)
MODEL_FN = functools.partial(harness.make_model, "tiny")
BATCHES = SyntheticBatches(MODEL_CFG.vocab_size, MODEL_CFG.block_size, MICRO_BS, seed=11)


# ZeRO-3 as the paper runs it, in both libraries: every parameter partitioned, gathered before
# each use and freed after (prefetch and reuse off), so gather counts compare one to one.
ZERO3_PAPER = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def make_config(stage: int, dtype: str = "fp32", ckpt: bool = False, clip: Optional[float] = None) -> Dict[str, Any]:
    """One config for both libraries. gradient_clipping is left at DeepSpeed's default (1.0)
    unless `clip` is given (the gradient norm of these runs is 0.50-0.98, so at 1.0 clipping
    never fires; at 0.5 the first 9 of the 10 steps clip)."""
    return harness.make_config(stage, dtype, micro_batch=MICRO_BS, optimizer="Adam", lr=LR,
                               zero={"reduce_bucket_size": BUCKET, **ZERO3_PAPER},
                               torch_adam=None, steps_per_print=10 ** 9, ckpt=ckpt, clip=clip)


# ----------------------------------------------------------------------------- the run

def run_minizero_many(jobs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Several run_minizero calls in the same rank processes (harness.run_many)."""
    return harness.run_many(jobs)


# ----------------------------------------------------------------------------- session cache

_CACHE: Dict[Any, Any] = {}


def _key(stage, dtype, ckpt=False, clip=None, variant="minizero"):
    return (stage, dtype, bool(ckpt), clip, variant)


def shared_folder(run: str) -> str:
    """Where the xdist workers of test run `run` share their runs (tests/conftest.py removes
    it when the run ends)."""
    return os.path.join(tempfile.gettempdir(), f"minizero-agreement-{run}")


def _shared_dir() -> Optional[str]:
    """The folder this test run's xdist workers share (PYTEST_XDIST_TESTRUNUID is the run's
    id, the same in every worker); None outside xdist, where the dict alone is the cache."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    path = shared_folder(run)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _shared(name: str):
    """Hold run `name`'s lock across xdist workers; yields (load, store): load() gives the
    stored runs or None, store(value) writes them for the other workers (whole files only:
    written aside, then renamed). Outside xdist no lock and nothing stored."""
    folder = _shared_dir()
    if folder is None:
        yield (lambda: None), (lambda value: None)
        return
    path = os.path.join(folder, name)

    def load():
        return torch.load(path + ".pt", weights_only=False) if os.path.exists(path + ".pt") else None

    def store(value):
        torch.save(value, path + ".tmp")
        os.replace(path + ".tmp", path + ".pt")

    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        yield load, store


def _file_name(key) -> str:
    return "-".join(str(k) for k in key).replace("/", "_")


def _deepspeed_many(jobs: List[tuple]) -> List[Dict[str, Any]]:
    """On each rank: run_deepspeed for every (config, steps) of `jobs`, one after another in
    this process. Each run builds its own engine from its own config and seed; none changes
    what the next computes (measured: every field of every run equal to its run in fresh
    processes, ZeRO-3, fp16 and bf16 in any order), and a launch of 2 ranks costs about a second."""
    from reference.ds_run import run_deepspeed
    return [run_deepspeed(MODEL_FN, config, BATCHES, steps, capture_memory=True) for config, steps in jobs]


def _prefetch(lib: str, keys: list, train) -> None:
    """Train every not-yet-cached configuration of `lib` ("ds" or "mz") in `keys` with
    `train(todo) -> per rank, one result per configuration`, in ONE launch (under xdist: those
    no other worker has trained yet, one worker at a time)."""
    todo = [k for k in dict.fromkeys(keys) if (lib,) + k not in _CACHE]
    if not todo:
        return
    with _shared(lib) as (load, store):
        stored = load() or {}
        for k in todo:
            if k in stored:
                _CACHE[(lib,) + k] = stored[k]
        todo = [k for k in todo if k not in stored]
        if not todo:
            return
        per_rank = train(todo)
        for i, k in enumerate(todo):
            _CACHE[(lib,) + k] = stored[k] = [per_rank[r][i] for r in range(N)]
        store(stored)


def prefetch_ds(keys) -> None:
    """Train every not-yet-cached DeepSpeed configuration in `keys` in ONE pair of rank
    processes, as prefetch_mz does minizero's."""
    from tests.support.launcher import run_ranks
    _prefetch("ds", [_key(*k)[:4] for k in keys],
              lambda todo: run_ranks(_deepspeed_many, world_size=N, args=([(make_config(*k), STEPS) for k in todo],),
                                     env=ENV, timeout=900))


def cached_ds(stage: int, dtype: str, ckpt: bool = False, clip: Optional[float] = None) -> List[Dict[str, Any]]:
    """DeepSpeed's per-rank results for one configuration, trained once per session."""
    prefetch_ds([(stage, dtype, ckpt, clip)])
    return _CACHE[("ds",) + _key(stage, dtype, ckpt, clip)[:4]]


def prefetch_mz(keys) -> None:
    """Train every not-yet-cached minizero configuration in `keys` in ONE pair of rank
    processes (under xdist: those no other worker has trained yet, one worker at a time)."""
    from tests.support.launcher import run_ranks

    def train(todo):
        jobs = [{"model_fn": MODEL_FN, "config": make_config(*k[:4]), "batches": BATCHES, "steps": STEPS,
                 "capture_memory": True, "variant": k[4]} for k in todo]
        return run_ranks(run_minizero_many, world_size=N, args=(jobs,), env=ENV, timeout=600)
    _prefetch("mz", [_key(*k) for k in keys], train)


def cached_mz(stage: int, dtype: str, ckpt: bool = False, clip: Optional[float] = None,
              variant: str = "minizero") -> List[Dict[str, Any]]:
    prefetch_mz([(stage, dtype, ckpt, clip, variant)])
    return _CACHE[("mz",) + _key(stage, dtype, ckpt, clip, variant)]


CLIP_ACTIVE = 0.5
CLIP_STAGES = (1, 3)
JITTER_SEEDS = range(6)
# Every minizero configuration any agreement test needs: trained in ONE pair of processes.
ALL_MZ_KEYS = ([(s, d, False, None) for d in DTYPES for s in STAGES]
               + [(s, d, False, CLIP_ACTIVE, n) for d in ("fp32", "bf16") for s in CLIP_STAGES
                  for n in ("minizero", "ds_norm")]
               + [(1, d, False, CLIP_ACTIVE, f"jitter{k}") for d in ("fp32", "bf16") for k in JITTER_SEEDS]
               + [(0, d, False, None, "ds_stage0") for d in ("bf16", "fp16")]
               + [(0, "fp32", True, None), (3, "fp32", True, None), (3, "bf16", True, None)])
# Every DeepSpeed configuration the agreement tests compare with: also ONE pair of processes.
ALL_DS_KEYS = ([(s, d, False, None) for d in DTYPES for s in STAGES]
               + [(s, d, False, CLIP_ACTIVE) for d in ("fp32", "bf16") for s in CLIP_STAGES]
               + [(0, "fp32", True, None), (3, "fp32", True, None), (3, "bf16", True, None)])


# ----------------------------------------------------------------------------- comparisons

def ds_inter_stage_weight_drift(dtype: str, stages=(0, 1, 2, 3), clip: Optional[float] = None) -> float:
    W = {s: cached_ds(s, dtype, clip=clip)[0]["final_state"] for s in stages}
    return max(max_abs_diff(W[s], W[t]) for s in stages for t in stages)


def ds_inter_stage_drift(dtype: str, stages=(0, 1, 2, 3), clip: Optional[float] = None) -> float:
    """max over stages s,t of max_step |loss_ds[s] - loss_ds[t]|: DeepSpeed's own disagreement."""
    L = {s: cached_ds(s, dtype, clip=clip)[0]["losses"] for s in stages}
    return max(max_list_diff(L[s], L[t]) for s in stages for t in stages)


# ----------------------------------------------------------------------------- the table

def gap_table() -> str:
    prefetch_mz([(s, d, False) for d in DTYPES for s in STAGES])
    prefetch_ds([(s, d, False) for d in DTYPES for s in STAGES])
    lines = ["| dtype | stage | max_step abs(loss_mz - loss_ds) | max abs(w_mz - w_ds) | "
             "DS inter-stage drift (stages 1-3; 0-3) | final loss DS |",
             "|---|---|---|---|---|---|"]
    for d in DTYPES:
        drift13 = ds_inter_stage_drift(d, (1, 2, 3))
        drift03 = ds_inter_stage_drift(d)
        for s in STAGES:
            ds, mz = cached_ds(s, d)[0], cached_mz(s, d)[0]
            lines.append(f"| {d} | {s} | {max_list_diff(mz['losses'], ds['losses']):.3e} | "
                         f"{max_abs_diff(mz['final_state'], ds['final_state']):.3e} | "
                         f"{drift13:.3e}; {drift03:.3e} | {ds['losses'][-1]:.6f} |")
    return "\n".join(lines)


def memory_table() -> str:
    lines = ["| stage | rank | category | minizero bwd / step | DeepSpeed bwd / step |", "|---|---|---|---|---|"]
    for s in STAGES:
        for r in range(N):
            mz, ds = cached_mz(s, "bf16")[r]["memory"], cached_ds(s, "bf16")[r]["memory"]
            for c in ("params", "master_params", "optimizer_states", "grads"):
                lines.append(f"| {s} | {r} | {c} | {mz['after_backward'][-1][c]:,} / {mz['after_step'][-1][c]:,} | "
                             f"{ds['after_backward'][-1][c]:,} / {ds['after_step'][-1][c]:,} |")
            lines.append(f"| {s} | {r} | buffers (DS) | - | {ds['after_backward'][-1]['buffers']:,} / "
                         f"{ds['after_step'][-1]['buffers']:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    print(gap_table())
    print()
    print(memory_table())
    print(f"\n({time.perf_counter() - t0:.0f} s)")
