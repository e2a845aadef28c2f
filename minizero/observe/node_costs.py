"""What ZeRO-3, hpZ and HSDP cost on several nodes: bytes per rank and per link, from the layout.

The mechanisms themselves are minizero/sharding.py's (which ranks each collective runs among); this
file only counts: `step_traffic`, one rank's wire and inter-node bytes in one step, byte for
byte what a real run's ledger records; `paper_costs`, the papers' accounting without padding.
Nodes are blocks of consecutive ranks, as torchrun and srun number them.
"""
from __future__ import annotations


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
