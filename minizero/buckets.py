"""Gradient buckets: reduce each bucket as soon as backward has produced all its gradients.

Backward produces gradients last layer first. Waiting for all of them before reducing any
leaves the network idle during backward and the compute idle during the reduction. PyTorch
DDP (Li et al., VLDB'20, "PyTorch Distributed", section 3.2.3) and DeepSpeed's ZeRO-2
(`overlap_comm`) cut the parameters into buckets in backward order and start a bucket's
reduction when its last gradient arrives, so communication of bucket k runs while backward
computes bucket k+1.

Each bucket is its own FlatParam (flat_param.py): padded to a multiple of N, so every rank
owns slice r of every bucket. A post-accumulate-grad hook on every parameter counts arrivals;
the bucket's last one *issues* its reduction (`issue`). With `overlap_comm` the collective is
asynchronous: `issue` returns at once and backward goes on; `wait` (at the end of backward)
completes every reduction in flight, in issue order. Without it the reduction runs inside the
hook and is done when the hook returns. Both reduce the same buffers with the same
collectives, so the numbers are bit-identical with overlap on and off; only *when* differs.

Which micro-steps reduce: stage 0 (all-reduce) and ZeRO-1 (reduce-scatter) let gradients
accumulate in p.grad and reduce once, in the backward of the last micro-step of the step
(DDP's no_sync); ZeRO-2/3 reduce-scatter in every micro-step's backward and accumulate the
shard. Without overlap, stage 0 and ZeRO-1 reduce at the step instead, after backward (as
the ZeRO paper describes them): the hooks are off.

With overlap, at most one reduction is in flight (`MAX_IN_FLIGHT`): before the next bucket's
flat gradient is laid out, the previous reduction is waited for. Its buffer is the only full-
size gradient alive besides the one being laid out, so a rank holds two buckets of gradient at
most during backward, as DeepSpeed's double-buffered ZeRO-2 does (two reduce_bucket_size
buffers), instead of every bucket's until backward ends (2Ψ bytes). On NCCL that wait makes
the compute stream wait for NCCL's (the host does not block), so backward keeps queueing
work; on gloo the host waits for a reduction issued one bucket ago.

A bucket some of whose parameters got no gradient this backward (an unused branch) is
reduced after backward, zeros for the missing ones, in bucket order so every rank issues the
same collectives. Every rank must use the same parameters in a step (a parameter unused on
*all* ranks is fine); a branch taken on one rank only reorders the buckets (docs/debugging.md).
"""
from __future__ import annotations

import torch

from .flat_param import FlatParam, build_flat
from .partition import FlatPlan, bucketize
from .sharding import Sharding


MAX_IN_FLIGHT = 1   # reductions in flight with overlap_comm (module docstring)


class Bucket:
    """Parameters whose gradients are reduced together, once all have arrived."""

    def __init__(self, name: str, flats: list[FlatParam]):
        self.name, self.flats = name, flats
        self.params = [p for f in flats for p in f.params]
        self.arrived = 0        # gradients landed in this backward
        self.reduced = False    # reduction issued in this backward

    def start_backward(self) -> None:
        self.arrived, self.reduced = 0, False

    def gradient_arrived(self) -> bool:
        """One more of its parameters has its gradient: was it the last?"""
        self.arrived += 1
        return self.arrived == len(self.params)

    def post_backward(self) -> None:
        """Its reduction is issued (ZeRO-3's Unit also frees its parameters here, unit.py)."""
        self.reduced = True


class GradBuckets:
    """The hooks and the issue/wait bookkeeping of bucketed gradient reduction.

    reduce(flat, async_op) -> an in-flight reduction (with .wait()) or None: the stage's
    collective on one FlatParam (FlatParam.all_reduce_grad or .reduce_scatter_grad). After
    issuing a bucket's reduction, its post_backward (ZeRO-3: the unit reshards)."""

    def __init__(self, buckets: list[Bucket], reduce, *, every_micro_step: bool, overlap: bool):
        self.buckets, self.reduce = buckets, reduce
        self.every_micro_step, self.overlap = every_micro_step, overlap
        self.in_flight: list = []
        self.active = False     # reducing from hooks in this backward
        if every_micro_step or overlap:   # else no backward ever reduces: no hook to call at all
            for b in buckets:
                hook = self.hook_for(b)
                for p in b.params:
                    p.register_post_accumulate_grad_hook(hook)

    def prepare_backward(self, boundary: bool) -> None:
        """Before a micro-step's backward: reduce in it? (every micro-step, or the last with overlap)"""
        self.active = self.every_micro_step or (self.overlap and boundary)
        for b in self.buckets:
            b.start_backward()

    def hook_for(self, b: Bucket):
        """The post_accumulate_grad hook of b's parameters: the bucket's last gradient issues
        its reduction (one closure per bucket: a backward calls it once per parameter)."""
        def grad_ready(_param) -> None:
            if self.active and b.gradient_arrived():
                self.issue(b)
        return grad_ready

    def issue(self, bucket: Bucket, async_op: bool | None = None) -> None:
        bounded = async_op is None and self.overlap   # from backward's hooks: bound what is in flight
        for f in bucket.flats:
            while bounded and len(self.in_flight) >= MAX_IN_FLIGHT:
                self.in_flight.pop(0).wait()     # its buffer goes before the next one is laid out
            in_flight = self.reduce(f, async_op=self.overlap if async_op is None else async_op)
            if in_flight is not None:
                self.in_flight.append(in_flight)
        bucket.post_backward()

    def finish_backward(self) -> None:
        """After backward: reduce the buckets that never completed, then wait for all."""
        if not self.active:
            return
        for b in self.buckets:
            if not b.reduced:
                self.issue(b)
        self.wait()

    def reduce_all(self) -> None:
        """At the step, when the hooks were off (stage 0 / ZeRO-1 without overlap): every
        bucket's reduction issued back to back, then all waited for. Nothing computes in
        between, so this hides nothing behind compute (that is overlap_comm); it only stops
        each collective from waiting for the previous one to return before it starts. NCCL
        queues them on its stream that way anyway; gloo's worker threads pipeline them
        (`python launch/bench_collectives.py` measures it). Same buffers, same sums: the
        numbers cannot change."""
        if self.active:
            return   # done in the last micro-step's backward
        for b in self.buckets:
            self.issue(b, async_op=True)
        self.wait()

    def wait(self) -> None:
        """Complete every reduction in flight, in issue order (the order adds into grad_shard)."""
        for r in self.in_flight:
            r.wait()
        self.in_flight.clear()


def build_buckets(module: torch.nn.Module, plans: list[FlatPlan], sharding: Sharding) -> list[Bucket]:
    """One Bucket per plan, holding one FlatParam cut as `sharding` says (over all ranks at
    ZeRO-1/2, so every rank owns slice r of every bucket; not cut at stage 0)."""
    by_name = dict(module.named_parameters())
    return [Bucket(plan.label, [build_flat(plan, by_name, sharding)]) for plan in plans]


def bucket_plan(module: torch.nn.Module, param_groups: list[dict], bucket_numel: int) -> list[FlatPlan]:
    """Stages 0-2's layout: per param group, buckets of at most `bucket_numel` elements
    (reduce_bucket_size), formed in reverse parameter order (the order backward produces
    gradients); within a bucket the parameters keep their forward order. With DeepSpeed's
    default (5e8) a model of this size is one bucket per param group."""
    names = {id(p): n for n, p in module.named_parameters()}
    plans = []
    for gi, g in enumerate(param_groups):
        params = list(g["params"])[::-1]  # backward order
        for bi, idx in enumerate(bucketize([p.numel() for p in params], bucket_numel)):
            members = [params[i] for i in idx][::-1]
            plans.append(FlatPlan(f"group{gi}.bucket{bi}", gi, tuple(names[id(p)] for p in members),
                                  tuple(p.numel() for p in members)))
    return plans
