"""ZeRO-3: partition the parameters too (P_os+g+p, ZeRO paper, Rajbhandari et al., SC'20, 5.3).

After ZeRO-2 the largest thing left on every rank is the full low-precision model (2Ψ).
ZeRO-3 keeps only slice r of it, and materialises one module's parameters at a time,
just before they are used, and frees them right after:

    memory per rank: (2 + 2 + 12)Ψ/N   (+ the one or two units currently unsharded)

The unit of gathering is a module (unit.py, `Unit`): each transformer block (every child of
an `nn.ModuleList`), plus the root for what is left (embeddings, final norm, head). Never
the whole model at once, with one exception: the root's forward is the model's forward
(the blocks run inside it), so the root's parameters stay gathered from the start of
forward to its end, and from the start of backward to its end. For the image GPT that is
the embeddings and head, gathered for the whole step.

What this file adds to ZeRO-2 (zero2.py), and all it adds:
  1. layout: `module_units` makes one bucket per module (a `Unit`) instead of one per
     reduce_bucket_size elements; its partitioned FlatParams keep only their shard;
  2. forward and backward: each Unit's hooks gather and free it (unit.py), when the
     Prefetcher says (prefetch.py);
  3. end of backward: nothing stays gathered into the step;
  4. step: nothing gathered stays into the next step either; ZeRO-1's gather after the step
     then gathers only what is kept whole, the persistent parameters, all in one collective
     (the rest on next use).

Per optimizer step every parameter is all-gathered twice (forward, backward) and its
gradient reduce-scattered once: 3Ψ(N-1)/N on the wire per rank, 1.5x stage 0's
all-reduce (paper, section 7.2.2); by payload (the bytes handed to the collectives) it is
3x, since an all-reduce's buffer is counted once though it crosses the wire twice. The
gathers are labelled `.fwd`, `.bwd` and, when activation checkpointing recomputes a block
inside backward, `.recompute`.

That is with DeepSpeed's knobs at 0. With `stage3_prefetch_bucket_size` the next units'
gathers are issued while this one computes (`.prefetch` in the label), and
`stage3_max_reuse_distance` keeps a unit that is used again within that many *elements* of
upcoming gathers. DeepSpeed's default (1e9 elements) keeps every unit from its forward to
its backward while the model is smaller than that (under a billion parameters): 2Ψ gathered per step
instead of 3Ψ. With `overlap_comm` (DeepSpeed's default at stage 3) the gradients'
reduce-scatters run asynchronously too (buckets.py).

Small parameters (at most `stage3_param_persistence_threshold` elements, DeepSpeed's
default 1e5) are *persistent*: kept gathered on every rank like ZeRO-2 (their optimizer
state and gradient stay partitioned) because gathering many tiny tensors costs more in
latency than their memory is worth. They are all-gathered once, after the step, every
unit's in one collective. At the default, every parameter of a small model is persistent and
ZeRO-3 gathers nothing in forward or backward.

Each (unit, param group) is one FlatParam (flat_param.py): the unit's parameters of that
group flattened, padded to a multiple of N, and cut into N slices. DeepSpeed instead pads
each parameter on its own to ceil(n/N) elements per rank (as FSDP2 does); the difference is
padding only.
"""
from __future__ import annotations

from torch import nn

from .flat_param import FlatParam, all_gather_coalesced, build_flat
from .partition import FlatPlan
from .prefetch import Prefetcher
from .sharding import Sharding, for_config
from .unit import LiveNumel, Unit, find_units
from .zero2 import Zero2


class Zero3(Zero2):
    stage = 3

    def __init__(self, module: nn.Module, param_groups: list[dict], zero_cfg):
        # 1. layout: one Unit per module instead of ZeRO-2's size buckets (its gradients still take
        #    ZeRO-2's path: GradBuckets' hooks, reduce-scatter when complete), each parameter cut
        #    over all ranks or, with hpZ or HSDP, as sharding.py says
        self.sharding = for_config(zero_cfg)
        units = module_units(module, param_groups, int(zero_cfg.stage3_param_persistence_threshold), self.sharding)
        super().__init__(module, param_groups, zero_cfg, units)
        # 2. forward and backward: each unit's hooks; when it is gathered and freed is the
        #    Prefetcher's decision: on demand, or read ahead from a recorded trace.
        self.prefetcher = Prefetcher(units, int(zero_cfg.stage3_prefetch_bucket_size),
                                     int(zero_cfg.stage3_max_live_parameters), int(zero_cfg.stage3_max_reuse_distance))
        for u in units:
            u.attach(self.prefetcher)

    @staticmethod
    def plan(module: nn.Module, param_groups: list[dict], zero_cfg) -> list[FlatPlan]:
        """The units' FlatParams (unit_plan), before they exist."""
        units = unit_plan(module, param_groups, int(zero_cfg.stage3_param_persistence_threshold))
        return [plan for _, _, plans in units for plan in plans]

    # ------------------------------------------------------------------ 3. end of backward
    def finish_backward(self) -> None:
        super().finish_backward()            # reduce what is left, wait for every reduction
        for u in self.prefetcher.end_of_backward():   # nothing stays gathered into the step
            u.reshard()

    # ------------------------------------------------------------------ 4. step
    def after_step(self) -> None:
        """Partitioned parameters were updated in their shards and are gathered on next use
        (none is still gathered: end_of_backward freed them, and reset() makes sure); ZeRO-1's
        gather then brings back the ones kept whole, the persistent ones."""
        for u in self.prefetcher.reset():
            u.reshard()
        super().after_step()

    def gather_whole(self, flats: list[FlatParam]) -> None:
        """The persistent parameters, small, all in one collective (DeepSpeed gathers them in
        one call too): one per unit would cost each its call's latency and host time."""
        all_gather_coalesced(flats, label="all.persist.params")


def module_units(model: nn.Module, param_groups: list[dict], persistence_threshold: int,
                 sharding: Sharding) -> list[Unit]:
    """One Unit per entry of unit_plan, its FlatParams built from the plan, cut as `sharding`
    says; the root (find_units puts it last) is the unit whose post_forward ends the forward."""
    by_name = dict(model.named_parameters())
    live = LiveNumel()
    units = unit_plan(model, param_groups, persistence_threshold)
    return [Unit(name, m, [build_flat(plan, by_name, sharding) for plan in plans], live, ends_forward=i == len(units) - 1)
            for i, (name, m, plans) in enumerate(units)]


def unit_plan(model: nn.Module, param_groups: list[dict],
              persistence_threshold: int) -> list[tuple[str, nn.Module, list[FlatPlan]]]:
    """ZeRO-3's layout: (name, module, plans) per module of find_units(); per param group,
    its parameters of more than `persistence_threshold` elements in one partitioned
    FlatParam (persistent=False), the rest in one kept-gathered ("persistent") FlatParam."""
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
            for params, persistent, suffix in (([p for p in in_group if p.numel() > persistence_threshold], False, ""),
                                              ([p for p in in_group if p.numel() <= persistence_threshold], True,
                                               ".persist")):
                if params:
                    plans.append(FlatPlan(f"{name}.g{gi}{suffix}", gi, tuple(names[id(p)] for p in params),
                                          tuple(p.numel() for p in params), persistent))
        units.append((name, m, plans))
    return units
