"""ZeRO-3 that knows where the nodes are: which ranks a parameter is sharded over, and which
ranks its gathers and reductions run among.

Plain ZeRO-3 shards every parameter over all N ranks, so each of its per-step all-gathers
(forward and backward) runs over all N, and on several nodes most of those bytes cross the
slow link between nodes. Two answers keep gathers inside a node (nodes are blocks of
consecutive ranks, as torchrun and srun number them: process_group.ranks_per_node):

hpZ, ZeRO++'s hierarchical partitioning (Wang et al., "ZeRO++", arXiv 2306.10209, section
3.2; DeepSpeed's `zero_hpz_partition_size: k`). Parameters stay sharded over all N ranks
(the primary shard, which the optimizer updates), and each rank also keeps a *secondary*
shard: its 1/k of the full parameter among the k ranks of its node, cut when a gathered unit
is released and dropped after every optimizer step (its values change). A gather uses the
secondary whenever there is one, over the node's k ranks. So backward's gathers stay inside
the node; forward's go over all N, except in the first step, whose secondaries were cut at
initialisation (as in DeepSpeed). Cost: 2Ψ/k more bytes per rank (bf16) from forward to the
step. Gradients are reduce-scattered over all N, as plain ZeRO-3.

HSDP, hybrid sharding (Zhao et al., "PyTorch FSDP", VLDB'23, arXiv 2304.11277, section 3.2.2;
MiCS, Zhang et al., VLDB'23, in DeepSpeed before 0.19.8; minizero's key `hsdp_shard_size: S`).
Every parameter, gradient and optimizer state is sharded over S consecutive ranks only, and
replicated across the N/S such groups. Both gathers and the reduce-scatter stay inside the
group; a rank then all-reduces its gradient shard with the ranks that hold the same shard in
the other groups (the one collective between nodes: 2Ψ/S·(R-1)/R per rank, R = N/S). Cost:
model states of 16Ψ/S per rank instead of 16Ψ/N.

`Sharding` says, for one rank, which ranks each collective runs among; every FlatParam of a
ZeRO-3 engine holds it (flat_param.py). Plain ZeRO-3 (and stages 1-2) is the Sharding of all
N ranks and no secondary, where every group is the default one.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import comm, process_group


@dataclass(frozen=True)
class Sharding:
    num_shards: int            # ranks one parameter is cut over (N; S with HSDP)
    shard_index: int           # this rank's shard among them
    ranks: int                 # ranks that average the gradient: every shard of every replica (N)
    group: object = None       # the process group of those ranks (None: all ranks)
    replicas: object = None    # HSDP: the ranks holding the same shard, one per group (None: no replicas)
    num_replicas: int = 1
    secondary_size: int = 1    # hpZ: k, the ranks a secondary shard is cut over (1: no secondary)
    secondary_index: int = 0   # this rank's secondary among them
    secondary_group: object = None


def plain(world_size: int, rank: int) -> Sharding:
    """ZeRO as the paper draws it: one shard per rank, over all ranks."""
    return Sharding(world_size, rank, world_size)


def for_config(zero_cfg) -> Sharding:
    """This rank's Sharding from zero_optimization (hsdp_shard_size, zero_hpz_partition_size).
    A collective: every rank makes every group, in the same order."""
    world, rank = comm.get_world_size(), comm.get_rank()
    hsdp, hpz = int(zero_cfg.hsdp_shard_size), int(zero_cfg.zero_hpz_partition_size)
    process_group.check_node_groups(hsdp or hpz, "hsdp_shard_size" if hsdp else "zero_hpz_partition_size")
    if hsdp and hsdp < world:
        shards = consecutive_groups(world, hsdp)                     # [0..S-1], [S..2S-1], ...
        replicas = [list(range(j, world, hsdp)) for j in range(hsdp)]   # {j, j+S, j+2S, ...}
        return Sharding(hsdp, rank % hsdp, world, group=comm.new_groups(shards), replicas=comm.new_groups(replicas),
                        num_replicas=world // hsdp)
    if hpz > 1 and hpz < world:
        return Sharding(world, rank, world, secondary_size=hpz, secondary_index=rank % hpz,
                        secondary_group=comm.new_groups(consecutive_groups(world, hpz)))
    return plain(world, rank)


def consecutive_groups(world_size: int, size: int) -> list[list[int]]:
    """Blocks of `size` consecutive ranks: the nodes, when size is the ranks per node."""
    return [list(range(i, i + size)) for i in range(0, world_size, size)]


# ----------------------------------------------------------------------------- what each costs

def ring_crosses(group: list[int], rank: int, per_node: int) -> bool:
    """On a ring over `group` (global ranks, in ring order), does `rank` send to another node?"""
    i = group.index(rank)
    return group[(i + 1) % len(group)] // per_node != rank // per_node


def step_traffic(padded: list[int], elem: int, world: int, per_node: int, scheme: str, rank: int,
                 first_step: bool = False) -> dict:
    """One rank's wire bytes in one optimizer step of ZeRO-3 with every parameter partitioned and
    gathered at each use (no prefetch, reuse or persistence; gradient accumulation 1), by
    collective: {op: (wire bytes, of which inter-node)}. padded: each FlatParam's padded
    element count (the shard size times the shards: N, or S with HSDP); elem: bytes per
    low-precision element. scheme: "zero3", "hpz" (k = per_node) or "hsdp" (S = per_node).
    A ring sends every byte of a rank to the next rank of its group (comm.py's ledger)."""
    everyone = list(range(world))
    node = list(range(rank // per_node * per_node, rank // per_node * per_node + per_node))
    replicas = list(range(rank % per_node, world, per_node))
    total = sum(padded) * elem
    out: dict = {}

    def add(op, group, nbytes, times=1):
        n = len(group)
        wire = times * (2 * nbytes * (n - 1) // n if op == "all_reduce" else nbytes * (n - 1) // n)
        w, x = out.get(op, (0, 0))
        out[op] = (w + wire, x + (wire if ring_crosses(group, rank, per_node) else 0))

    if scheme == "zero3":
        add("all_gather", everyone, total, times=2)                      # forward, backward
        add("reduce_scatter", everyone, total)
        add("all_reduce", everyone, 8)                                  # the fp64 gradient norm
    elif scheme == "hpz":
        add("all_gather", node if first_step else everyone, total)     # forward: the secondary only at first
        add("all_gather", node, total)                                   # backward: always the secondary
        add("reduce_scatter", everyone, total)
        add("all_reduce", everyone, 8)
    elif scheme == "hsdp":
        add("all_gather", node, total, times=2)
        add("reduce_scatter", node, total)
        add("all_reduce", replicas, total // per_node)                   # this rank's gradient shard
        add("all_reduce", node, 8)                                       # the norm, over one shard group
    else:
        raise ValueError(f"scheme {scheme!r}: zero3, hpz or hsdp")
    return out


def paper_costs(psi: int, nodes: int, per_node: int, mixed: bool = True) -> dict:
    """The ZeRO paper's accounting for ZeRO-3, hpZ (k = per_node) and HSDP (S = per_node) at
    nodes x per_node ranks, Ψ parameters, no padding: per rank, model-state bytes (hpZ's
    secondary shard included) and wire bytes per step; per link between two nodes, the bytes
    per step (a ring crosses each such link once per collective: what the slowest link carries).
    ZeRO++ (arXiv 2306.10209) counts hpZ's cross-node volume as forward's gather and the
    gradient's reduce-scatter; FSDP (arXiv 2304.11277) HSDP's as one all-reduce of a 1/S shard."""
    n, lp = nodes * per_node, 2 if mixed else 4
    states = (lp + lp + (12 if mixed else 8))   # bytes per element of params, grads, optimizer states
    r = nodes
    rows = {
        "zero3": {"states": states * psi / n, "wire": 3 * lp * psi * (n - 1) / n,
                  "link": 3 * lp * psi * (n - 1) / n if nodes > 1 else 0.0},
        "hpz": {"states": states * psi / n + lp * psi / per_node,
                "wire": lp * psi * (2 * (n - 1) / n + (per_node - 1) / per_node),
                "link": 2 * lp * psi * (n - 1) / n if nodes > 1 else 0.0},
        "hsdp": {"states": states * psi / per_node,
                 "wire": lp * psi * (3 * (per_node - 1) / per_node + 2 * (r - 1) / r / per_node),
                 # each of the S replica rings crosses every link once: S x 2(R-1)/R x Ψ/S
                 "link": 2 * lp * psi * (r - 1) / r if nodes > 1 else 0.0},
    }
    return rows
