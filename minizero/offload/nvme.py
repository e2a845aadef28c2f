"""ZeRO-Infinity's NVMe tier: model states that live in files, and come to host memory to be used.

host.py puts the optimizer's shard (fp32 master + Adam's moments) and ZeRO-3's
parameter shards in host memory. ZeRO-Infinity (Rajbhandari et al., SC'21) goes one tier
further: between uses they live on an NVMe drive, so a model larger than the hosts' memory
still trains. With `"device": "nvme"` minizero keeps every such tensor object (the optimizer
and the FlatParam hold the same ones as with `"device": "cpu"`) but gives its storage back
while it is not in use, using the storage-resize trick ZeRO-3 already uses for gathered
parameters (flat_param.py):

    swap_out(t)   write t's bytes to its file, then resize t's storage to 0 bytes
    swap_in(t)    resize the storage back, read the file into it
    prefetch(t)   swap_in issued now, waited for at the next access to t

So the arithmetic is the host offload's, on the same tensors, bit for bit; only where the
bytes wait between uses changes. What moves, per rank and step (Ψ/N elements per rank):

    optimizer (offload_optimizer.device = nvme)
      reads   master + exp_avg + exp_avg_sq   12Ψ/N bytes   issued when the step starts
              (with the gradient copies), waited for just before Adam
      writes  the same 12Ψ/N bytes after Adam, issued at once and finished in the background
              during the next forward and backward; waited for before the next read
    parameters (offload_param.device = nvme, ZeRO-3)
      reads   a unit's shard before each gather (2Ψ/N bytes per gather), the next ones
              read ahead in the order the previous step used them (`read_ahead` shards)
      writes  the new shards after the step (2Ψ/N bytes); an unchanged shard is never
              rewritten: after its gather it is simply dropped from host memory

Why plain Python file I/O in threads (`os.pread`/`os.pwrite` in a ThreadPoolExecutor, one
block of `aio.block_size` bytes at a time): a reader can follow it line by line, it needs no
compiled extension, and CPython releases the GIL during each system call, so `thread_count`
threads keep that many requests in flight while the training thread computes. What it
does not do, and DeepSpeed's libaio op does: O_DIRECT. These files go through the kernel's
page cache, which the kernel may keep in host RAM until it needs the memory; the swap
saves the process's memory, and the machine's only once the page cache is reclaimed.

The files are not a checkpoint. Each rank has its own folder, `<nvme_path>/minizero_swap/rank<r>`,
held with a file lock while the run lives and removed at a clean exit. A checkpoint holds
the same state as with `"device": "cpu"` (everything is swapped in to save or load it), so a
run killed mid-swap resumes from its last checkpoint, with either setting.
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import socket
import threading
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from .. import comm
from ..config import ConfigError

logger = logging.getLogger("minizero")

SWAP_DIR = "minizero_swap"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SwapFolder:
    """This rank's folder of swap files: made, locked, and cleared of a dead run's files at start."""

    def __init__(self, nvme_path: str, rank: int, what: str):
        self.path = os.path.join(nvme_path, SWAP_DIR, f"rank{rank}")
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = os.path.join(self.path, ".probe")
            with open(probe, "wb") as fh:
                fh.write(b"0")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"{what} = {nvme_path!r}: cannot write swap files there ({e.strerror}); "
                              f"point it at a writable folder on a local disk") from None
        self._lock = open(os.path.join(self.path, ".lock"), "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            owner = self._lock.read().strip() or "another process"
            self._lock.close()
            raise ConfigError(f"{what} = {nvme_path!r}: {self.path} is in use by a running training "
                              f"({owner}); give each run its own nvme_path") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self._lock.flush()
        stale = [n for n in os.listdir(self.path) if n.endswith(".swp")]
        for n in stale:
            os.remove(os.path.join(self.path, n))
        self.removed_stale = len(stale)

    def file(self, key: str) -> str:
        return os.path.join(self.path, f"{key}.swp")

    def remove(self) -> None:
        """At a clean exit: the files, the lock, the folder (and minizero_swap/ once empty)."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass                                   # another rank's folder is still there
        self._lock.close()


class Swapper:
    """Tensors whose bytes live in files between uses. Every access to a key first waits for
    that key's read or write in flight, so no tensor is read while it is being filled, and no
    file is read before its write has finished."""

    def __init__(self, folder: SwapFolder, threads: int, block_size: int):
        self.folder, self.block_size = folder, block_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="minizero-nvme")
        self.in_flight: dict[str, Future] = {}
        self.resident: set[str] = set()          # keys whose storage is in host memory now
        self.written: set[str] = set()           # keys whose file holds their current value
        self._finalizer = weakref.finalize(self, _shutdown, self.pool, folder)

    # -- the three operations ---------------------------------------------------------------
    def swap_out(self, key: str, t: torch.Tensor, write: bool = True) -> None:
        """Drop t from host memory; write it first unless its file already holds it (write=False)."""
        self.wait(key)
        if key not in self.resident:
            return
        self.resident.discard(key)
        if not write and key in self.written:
            free_storage(t)
            return
        comm.ledger.record("nvme_write", nbytes(t), 0, key)
        self.in_flight[key] = self.pool.submit(self._write, self.folder.file(key), t)
        self.written.add(key)                     # once waited for; a failed write raises at the wait

    def prefetch(self, key: str, t: torch.Tensor, read: bool = True) -> None:
        """Give t its storage back and start reading its file into it (read=False: the caller
        overwrites all of it, so only the storage comes back)."""
        self.wait(key)
        if not read:
            self.written.discard(key)            # the caller is about to change it: the file is stale
        if key in self.resident:
            return
        self.resident.add(key)
        t.untyped_storage().resize_(nbytes(t))
        if read:
            comm.ledger.record("nvme_read", nbytes(t), 0, key)
            self.in_flight[key] = self.pool.submit(self._read, self.folder.file(key), t)

    def swap_in(self, key: str, t: torch.Tensor, read: bool = True) -> None:
        self.prefetch(key, t, read)
        self.wait(key)

    def wait(self, key: str) -> None:
        fut = self.in_flight.pop(key, None)
        if fut is not None:
            with comm.profiled(f"minizero::nvme_wait::{key}"):
                fut.result()                     # an OSError (a full disk) surfaces here

    def wait_all(self) -> None:
        for key in list(self.in_flight):
            self.wait(key)

    # -- the worker threads' part -----------------------------------------------------------
    def _write(self, path: str, t: torch.Tensor) -> None:
        view = byte_view(t)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for start in range(0, len(view), self.block_size):
                chunk = view[start:start + self.block_size]
                done = 0
                while done < len(chunk):
                    done += os.pwrite(fd, chunk[done:], start + done)
        finally:
            os.close(fd)
        free_storage(t)                           # only once the file holds every byte

    def _read(self, path: str, t: torch.Tensor) -> None:
        view = byte_view(t)
        fd = os.open(path, os.O_RDONLY)
        try:
            for start in range(0, len(view), self.block_size):
                end = min(start + self.block_size, len(view))
                while start < end:
                    got = os.preadv(fd, [view[start:end]], start)
                    if got == 0:
                        raise OSError(f"{path} ends before byte {start}: a swap file was truncated")
                    start += got
        finally:
            os.close(fd)

    def close(self) -> None:
        self._finalizer()


def byte_view(t: torch.Tensor) -> memoryview:
    """t's bytes, shared with t (no copy), as a writable flat memoryview. Through ctypes,
    not t.numpy(): handing a storage to numpy makes it non-resizable for good, and swapping
    is resizing it."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * nbytes(t)).from_address(t.data_ptr())).cast("B")


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _shutdown(pool: ThreadPoolExecutor, folder: SwapFolder) -> None:
    """Wait for every read and write, then remove the folder. The Swapper's last reference can
    die inside one of the pool's own tasks (the garbage collector runs wherever it runs), and a
    thread cannot wait for itself: then a helper thread waits, after this task has returned."""
    try:
        pool.shutdown(wait=True)
    except RuntimeError:          # "cannot join current thread": this is one of the pool's threads
        threading.Thread(target=_shutdown, args=(pool, folder), name="minizero-nvme-shutdown").start()
        return
    folder.remove()


def check_free_space(folder: SwapFolder, need: int, what: str) -> None:
    """One line at start, on every rank, when the swap files would not fit: the ranks on one
    host that share a file system add up. A collective: call on every rank."""
    here = (socket.gethostname(), os.stat(folder.path).st_dev)
    everyone = comm.all_gather_object((*here, need, shutil.disk_usage(folder.path).free))
    need_on, ranks_on = Counter(), Counter()          # per (host, file system): bytes needed, ranks
    for host, dev, n, _ in everyone:
        need_on[host, dev] += n
        ranks_on[host, dev] += 1
    short = [(host, dev, free) for host, dev, n, free in everyone if n and free < need_on[host, dev]]
    if short:
        host, dev, free = short[0]
        raise ConfigError(f"{what}: the swap files need {need_on[host, dev]:,} bytes on {host} "
                          f"({ranks_on[host, dev]} rank(s) sharing the disk), but only {free:,} are free; "
                          f"free space there or point nvme_path at a larger disk")


def agree_on_errors(fn):
    """Run fn() on every rank; if it fails on any, every rank raises that rank's ConfigError
    (comm.raise_if_any_rank_failed: rank 0's message first, else the lowest failing rank's),
    so no rank goes on into a collective the failed one will never join."""
    try:
        fn()
        err = None
    except ConfigError as e:
        err = str(e)
    comm.raise_if_any_rank_failed(err, ConfigError, label="nvme_ok")


# ----------------------------------------------------------------------------- one rank's swap folders

class NvmeTier:
    """This rank's swap folders and their Swappers, one per nvme_path (offload_param and
    offload_optimizer may share one). Made by `open` (a collective), filled by `start`."""

    def __init__(self, folders: dict, swappers: dict):
        self.folders, self.swappers = folders, swappers

    @classmethod
    def open(cls, paths: dict, aio) -> "NvmeTier":
        """{nvme_path: the config key that names it}: each rank's folder made and locked; one
        line on every rank if any rank cannot (agree_on_errors)."""
        folders = {}

        def make_folders():
            for p in sorted(paths):
                folders[p] = SwapFolder(p, comm.get_rank(), paths[p])
        try:
            agree_on_errors(make_folders)
        except ConfigError:                          # leave no folder behind, on any rank
            for folder in folders.values():
                folder.remove()
            raise
        tier = cls(folders, {p: Swapper(f, aio.intra_op_parallelism, aio.block_size) for p, f in folders.items()})
        tier.names = paths
        return tier

    def start(self, swappable: list) -> None:
        """`swappable`: (key, tensor, swapper) of every state that lives in files. One line at
        start on every rank when the files would not fit; then each is written once and its
        host memory let go. A collective."""
        try:
            for p, swapper in self.swappers.items():
                need = sum(nbytes(t) for _, t, s in swappable if s is swapper)
                check_free_space(self.folders[p], need, self.names[p])
        except ConfigError:                          # leave no folder behind, on any rank
            self.close()
            raise
        for folder in self.folders.values():
            if folder.removed_stale:
                logger.warning(f"rank {comm.get_rank()}: removed {folder.removed_stale} swap file(s) in "
                               f"{folder.path} left by a run that did not exit cleanly (swap files are not a "
                               f"checkpoint: a run resumes from its checkpoint)")
        for key, t, swapper in swappable:
            swapper.resident.add(key)                 # all in host memory now: write each once
        for key, t, swapper in swappable:
            swapper.swap_out(key, t)
        self.wait_all()                               # a disk error surfaces here, at start

    @contextmanager
    def resident(self, swappable, after_load):
        """Everything swapped in for the block, written back after it. `swappable()` is asked
        again at the end, and `after_load()` first: a checkpoint load may have replaced the
        tensors."""
        for key, t, swapper in swappable():
            swapper.swap_in(key, t)
        try:
            yield
        finally:
            after_load()
            now = swappable()
            for key, t, swapper in now:
                swapper.resident.add(key)
            for key, t, swapper in now:
                swapper.swap_out(key, t)

    def wait_all(self) -> None:
        for s in self.swappers.values():
            s.wait_all()

    def close(self) -> None:
        for s in self.swappers.values():
            s.close()


# ----------------------------------------------------------------------------- what lives in the files

class ReadAhead:
    """The order in which NVMe parameter shards were gathered last step (the same every step:
    forward, then backward's reverse, per micro-step), so each read can start the reads of the
    next `count` shards while this unit computes. No read-ahead crosses a step: the step
    rewrites every shard."""

    def __init__(self, count: int):
        self.count, self.last, self.now = count, [], []

    def fetched(self, shard: "ShardFile") -> list:
        """`shard` is being read for a gather: the shards to read ahead of it."""
        i = len(self.now)
        self.now.append(shard)
        if i < len(self.last) and self.last[i] is shard:   # on the same path as last step
            return [s for s in self.last[i + 1:i + 1 + self.count] if s is not shard]
        return []

    def step_done(self) -> None:
        """The step wrote the shards: this step's order is the one the next reads ahead in."""
        if self.now:
            self.last, self.now = self.now, []


class ShardFile:
    """offload_param to NVMe: a host shard's file (offload.HostShard holds it). The shard is
    read just before its gather (and the next shards' reads started, ReadAhead), dropped right
    after (its file still holds it: no write), and written after the step changed it."""

    def __init__(self, swapper: Swapper, key: str, tensor: torch.Tensor, read_ahead: ReadAhead):
        self.swapper, self.key, self.tensor, self.read_ahead = swapper, key, tensor, read_ahead

    def read(self) -> None:
        ahead = self.read_ahead.fetched(self)
        self.swapper.swap_in(self.key, self.tensor)
        for f in ahead:
            self.swapper.prefetch(f.key, f.tensor)

    def drop(self) -> None:
        self.swapper.swap_out(self.key, self.tensor, write=False)

    def reclaim(self) -> None:
        """The storage back, unread: the caller overwrites all of it."""
        self.swapper.prefetch(self.key, self.tensor, read=False)

    def write(self) -> None:
        """To the file, in the background (the caller waited for any device-to-host copy)."""
        self.swapper.swap_out(self.key, self.tensor)
        self.read_ahead.step_done()


class StateFiles:
    """offload_optimizer to NVMe (offload.HostStates holds it): the fp32 masters and Adam's
    moments live in files between steps. Per step their reads start with the gradient copies
    (the disk works meanwhile), are waited for just before Adam, and the writes start after it
    and finish in the background, during the next forward and backward. `swappable`: the
    optimizer's (key, tensor) pairs, asked each time (a checkpoint load replaces tensors)."""

    def __init__(self, swapper: Swapper):
        self.swapper = swapper

    def prefetch(self, swappable) -> None:
        for key, t in swappable:
            self.swapper.prefetch(key, t)

    def swap_in(self, swappable) -> None:
        for key, t in swappable:
            self.swapper.swap_in(key, t)

    def swap_out(self, swappable) -> None:
        for key, t in swappable:
            self.swapper.swap_out(key, t)
