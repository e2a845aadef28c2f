"""ZeRO-2: partition the gradients too (P_os+g, ZeRO paper, Rajbhandari et al., SC'20, 5.2).

ZeRO-1 still materialises the full low-precision gradient (2Ψ bytes) on every rank
before reducing it. But rank r only needs gradient slice r. ZeRO-2 reduce-scatters each
gradient *while backward is still running*, as soon as a bucket of them is complete, and
frees the full gradients of that bucket at once:

    memory per rank: 2Ψ (lp params) + (2 + 12)Ψ/N

Mechanics:
- Parameters are grouped into buckets of at most `reduce_bucket_size` elements (DeepSpeed's
  knob, default 5e8: one bucket for a small model). Each bucket is its own FlatParam, so
  each bucket is padded to a multiple of N and every rank owns slice r of every bucket.
  Buckets are formed in *reverse* parameter order, the order backward produces gradients.
- A `post_accumulate_grad` hook on every parameter counts arrivals; when the last
  gradient of a bucket lands, the bucket is reduce-scattered into the rank's `grad_shard`
  (accumulated across micro-steps) and its `p.grad`s dropped (buckets.py, shared with
  stage 0 and ZeRO-1). With `overlap_comm` the reduce-scatter is asynchronous and backward
  goes on; all are waited for when backward returns.
- After backward returns, any bucket still incomplete (a parameter that got no gradient
  this step, e.g. an unused branch) is reduced with zeros for the missing gradients, in
  bucket order. Missing gradients are zero, not stale (DeepSpeed's ZeRO-3 differs:
  docs/deepspeed.md, "ZeRO-3 reapplies a stale gradient").
- Collectives must line up across ranks, so every rank must use the same parameters in
  a step (a parameter unused on *all* ranks is fine). A data-dependent branch taken on
  one rank only would reduce buckets in a different order per rank; DeepSpeed's hooks
  have the same requirement.

Communication per micro-step is ZeRO-1's: reduce-scatter + all-gather = one all-reduce's
volume, Ψ(N-1)/N each way. With gradient accumulation it is not the same: ZeRO-2
reduce-scatters in every micro-step's backward (it cannot keep the full gradient to sum
locally: that is what it saves), so A micro-steps per step move (A + 1)·Ψ(N-1)/N per rank,
against 2Ψ(N-1)/N for stage 0 and ZeRO-1, which reduce once per step.

What this file adds to ZeRO-1 (zero1.py): reduce in every micro-step (`reduce_every_micro_step`,
so the hooks are on and the full gradient is dropped bucket by bucket), nothing left to
reduce at the boundary, and the shard as the gradient bytes a rank holds. ZeRO-3 (zero3.py)
builds on this class in turn.
"""
from __future__ import annotations

from .zero1 import Zero1


class Zero2(Zero1):
    """Each bucket's gradients are reduce-scattered in every micro-step's backward, as soon
    as all of them have arrived (buckets.py), asynchronously with overlap_comm; rank r keeps
    the averaged slice r only, accumulated over the micro-steps."""
    stage = 2
    reduce_every_micro_step = True

    def reduce_gradients(self) -> None:
        """Nothing left to do at the boundary: every micro-step was reduced in backward."""

    def grad_bytes(self) -> int:
        """Only this rank's reduced slice of each bucket."""
        return sum(f.shard_numel for f in self.flat_params) * self.flat_params[0].full.element_size()
