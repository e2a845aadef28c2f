"""Sharding: which ranks a FlatParam's collectives run among, and from what. One owner for all of them.

A FlatParam (flat_param.py) is a padded buffer cut into shards. Three questions decide every
collective on it, and this file answers all three, so no other class has to know them:

- *Over which ranks is it cut?* `num_shards` ranks; this rank holds shard `shard_index`.
- *Which ranks gather it, from which shard?* Its shard group (`group`), from this rank's
  shard, handed over as a device tensor by wherever the shard lives (`f.storage`: the
  device, or host memory and NVMe files with offload_param); or, with hpZ, its node, from
  this rank's secondary shard.
- *Which ranks sum its gradient?* All `ranks` of the job (the average is over every rank):
  a reduce-scatter within the shard group, and with HSDP an all-reduce of the result with
  the ranks holding the same shard in the other groups, issued right after it.

Three answers are in use, all in the ZeRO-3 of minizero (stages 0-2 use the first, or no
cut at all at stage 0):

plain ZeRO (Rajbhandari et al., SC'20): every parameter cut over all N ranks; every gather
and reduce-scatter runs over all N. On several nodes most of those bytes cross the slow link
between nodes, three times a step at ZeRO-3. Two answers keep gathers inside a node (nodes
are blocks of consecutive ranks, as torchrun and srun number them: process_group.ranks_per_node):

hpZ, ZeRO++'s hierarchical partitioning (Wang et al., "ZeRO++", arXiv 2306.10209, section
3.2; DeepSpeed's `zero_hpz_partition_size: k`). Parameters stay cut over all N ranks (the
primary shard, which the optimizer updates), and each rank also keeps a *secondary* shard:
its 1/k of the full parameter among the k ranks of its node, cut when a gathered unit is
released, dropped when the parameters change (a step, a checkpoint load). A gather reads the
secondary whenever there is one, over the node's k ranks. So backward's gathers stay inside
the node; forward's go over all N, except in the first step, whose secondaries were cut at
initialisation (as in DeepSpeed). Cost: 2Ψ/k more bytes per rank (bf16) from forward to the
step. Gradients are reduce-scattered over all N, as plain ZeRO-3.

HSDP, hybrid sharding (Zhao et al., "PyTorch FSDP", VLDB'23, arXiv 2304.11277, section 3.2.2;
MiCS, Zhang et al., VLDB'23, in DeepSpeed before 0.19.8; minizero's key `hsdp_shard_size: S`).
Every parameter, gradient and optimizer state is cut over S consecutive ranks only, and
replicated across the N/S such groups. Both gathers and the reduce-scatter stay inside the
group; a rank then all-reduces its gradient shard with the ranks that hold the same shard in
the other groups (the one collective between nodes: 2Ψ/S·(R-1)/R per rank, R = N/S). On a
GPU that all-reduce is issued on a stream of its own as soon as the reduce-scatter is
queued (PyTorch FSDP2's `foreach_reduce` does the same), so the compute stream never waits
for the slow link until the gradient is needed; gloo runs each group's collectives on its
own threads, so there the host issues it once the reduce-scatter is done. Cost: model states
of 16Ψ/S per rank instead of 16Ψ/N.

A Sharding is one rank's; the FlatParams of one stage share it. It holds the hpZ secondary
shards (a FlatParam's own is `secondary(f)`), because choosing them as the gather's source
is its decision. A secondary is kept where the FlatParam keeps its shard (its storage's
`blank`): on the device, or with offload_param in host memory, as DeepSpeed keeps it on
offload_param's device (never in an NVMe file: it lives only from a release to the step).
"""
from __future__ import annotations

import torch

from . import comm, process_group


class Sharding:
    def __init__(self, num_shards: int, shard_index: int, ranks: int, *, group=None, replicas=None,
                 num_replicas: int = 1, secondary_size: int = 1, secondary_index: int = 0, secondary_group=None):
        self.num_shards = num_shards              # ranks one parameter is cut over (N; S with HSDP; 1 at stage 0)
        self.shard_index = shard_index            # this rank's shard among them
        self.ranks = ranks                        # ranks that average the gradient: every shard of every replica (N)
        self.group = group                        # the process group of the shard's ranks (None: all ranks)
        self.replicas = replicas                  # HSDP: the ranks holding the same shard, one per group
        self.num_replicas = num_replicas
        self.secondary_size = secondary_size      # hpZ: k, the ranks a secondary shard is cut over (1: none)
        self.secondary_index = secondary_index    # this rank's secondary among them
        self.secondary_group = secondary_group
        self._secondaries: dict = {}              # hpZ: FlatParam -> this rank's node-local shard of it

    # ------------------------------------------------------------------ parameters
    def all_gather(self, f, label: str, async_op: bool):
        """f.full <- every shard (f.full is allocated). The source: this rank's hpZ secondary,
        over its node, when there is one; else this rank's shard, handed over on the device by
        its storage (copied into its own slice of f.full when it lives in host memory or a file),
        over the shard group. async_op: the Pending (None otherwise)."""
        secondary = self._secondaries.get(f)
        if secondary is not None:   # hpZ: over the node, from this rank's 1/k
            part = f.padded_numel // self.secondary_size
            source, group, mine = secondary, self.secondary_group, slice(self.secondary_index * part,
                                                                          (self.secondary_index + 1) * part)
        else:
            source, group, mine = f.storage, self.group, slice(f.shard_start, f.shard_end)
        into = f.full[mine]   # this rank's place in the output: the gather reads it there, in place
        side = comm.side_stream(f.device, "offload_copy") if async_op and source.on_host else None
        if side is None:
            pending = comm.all_gather_into_tensor(f.full, source.to_device(into, label), label=label,
                                                  group=group, async_op=async_op)
            return pending if async_op else None
        # A prefetch of a host shard on a GPU: the copy, and the gather that reads it, go on a side
        # stream, so the copy runs beside the compute queued after this point instead of ahead of
        # it on the compute stream (which would stall the next unit's forward). NCCL's stream waits
        # for the stream that issues the gather (so the gather follows the copy), and wait() makes
        # the compute stream wait for NCCL's. First the side stream waits for the compute stream's
        # work so far: `full` was just given memory that kernels queued there may still be using.
        # At world size 1 the "gather" is a copy on the side stream itself: the returned wait()
        # also waits for its event.
        side.wait_stream(torch.cuda.current_stream(f.device))
        with torch.cuda.stream(side):
            pending = comm.all_gather_into_tensor(f.full, source.to_device(into, label), label=label,
                                                  group=group, async_op=True)
            return OnSideStream(pending, side.record_event(), f.device)

    def all_gather_coalesced(self, flats: list, label: str) -> None:
        """Several FlatParams gathered by one collective (their shards on the device): this rank's
        shards laid end to end, one all-gather, then each FlatParam's slice of every rank copied
        into its full buffer. ZeRO-3's persistent FlatParams after the step: one small collective
        per unit would cost each its call's latency and host time (DeepSpeed gathers them in one
        call too). The same bytes per rank as separate gathers."""
        n = self.num_shards
        mine = torch.cat([f.shard for f in flats])
        everyone = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.all_gather_into_tensor(everyone, mine, label=label, group=self.group)
        rows, at = everyone.view(n, -1), 0
        for f in flats:
            f.full.view(n, f.shard_numel).copy_(rows[:, at:at + f.shard_numel])
            at += f.shard_numel

    def keep_secondary(self, f) -> None:
        """f's full buffer is about to be freed (a unit's reshard): with hpZ, keep this rank's
        1/k of it first, where f keeps its shard, unless a secondary of these values exists."""
        if self.secondary_size > 1 and f not in self._secondaries:
            part = f.padded_numel // self.secondary_size
            i = self.secondary_index
            secondary = f.storage.blank(part)
            secondary.write(f.full[i * part:(i + 1) * part], from_host=False, pin=False, label=f"{f.label}.secondary")
            self._secondaries[f] = secondary

    def secondary(self, f):
        """f's hpZ secondary shard (a storage: `.tensor`, `.on_host`), while it has one."""
        return self._secondaries.get(f)

    def secondary_bytes(self, f) -> int:
        """The layout's secondary bytes of f, held from its first release to the step: padded/k
        low-precision elements, for a partitioned FlatParam (a persistent one is never released,
        so never cut)."""
        if self.secondary_size == 1 or f.persistent:
            return 0
        return f.padded_numel // self.secondary_size * f.full.element_size()

    def changed(self, f) -> None:
        """f's shard has new values (the optimizer's step, a checkpoint load): its secondary, cut
        from the old ones, is gone."""
        self._secondaries.pop(f, None)

    # ------------------------------------------------------------------ gradients
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, label: str, async_op: bool):
        """out <- this rank's chunk of the sum of every rank's `full` (pre-divided by `ranks`: an
        average): a reduce-scatter over the shard group, and with HSDP the all-reduce of `out`
        over the replicas after it. Returns what to wait on before reading `out` (None: done)."""
        pending = comm.reduce_scatter_tensor(out, full, label=label, group=self.group, async_op=async_op)
        if self.replicas is None:
            return pending if async_op else None
        summed = ReplicaSum(pending if async_op else None, out, f"{label}.replicas", self.replicas)
        if async_op:
            return summed
        summed.wait()
        return None

    def all_reduce(self, full: torch.Tensor, label: str, async_op: bool):
        """Stage 0 (one shard, every rank a replica): the whole buffer summed over every rank."""
        pending = comm.all_reduce(full, label=label, async_op=async_op)
        return pending if async_op else None

    def __repr__(self) -> str:
        extra = (f", replicas={self.num_replicas}" if self.replicas is not None else "") + \
            (f", secondary 1/{self.secondary_size}" if self.secondary_size > 1 else "")
        return f"Sharding(shard {self.shard_index} of {self.num_shards}, averaged over {self.ranks}{extra})"


class ReplicaSum:
    """HSDP's gradient reduction in flight: a reduce-scatter within the shard group, then the
    all-reduce of its result across the replicas. On a GPU the all-reduce is issued now, on the
    "replicas" side stream, which first waits for the reduce-scatter (the host does not); wait()
    makes the compute stream wait for it. On gloo the all-reduce is issued at wait(), once the
    reduce-scatter is done: gloo runs each group's collectives on its own threads, so only the
    host can order two groups' collectives."""

    def __init__(self, scatter, out: torch.Tensor, label: str, replicas):
        self.scatter, self.out, self.label, self.replicas = scatter, out, label, replicas
        self.summed = None
        side = comm.side_stream(out.device, "replicas")
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(out.device))   # a synchronous scatter is queued there
            with torch.cuda.stream(side):
                if scatter is not None:
                    scatter.wait()                                       # this stream waits for NCCL's
                self.summed = comm.all_reduce(out, label=label, group=replicas, async_op=True)

    def wait(self) -> None:
        if self.summed is not None:
            self.summed.wait()
            return
        if self.scatter is not None:
            self.scatter.wait()
        comm.all_reduce(self.out, label=self.label, group=self.replicas)


class OnSideStream:
    """A gather issued on a side stream (a prefetched host shard on a GPU): wait() waits for the
    gather (its Pending) and makes the compute stream wait for the side stream's work."""

    def __init__(self, pending, event, device: torch.device):
        self.pending, self.event, self.device = pending, event, device

    def wait(self) -> None:
        self.pending.wait()
        torch.cuda.current_stream(self.device).wait_event(self.event)


# ----------------------------------------------------------------------------- one rank's Sharding

def replicated(world_size: int | None = None) -> Sharding:
    """Stage 0: nothing is cut (one shard, the whole buffer); the gradient is averaged over all
    ranks (default: this job's)."""
    return Sharding(1, 0, comm.get_world_size() if world_size is None else world_size)


def plain(world_size: int | None = None, rank: int | None = None) -> Sharding:
    """ZeRO as the paper draws it: one shard per rank, over all ranks (default: this job's)."""
    world = comm.get_world_size() if world_size is None else world_size
    return Sharding(world, comm.get_rank() if rank is None else rank, world)


def for_config(zero_cfg) -> Sharding:
    """This rank's Sharding from zero_optimization (hsdp_shard_size, zero_hpz_partition_size).
    A collective: every rank makes every group, in the same order."""
    world, rank = comm.get_world_size(), comm.get_rank()
    hsdp, hpz = int(zero_cfg.hsdp_shard_size), int(zero_cfg.zero_hpz_partition_size)
    process_group.check_node_groups(hsdp or hpz, "hsdp_shard_size" if hsdp else "zero_hpz_partition_size")
    if hsdp and hsdp < world:
        shards = consecutive_groups(world, hsdp)                        # [0..S-1], [S..2S-1], ...
        replicas = [list(range(j, world, hsdp)) for j in range(hsdp)]   # {j, j+S, j+2S, ...}
        return Sharding(hsdp, rank % hsdp, world, group=comm.new_groups(shards), replicas=comm.new_groups(replicas),
                        num_replicas=world // hsdp)
    if 1 < hpz < world:
        return Sharding(world, rank, world, secondary_size=hpz, secondary_index=rank % hpz,
                        secondary_group=comm.new_groups(consecutive_groups(world, hpz)))
    return plain(world, rank)


def consecutive_groups(world_size: int, size: int) -> list[list[int]]:
    """Blocks of `size` consecutive ranks: the nodes, when size is the ranks per node."""
    return [list(range(i, i + size)) for i in range(0, world_size, size)]
