"""ZeRO-3: partition the parameters too (P_os+g+p, ZeRO paper, Rajbhandari et al., SC'20, 5.3).

After ZeRO-2 the largest thing left on every rank is the full low-precision model (2Ψ).
ZeRO-3 keeps only slice r of it, and materialises one module's parameters at a time,
just before they are used, and frees them right after:

    memory per rank: (2 + 2 + 12)Ψ/N   (+ the one or two modules currently unsharded)

The unit of gathering is a module: each transformer block (every child of an
`nn.ModuleList`), plus the root for what is left (embeddings, final norm, head). Never
the whole model at once, with one exception: the root's forward is the model's forward
(the blocks run inside it), so the root's parameters stay gathered from the start of
forward to its end, and from the start of backward to its end. For the image GPT that is
the embeddings and head, gathered for the whole step. A `Unit` holds one module's parameters and their whole lifecycle,
as PyTorch FSDP2's FSDPParamGroup does, in FSDP2's vocabulary:

    pre_forward    unshard: all-gather the unit's parameters
    post_forward   reshard: free them; hook the outputs so backward can find the unit
    pre_backward   unshard again (backward needs the weights): `on_backward`, an autograd
                   Function placed on the unit's outputs in post_forward
    post_backward  when every parameter of the unit has its gradient, ZeRO-2's bucket path
                   reduce-scatters the gradients (buckets.py) and calls it: reshard

What this file adds to ZeRO-2 (zero2.py), and all it adds:
  1. layout: `module_units` makes one bucket per module (a `Unit`) instead of one per
     reduce_bucket_size elements, and its FlatParams keep only their shard (keep_full=False);
  2. forward and backward: each Unit's four hooks above gather and free it;
  3. end of backward: nothing stays gathered into the step;
  4. step: `after_step` gathers only the persistent parameters (the rest on next use).

Per optimizer step every parameter is all-gathered twice (forward, backward) and its
gradient reduce-scattered once: 3Ψ(N-1)/N on the wire per rank, 1.5x stage 0's
all-reduce (paper, section 7.2.2). The gathers are labelled `.fwd`, `.bwd` and, when
activation checkpointing recomputes a block inside backward, `.recompute`.

That is with DeepSpeed's knobs at 0. *When* a unit is gathered and freed is prefetch.py's
decision (the `Prefetcher`, which the unit asks at each hook and obeys): with `stage3_prefetch_bucket_size` the next units' gathers are
issued while this one computes (`.prefetch` in the label), and `stage3_max_reuse_distance`
keeps a unit that is used again within that many *elements* of upcoming gathers. DeepSpeed's
default (1e9 elements) keeps every unit from its forward to its backward only while the
model is smaller than that (every model here): 2Ψ gathered per step instead of 3Ψ. In a
larger model only the units within 1e9 elements of their backward stay. With `overlap_comm` (DeepSpeed's
default at stage 3) the gradients' reduce-scatters run asynchronously too (buckets.py).

Small parameters (at most `stage3_param_persistence_threshold` elements, DeepSpeed's
default 1e5) are *persistent*: kept gathered on every rank like ZeRO-2 (their optimizer
state and gradient stay partitioned) because gathering many tiny tensors costs more in
latency than their memory is worth. They are all-gathered once, after the step.

Each (unit, param group) is one FlatParam (flat_param.py): the unit's parameters of that
group flattened, padded to a multiple of N, and cut into N slices. DeepSpeed instead pads
each parameter on its own to ceil(n/N) elements per rank; the difference is padding only.
"""
from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn

from . import checkpointing, comm
from .buckets import Bucket
from .flat_param import FlatParam, build_flat
from .partition import FlatPlan
from .prefetch import Prefetcher
from .stage import Stage


class ShardState(Enum):
    """A unit's state, read from its FlatParams' storage, never stored beside it (so it
    cannot go stale)."""
    SHARDED = auto()      # only this rank's shards exist; parameters are empty placeholders
    UNSHARDED = auto()    # the full buffers are allocated; parameters are views into them


class Unit(Bucket):
    """One module's parameters, gathered and freed together, and their lifecycle (module
    docstring); also ZeRO-2's gradient bucket. The Prefetcher decides when; the unit acts."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam]):
        super().__init__(name, flats)
        self.module = module
        self.partitioned = [f for f in flats if not f.keep_full]   # the persistent ones stay gathered
        self.partitioned_numel = sum(f.padded_numel for f in self.partitioned)   # elements while gathered
        self.ends_forward = False   # the root: its post_forward ends the model's forward
        self.prefetcher: Prefetcher | None = None

    @property
    def state(self) -> ShardState:
        return ShardState.UNSHARDED if any(f.full_is_allocated() for f in self.partitioned) else ShardState.SHARDED

    # ------------------------------------------------------------------ the two moves
    def unshard(self, why: str, async_op: bool = False):
        """All-gather the partitioned FlatParams (`why`: fwd, bwd, recompute; .prefetch).
        async_op: returns their Pendings, to wait() before the unit runs (prefetch.py)."""
        with torch.profiler.record_function(f"minizero::unshard::{self.name}"):
            pendings = [f.all_gather(label=why, async_op=async_op) for f in self.partitioned]
        return pendings if async_op else None

    def reshard(self) -> None:
        for f in self.partitioned:
            f.free_full()

    # ------------------------------------------------------------------ the four hooks
    def attach(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher
        self.module.register_forward_pre_hook(self.pre_forward)
        self.module.register_forward_hook(self.post_forward)

    def pre_forward(self, module, args) -> None:
        # label only: a forward inside minizero's activation-checkpointing backward is
        # a recompute (another library's recompute is labelled "fwd")
        self._use("recompute" if checkpointing.in_recompute() else "fwd")

    def post_forward(self, module, args, output):
        self._done()
        if not torch.is_grad_enabled():
            if self.ends_forward:   # an evaluation forward: no backward will follow
                for u in self.prefetcher.reset():
                    u.reshard()
            return output
        return on_backward(output, self.pre_backward)

    def pre_backward(self) -> None:
        self._use("bwd")

    def post_backward(self) -> None:
        """The unit's gradients are issued for reduce-scatter (ZeRO-2's path, GradBuckets):
        free its parameters. Safe while the reduce-scatter may still run: it reads the flat
        gradient buffer, which its Pending keeps alive, never the parameters."""
        self._done()

    def _use(self, why: str) -> None:
        """The unit is about to run: do what the Prefetcher says (free, gather, read ahead)."""
        free, gather, ahead = self.prefetcher.fetch(self)
        for u in free:
            u.reshard()
        if gather:
            self.unshard(why)
        for u in ahead:
            self.prefetcher.prefetched(u, u.unshard(f"{why}.prefetch", async_op=True))

    def _done(self) -> None:
        if self.prefetcher.release(self):
            self.reshard()


class Zero3(Stage):
    stage = 3

    def __init__(self, module: nn.Module, param_groups: list[dict], zero_cfg):
        # 1. layout: one Unit per module instead of ZeRO-2's size buckets; its gradients
        #    still take ZeRO-2's path (GradBuckets: hooks, reduce-scatter when complete).
        units = module_units(module, param_groups, int(zero_cfg.stage3_param_persistence_threshold))
        super().__init__(units, FlatParam.reduce_scatter_grad, every_micro_step=True, zero_cfg=zero_cfg)
        # 2. forward and backward: each unit's hooks; when it is gathered and freed is the
        #    Prefetcher's decision: on demand, or read ahead from a recorded trace.
        self.prefetcher = Prefetcher(units, int(zero_cfg.stage3_prefetch_bucket_size),
                                     int(zero_cfg.stage3_max_live_parameters), int(zero_cfg.stage3_max_reuse_distance))
        for u in units:
            u.attach(self.prefetcher)
        units[-1].ends_forward = True   # find_units puts the root last

    def reduce_gradients(self) -> None:
        """Nothing left to do at the boundary: every micro-step was reduced in backward."""

    # ------------------------------------------------------------------ 3. end of backward
    def finish_backward(self) -> None:
        super().finish_backward()            # reduce what is left, wait for every reduction
        for u in self.prefetcher.end_of_backward():   # nothing stays gathered into the step
            u.reshard()

    # ------------------------------------------------------------------ 4. step
    def after_step(self) -> None:
        """Partitioned parameters were updated in their shards and are gathered on next use
        (none is still gathered: end_of_backward freed them, and reset() makes sure); only the
        persistent (small, always-gathered) ones need an all-gather now."""
        for u in self.prefetcher.reset():
            u.reshard()
        for f in self.flat_params:
            if f.keep_full:
                f.all_gather()

    def grad_bytes(self) -> int:
        return sum(f.shard_numel for f in self.flat_params) * self.flat_params[0].full.element_size()


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward first calls `callback` (once), then passes the
    gradients on unchanged: the gradient arriving at a module's outputs is the signal that its
    backward is next. ZeRO-3's pre_backward (re-gather the unit) and the trace's unit marks
    (trace.py) are both this."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def on_backward(value, callback):
    """`value` (a tensor, or a tuple/list holding tensors and others) with its grad-requiring
    tensors routed together through one _OnBackward, the same structure back."""
    if torch.is_tensor(value):
        return _OnBackward.apply(callback, value)[0] if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        idx = [i for i, t in enumerate(value) if torch.is_tensor(t) and t.requires_grad]
        if not idx:
            return value
        out = list(value)
        for i, t in zip(idx, _OnBackward.apply(callback, *[value[i] for i in idx])):
            out[i] = t
        return type(value)(out) if isinstance(value, tuple) else out
    return value


def module_units(model: nn.Module, param_groups: list[dict], persistence_threshold: int) -> list[Unit]:
    """One Unit per entry of unit_plan, its FlatParams built from the plan."""
    by_name = dict(model.named_parameters())
    return [Unit(name, m, [build_flat(plan, by_name, comm.get_world_size(), comm.get_rank()) for plan in plans])
            for name, m, plans in unit_plan(model, param_groups, persistence_threshold)]


def unit_plan(model: nn.Module, param_groups: list[dict],
              persistence_threshold: int) -> list[tuple[str, nn.Module, list[FlatPlan]]]:
    """ZeRO-3's layout: (name, module, plans) per module of find_units(); per param group,
    its parameters of more than `persistence_threshold` elements in one partitioned
    FlatParam (keep_full=False), the rest in one kept-gathered ("persistent") FlatParam."""
    names = {id(p): n for n, p in model.named_parameters()}
    group_of = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    modules = find_units(model)
    owner = {}  # parameter -> the innermost unit containing it (blocks come before the root)
    for name, m in modules:
        for p in m.parameters():
            owner.setdefault(id(p), name)
    units = []
    for name, m in modules:
        mine = [p for p in m.parameters() if owner[id(p)] == name and id(p) in group_of]
        plans = []
        for gi in range(len(param_groups)):
            in_group = [p for p in mine if group_of[id(p)] == gi]
            for params, keep_full, suffix in (([p for p in in_group if p.numel() > persistence_threshold], False, ""),
                                              ([p for p in in_group if p.numel() <= persistence_threshold], True,
                                               ".persist")):
                if params:
                    plans.append(FlatPlan(f"{name}.g{gi}{suffix}", gi, tuple(names[id(p)] for p in params),
                                          tuple(p.numel() for p in params), keep_full))
        units.append((name, m, plans))
    return units


def find_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every element of every outermost nn.ModuleList (the transformer blocks), then the
    root for the parameters no block owns. A ModuleList inside a block stays part of that
    block. Each parameter belongs to exactly one unit: tied weights shared by two units
    are not supported."""
    units = []
    for name, m in model.named_modules():
        inside = any(name.startswith(u + ".") for u, _ in units)
        if isinstance(m, nn.ModuleList) and not inside:
            units += [(f"{name}.{i}", child) for i, child in enumerate(m)]
    return units + [("root", model)]
