"""FlatParam: a group of parameters living in one padded 1-D buffer, cut into N shards.

Every ZeRO stage in minizero stores parameters the same way, one FlatParam per gradient
bucket (stages 0-2) or per ZeRO-3 unit, each padded and cut on its own (PyTorch FSDP1's
`FlatParameter`; the ZeRO paper draws one such buffer for the whole model):

    full    [ p0 ........ | p1 ..... | p2 ... | pad ]   padded_numel = ceil(Ψ/N) * N
    shards  [ rank 0      | rank 1            | ... ]   shard_numel  = padded_numel / N

Each `nn.Parameter` becomes a *view* into `full`, so the module computes with it as
usual, and a collective on `full` updates every parameter at once:

- ZeRO-0/1/2 keep `full` alive; `shard` is a view of this rank's slice of it. After the
  optimizer updates the shard, one `all_gather_into_tensor(full, shard)` brings every
  rank's new slice back (in place: the shard *is* part of the output buffer).
- ZeRO-3 keeps only `shard` (its own storage). `full`'s storage is resized to zero bytes
  between uses (`reshard`) and re-allocated and all-gathered just before the parameters
  are needed (`unshard`). The parameter views survive the resize, so tensors that
  autograd saved for backward (e.g. `weight.t()`) read valid data again once the buffer
  is re-gathered. This is FSDP's storage-resize trick; it means a gathered copy is never
  kept alive between forward and backward. While resharded, each parameter points at a
  zero-size placeholder, so a stray read fails with a size error instead of reading the
  freed buffer (a view kept from before, e.g. by autograd, must not be read until the
  unit is unsharded again: the hooks in zero3.py guarantee that for forward/backward).

Gradients follow the same layout: `flat_grad` lays each `p.grad` into a padded buffer
whose chunk r is exactly rank r's shard, ready for `reduce_scatter_tensor`.

Every collective that moves a FlatParam is a method here, so they read together:

    all_gather()           full <- every rank's shard        (ZeRO-1/2 after the step, ZeRO-3 before use)
    release_full()         drop the full buffer's storage    (ZeRO-3 after use; hpZ: keep a secondary shard)
    reduce_scatter_grad()  grad_shard += my chunk of the rank-averaged gradient  (ZeRO-1/2/3)
    all_reduce_grad()      grad_shard  = the whole rank-averaged gradient        (stage 0)

(Averaged: each rank divides its gradient by N before the collective sums, as DeepSpeed does.)

Each takes async_op (overlap_comm, ZeRO-3 prefetch): the collective is issued and a handle
returned, whose wait() must come before the result is read or the buffers are touched.
"""
from __future__ import annotations

import torch

from . import comm, hierarchy
from .hierarchy import Sharding
from .partition import FlatPlan, padded_numel, shard_range, unflatten


class FlatParam:
    def __init__(self, params: list[torch.nn.Parameter], names: list[str], label: str, *, group: int,
                 num_shards: int, shard_index: int, persistent: bool = True, sharding: Sharding | None = None):
        """sharding: which ranks this FlatParam is cut over and gathered among (hierarchy.py);
        default: num_shards ranks, all of them."""
        assert params, "a FlatParam needs at least one parameter"
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"{label}: parameters of one FlatParam must share a dtype, got {dtypes}"
        self.params, self.names, self.label = params, names, label
        self.group = group                                    # index of the optimizer param group
        self.sharding = sharding or hierarchy.plain(num_shards, shard_index)
        num_shards, shard_index = self.sharding.num_shards, self.sharding.shard_index
        self.num_shards, self.shard_index = num_shards, shard_index   # 1 and 0 at stage 0
        self.dtype, self.device = params[0].dtype, params[0].device
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)                         # Ψ of this group
        self.padded_numel = padded_numel(self.numel, num_shards)
        self.shard_start, self.shard_end = shard_range(self.numel, num_shards, shard_index)
        self.shard_numel = self.shard_end - self.shard_start

        self.full = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self._views = list(unflatten(self.full, names, self.shapes).values())
        for p, view in zip(params, self._views):
            view.copy_(p.detach())
            p.data = view                                     # the parameter is now a view
        # While resharded, parameters point at an empty tensor, so a stray read raises a
        # size error instead of reading freed memory.
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        # Start every rank from rank 0's weights (DeepSpeed's `_broadcast_model`), before
        # anything is sharded, so a model initialised differently per rank still agrees.
        comm.broadcast(self.full, src=0, label=f"{label}.init")
        self.persistent = persistent
        # Where this rank's shard lives between uses: a policy the FlatParam owns. Device memory
        # here; offload_param moves a partitioned shard to host memory or NVMe files
        # (move_shard; offload.HostShard, with an nvme.ShardFile), which change how it reaches a gather.
        # hpZ (hierarchy.py): a second shard among the ranks of this rank's node, cut from the
        # full buffer at each release until the step changes the parameters.
        self.secondary: torch.Tensor | None = None
        if persistent:
            self.storage = DeviceShard(self.full[self.shard_start:self.shard_end])   # a view: in-place all-gather
        else:
            self.storage = DeviceShard(self.full[self.shard_start:self.shard_end].clone())
            self.release_full()
        # This rank's reduced gradient (its shard; the whole buffer at stage 0), kept across
        # micro-steps at ZeRO-2/3, consumed by the optimizer step.
        self.grad_shard: torch.Tensor | None = None
        # The flat gradient buffer and its views in each parameter's shape, built at the first
        # reduction and kept: cutting a buffer into views costs a tensor per parameter, more
        # host time than copying the gradients into them. Its *storage* is released once nothing
        # reads it (release_grad_buffer: after a reduce-scatter's wait; at zero_grad for stage
        # 0, whose all-reduced buffer is the gradient the step reads) and re-allocated at the
        # next reduction, as `full`'s is for the parameters: the views survive the resize. So no
        # stage holds a flat gradient beside the parameters' own between steps, which is what
        # the layout formulas (memory.py) and DeepSpeed hold. The price, on a CPU only: a
        # bucket over 32 MB (glibc's largest mmap threshold) comes back as a fresh mmap the
        # kernel zeroes page by page (docs/zero.md, "The optimizer step on a CPU").
        self._grad_buffer: torch.Tensor | None = None
        self._grad_views: list = []

    # -- parameters: gather, free ---------------------------------------------------------
    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free_full(self) -> None:
        """Drop the full buffer's storage. Never while an all-gather into it may still run:
        on NCCL the asynchronous gather writes from its own stream, and the allocator would
        hand the memory to the next tensor under it. Every caller guarantees the wait first
        (prefetch.py: a prefetched unit is waited for before use and drained before free)."""
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self._placeholder

    def release_full(self) -> None:
        """A partitioned FlatParam is done with its full buffer (a unit's release): with hpZ keep
        this rank's secondary shard of it first, then free it."""
        k = self.sharding.secondary_size
        if k > 1 and self.secondary is None:
            part = self.padded_numel // k
            i = self.sharding.secondary_index
            self.secondary = self.full[i * part:(i + 1) * part].clone()
        self.free_full()

    def drop_secondary(self) -> None:
        """The step changed the shards: a secondary shard holds last step's values."""
        self.secondary = None

    def alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        for p, v in zip(self.params, self._views):
            p.data = v

    def all_gather(self, label: str = "params", async_op: bool = False):
        """full <- every rank's shard. With persistent the shard is already in place; a shard
        elsewhere is the gather's input, or is first copied into this rank's slice of `full`
        (host memory, NVMe: the storage policy says how). async_op (ZeRO-3 prefetch, ZeRO-1/2's
        gather after the step): returns the Pending; `full` must be neither read nor freed
        before its wait()."""
        if not self.full_is_allocated():
            self.alloc_full()
        return self.storage.all_gather(self, f"{self.label}.{label}", async_op)

    # -- where the shard lives --------------------------------------------------------------
    @property
    def shard(self) -> torch.Tensor:
        """This rank's slice, wherever its storage keeps it."""
        return self.storage.tensor

    def move_shard(self, storage) -> None:
        """Keep the shard in `storage` from now on (offload_param). Partitioned FlatParams only:
        a persistent one's shard is a view of its gathered buffer, which stays on the device."""
        assert not self.persistent, f"{self.label}: a persistent shard stays in its gathered buffer"
        self.storage = storage

    def write_shard(self, values: torch.Tensor, from_host: bool, pin: bool = False) -> None:
        """The shard <- `values` (the optimizer's updated master), rounded to this dtype where
        the values are, and copied over when they live on the other side of the device/host
        divide (counted as h2d / d2h). from_host: the values are in host memory; pin: stage
        them in pinned memory (a GPU's asynchronous copy)."""
        self.storage.write(values, from_host, pin, f"{self.label}.params")

    def param_bytes(self) -> int:
        """Bytes of low-precision parameters this rank keeps between uses (wherever the shard
        lives), an hpZ secondary shard included: it lives from forward to the step."""
        secondary = self.padded_numel // self.sharding.secondary_size if self.sharding.secondary_size > 1 else 0
        return ((self.padded_numel if self.persistent else self.shard_numel) + secondary) * self.full.element_size()

    # -- gradients: reduce ----------------------------------------------------------------
    def flat_grad(self, divide_by: int = 1) -> torch.Tensor:
        """Padded flat copy of the parameters' `.grad` (zeros where a parameter got none),
        pre-divided by `divide_by` in the gradients' own dtype: one foreach copy into the
        views of the same buffer every call (__init__). Its previous contents are no longer
        read by then: the reduction that used them was waited for, and the step that read
        grad_shard is over.

        Dividing *before* summing across ranks is what DeepSpeed does (`average_tensor`):
        in bf16/fp16 it keeps the sum from overflowing and rounds the same way, so the
        reduced gradient is lp(g0/N) + lp(g1/N) + ... exactly as in DeepSpeed.
        """
        grads = [p.grad for p in self.params]
        buf = self._grad_buffer
        if buf is None:
            buf = self._grad_buffer = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            self._grad_views = list(unflatten(buf, self.names, self.shapes).values())
        elif buf.untyped_storage().nbytes() == 0:   # released after the last reduction: new memory
            buf.untyped_storage().resize_(self.padded_numel * buf.element_size())
            if self.padded_numel > self.numel:
                buf[self.numel:].zero_()
        try:
            torch._foreach_copy_(self._grad_views, grads)
        except TypeError:                   # a parameter got no gradient (None): zeros in its place
            for view, g in zip(self._grad_views, grads):
                view.copy_(g) if g is not None else view.zero_()
        if divide_by != 1:
            buf.div_(divide_by)
        return buf

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """The flat gradient buffer (None before the first reduction); its storage is empty
        whenever no reduction or step needs it (release_grad_buffer)."""
        return self._grad_buffer

    def release_grad_buffer(self) -> None:
        """The flat gradient has been reduced and nothing reads it any more: free its storage.
        Never while a reduction may still read it (its wait comes first: GradReduction.wait,
        zero_grad)."""
        if self._grad_buffer is not None:
            self._grad_buffer.untyped_storage().resize_(0)

    def reduce_scatter_grad(self, async_op: bool = False) -> "GradReduction | None":
        """grad_shard += this rank's chunk of the rank-averaged gradient; drop the full one.

        ZeRO-1 calls it once per step; ZeRO-2/3 once per micro-step from backward hooks, so
        grad_shard accumulates the micro-steps. async_op (overlap_comm): returns the
        reduction in flight; its wait() does the add. The p.grads are dropped at once either
        way: their values are in the flat buffer, which the Pending keeps until the wait."""
        full = self.flat_grad(divide_by=self.sharding.ranks)   # N: every rank's gradient is averaged
        out = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        pending = comm.reduce_scatter_tensor(out, full, label=f"{self.label}.grads", group=self.sharding.group,
                                             async_op=async_op)
        self.clear_param_grads()
        reduction = GradReduction(self, out, pending if async_op else None, accumulate=True)
        if async_op:
            return reduction
        reduction.wait()
        return None

    def all_reduce_grad(self, async_op: bool = False) -> "GradReduction | None":
        """Stage 0: grad_shard = the whole rank-averaged gradient (one flat all-reduce, so
        the ledger counts 2Ψ(N-1)/N per rank, the ring all-reduce). async_op: as above."""
        buf = self.flat_grad(divide_by=comm.get_world_size())
        pending = comm.all_reduce(buf, label=f"{self.label}.grads", async_op=async_op)
        self.clear_param_grads()
        reduction = GradReduction(self, buf, pending if async_op else None, accumulate=False)
        if async_op:
            return reduction
        reduction.wait()
        return None

    def clear_param_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def zero_grad(self) -> None:
        self.clear_param_grads()
        self.grad_shard = None
        self.release_grad_buffer()   # stage 0's grad_shard was the flat buffer itself

    def __repr__(self) -> str:
        return (f"FlatParam({self.label}: {len(self.params)} params, Ψ={self.numel}, "
                f"padded={self.padded_numel}, shard={self.shard_numel} x {self.num_shards}, {self.dtype})")


class GradReduction:
    """A FlatParam's gradient reduction, possibly still in flight (comm.Pending). wait()
    completes it and puts the result where the optimizer reads it: added into grad_shard
    (reduce-scatter: micro-steps accumulate) or as grad_shard (stage 0's all-reduce)."""

    def __init__(self, flat: FlatParam, result: torch.Tensor, pending, accumulate: bool):
        self.flat, self.result, self.pending, self.accumulate = flat, result, pending, accumulate

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
        f = self.flat
        if self.accumulate:   # a reduce-scatter: its input, the flat gradient, is read no more
            f.release_grad_buffer()
        if f.sharding.replicas is not None:   # HSDP: the same shard of the other groups, summed in
            comm.all_reduce(self.result, label=f"{f.label}.grads.replicas", group=f.sharding.replicas)
        if self.accumulate and f.grad_shard is not None:
            f.grad_shard.add_(self.result)
        else:
            f.grad_shard = self.result


def all_gather_coalesced(flats: list[FlatParam], label: str) -> None:
    """Several FlatParams cut the same way, gathered by one collective: this rank's shards laid
    end to end, one all-gather, then each FlatParam's slice of every rank copied into its full
    buffer. ZeRO-3's persistent FlatParams after the step: one small collective per unit would
    cost each its call's latency and host time (DeepSpeed gathers them in one call too).
    The same bytes per rank as separate gathers."""
    if len(flats) == 1:
        flats[0].all_gather()
        return
    n = flats[0].num_shards
    mine = torch.cat([f.shard for f in flats])
    everyone = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather_into_tensor(everyone, mine, label=label, group=flats[0].sharding.group)
    rows, at = everyone.view(n, -1), 0
    for f in flats:
        f.full.view(n, f.shard_numel).copy_(rows[:, at:at + f.shard_numel])
        at += f.shard_numel


def all_gather_params(flats: list[FlatParam]) -> None:
    """ZeRO-1/2 after the step: every rank gets every updated slice. Each FlatParam's gather
    is issued back to back and all are waited for before returning: the gathers overlap one
    another, not compute (there is none between the step and the next forward), and the
    parameters are whole again when the step returns, whatever user code reads them next."""
    in_flight = [f.all_gather(async_op=True) for f in flats]
    for pending in in_flight:
        pending.wait()


# ----------------------------------------------------------------------------- layout plans -> FlatParams

def build_flat(plan: FlatPlan, params_by_name: dict, num_shards: int, shard_index: int,
               sharding: Sharding | None = None) -> FlatParam:
    """The FlatParam a plan describes, over the module's parameters of those names."""
    return FlatParam([params_by_name[n] for n in plan.names], list(plan.names), plan.label, group=plan.group,
                     num_shards=num_shards, shard_index=shard_index, persistent=plan.persistent, sharding=sharding)


class DeviceShard:
    """A shard that lives in device memory: the gather reads it where it is. The protocol of
    every shard storage (offload.HostShard, nvme.NvmeShard):

        tensor                the shard (its place is logical: "host" may be the CPU device too)
        on_host               whether it lives in host memory between uses
        all_gather(f, ...)    f.full <- every rank's shard, this rank's read from here
        write(values, ...)    the optimizer's new values into the shard
        written()             after the step's writes (NVMe: to the file)
    """
    on_host = False

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def all_gather(self, f: FlatParam, label: str, async_op: bool):
        if f.secondary is not None:   # hpZ: among the ranks of this node, from the secondary shard
            pending = comm.all_gather_into_tensor(f.full, f.secondary, label=label, group=f.sharding.secondary_group,
                                                  async_op=async_op)
        else:
            pending = comm.all_gather_into_tensor(f.full, self.tensor, label=label, group=f.sharding.group,
                                                  async_op=async_op)
        return pending if async_op else None

    def write(self, values: torch.Tensor, from_host: bool, pin: bool, label: str) -> None:
        if not from_host:
            if values is not self.tensor:    # fp32: the master is the shard itself
                self.tensor.copy_(values)
            return
        # the master is in host memory (offload_optimizer): round there, send the low-precision bytes
        staged = values if values.dtype == self.tensor.dtype else \
            comm.host_empty(values.numel(), self.tensor.dtype, pin).copy_(values)
        comm.copy_to_device(self.tensor, staged, label=label)

    def written(self) -> None:
        """Nothing: device memory is where it lives."""
