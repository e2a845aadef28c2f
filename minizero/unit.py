"""A ZeRO-3 unit: one module's parameters, gathered and freed together, and their lifecycle.

The unit of gathering is a module: each transformer block (every child of an
`nn.ModuleList`), plus the root for what is left (embeddings, final norm, head). A `Unit`
holds one module's FlatParams and their lifecycle, as PyTorch FSDP2's FSDPParamGroup does,
in FSDP2's vocabulary (Zhao et al., "PyTorch FSDP", VLDB'23, section 3.2):

    pre_forward    unshard: all-gather the unit's parameters
    post_forward   reshard: free them; hook the outputs so backward can find the unit
    pre_backward   unshard again (backward needs the weights): `on_backward`, an autograd
                   Function placed on the unit's outputs in post_forward
    post_backward  when every parameter of the unit has its gradient, ZeRO-2's bucket path
                   reduce-scatters the gradients (buckets.py) and calls it: reshard

*When* a unit is gathered and freed is prefetch.py's decision (the `Prefetcher`, which the
unit asks at each hook and obeys). A unit is also ZeRO-2's gradient bucket (buckets.Bucket).
"""
from __future__ import annotations

from enum import Enum, auto

import torch
from torch import nn

from . import checkpointing, comm
from .buckets import Bucket
from .flat_param import FlatParam


class ShardState(Enum):
    """Where a unit's parameters are. Only the unit's own unshard, wait_unshard and reshard
    change it (nothing else gathers or frees a partitioned FlatParam)."""
    SHARDED = auto()      # only this rank's shards exist; parameters are empty placeholders
    UNSHARDING = auto()   # asynchronous all-gathers are writing the full buffers (a prefetch)
    UNSHARDED = auto()    # the full buffers hold every rank's shard; parameters are views into them


class LiveNumel:
    """The units of one stage gathered right now (or being gathered), and their elements of
    partitioned parameters (the number stage3_max_live_parameters bounds): each unit adds
    itself as it unshards and takes itself off as it reshards, so the Prefetcher reads what is
    gathered without looking at every unit."""

    def __init__(self):
        self.numel = 0
        self.units: dict = {}   # the gathered units (a dict: ordered, O(1) to remove)


class Unit(Bucket):
    """One module's parameters, gathered and freed together, and their lifecycle (module
    docstring); also ZeRO-2's gradient bucket. The unit owns its state and its gathers in
    flight; the Prefetcher only answers which units to free, prefetch or keep."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam], live: "LiveNumel | None" = None,
                 ends_forward: bool = False):
        super().__init__(name, flats)
        self.module = module
        self.state = ShardState.SHARDED
        self.live = live if live is not None else LiveNumel()   # shared by the units of one stage
        self.partitioned = [f for f in flats if not f.persistent]   # the persistent ones stay gathered
        self.partitioned_numel = sum(f.padded_numel for f in self.partitioned)   # elements while gathered
        self.ends_forward = ends_forward   # the root: its post_forward ends the model's forward
        self.in_use = False         # between its pre_ hook and its post_ hook: being computed
        self.gathers: list = []     # the comm.Pendings of an unshard still in flight
        self.prefetcher = None      # the Prefetcher (prefetch.py) it asks; given by attach

    # ------------------------------------------------------------------ the two moves
    def unshard(self, why: str, async_op: bool = False) -> None:
        """All-gather the partitioned FlatParams (`why`: fwd, bwd, recompute; .prefetch).
        async_op: the gathers run while the caller goes on (a prefetch); wait_unshard()
        before the unit runs."""
        if not self.partitioned:   # persistent parameters only: always gathered, never moved
            return
        with comm.profiled(f"minizero::unshard::{self.name}"):
            pendings = [f.all_gather(label=why, async_op=async_op) for f in self.partitioned]
        self.live.numel += self.partitioned_numel
        self.live.units[self] = None
        if async_op:
            self.gathers, self.state = pendings, ShardState.UNSHARDING
        else:
            self.state = ShardState.UNSHARDED

    def wait_unshard(self) -> None:
        for pending in self.gathers:
            pending.wait()
        self.gathers = []
        if self.state is ShardState.UNSHARDING:
            self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        """Free the full buffers. A gather still in flight is waited for first: on NCCL it
        writes from its own stream, and the allocator would hand the memory on under it."""
        self.in_use = False
        if self.state is ShardState.SHARDED:
            return
        self.wait_unshard()
        for f in self.partitioned:
            f.release_full()
        self.live.numel -= self.partitioned_numel
        del self.live.units[self]
        self.state = ShardState.SHARDED

    # ------------------------------------------------------------------ the four hooks
    def attach(self, prefetcher) -> None:
        self.prefetcher = prefetcher
        if not self.partitioned and not self.ends_forward:
            # persistent parameters only: nothing to gather or free, so no hooks. Each would
            # cost host time every step for nothing (two module hooks, an autograd node on the
            # outputs, the Prefetcher's bookkeeping), and the trace would hold a unit whose
            # fetches move no element. The root keeps its hooks: its post_forward ends the forward.
            return
        self.module.register_forward_pre_hook(self.pre_forward)
        self.module.register_forward_hook(self.post_forward)

    def pre_forward(self, module, args) -> None:
        # label only: a forward inside minizero's activation-checkpointing backward is
        # a recompute (another library's recompute is labelled "fwd")
        self._fetch("recompute" if checkpointing.in_recompute() else "fwd")

    def post_forward(self, module, args, output):
        self._release()
        if not torch.is_grad_enabled():
            if self.ends_forward:   # an evaluation forward: no backward will follow
                for u in self.prefetcher.reset():
                    u.reshard()
            return output
        return on_backward(output, self.pre_backward)

    def pre_backward(self) -> None:
        self._fetch("bwd")

    def post_backward(self) -> None:
        """The unit's gradients are issued for reduce-scatter (ZeRO-2's path, GradBuckets):
        free its parameters. Safe while the reduce-scatter may still run: it reads the flat
        gradient buffer, which its Pending keeps alive, never the parameters."""
        super().post_backward()
        self._release()

    def _fetch(self, why: str) -> None:
        """The unit is about to run: free what the Prefetcher says, make sure this unit is
        gathered, then start the gathers it says to read ahead."""
        for u in self.prefetcher.before_fetch(self):
            u.reshard()
        if self.state is ShardState.UNSHARDING:     # prefetched: its gathers were issued earlier
            self.wait_unshard()
        elif self.state is ShardState.SHARDED:
            for u in self.prefetcher.make_room(self.partitioned_numel):
                u.reshard()
            self.unshard(why)
        self.in_use = True
        for u in self.prefetcher.ahead():
            u.unshard(f"{why}.prefetch", async_op=True)

    def _release(self) -> None:
        """The unit is done: free it, unless the Prefetcher keeps it for a use soon."""
        self.in_use = False
        if not self.prefetcher.keep(self):
            self.reshard()


class _OnBackward(torch.autograd.Function):
    """Identity on some tensors whose backward first calls `callback` (once), then passes the
    gradients on unchanged: the gradient arriving at a module's outputs is the signal that its
    backward is next. ZeRO-3's pre_backward (re-gather the unit) and the tools' unit marks
    (observe/unit_marks.py) are both this."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        ctx.set_materialize_grads(False)   # an output no loss used gets None, not a tensor of zeros
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
