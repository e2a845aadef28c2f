"""Stage 0: plain data parallelism, the baseline every ZeRO stage builds on.

Every rank holds everything: low-precision parameters (2Ψ bytes in bf16/fp16), their
gradients (2Ψ), an fp32 master copy (4Ψ) and Adam's two moments (8Ψ): the 16Ψ of the
ZeRO paper's baseline (Rajbhandari et al., SC'20, section 3.1). After backward, one
all-reduce of the flat gradient averages it across ranks; each rank then takes the same
optimizer step on the same numbers.

This class is also the protocol of every stage. zero1.py derives from it, zero2.py from
zero1.py, zero3.py from zero2.py, and each file shows only what its stage adds. The engine
calls, in this order (plus `grad_bytes` for memory_breakdown, and `plan`, the layout before it
exists, for the tools that size a run without starting it):

    prepare_backward(b)  before each micro-batch's backward (b: it is the step's last)
    finish_backward()    after it returns
    reduce_gradients()   at the accumulation boundary, before the step
    after_step()         after the optimizer updated this rank's shard
    grad_bytes()         gradient bytes a rank holds at the end of backward

What a stage decides is *where state lives and which collective moves it*: its buckets (each
a FlatParam, or a ZeRO-3 unit's FlatParams; a later stage builds its own and hands them to the
constructor of the stage before it), `flat_params` (what the optimizer shards), and `reduce`
(the collective on one bucket's gradient). Each stage extends the one before: a method it
changes calls its parent's where the parent's work still has to happen. The step itself
(norm, clip, Adam on the fp32 masters) is the same at every stage: sharded_optimizer.py.
`grad_buckets` holds the backward hooks that reduce each bucket as its last gradient
arrives (buckets.py).

Stage 0's buckets: one FlatParam per gradient bucket (reduce_bucket_size elements;
DeepSpeed's default makes that one per param group), not sharded (num_shards = 1: a rank's
"shard" is the whole buffer), each reduced by one all-reduce at the boundary, or with
`overlap_comm` from backward hooks as it fills (DDP's bucketed all-reduce).
"""
from __future__ import annotations

import torch

from .buckets import GradBuckets, bucket_plan, build_buckets
from .flat_param import FlatParam
from .partition import FlatPlan
from .sharding import replicated


class Zero0:
    """Gradients accumulate in p.grad over the micro-steps; with overlap_comm the last
    micro-step's backward all-reduces each bucket as it fills (DDP); without, one all-reduce
    per bucket's flat buffer at the boundary (one collective per bucket rather than one per
    parameter)."""
    stage = 0
    reduce_every_micro_step = False   # gradients accumulate in p.grad; reduced once per step

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg, buckets=None, sharding=None):
        """The plan's buckets, each FlatParam cut as `sharding` says (stage 0: not cut, a rank's
        shard is the whole buffer), or `buckets`, a later stage's own layout."""
        plans = Zero0.plan(module, param_groups, zero_cfg)
        self.buckets = buckets or build_buckets(module, plans, sharding or replicated())
        self.flat_params = [f for b in self.buckets for f in b.flats]
        self.grad_buckets = GradBuckets(self.buckets, self.reduce, every_micro_step=self.reduce_every_micro_step,
                                        overlap=bool(zero_cfg.overlap_comm))

    @staticmethod
    def plan(module: torch.nn.Module, param_groups: list[dict], zero_cfg) -> list[FlatPlan]:
        """One FlatParam per gradient bucket (buckets.bucket_plan), before it exists."""
        return bucket_plan(module, param_groups, int(zero_cfg.reduce_bucket_size))

    def reduce(self, flat: FlatParam, async_op: bool):
        """The collective on one bucket's gradient: the rank-averaged whole."""
        return flat.all_reduce_grad(async_op=async_op)

    def prepare_backward(self, boundary: bool = True) -> None:
        self.grad_buckets.prepare_backward(boundary)

    def finish_backward(self) -> None:
        """Buckets some of whose parameters got no gradient: reduce them now, zeros for the
        missing ones, in bucket order so every rank issues the same collectives; then wait
        for every reduction in flight."""
        self.grad_buckets.finish_backward()

    def reduce_gradients(self) -> None:
        """Every bucket's reduction, at the boundary (done already in the last backward with
        overlap_comm)."""
        self.grad_buckets.reduce_all()

    def after_step(self) -> None:
        """Nothing: every rank took the same step on the whole model."""

    def grad_bytes(self) -> int:
        """The full low-precision gradient (held at the end of backward)."""
        return sum(f.numel for f in self.flat_params) * self.flat_params[0].full.element_size()
