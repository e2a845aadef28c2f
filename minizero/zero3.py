"""ZeRO-3: partition the parameters too (P_os+g+p, ZeRO paper, Rajbhandari et al., SC'20, 5.3).

After ZeRO-2 the largest thing left on every rank is the full low-precision model (2Ψ).
ZeRO-3 keeps only slice r of it, and materialises one module's parameters at a time,
just before they are used, and frees them right after:

    memory per rank: (2 + 2 + 12)Ψ/N   (+ the one or two modules currently unsharded)

The unit of gathering is a module: each transformer block (every child of an
`nn.ModuleList`), plus the root for what is left (embeddings, final norm, head). Never
the whole model at once. Vocabulary follows PyTorch FSDP2:

    pre_forward    unshard: all-gather the unit's parameters
    post_forward   reshard: free them; hook the outputs so backward can find the unit
    pre_backward   unshard again (backward needs the weights): `_PreBackward`, an autograd
                   Function placed on the unit's outputs in post_forward
    post_backward  when every parameter of the unit has its gradient: reduce-scatter the
                   gradients into this rank's grad shard (ZeRO-2's bucket path), reshard

What this file adds to ZeRO-2 (zero2.py), and all it adds:
  1. layout: `module_units` makes one bucket per module (a `Unit`) instead of one per
     reduce_bucket_size elements, and its FlatParams keep only their shard (keep_full=False);
  2. forward: pre_forward / post_forward hooks gather and free each unit;
  3. backward: `_PreBackward` gathers it again; `post_backward` is ZeRO-2's plus a reshard;
  4. step: `after_step` gathers only the persistent parameters (the rest on next use).

Per optimizer step every parameter is all-gathered twice (forward, backward) and its
gradient reduce-scattered once: 3Ψ(N-1)/N on the wire per rank, 1.5x stage 0's
all-reduce (paper, section 7.2.2). The gathers are labelled `.fwd`, `.bwd` and, when
activation checkpointing recomputes a block inside backward, `.recompute`.

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
from .flat_param import FlatParam, build_flat
from .partition import FlatPlan
from .zero2 import Bucket, Zero2


class ShardState(Enum):
    """A unit's state, read from its FlatParams' storage, never stored beside it (so it
    cannot go stale)."""
    SHARDED = auto()      # only this rank's shards exist; parameters are empty placeholders
    UNSHARDED = auto()    # the full buffers are allocated; parameters are views into them


class Unit(Bucket):
    """One module's parameters, gathered and freed together; also ZeRO-2's gradient bucket."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam]):
        super().__init__(name, flats)
        self.module = module
        self.partitioned = [f for f in flats if not f.keep_full]   # the persistent ones stay gathered

    @property
    def state(self) -> ShardState:
        return ShardState.UNSHARDED if any(f.full_is_allocated() for f in self.partitioned) else ShardState.SHARDED

    def unshard(self, why: str) -> None:
        if self.state is ShardState.UNSHARDED:
            return
        with torch.profiler.record_function(f"minizero::unshard::{self.name}"):
            for f in self.partitioned:
                f.all_gather(label=why)

    def reshard(self) -> None:
        for f in self.partitioned:
            f.free_full()


class Zero3(Zero2):
    stage = 3

    def __init__(self, module: nn.Module, param_groups: list[dict], zero_cfg):
        # 1. layout: one Unit per module instead of ZeRO-2's size buckets; its gradients
        #    still take ZeRO-2's path (use_buckets: hooks, reduce-scatter when complete).
        self.use_buckets(module_units(module, param_groups, int(zero_cfg.stage3_param_persistence_threshold)))
        for u in self.buckets:
            u.module.register_forward_pre_hook(self.pre_forward_hook(u))
            u.module.register_forward_hook(self.post_forward_hook(u))

    # ------------------------------------------------------------------ 2. forward
    def pre_forward_hook(self, unit: Unit):
        def pre_forward(module, args):
            # label only: a forward inside minizero's activation-checkpointing backward is
            # a recompute (another library's recompute is labelled "fwd")
            unit.unshard("recompute" if checkpointing.in_recompute() else "fwd")
        return pre_forward

    def post_forward_hook(self, unit: Unit):
        def post_forward(module, args, output):
            unit.reshard()
            if not torch.is_grad_enabled():
                return output
            return _register_pre_backward(unit, output)
        return post_forward

    # ------------------------------------------------------------------ 3. backward
    # pre_backward: _PreBackward below, on the unit's outputs.
    def post_backward(self, unit: Unit) -> None:
        super().post_backward(unit)   # reduce-scatter the unit's gradients, as ZeRO-2
        unit.reshard()

    # ------------------------------------------------------------------ 4. step
    def after_step(self) -> None:
        """Partitioned parameters were updated in their shards and are gathered on next use;
        only the persistent (small, always-gathered) ones need an all-gather now."""
        for f in self.flat_params:
            if f.keep_full:
                f.all_gather()


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward re-gathers the unit's parameters:
    the gradient arriving at a module's outputs is the signal that its backward is next."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.unshard("bwd")
        return (None, *grads)


def _register_pre_backward(unit: Unit, output):
    """Route the tensors in `output` (a tensor, or a tuple/list of tensors and others)
    through _PreBackward, returning the same structure."""
    if torch.is_tensor(output):
        return _PreBackward.apply(unit, output)[0] if output.requires_grad else output
    if isinstance(output, (tuple, list)):
        idx = [i for i, t in enumerate(output) if torch.is_tensor(t) and t.requires_grad]
        if not idx:
            return output
        wrapped = _PreBackward.apply(unit, *[output[i] for i in idx])
        out = list(output)
        for i, t in zip(idx, wrapped):
            out[i] = t
        return type(output)(out) if isinstance(output, tuple) else out
    return output


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
