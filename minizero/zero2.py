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
  gradient of a bucket lands (the bucket's `post_backward`), the bucket is reduce-scattered
  into the rank's `grad_shard` (accumulated across micro-steps) and its `p.grad`s dropped.
- After backward returns, any bucket still incomplete (a parameter that got no gradient
  this step, e.g. an unused branch) is reduced with zeros for the missing gradients, in
  bucket order. Missing gradients are zero, not stale (DeepSpeed's ZeRO-3 differs:
  docs/deepspeed.md, "ZeRO-3 reapplies a stale gradient").
- Collectives must line up across ranks, so every rank must use the same parameters in
  a step (a parameter unused on *all* ranks is fine). A data-dependent branch taken on
  one rank only would reduce buckets in a different order per rank; DeepSpeed's hooks
  have the same requirement.

Communication is ZeRO-1's: reduce-scatter + all-gather = one all-reduce's volume.

ZeRO-3 (zero3.py) is this class with one change of layout and two additions: each module
is its own bucket, its parameters are sharded too, gathered around its forward and
backward and freed again after its bucket is reduced.
"""
from __future__ import annotations

import torch

from . import comm
from .flat_param import FlatParam, build_flat
from .partition import FlatPlan, bucketize


class Bucket:
    """Parameters whose gradients are reduce-scattered together, once all have arrived."""

    def __init__(self, name: str, flats: list[FlatParam]):
        self.name, self.flats = name, flats
        self.params = [p for f in flats for p in f.params]
        self.arrived = 0        # gradients landed in this backward
        self.reduced = False    # reduce-scattered in this backward


class Zero2:
    stage = 2

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg):
        self.use_buckets(size_buckets(module, param_groups, int(zero_cfg.reduce_bucket_size)))

    def use_buckets(self, buckets: list[Bucket]) -> None:
        """Reduce each bucket's gradients as soon as all of them have arrived in backward:
        a post-accumulate-grad hook on every parameter counts arrivals per bucket."""
        self.buckets = buckets
        self.flat_params = [f for b in buckets for f in b.flats]
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        for b in buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    # ------------------------------------------------------------------ backward
    def prepare_backward(self) -> None:
        for b in self.buckets:
            b.arrived, b.reduced = 0, False

    def grad_ready(self, p) -> None:
        """post_accumulate_grad hook: the bucket's last gradient starts its reduction."""
        b = self.bucket_of[id(p)]
        b.arrived += 1
        if b.arrived == len(b.params):
            self.post_backward(b)

    def post_backward(self, bucket: Bucket) -> None:
        for f in bucket.flats:
            f.reduce_scatter_grad()
        bucket.reduced = True

    def finish_backward(self) -> None:
        """Buckets some of whose parameters got no gradient: reduce them now, zeros for the
        missing ones, in bucket order so every rank issues the same collectives."""
        for b in self.buckets:
            if not b.reduced:
                self.post_backward(b)

    def reduce_gradients(self) -> None:
        """Nothing left to do at the boundary: every micro-step was reduced in backward."""

    # ------------------------------------------------------------------ step
    def after_step(self) -> None:
        """Every rank updated only its slice: all-gather the new low-precision parameters."""
        for f in self.flat_params:
            f.all_gather()

    def grad_bytes(self) -> int:
        return sum(f.shard_numel for f in self.flat_params) * self.flat_params[0].full.element_size()


def size_buckets(module: torch.nn.Module, param_groups: list[dict], bucket_numel: int) -> list[Bucket]:
    """One Bucket (holding one FlatParam, padded and sharded on its own, so every rank owns
    slice r of every bucket) per entry of bucket_plan."""
    by_name = dict(module.named_parameters())
    return [Bucket(plan.label, [build_flat(plan, by_name, comm.get_world_size(), comm.get_rank())])
            for plan in bucket_plan(module, param_groups, bucket_numel)]


def bucket_plan(module: torch.nn.Module, param_groups: list[dict], bucket_numel: int) -> list[FlatPlan]:
    """ZeRO-2's layout: per param group, buckets of at most `bucket_numel` elements
    (reduce_bucket_size), formed in reverse parameter order (the order backward produces
    gradients); within a bucket the parameters keep their forward order."""
    names = {id(p): n for n, p in module.named_parameters()}
    plans = []
    for gi, g in enumerate(param_groups):
        params = list(g["params"])[::-1]  # backward order
        for bi, idx in enumerate(bucketize([p.numel() for p in params], bucket_numel)):
            members = [params[i] for i in idx][::-1]
            plans.append(FlatPlan(f"group{gi}.bucket{bi}", gi, tuple(names[id(p)] for p in members),
                                  tuple(p.numel() for p in members)))
    return plans
