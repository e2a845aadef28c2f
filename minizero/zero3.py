"""ZeRO-3: partition the parameters too (P_os+g+p, ZeRO paper, Rajbhandari et al., SC'20, 5.3).

After ZeRO-2 the largest thing left on every rank is the full low-precision model (2Ψ).
ZeRO-3 keeps only slice r of it, and materialises one module's parameters at a time,
just before they are used, and frees them right after:

    memory per rank: (2 + 2 + 12)Ψ/N   (+ the one or two modules currently unsharded)

The unit of gathering is a module: each transformer block (every child of an
`nn.ModuleList`), plus the root for what is left (embeddings, final norm, head). Never
the whole model at once. Vocabulary and states follow PyTorch FSDP2:

    pre_forward    unshard: all-gather the unit's parameters
    post_forward   reshard: free them; hook the outputs so backward can find the unit
    pre_backward   unshard again (backward needs the weights), fired by an autograd
                   Function placed on the unit's outputs in post_forward
    post_backward  when every parameter of the unit has its gradient (post-accumulate-grad
                   hooks): reduce-scatter the gradients into this rank's grad shard, reshard

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

from .zero2 import Zero2


class ShardState(Enum):
    SHARDED = auto()      # only this rank's slice exists; parameters are empty placeholders
    UNSHARDED = auto()    # full parameters gathered; parameters are views into the buffer


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()   # backward has reached this unit: parameters re-gathered
    POST_BACKWARD = auto()  # all gradients of this unit reduced; resharded


class Unit:
    """One module's worth of parameters that are gathered and released together."""

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module = name, module
        self.flats = []          # partitioned FlatParams: gathered around use
        self.persistent = []     # FlatParams kept gathered (small parameters)
        self.params = []         # every parameter of the unit (for post-backward counting)
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.arrived = 0

    def unshard(self, why: str) -> None:
        if self.shard_state is ShardState.UNSHARDED:
            return
        with torch.profiler.record_function(f"minizero::unshard::{self.name}"):
            for f in self.flats:
                f.all_gather(label=why)
        self.shard_state = ShardState.UNSHARDED

    def reshard(self) -> None:
        if self.shard_state is ShardState.SHARDED:
            return
        for f in self.flats:
            f.free_full()
        self.shard_state = ShardState.SHARDED


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward re-gathers the unit's parameters:
    the gradient arriving at a module's outputs is the signal that its backward is next."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.training_state = TrainingState.PRE_BACKWARD
        ctx.unit.unshard("bwd")
        return (None, *grads)


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


class Zero3(Zero2):
    stage = 3

    def build_flat_params(self) -> None:
        cfg = self.zero_cfg
        threshold = int(cfg.stage3_param_persistence_threshold) if cfg is not None else int(1e5)
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        owner = {}  # parameter -> the innermost unit containing it
        self.units = [Unit(n, m) for n, m in find_units(self.module)]
        for u in self.units:  # blocks before the root, so the root gets only what is left
            for p in u.module.parameters():
                owner.setdefault(id(p), u)
        self._unit_of = {}
        for u in self.units:
            mine = [p for p in u.module.parameters() if owner[id(p)] is u and id(p) in group_of]
            u.params = mine
            for gi in range(len(self.param_groups)):
                in_group = [p for p in mine if group_of[id(p)] == gi]
                big = [p for p in in_group if p.numel() > threshold]
                small = [p for p in in_group if p.numel() <= threshold]
                if big:
                    u.flats.append(self._add_flat(gi, big, f"{u.name}.g{gi}", keep_full=False))
                if small:
                    u.persistent.append(self._add_flat(gi, small, f"{u.name}.g{gi}.persist", keep_full=True))
            for p in mine:
                self._unit_of[id(p)] = u
            u.module.register_forward_pre_hook(self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u))
        for g in self.param_groups:
            for p in g["params"]:
                p.register_post_accumulate_grad_hook(self._post_accumulate)

    # ------------------------------------------------------------------ forward hooks
    def _make_pre_forward(self, unit: Unit):
        def pre_forward(module, args):
            # Inside backward, a forward is activation checkpointing's recomputation.
            in_backward = torch._C._current_graph_task_id() != -1
            unit.training_state = TrainingState.FORWARD
            unit.unshard("recompute" if in_backward else "fwd")
        return pre_forward

    def _make_post_forward(self, unit: Unit):
        def post_forward(module, args, output):
            unit.reshard()
            unit.training_state = TrainingState.IDLE
            if not torch.is_grad_enabled():
                return output
            return _register_pre_backward(unit, output)
        return post_forward

    # ------------------------------------------------------------------ backward hooks
    def pre_backward(self) -> None:
        for u in self.units:
            u.arrived = 0

    def _post_accumulate(self, p) -> None:
        u = self._unit_of[id(p)]
        u.arrived += 1
        if u.arrived == len(u.params):
            self._post_backward_unit(u)

    def _post_backward_unit(self, u: Unit) -> None:
        for f in u.flats + u.persistent:
            self.reduce_scatter_grads(f)
        u.reshard()
        u.training_state = TrainingState.POST_BACKWARD

    def post_backward(self) -> None:
        """Units whose gradients did not all arrive (unused parameters): reduce with zeros
        for the missing ones, in unit order so every rank issues the same collectives."""
        for u in self.units:
            if u.training_state is not TrainingState.POST_BACKWARD:
                self._post_backward_unit(u)
            u.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------ step
    def after_step(self) -> None:
        """Partitioned parameters were updated in their shards and will be gathered on next
        use; only the persistent (small, always-gathered) ones need an all-gather now."""
        for u in self.units:
            for f in u.persistent:
                f.all_gather()


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
