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
Which ranks each runs among, and from which shard, is the FlatParam's `sharding`'s decision
(sharding.py: all ranks; with HSDP a group of them and its replicas; with hpZ the node's
secondary shards); where this rank's shard lives between uses is its `storage`'s (device
memory here; host memory and NVMe files in offload/host.py and offload/nvme.py), which does two things
only: hand the shard over as a device tensor, and take the updated values back.

Each takes async_op (overlap_comm, ZeRO-3 prefetch): the collective is issued and a handle
returned, whose wait() must come before the result is read or the buffers are touched.
"""
from __future__ import annotations

import torch

from . import comm
from .partition import FlatPlan, padded_numel, shard_range, unflatten
from .sharding import Sharding


class FlatParam:
    def __init__(self, params: list[torch.nn.Parameter], names: list[str], label: str, *, group: int,
                 sharding: Sharding, persistent: bool = True):
        """sharding: which ranks this FlatParam is cut over, gathered and reduced among (sharding.py)."""
        assert params, "a FlatParam needs at least one parameter"
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"{label}: parameters of one FlatParam must share a dtype, got {dtypes}"
        self.params, self.names, self.label = params, names, label
        self.group = group                                    # index of the optimizer param group
        self.sharding = sharding
        num_shards, shard_index = sharding.num_shards, sharding.shard_index
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
        # Where this rank's shard lives between uses: device memory here; offload_param moves a
        # partitioned shard to host memory or NVMe files (move_shard; offload.HostShard, with an
        # nvme.ShardFile), which hand it over to a gather on the device.
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

    def release_full(self) -> None:
        """A partitioned FlatParam is done with its full buffer (a unit's reshard): drop its
        storage (with hpZ, the sharding keeps this rank's secondary shard of it first). Never
        while an all-gather into it may still run: on NCCL the asynchronous gather writes from
        its own stream, and the allocator would hand the memory to the next tensor under it.
        Every caller guarantees the wait first (unit.Unit.reshard waits for its gathers)."""
        self.sharding.keep_secondary(self)
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = self._placeholder

    def alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        for p, v in zip(self.params, self._views):
            p.data = v

    def all_gather(self, label: str = "params", async_op: bool = False):
        """full <- every rank's shard, among the ranks and from the shard the sharding says.
        async_op (ZeRO-3 prefetch, ZeRO-1/2's gather after the step): returns the Pending; `full`
        must be neither read nor freed before its wait()."""
        if not self.full_is_allocated():
            self.alloc_full()
        return self.sharding.all_gather(self, f"{self.label}.{label}", async_op)

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
        self.sharding.changed(self)

    def load_shard(self, values: torch.Tensor) -> None:
        """The shard <- `values` as they are (a checkpoint's; no copy counted)."""
        self.shard.copy_(values)
        self.sharding.changed(self)

    def param_bytes(self) -> int:
        """Bytes of low-precision parameters this rank keeps between uses, wherever its shard
        lives: the gathered buffer of a persistent FlatParam, else its shard. (An hpZ secondary
        shard is the sharding's: Sharding.secondary_bytes.)"""
        return (self.padded_numel if self.persistent else self.shard_numel) * self.full.element_size()

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
        if any(g is None for g in grads):   # a parameter got no gradient: zeros in its place
            for view, g in zip(self._grad_views, grads):
                view.copy_(g) if g is not None else view.zero_()
        else:
            torch._foreach_copy_(self._grad_views, grads)
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
        pending = self.sharding.reduce_scatter(out, full, label=f"{self.label}.grads", async_op=async_op)
        self.clear_param_grads()
        reduction = GradReduction(self, out, pending, accumulate=True)
        if async_op:
            return reduction
        reduction.wait()
        return None

    def all_reduce_grad(self, async_op: bool = False) -> "GradReduction | None":
        """Stage 0: grad_shard = the whole rank-averaged gradient (one flat all-reduce, so
        the ledger counts 2Ψ(N-1)/N per rank, the ring all-reduce). async_op: as above."""
        buf = self.flat_grad(divide_by=self.sharding.ranks)
        pending = self.sharding.all_reduce(buf, label=f"{self.label}.grads", async_op=async_op)
        self.clear_param_grads()
        reduction = GradReduction(self, buf, pending, accumulate=False)
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
    """A FlatParam's gradient reduction, possibly still in flight (what the sharding returned:
    a comm.Pending, or HSDP's reduce-scatter and replica all-reduce). wait() completes it and
    puts the result where the optimizer reads it: added into grad_shard (reduce-scatter:
    micro-steps accumulate) or as grad_shard (stage 0's all-reduce)."""

    def __init__(self, flat: FlatParam, result: torch.Tensor, pending, accumulate: bool):
        self.flat, self.result, self.pending, self.accumulate = flat, result, pending, accumulate

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
        f = self.flat
        if self.accumulate:   # a reduce-scatter: its input, the flat gradient, is read no more
            f.release_grad_buffer()
        if self.accumulate and f.grad_shard is not None:
            f.grad_shard.add_(self.result)
        else:
            f.grad_shard = self.result


def all_gather_coalesced(flats: list[FlatParam], label: str) -> None:
    """Several FlatParams cut the same way, gathered by one collective: this rank's shards laid
    end to end, one all-gather, then each FlatParam's slice of every rank copied into its full
    buffer. ZeRO-3's persistent FlatParams after the step: one small collective per unit would
    cost each its call's latency and host time (DeepSpeed gathers them in one call too).
    The same bytes per rank as separate gathers; none, no collective."""
    if not flats:
        return
    if len(flats) == 1:
        flats[0].all_gather()
        return
    flats[0].sharding.all_gather_coalesced(flats, label)


def all_gather_params(flats: list[FlatParam]) -> None:
    """ZeRO-1/2 after the step: every rank gets every updated slice. Each FlatParam's gather
    is issued back to back and all are waited for before returning: the gathers overlap one
    another, not compute (there is none between the step and the next forward), and the
    parameters are whole again when the step returns, whatever user code reads them next."""
    in_flight = [f.all_gather(async_op=True) for f in flats]
    for pending in in_flight:
        pending.wait()


def write_shards(flats: list[FlatParam], values: list[torch.Tensor], from_host: bool, pin: bool = False) -> None:
    """Each FlatParam's write_shard(value), the step's write-back; the shards on the device fed
    from device values (no offload) by one foreach copy (rounding to the low precision as
    copy_ does), the rest one by one through their storage. In fp32 without offload a master
    *is* its shard: nothing to copy."""
    local = [(f, v) for f, v in zip(flats, values) if not from_host and not f.storage.on_host]
    copies = [(f.shard, v) for f, v in local if v is not f.shard]
    if copies:
        torch._foreach_copy_([s for s, _ in copies], [v for _, v in copies])
    for f, _ in local:
        f.sharding.changed(f)
    if len(local) < len(flats):
        for f, v in zip(flats, values):
            if from_host or f.storage.on_host:
                f.write_shard(v, from_host, pin)


# ----------------------------------------------------------------------------- layout plans -> FlatParams

def build_flat(plan: FlatPlan, params_by_name: dict, sharding: Sharding) -> FlatParam:
    """The FlatParam a plan describes, over the module's parameters of those names."""
    return FlatParam([params_by_name[n] for n in plan.names], list(plan.names), plan.label, group=plan.group,
                     sharding=sharding, persistent=plan.persistent)


class DeviceShard:
    """A shard that lives in device memory. The protocol of every shard storage (offload.HostShard,
    with an nvme.ShardFile for NVMe), two things only:

        to_device(into, label) -> the shard as a device tensor, for a gather (`into`: this rank's
                                  slice of the full buffer, where a copy from elsewhere goes)
        write(values, ...)        the optimizer's new values into the shard; written() once all
                                  of a step's writes are done (NVMe: to the file)

    and `tensor` (the shard, wherever it is: its place is logical, "host" may be the CPU device
    too), `on_host` (whether it lives in host memory between uses), and `blank(numel)`, an
    empty storage of the same kind (hpZ's secondary shard is kept where the shard is).
    """
    on_host = False

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def blank(self, numel: int) -> "DeviceShard":
        return DeviceShard(torch.empty(numel, dtype=self.tensor.dtype, device=self.tensor.device))

    def to_device(self, into: torch.Tensor, label: str) -> torch.Tensor:
        """Already there: the gather reads it where it is (a persistent shard *is* `into`)."""
        return self.tensor

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
