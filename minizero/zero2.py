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
  gradient of a bucket lands, the bucket is reduce-scattered into the rank's persistent
  `grad_shard` (accumulated across micro-steps) and the bucket's `p.grad`s are dropped.
- After backward returns, any bucket still incomplete (a parameter that got no gradient
  this step, e.g. an unused branch) is reduced with zeros for the missing gradients, in
  bucket order. Missing gradients are zero, not stale (DEEPSPEED_FACTS: DeepSpeed's
  ZeRO-3 reapplies a stale gradient; we do not).
- Collectives must line up across ranks, so every rank must use the same parameters in
  a step (a parameter unused on *all* ranks is fine). A data-dependent branch taken on
  one rank only would reduce buckets in a different order per rank; DeepSpeed's hooks
  have the same requirement.

Communication is ZeRO-1's: reduce-scatter + all-gather = one all-reduce's volume.
"""
from __future__ import annotations

from .partition import bucketize
from .zero1 import Zero1


class Zero2(Zero1):
    stage = 2

    def build_flat_params(self) -> None:
        bucket = int(self.zero_cfg.reduce_bucket_size) if self.zero_cfg is not None else int(5e8)
        for gi, g in enumerate(self.param_groups):
            params = list(g["params"])[::-1]  # backward order
            for bi, idx in enumerate(bucketize([p.numel() for p in params], bucket)):
                members = [params[i] for i in idx][::-1]
                self._add_flat(gi, members, f"group{gi}.bucket{bi}", keep_full=True)
        self._bucket_of = {}
        for fi, f in enumerate(self.flat_params):
            for p in f.params:
                self._bucket_of[id(p)] = fi
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._arrived = [0] * len(self.flat_params)
        self._reduced = [False] * len(self.flat_params)

    def pre_backward(self) -> None:
        self._arrived = [0] * len(self.flat_params)
        self._reduced = [False] * len(self.flat_params)

    def _on_grad_ready(self, p) -> None:
        fi = self._bucket_of[id(p)]
        self._arrived[fi] += 1
        if self._arrived[fi] == len(self.flat_params[fi].params):
            self._reduce_bucket(fi)

    def _reduce_bucket(self, fi: int) -> None:
        self.reduce_scatter_grads(self.flat_params[fi])
        self._reduced[fi] = True

    def post_backward(self) -> None:
        for fi in range(len(self.flat_params)):
            if not self._reduced[fi]:
                self._reduce_bucket(fi)

    def reduce_gradients(self) -> None:
        """Nothing left to do at the boundary: every micro-step was reduced in backward."""

    def grad_bytes(self) -> int:
        return sum(f.shard_numel for f in self.flat_params) * self.flat_params[0].full.element_size()
