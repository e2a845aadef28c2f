"""ZeRO-1: partition the optimizer states (P_os in the ZeRO paper, Rajbhandari et al., SC'20, 5.1).

Adam keeps, per parameter, an fp32 master copy and two fp32 moments: 12 of the 16 bytes
per parameter of mixed-precision training. None of it is needed by forward or backward,
only by the update, and the update is element-wise. So rank r keeps those 12 bytes only
for its slice of the parameters and updates only that slice. The paper draws one buffer of
all Ψ parameters cut into N pieces; minizero cuts each gradient bucket's flat buffer
(buckets.py), so rank r owns slice r of every bucket: the same 1/N, up to padding. The
update itself is not in this file: every stage shares it (sharded_optimizer.py builds the
fp32 master and Adam's moments for this rank's shard). What this file adds to stage 0
(zero0.py) is only *how the gradient slice arrives* and the all-gather after the step:

    memory per rank: 2Ψ (lp params) + 2Ψ (lp grads) + 12Ψ/N

One step, per gradient bucket (one FlatParam each, padded to a multiple of N; with
DeepSpeed's default reduce_bucket_size, one per param group; buckets.py):

    backward          full low-precision gradient in each p.grad (as stage 0)
    reduce_gradients  reduce-scatter the flat gradient: rank r receives the *sum over ranks*
                      of slice r only (pre-divided by N, so it is the average)
    step              Adam on rank r's fp32 master slice; round it into lp slice r
    after_step        all-gather: every rank gets every updated slice

Why reduce-scatter and not all-reduce? Rank r only ever needs gradient slice r, and
reduce-scatter + all-gather moves exactly what one all-reduce would (Ψ(N-1)/N each way:
an all-reduce *is* a reduce-scatter followed by an all-gather), so ZeRO-1 costs no extra
communication over stage 0. DeepSpeed's ZeRO-1/2 instead all-reduce the gradient bucket
and keep their slice (docs/deepspeed.md, "ZeRO-1/2 reduce-scatter is an all-reduce"),
then all-gather the parameters: 3Ψ(N-1)/N on the wire rather than the paper's 2Ψ(N-1)/N.
The numbers are identical; the volume is not.

Gradient accumulation: p.grad accumulates over micro-steps as at stage 0 and is reduced
once, at the boundary; so with accumulation a ZeRO-1 rank holds the full gradient.
"""
from __future__ import annotations

import torch

from .flat_param import FlatParam, all_gather_params
from .sharding import plain
from .zero0 import Zero0


class Zero1(Zero0):
    """Gradients accumulate in p.grad over the micro-steps; with overlap_comm the last
    micro-step's backward reduce-scatters each bucket as it fills; without, each bucket's
    flat gradient is reduce-scattered at the boundary: rank r keeps the averaged slice r only."""
    stage = 1

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg, buckets=None):
        """The same buckets, each cut into N shards: rank r owns slice r of every bucket."""
        super().__init__(module, param_groups, zero_cfg, buckets, sharding=plain())

    def reduce(self, flat: FlatParam, async_op: bool):
        """Only this rank's slice of the rank-averaged gradient."""
        return flat.reduce_scatter_grad(async_op=async_op)

    def after_step(self) -> None:
        """Every rank updated only its slice: all-gather the new low-precision parameters every
        rank keeps whole (at ZeRO-1/2 all of them). The shard is a view of `full`, so the gather
        writes straight into the parameters."""
        self.gather_whole([f for f in self.flat_params if f.persistent])

    def gather_whole(self, flats: list[FlatParam]) -> None:
        """One all-gather per bucket, issued back to back (flat_param.all_gather_params)."""
        all_gather_params(flats)
