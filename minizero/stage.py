"""What every ZeRO stage is: gradient buckets, and the four methods the engine calls.

Each stage (zero0-3.py) says *where state lives and which collective moves it*; the step
itself (norm, clip, Adam on the fp32 masters) is the same at every stage:
sharded_optimizer.py. The engine calls, in this order (plus `grad_bytes` for
memory_breakdown):

    prepare_backward(b)  before each micro-batch's backward (b: it is the step's last)
    finish_backward()    after it returns
    reduce_gradients()   at the accumulation boundary, before the step
    after_step()         after the optimizer updated this rank's shard
    grad_bytes()         gradient bytes a rank holds at the end of backward

This base class holds what they share: the buckets (each a FlatParam, or a ZeRO-3 unit's
FlatParams), `flat_params` (what the optimizer shards), and `grads`, the backward hooks that
reduce each bucket as its last gradient arrives (buckets.py). A stage file shows only what
it adds: `diff zero1.py zero2.py`, `diff zero2.py zero3.py`.
"""
from __future__ import annotations

from .buckets import Bucket, GradBuckets


class Stage:
    stage: int

    def __init__(self, buckets: list[Bucket], reduce, *, every_micro_step: bool, zero_cfg):
        """reduce(flat, async_op): the stage's collective on one FlatParam's gradient
        (FlatParam.all_reduce_grad or .reduce_scatter_grad). every_micro_step: reduce in
        every micro-step's backward (ZeRO-2/3), or once per step (stage 0, ZeRO-1)."""
        self.buckets = buckets
        self.flat_params = [f for b in buckets for f in b.flats]
        self.grads = GradBuckets(buckets, reduce, every_micro_step=every_micro_step,
                                 overlap=bool(zero_cfg.overlap_comm))

    def prepare_backward(self, boundary: bool = True) -> None:
        self.grads.prepare_backward(boundary)

    def finish_backward(self) -> None:
        """Buckets some of whose parameters got no gradient: reduce them now, zeros for the
        missing ones, in bucket order so every rank issues the same collectives; then wait
        for every reduction in flight."""
        self.grads.finish_backward()

    def reduce_gradients(self) -> None:
        """Every bucket's reduction, at the boundary (done already in the last backward with
        overlap_comm, or in every backward at ZeRO-2/3)."""
        self.grads.reduce_all()

    def after_step(self) -> None:
        """Nothing: every rank took the same step on the whole model."""

    def grad_bytes(self) -> int:
        """The full low-precision gradient (stage 0, ZeRO-1 hold it at the end of backward)."""
        return sum(f.numel for f in self.flat_params) * self.flat_params[0].full.element_size()


def keep_grad_buffers(flat_params) -> None:
    """Stage 0 and ZeRO-1 on a CPU: reuse each bucket's flat gradient buffer every step
    (flat_param.py, keep_grad_buffer). They hold the full gradient at the end of backward
    anyway (grad_bytes); ZeRO-2/3 must not, so they keep allocating per reduction."""
    for f in flat_params:
        f.keep_grad_buffer = f.device.type == "cpu"
