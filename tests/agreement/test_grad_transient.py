"""Gradient bytes alive during backward with overlap_comm on, minizero against DeepSpeed.

With overlap_comm a bucket's reduction runs while backward goes on, and its flat gradient
buffer lives until the reduction is waited for. Unbounded, every bucket's buffer would live
until backward ends: the whole low-precision gradient, 2Ψ bytes, on top of the shard ZeRO-2
keeps. minizero waits for the previous reduction before laying out the next bucket
(buckets.MAX_IN_FLIGHT = 1), so one flat buffer is alive at a time, and while it is laid out
the bucket's own parameter gradients (what autograd produced, freed once copied) beside it:
two buckets' worth of gradient at most. DeepSpeed's ZeRO-1/2 hold the same two: its double-buffered
ipg buckets of reduce_bucket_size each (stage_1_and_2.py, setup_buckets), allocated at the
start of backward; its ZeRO-3 one persistent bucket, with at most two reductions queued
behind it (stage3.py, max_param_reduce_events).

minizero's count comes from comm's observer seam: each reduction's payload is its flat
buffer, added at issue (with the buffer just laid out) and taken off at its wait.
DeepSpeed's from reference/ds_memory.py's track_transient_buckets. Tiny GPT, 2 ranks, bf16,
reduce_bucket_size 2e4 elements, one step of each stage in one launch per library.
"""
from __future__ import annotations

import pytest

from tests.support import agreement as A
from tests.support.launcher import run_ranks

STEPS = 1
STAGES = (2, 3)   # DeepSpeed's ZeRO-3 patches torch process-wide: it runs last


class InFlight:
    """comm observer: the peak bytes of gradient buffers alive for reductions: those issued
    and not yet waited for, counted from the moment the new one is laid out."""

    def __init__(self):
        self.live, self.peak = 0, 0

    def begin(self, op, label, tensor, nbytes, group):
        if op in ("reduce_scatter", "all_reduce") and label and label.endswith(".grads"):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            return nbytes
        return None

    def end(self, token, op, label, nbytes, wire_bytes, msg_bytes):
        if token is not None:
            self.live -= token


def _minizero() -> dict:
    return {s: _minizero_stage(s) for s in STAGES}


def _minizero_stage(stage: int) -> dict:
    import minizero
    from minizero import comm
    from tests.support.harness import build_model, prepare_ds_config, train_steps
    cfg = A.make_config(stage, "bf16")
    cfg["zero_optimization"]["overlap_comm"] = True
    cfg = prepare_ds_config(cfg)
    model, groups = build_model(A.MODEL_FN, cfg, 0, None)
    engine = minizero.initialize(model=model, model_parameters=groups, config=cfg)[0]
    watch = InFlight()
    comm.subscribe(watch)
    try:
        train_steps(engine, A.BATCHES, STEPS, lambda e: 1.0, None, None)
    finally:
        comm.unsubscribe(watch)
    return {"peak": watch.peak, "buckets": [f.padded_numel * 2 for f in engine.zero.flat_params]}


def _deepspeed() -> dict:
    return {s: _deepspeed_stage(s) for s in STAGES}


def _deepspeed_stage(stage: int) -> dict:
    from reference.ds_run import run_deepspeed
    cfg = A.make_config(stage, "bf16")
    cfg["zero_optimization"]["overlap_comm"] = True
    r = run_deepspeed(A.MODEL_FN, cfg, A.BATCHES, STEPS, capture_memory=True, return_final_state=False)
    return {"transient": r["memory"]["transient_buckets"]["max_bytes"],
            "buffers": r["memory"]["after_init"]["buffers"]}


@pytest.fixture(scope="module")
def runs():
    mz, ds = run_ranks(_minizero, A.N, env=A.ENV), run_ranks(_deepspeed, A.N, env=A.ENV)
    return ({s: [r[s] for r in mz] for s in STAGES}, {s: [r[s] for r in ds] for s in STAGES})


def test_zero2_holds_two_buckets_of_gradient_at_most_as_deepspeed_does(runs):
    mz, ds = runs
    for rank in range(A.N):
        m, d = mz[2][rank], ds[2][rank]
        # one flat buffer at a time (unbounded, all of them until backward ended: the sum)
        assert m["peak"] == max(m["buckets"]) < sum(m["buckets"]) // 2
        # DeepSpeed: two reduce_bucket_size buffers (bf16). minizero: a flat buffer and the
        # parameter gradients it is laid out from, each at most reduce_bucket_size elements,
        # padded to a multiple of N: the same bound, up to 2 x (N - 1) elements of padding.
        assert d["transient"] == 2 * A.BUCKET * 2
        assert 2 * m["peak"] <= d["transient"] + 2 * (A.N - 1) * 2


def test_zero3_holds_two_units_of_gradient_at_most(runs):
    mz, ds = runs
    for rank in range(A.N):
        m, d = mz[3][rank], ds[3][rank]
        assert m["peak"] == max(m["buckets"]) < sum(m["buckets"]) // 2
        # DeepSpeed's ZeRO-3 copies gradients into one reduce_bucket_size bucket it keeps from
        # init: 40,000 bytes here, not transient. minizero reduce-scatters each unit's own
        # flat gradient: one at a time (beside the unit's parameter gradients) while backward
        # runs, none after it.
        assert d["buffers"] == A.BUCKET * 2
