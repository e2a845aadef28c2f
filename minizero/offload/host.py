"""ZeRO-Offload: the optimizer's shard (and, at stage 3, the parameter shards) in host memory.

ZeRO-Offload (Ren et al., USENIX ATC'21) observes that of the 16 bytes per parameter of
mixed-precision Adam, the 12 of optimizer state (fp32 master, two moments) are touched
once per step, by an element-wise update a CPU can do. So they can live in host memory,
which is large, and the GPU keeps only what forward and backward touch:

    per step, per rank (N ranks, Ψ parameters, lp = 2 bytes in bf16/fp16):
      device -> host   the reduced gradient shard           lp Ψ/N bytes   ("d2h")
      host             unscale + clip, Adam on the fp32 master shard (torch's CPU Adam)
      host -> device   the new low-precision parameter shard lp Ψ/N bytes   ("h2d")
    then the stage shares the new shard as before (ZeRO-1/2 all-gather; ZeRO-3 on use).

The device saves 12Ψ/N (4 master + 8 moments); the host holds them. In fp32 training the
device keeps its fp32 shard to compute with, so the host needs a master of its own: the
device saves 8Ψ/N and the host holds 12Ψ/N (memory.py).

`offload_param` (ZeRO-Infinity's CPU tier, Rajbhandari et al., SC'21) moves ZeRO-3's
partitioned low-precision parameter shards to the host too (another 2Ψ/N): a unit's
shard is copied to the device only to be all-gathered (HostShard.to_device: straight into
this rank's slice of the gather's output, no temporary), and the optimizer
writes the new shard on the host, so nothing of it stays on the device between uses.
Persistent (small, always-gathered) parameters have no shard of their own to move.

What stays exact: the gradient norm is taken on the device, from the reduced shard, in
fp64, before any copy (sharded_optimizer.grad_norm_sq), so clipping and the fp16 overflow
vote are the same numbers with and without offload. The host computes the same fp32
operations on the same values, so on a CPU device offload changes no bit (tested); on a
GPU the CPU's Adam rounds like any other Adam kernel, not like the GPU's.

Place here is logical: a tensor "on the host" is in host memory even when the training
device is the CPU too. The copies then are plain memcpys, but they run and are counted
(comm.copy_to_host / copy_to_device: `engine.comm_stats()["d2h"]`, profiler ranges
`minizero::d2h::<label>`), so a CPU run shows exactly what a GPU run would move.
Host buffers are pinned when the device is a GPU and `pin_memory` is set (DeepSpeed's
default): pinned memory is what lets a copy run asynchronously at full PCIe speed.

Staging buffers (the gradient shard as it lands on the host, the low-precision shard on
its way back) live for one step, like the fp32 gradient the step makes without offload;
they are not model state and memory_breakdown does not count them.

Who owns what: a parameter shard's place is its FlatParam's storage (`HostShard` here,
flat_param.DeviceShard by default): it hands the shard over to a gather as a device tensor
and takes the optimizer's new values back; which ranks gather it, and when a prefetched copy
runs on a side stream, is the FlatParam's sharding's (sharding.py). The optimizer's place is the ShardedOptimizer's `states`
(`HostStates` here): its masters, the gradient copies in, the step's calls around Adam.
`Offload`, read from the config, only decides and sets both up.

`"device": "nvme"` (ZeRO-Infinity's NVMe tier, nvme.py) is this same host offload with one
more tier below it: the host tensors above keep their identity and their arithmetic, and
between uses their bytes wait in files (nvme.ShardFile, nvme.StateFiles, which the two
here hold when the config says "nvme").
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import comm
from ..flat_param import DeviceShard, FlatParam
from ..memory import CATEGORIES
from . import nvme

HOST = torch.device("cpu")


class Offload:
    """Which model state lives in host memory (or NVMe files), read from the config, and the
    setting up of both places: `place_params` (ZeRO-3's partitioned shards), `optimizer_states`
    (the ShardedOptimizer's masters and moments), `start_nvme` (the files)."""

    def __init__(self, device: torch.device, *, optimizer: bool, params: bool,
                 pin_optimizer: bool = True, pin_params: bool = True,
                 nvme_optimizer: str | None = None, nvme_params: str | None = None, read_ahead: int = 0, aio=None):
        self.device = device
        self.optimizer, self.params = optimizer, params
        on_gpu = device.type == "cuda"
        self.pin_optimizer, self.pin_params = pin_optimizer and on_gpu, pin_params and on_gpu
        # "device": "nvme": the folder each tier swaps to (None: it stays in host memory)
        self.nvme_optimizer, self.nvme_params, self.read_ahead = nvme_optimizer, nvme_params, read_ahead
        self.aio = aio
        self.tier: nvme.NvmeTier | None = None   # the swap folders, once start_nvme made them

    @classmethod
    def from_config(cls, config, device: torch.device) -> "Offload | None":
        """None when the config offloads nothing."""
        zero_cfg = config.zero
        opt, par = zero_cfg.offload_optimizer_enabled, zero_cfg.offload_param_enabled
        if not (opt or par):
            return None
        oo, op = zero_cfg.offload_optimizer, zero_cfg.offload_param
        return cls(device, optimizer=opt, params=par,
                   pin_optimizer=opt and oo.pin_memory, pin_params=par and op.pin_memory,
                   nvme_optimizer=oo.nvme_path if opt and oo.device == "nvme" else None,
                   nvme_params=op.nvme_path if par and op.device == "nvme" else None,
                   read_ahead=op.buffer_count if par else 0, aio=config.aio)

    def optimizer_states(self) -> "HostStates | None":
        """Where the ShardedOptimizer keeps its masters and moments: None on the device."""
        return HostStates(self.device, self.pin_optimizer) if self.optimizer else None

    def place_params(self, flat_params: list[FlatParam]) -> None:
        """offload_param: every partitioned shard to host memory. Persistent FlatParams keep
        their shard as a view of the gathered buffer, on the device."""
        if not self.params:
            return
        for f in flat_params:
            if not f.persistent:
                host = comm.host_empty(f.shard_numel, f.dtype, self.pin_params)
                comm.copy_to_host(host, f.shard, label=f"{f.label}.offload_param")
                f.move_shard(HostShard(host, self.pin_params))
        comm.wait_for_device(self.device)

    def start_nvme(self, flat_params: list[FlatParam], optimizer) -> None:
        """"device": "nvme": make each rank's swap folder (one line at start on every rank if
        it cannot be written or the files would not fit), then move the states there. A
        collective: every rank calls it, after place_params. `optimizer`: the ShardedOptimizer,
        whose states object is told its swapper here."""
        paths = {p: what for p, what in ((self.nvme_params, "zero_optimization.offload_param.nvme_path"),
                                         (self.nvme_optimizer, "zero_optimization.offload_optimizer.nvme_path"))
                 if p is not None}
        if not paths:
            return
        self.tier = nvme.NvmeTier.open(paths, self.aio)
        read_ahead = nvme.ReadAhead(self.read_ahead)
        if self.nvme_params is not None:
            for f in flat_params:
                if f.storage.on_host:
                    f.storage.keep_in_file(nvme.ShardFile(self.tier.swappers[self.nvme_params], f"{f.label}.shard",
                                                          f.shard, read_ahead))
        if self.nvme_optimizer is not None:
            optimizer.states.keep_in_files(nvme.StateFiles(self.tier.swappers[self.nvme_optimizer]))
        self.tier.start(list(self.swappable(flat_params, optimizer)))

    def swappable(self, flat_params: list[FlatParam], optimizer):
        """(key, tensor, swapper) of everything that lives in files between uses."""
        if self.tier is None:
            return
        if self.nvme_optimizer is not None:
            swapper = self.tier.swappers[self.nvme_optimizer]
            for key, t in optimizer.swappable():
                yield key, t, swapper
        for f in flat_params:
            file = getattr(f.storage, "file", None)
            if file is not None:
                yield file.key, f.shard, file.swapper

    def resident(self, flat_params: list[FlatParam], optimizer):
        """Everything swapped in for the block (a checkpoint reads and writes the states as with
        "device": "cpu"), written back after it; a plain block without NVMe."""
        if self.tier is None:
            return nullcontext()
        return self.tier.resident(lambda: list(self.swappable(flat_params, optimizer)), optimizer.own_swapped_states)

    def close(self) -> None:
        """Writes in flight finished, swap files and folders removed (a clean exit)."""
        if self.tier is not None:
            self.tier.close()

    def nvme_places(self, where: dict) -> dict:
        """memory_breakdown's split with an "nvme" place: what lives in files between uses."""
        nvme_place = dict.fromkeys(where["host"], 0)
        moves = (["params"] if self.nvme_params else []) + \
            (["master_params", "optimizer_states"] if self.nvme_optimizer else [])
        for k in moves:
            nvme_place[k], where["host"][k] = where["host"][k], 0
        return nvme_place

    def swapped_out_bytes(self, flat_params: list[FlatParam], optimizer) -> dict:
        """Bytes per model-state category that live only in their files right now (a swapped-out
        tensor keeps its shape but holds no storage): memory.held_bytes' "nvme" place. Waits for
        the writes in flight first, so each state is counted in exactly one place."""
        category = {"master": "master_params", "shard": "params"}     # the rest: Adam's moments
        self.tier.wait_all()
        out = dict.fromkeys(CATEGORIES, 0)
        for key, t, _ in self.swappable(flat_params, optimizer):
            if t.untyped_storage().nbytes() == 0:
                out[category.get(key.rsplit(".", 1)[1], "optimizer_states")] += nvme.nbytes(t)
        return out

    def describe(self, flat_params: list[FlatParam]) -> str:
        """The one log line saying what lives where."""
        parts = []
        if self.optimizer:
            parts.append("offload_optimizer: fp32 master shard + Adam moments in host memory, Adam on the CPU")
        if self.params:
            moved = [f for f in flat_params if f.storage.on_host]
            kept = [f for f in flat_params if f.persistent]
            parts.append(f"offload_param: {len(moved)} partitioned parameter shard(s) in host memory"
                         + (f"; {len(kept)} persistent FlatParam(s) (parameters <= "
                            f"stage3_param_persistence_threshold) stay gathered on the device" if kept else ""))
        pinned = self.pin_optimizer or self.pin_params
        for what, p in (("optimizer", self.nvme_optimizer), ("parameter shards", self.nvme_params)):
            if p is not None:
                parts.append(f"{what} swapped to NVMe files in {self.tier.swappers[p].folder.path} between uses")
        return "; ".join(parts) + f" (host buffers {'pinned' if pinned else 'not pinned'})"


# ----------------------------------------------------------------------------- a parameter shard in host memory

class HostShard(DeviceShard):
    """A partitioned parameter shard in host memory (offload_param). A gather first has it
    copied into this rank's slice of the full buffer, which is then the gather's input: in
    place, no temporary on the device. With "device": "nvme" its bytes wait in a file between
    uses (`file`, nvme.ShardFile)."""
    on_host = True

    def __init__(self, tensor: torch.Tensor, pin: bool):
        super().__init__(tensor)
        self.pin = pin
        self.file = None

    def keep_in_file(self, file) -> None:
        """"device": "nvme": between uses the bytes wait in `file` (nvme.ShardFile)."""
        self.file = file

    def blank(self, numel: int) -> "HostShard":
        """In host memory (never in a file: hpZ's secondary lives only from a release to the step)."""
        return HostShard(comm.host_empty(numel, self.tensor.dtype, self.pin), self.pin)

    def to_device(self, into: torch.Tensor, label: str) -> torch.Tensor:
        """Copied into `into` on the device (on the caller's stream: a prefetch's side stream)."""
        if self.file is not None:
            self.file.read()                     # the shard's bytes from its file into host memory
        comm.copy_to_device(into, self.tensor, label=label)
        if self.file is not None:
            self.file.drop()                     # its file still holds it: dropped, not written (pinned:
                                                 # torch's host allocator keeps it until the copy ran)
        return into

    def write(self, values: torch.Tensor, from_host: bool, pin: bool, label: str) -> None:
        if self.file is not None:
            self.file.reclaim()                  # its storage back, unread: overwritten here
        if from_host:                            # both on the host (offload_optimizer too)
            self.tensor.copy_(values)
        else:                                    # offload_param alone: round on the device, copy over
            comm.copy_to_host(self.tensor, values.to(self.tensor.dtype), label=label)

    def written(self) -> None:
        if self.file is not None:
            self.file.write()


# ----------------------------------------------------------------------------- the optimizer in host memory

class HostStates:
    """Where a ShardedOptimizer keeps its fp32 masters and Adam's moments with offload_optimizer:
    host memory. The optimizer calls: new_master at init; per step grads_to_host, before_adam,
    Adam (on the host), the shards' writes from host values, after_step. With "device": "nvme"
    the states wait in files between steps (`files`, nvme.StateFiles). `swappable`: the
    optimizer's (key, tensor) pairs of masters and moments."""
    on_host = True

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin
        self.files = None

    def keep_in_files(self, files) -> None:
        """"device": "nvme": between steps the states wait in `files` (nvme.StateFiles)."""
        self.files = files

    def new_master(self, f: FlatParam) -> torch.Tensor:
        """This rank's fp32 master shard, in host memory."""
        master = comm.host_empty(f.shard_numel, torch.float32, self.pin)
        if f.storage.on_host:
            master.copy_(f.shard)
        else:
            staged = comm.host_empty(f.shard_numel, f.dtype, self.pin)
            comm.copy_to_host(staged, f.shard, label=f"{f.label}.master_init")
            comm.wait_for_device(self.device)
            master.copy_(staged)
        return master

    def grads_to_host(self, flat_params: list[FlatParam], swappable) -> list[torch.Tensor]:
        """Each FlatParam's reduced gradient shard, copied into host memory as it is (low
        precision: the fewest bytes over PCIe); zeros for a FlatParam that got none.
        All copies are queued first, then one wait: the CPU's Adam needs the data.
        nvme: the states' reads are issued first, so the disk works during the copies."""
        if self.files is not None:
            self.files.prefetch(swappable)
        out = []
        for f in flat_params:
            g = f.grad_shard
            if g is None:
                out.append(torch.zeros(f.shard_numel, dtype=f.dtype, device=HOST))
                continue
            out.append(comm.copy_to_host(comm.host_empty(g.numel(), g.dtype, self.pin), g,
                                         label=f"{f.label}.grads"))
        comm.wait_for_device(self.device)
        return out

    def before_adam(self, swappable) -> None:
        """nvme: the reads grads_to_host issued, done."""
        if self.files is not None:
            self.files.swap_in(swappable)

    def after_step(self, swappable) -> None:
        """nvme: the new states to their files, in the background."""
        if self.files is not None:
            self.files.swap_out(swappable)
