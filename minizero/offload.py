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
shard is copied to the device only to be all-gathered (flat_param.FlatParam.all_gather:
straight into this rank's slice of the gather's output, no temporary), and the optimizer
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

`"device": "nvme"` (ZeRO-Infinity's NVMe tier, nvme.py) is this same host offload with one
more tier below it: the host tensors above keep their identity and their arithmetic, and
between uses their bytes wait in files (`start_swapping`, and the few `swap` lines below).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from . import comm
from .flat_param import FlatParam
from .memory import CATEGORIES
from .nvme import SwapFolder, Swapper, agree_on_errors, check_free_space, logger, nbytes
from .errors import ConfigError

HOST = torch.device("cpu")


class HostOffload:
    """Which model state lives in host memory, and the copies that move it.

    optimizer: the fp32 master shard and Adam's moments (offload_optimizer)
    params:    ZeRO-3's partitioned low-precision parameter shards (offload_param)
    """

    def __init__(self, device: torch.device, *, optimizer: bool, params: bool,
                 pin_optimizer: bool = True, pin_params: bool = True,
                 nvme_optimizer: str | None = None, nvme_params: str | None = None, read_ahead: int = 0):
        self.device = device
        self.optimizer, self.params = optimizer, params
        on_gpu = device.type == "cuda"
        self.pin_optimizer, self.pin_params = pin_optimizer and on_gpu, pin_params and on_gpu
        # "device": "nvme": the folder each tier swaps to (None: it stays in host memory)
        self.nvme_optimizer, self.nvme_params, self.read_ahead = nvme_optimizer, nvme_params, read_ahead
        self.swappers: dict[str, Swapper] = {}     # by nvme_path; empty until start_swapping
        self.sharded_optimizer = None
        self._order_last: list = []                # offload_param to NVMe: the shards' gathers, last step
        self._order_now: list = []                 # ... and this step so far

    @classmethod
    def from_config(cls, zero_cfg, device: torch.device) -> "HostOffload | None":
        """None when the config offloads nothing."""
        opt, par = zero_cfg.offload_optimizer_enabled, zero_cfg.offload_param_enabled
        if not (opt or par):
            return None
        oo, op = zero_cfg.offload_optimizer, zero_cfg.offload_param
        return cls(device, optimizer=opt, params=par,
                   pin_optimizer=opt and oo.pin_memory, pin_params=par and op.pin_memory,
                   nvme_optimizer=oo.nvme_path if opt and oo.device == "nvme" else None,
                   nvme_params=op.nvme_path if par and op.device == "nvme" else None,
                   read_ahead=op.buffer_count if par else 0)

    # ------------------------------------------------------------------ parameters (stage 3)
    def move_param_shards(self, flat_params: list[FlatParam]) -> int:
        """Put every partitioned FlatParam's shard in host memory; returns how many moved.
        Persistent ones keep their shard as a view of the gathered buffer, on the device."""
        moved = 0
        for f in flat_params:
            if self.params and not f.persistent and not f.shard_on_host:
                host = host_empty(f.shard_numel, f.dtype, self.pin_params)
                comm.copy_to_host(host, f.shard, label=f"{f.label}.offload_param")
                f.shard, f.shard_on_host = host, True
                moved += 1
        wait_for_device(self.device)
        return moved

    # ------------------------------------------------------------------ optimizer
    def new_master(self, f: FlatParam) -> torch.Tensor:
        """This rank's fp32 master shard, in host memory."""
        master = host_empty(f.shard_numel, torch.float32, self.pin_optimizer)
        if f.shard_on_host:
            master.copy_(f.shard)
        else:
            staged = host_empty(f.shard_numel, f.dtype, self.pin_optimizer)
            comm.copy_to_host(staged, f.shard, label=f"{f.label}.master_init")
            wait_for_device(self.device)
            master.copy_(staged)
        return master

    def grads_to_host(self, flat_params: list[FlatParam]) -> list[torch.Tensor]:
        """Each FlatParam's reduced gradient shard, copied into host memory as it is (low
        precision: the fewest bytes over PCIe); zeros for a FlatParam that got none.
        All copies are queued first, then one wait: the CPU's Adam needs the data.
        nvme: the optimizer's reads are issued first, so the disk works during the copies."""
        for key, t in self._optimizer_tensors():
            self.swappers[self.nvme_optimizer].prefetch(key, t)
        out = []
        for f in flat_params:
            g = f.grad_shard
            if g is None:
                out.append(torch.zeros(f.shard_numel, dtype=f.dtype, device=HOST))
                continue
            out.append(comm.copy_to_host(host_empty(g.numel(), g.dtype, self.pin_optimizer), g,
                                         label=f"{f.label}.grads"))
        wait_for_device(self.device)
        return out

    def write_shard(self, f: FlatParam, master: torch.Tensor) -> None:
        """f.shard <- the updated fp32 master, rounded to the training dtype where the master
        lives, then copied to where the shard lives (2 bytes per element in bf16/fp16)."""
        if f.swap is not None:                       # nvme: the shard's storage back, unread (overwritten)
            f.swap.swapper.prefetch(f.swap.key, f.shard, read=False)
        if not self.optimizer:                       # the master is on the device
            if f.shard_on_host:                      # offload_param alone: round there, copy over
                comm.copy_to_host(f.shard, master.to(f.dtype), label=f"{f.label}.params")
            elif master is not f.shard:
                f.shard.copy_(master)
            return
        if f.shard_on_host:                          # both on the host
            f.shard.copy_(master)
            return
        if master.dtype == f.dtype:                  # fp32 training: copy the master itself
            staged = master
        else:
            staged = host_empty(f.shard_numel, f.dtype, self.pin_optimizer)
            staged.copy_(master)
        comm.copy_to_device(f.shard, staged, label=f"{f.label}.params")

    def finish_writes(self, flat_params: list[FlatParam]) -> None:
        """After the step's write_shard calls. offload_param alone wrote the host shards by
        asynchronous device-to-host copies: wait for them before anything on the CPU (a
        checkpoint save) reads those shards. (Copies to the device need no wait: the stream
        orders them before the gathers that read them.)"""
        if not self.optimizer and any(f.shard_on_host for f in flat_params):
            wait_for_device(self.device)
        self.swap_out()                                             # nvme: the new states to their files, in the background
        self._order_last, self._order_now = self._order_now, []     # next step reads ahead in this step's order

    # ------------------------------------------------------------------ NVMe (nvme.py)
    def start_swapping(self, sharded_optimizer, aio) -> None:
        """"device": "nvme": make each rank's swap folder (one line at start on every rank if
        it cannot be written or the files would not fit), then move the states there. A
        collective: every rank calls it, after move_param_shards."""
        self.sharded_optimizer = sharded_optimizer
        paths = {p for p in (self.nvme_optimizer, self.nvme_params) if p is not None}
        if not paths:
            return
        names = {self.nvme_params: "zero_optimization.offload_param.nvme_path",
                 self.nvme_optimizer: "zero_optimization.offload_optimizer.nvme_path"}
        folders = {}

        def make_folders():
            for p in sorted(paths):
                folders[p] = SwapFolder(p, comm.get_rank(), names[p])
        try:
            agree_on_errors(make_folders)
            for p, folder in folders.items():
                self.swappers[p] = Swapper(folder, aio.intra_op_parallelism, aio.block_size)
            if self.nvme_params is not None:
                for f in sharded_optimizer.flat_params:
                    if f.shard_on_host:
                        f.swap = ParamSwap(self, f)
            for p in sorted(paths):
                need = sum(nbytes(t) for key, t, q in self._swapped() if q == p)
                check_free_space(folders[p], need, names[p])
        except ConfigError:                          # leave no folder behind, on any rank
            for f in sharded_optimizer.flat_params:
                f.swap = None
            for folder in folders.values():
                folder.remove()
            self.swappers.clear()
            raise
        for folder in folders.values():
            if folder.removed_stale:
                logger.warning(f"rank {comm.get_rank()}: removed {folder.removed_stale} swap file(s) in "
                               f"{folder.path} left by a run that did not exit cleanly (swap files are not a "
                               f"checkpoint: a run resumes from its checkpoint)")
        if self.nvme_optimizer is not None:        # Adam waits for the reads grads_to_host issued
            sharded_optimizer.optimizer.register_step_pre_hook(lambda *_: self.swap_in_optimizer())
        for key, t, p in self._swapped():
            self.swappers[p].resident.add(key)       # all in host memory now: write each once
        self.swap_out()
        for s in self.swappers.values():
            s.wait_all()                             # a disk error surfaces here, at start

    def _optimizer_tensors(self):
        """(key, tensor) of the optimizer's swapped state: fp32 master and Adam's moments
        (looked up each time: loading a checkpoint gives the optimizer new state tensors)."""
        if self.nvme_optimizer is None or self.sharded_optimizer is None:
            return
        opt = self.sharded_optimizer
        for f, m in zip(opt.flat_params, opt.masters):
            yield f"{f.label}.master", m
            for name, v in opt.optimizer.state.get(m, {}).items():
                if torch.is_tensor(v) and v.dim() > 0:   # not Adam's scalar step
                    yield f"{f.label}.{name}", v

    def _swapped(self):
        """(key, tensor, nvme_path) of everything that lives in files between uses."""
        for key, t in self._optimizer_tensors():
            yield key, t, self.nvme_optimizer
        if self.nvme_params is not None and self.sharded_optimizer is not None:
            for f in self.sharded_optimizer.flat_params:
                if f.swap is not None:
                    yield f.swap.key, f.shard, self.nvme_params

    def swapped_out_bytes(self) -> dict:
        """Bytes per model-state category that live only in their files right now (a swapped-out
        tensor keeps its shape but holds no storage): memory.held_bytes' "nvme" place. Waits for
        the writes in flight first, so each state is counted in exactly one place."""
        category = {"master": "master_params", "shard": "params"}     # the rest: Adam's moments
        for swapper in self.swappers.values():
            swapper.wait_all()
        out = dict.fromkeys(CATEGORIES, 0)
        for key, t, _ in self._swapped():
            if t.untyped_storage().nbytes() == 0:
                out[category.get(key.rsplit(".", 1)[1], "optimizer_states")] += nbytes(t)
        return out

    def swap_out(self) -> None:
        """Write what is in host memory to its file and let the memory go, in the background."""
        for key, t, p in self._swapped():
            self.swappers[p].swap_out(key, t)

    def swap_in_optimizer(self) -> None:
        """Before Adam (a step pre-hook): the reads grads_to_host issued, done."""
        for key, t in self._optimizer_tensors():
            self.swappers[self.nvme_optimizer].swap_in(key, t)

    @contextmanager
    def resident(self):
        """Everything swapped in for the block (a checkpoint's save or load reads and writes
        the states as with "device": "cpu"), written back after it."""
        for key, t, p in self._swapped():
            self.swappers[p].swap_in(key, t)
        try:
            yield
        finally:
            self._own_states()
            for key, t, p in self._swapped():
                self.swappers[p].resident.add(key)   # a load may have replaced the tensors
            self.swap_out()

    def _own_states(self) -> None:
        """After a checkpoint load, Adam's moments may share a storage that cannot be resized
        (a view of what torch.load read): give each one a storage of its own to swap."""
        if self.nvme_optimizer is None:
            return
        opt = self.sharded_optimizer.optimizer
        for st in opt.state.values():
            for name, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0 and (
                        not v.untyped_storage().resizable() or v.untyped_storage().nbytes() != nbytes(v)):
                    st[name] = v.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        """Writes in flight finished, swap files and folders removed (a clean exit)."""
        for s in self.swappers.values():
            s.close()

    def nvme_places(self, where: dict) -> dict:
        """memory_breakdown's split with an "nvme" place: what lives in files between uses."""
        nvme = dict.fromkeys(where["host"], 0)
        moves = (["params"] if self.nvme_params else []) + \
            (["master_params", "optimizer_states"] if self.nvme_optimizer else [])
        for k in moves:
            nvme[k], where["host"][k] = where["host"][k], 0
        return nvme

    def describe(self, flat_params: list[FlatParam]) -> str:
        """The one log line saying what lives where."""
        parts = []
        if self.optimizer:
            parts.append("offload_optimizer: fp32 master shard + Adam moments in host memory, Adam on the CPU")
        if self.params:
            moved = [f for f in flat_params if f.shard_on_host]
            kept = [f for f in flat_params if f.persistent]
            parts.append(f"offload_param: {len(moved)} partitioned parameter shard(s) in host memory"
                         + (f"; {len(kept)} persistent FlatParam(s) (parameters <= "
                            f"stage3_param_persistence_threshold) stay gathered on the device" if kept else ""))
        pinned = self.pin_optimizer or self.pin_params
        for what, p in (("optimizer", self.nvme_optimizer), ("parameter shards", self.nvme_params)):
            if p is not None:
                parts.append(f"{what} swapped to NVMe files in {self.swappers[p].folder.path} between uses")
        return "; ".join(parts) + f" (host buffers {'pinned' if pinned else 'not pinned'})"


class ParamSwap:
    """offload_param to NVMe: a FlatParam's host shard, read from its file just before its
    gather and dropped right after (its file still holds it: no write). Each read also starts
    the reads of the next `read_ahead` shards, in the order the previous step gathered them
    (the same order every step: forward, then backward's reverse, per micro-step), so the
    disk works while this unit computes. No read-ahead crosses a step: the step rewrites
    every shard."""

    def __init__(self, offload: HostOffload, f: FlatParam):
        self.offload, self.flat, self.key = offload, f, f"{f.label}.shard"
        self.swapper = offload.swappers[offload.nvme_params]

    def fetch(self) -> None:
        off = self.offload
        i = len(off._order_now)
        off._order_now.append(self)
        self.swapper.swap_in(self.key, self.flat.shard)
        last = off._order_last
        if i < len(last) and last[i] is self:           # on the same path as last step
            for ahead in last[i + 1:i + 1 + off.read_ahead]:
                if ahead is not self:
                    self.swapper.prefetch(ahead.key, ahead.flat.shard)

    def done(self) -> None:
        self.swapper.swap_out(self.key, self.flat.shard, write=False)


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer; pinned (page-locked) when asked, so device copies run asynchronously.
    torch caches pinned blocks, so a staging buffer made every step is not a new
    cudaHostAlloc every step."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)


def wait_for_device(device: torch.device) -> None:
    """Block the CPU until the device-to-host copies queued on the current stream are done
    (non_blocking copies into pinned memory return before the data is there)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
