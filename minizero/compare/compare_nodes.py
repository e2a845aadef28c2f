"""minizero, DeepSpeed and PyTorch on pretended nodes (--hpz k, --hsdp S): what crosses between
nodes, per library, every byte predicted from the library's own layout.

With --hpz or --hsdp every run gets MINIZERO_RANKS_PER_NODE = k (or S), so minizero's ledger
and the reference runs' counters (reference/comm_counter.py) split each collective's wire
bytes by one rule: on a ring a rank sends all of them to the next rank of the group, across
nodes or not. Each run's summary.json then holds every rank's inter-node bytes per step, and
the bytes on the link from node 0 to node 1 are what node 0's ranks sent across.

The three libraries run the same algorithm with the same knobs (compare.py pins prefetch,
reuse and persistence to 0), so the collectives that move parameters and gradients differ
only by how each library pads what it cuts (docs/fsdp.md draws the three layouts):
    minizero   each FlatParam (a unit's parameters of one param group) padded to a multiple
               of the ranks it is cut over (N; S under HSDP)
    DeepSpeed  each parameter padded to a multiple of N (partition_parameters.py:
               _aligned_size); hpZ's secondary partition is padded/k of each
    FSDP2      each parameter's dim 0 padded to a multiple of the shard ranks
               (torch's _fsdp_param.py), so a (1, 63, 63) tensor is cut as (4, 63, 63) at N = 4
With P the padded elements and b the bytes per element, per rank and step (node_costs.step_traffic):
    ZeRO-3 hpZ   all-gather P·b·((N-1)/N + (k-1)/k) (forward over N, backward over the node);
                 reduce-scatter P·b·(N-1)/N
    HSDP         all-gather 2·P·b·(S-1)/S; reduce-scatter P·b·(S-1)/S; all-reduce of the
                 P/S shard across the N/S replicas, 2·(P/S)·b·(R-1)/R
and the few bytes each library adds: the gradient norm's fp64 all-reduce (minizero one per
step, over its shard group; DeepSpeed two, get_grad_norm_direct; FSDP2's goes through
DTensor's functional collectives, which the counter does not see) and DeepSpeed's check that
every rank recorded the same module order (partitioned_param_coordinator.reset_step ->
assert_ints_same_as_other_ranks: int64 broadcasts from rank 0, in the step whose trace it
records, once per run). A measured number that the prediction does not give is marked
"unexplained".
"""
from __future__ import annotations

import contextlib
import json
import os

from ..observe.node_costs import step_traffic
from ..partition import padded_numel
from .render import SHORT   # the table's column suffixes, one per library

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
NORMS = {"minizero": 1, "deepspeed": 2, "torch": 0}   # fp64 gradient-norm all-reduces per step the counter sees
PADDING = {"minizero": "each FlatParam padded to a multiple of {n}",
           "deepspeed": "each parameter padded to a multiple of {n}",
           "torch": "each parameter's dim 0 padded to a multiple of {n}"}


# The multi-node keys, the libraries that have each, and the stages it applies to (minizero's
# at stage 3 only: compare.MINIZERO_STAGES).
HIERARCHY = {"zero_hpz_partition_size": ("--hpz", {"deepspeed", "torch"}, {3}),
             "hsdp_shard_size": ("--hsdp", {"torch"}, {2, 3})}


def hierarchy_keys(args) -> dict:
    """{key: size} of the multi-node keys this comparison runs: the flags, else --config's."""
    keys = {}
    config = getattr(args, "config", None)
    if config and os.path.isfile(config):
        with contextlib.suppress(OSError, ValueError):
            with open(config) as f:
                zero = json.load(f).get("zero_optimization")
            if isinstance(zero, dict):
                keys.update({k: zero[k] for k in HIERARCHY if k in zero})
    for key, (flag, _, _) in HIERARCHY.items():
        value = getattr(args, flag[2:], None)
        if value is not None:
            keys[key] = value
    return keys


def ranks_per_node(args) -> int | None:
    """The "node" the runs pretend with --hpz k / --hsdp S: k (or S) consecutive ranks, as
    both libraries group them; None without either (one node)."""
    sizes = set(hierarchy_keys(args).values())
    return min(sizes) if sizes else None


def scheme_of(args) -> str | None:
    """"hpz" or "hsdp": the multi-node key this comparison runs (check_hierarchy allows one size)."""
    keys = hierarchy_keys(args)
    return "hsdp" if "hsdp_shard_size" in keys else "hpz" if "zero_hpz_partition_size" in keys else None


def link_bytes(summary: dict) -> dict | None:
    """{op: bytes per step, ..., "total"} that node 0's ranks sent to another node (the link
    from node 0 to node 1), from summary.json; None for a run without the per-rank split."""
    per_rank, per_node = summary.get("comm_inter_node_bytes_per_step"), summary.get("ranks_per_node")
    if not per_rank or not per_node or per_node >= summary.get("world_size", 1) or len(per_rank) < per_node:
        return None
    out: dict = {}
    for rank in range(per_node):
        for op, b in per_rank[rank].items():
            out[op] = out.get(op, 0) + b
    return out


def padded_elements(lib: str, model: str, shards: int) -> tuple[int, int]:
    """(Ψ, Σ padded elements) of the preset's parameters cut over `shards` ranks by `lib`'s rule."""
    from ..observe.memory_table import layout, meta_model
    m, groups = meta_model(model)
    params = [p for g in groups for p in g["params"]]
    psi = sum(p.numel() for p in params)
    if lib == "minizero":
        return psi, sum(padded_numel(f.numel, shards) for f in layout(m, groups, 3))
    if lib == "deepspeed":
        return psi, sum(padded_numel(p.numel(), shards) for p in params)
    return psi, sum(padded_numel(p.shape[0], shards) * (p.numel() // p.shape[0]) for p in params)


def predicted(lib: str, model: str, dtype: str, world: int, per_node: int, scheme: str) -> tuple[dict, dict, int]:
    """({op: rank 0's wire bytes per step}, {op: the link's bytes per step}, padded elements)
    that `lib` must move, from its padding rule and node_costs.step_traffic (minizero's norm
    replaced by the library's own count of them)."""
    b = 4 if dtype == "fp32" else 2
    shards = per_node if scheme == "hsdp" else world
    _, padded = padded_elements(lib, model, shards)
    norm_group = per_node if scheme == "hsdp" else world
    norm = 2 * 8 * (norm_group - 1) // norm_group
    wire, link = {op: 0 for op in OPS}, {op: 0 for op in OPS}
    for rank in range(per_node):
        for op, (w, x) in step_traffic([padded], b, world, per_node, scheme, rank).items():
            if op == "all_reduce":   # the norm: this library's count of them (HSDP's, inside the node)
                crosses = scheme != "hsdp" and x > 0
                w, x = w + (NORMS[lib] - 1) * norm, x + ((NORMS[lib] - 1) * norm if crosses else 0)
            if rank == 0:
                wire[op] += w
            link[op] += x
    return wire, link, padded


def _cell(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def nodes_section(results: dict, args, libs: list[str], per_node: int, scheme: str) -> list[str]:
    """report.md's section: per stage, every library's wire bytes (rank 0) and link bytes per
    step by op, each beside its prediction, and why the libraries differ."""
    world = args.nproc
    size_name = {"hpz": f"hpZ, k = {per_node}", "hsdp": f"HSDP, S = {per_node}"}[scheme]
    out = [f"## Between nodes: {world // per_node} pretended nodes of {per_node} ranks ({size_name})", "",
           f"Every run had MINIZERO_RANKS_PER_NODE={per_node}: ranks 0-{per_node - 1} are node 0. Per optimizer "
           "step (steady state: the first step is left out), rank 0's wire bytes and the bytes on the link from "
           "node 0 to node 1 (what node 0's ranks sent across: on a ring a rank sends everything to the next "
           "rank of the group, so each collective's bytes cross at one rank per node), by op. `= ` marks a "
           "number the library's own padding rule predicts exactly (minizero/compare/compare_nodes.py).", ""]
    for stage in sorted(results):
        summaries = results[stage]
        model = next(iter(summaries.values())).get("model")
        heads = [f"wire {SHORT[lib]}" for lib in libs] + [f"link {SHORT[lib]}" for lib in libs]
        out += [f"### ZeRO-{stage}", "", "| op | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
        preds, why = {}, []
        knobs = getattr(args, "own_knobs", False)
        for lib in libs:
            s = summaries[lib]
            if stage == 3 and not knobs and model:
                psi, _ = padded_elements(lib, model, world)
                if psi == s.get("params"):
                    preds[lib] = predicted(lib, model, args.dtype, world, per_node, scheme)
        for op in OPS:
            cells = []
            for kind in ("wire", "link"):
                for lib in libs:
                    s = summaries[lib]
                    got = (s.get("comm_wire_bytes_per_step") or {}).get(op) if kind == "wire" else \
                        (link_bytes(s) or {}).get(op)
                    want = preds[lib][0 if kind == "wire" else 1].get(op) if lib in preds else None
                    if lib == "deepspeed" and op == "broadcast":
                        want = None   # its trace check, named below
                    cell = _cell(got)
                    if want is not None and got is not None:
                        cell = ("= " if round(got) == want else "unexplained ") + cell
                    cells.append(cell)
            out.append(f"| {op} | " + " | ".join(cells) + " |")
        out.append("")
        for lib in libs:
            if lib in preds:
                shards = per_node if scheme == "hsdp" else world
                why.append(f"- {SHORT[lib]}: P = {preds[lib][2]:,} elements ({PADDING[lib].format(n=shards)}; "
                           f"Ψ = {summaries[lib]['params']:,})")
            else:
                why.append(f"- {SHORT[lib]}: not predicted (" + ("stage 3 only" if stage != 3 else
                           "--own-knobs: the config's prefetch and reuse decide the gathers" if knobs else
                           "a model other than the preset's shapes") + ")")
        formulas = ("all_gather P·b·((N-1)/N + (k-1)/k), forward over all N and backward inside the node; "
                    "reduce_scatter P·b·(N-1)/N; on the link: the forward gather and the reduce-scatter"
                    if scheme == "hpz" else
                    "all_gather 2·P·b·(S-1)/S and reduce_scatter P·b·(S-1)/S, inside the node; all_reduce of the "
                    "P/S shard across the replicas 2·(P/S)·b·(R-1)/R, the only bytes on the link")
        out += [f"Predicted with b = {4 if args.dtype == 'fp32' else 2} bytes per element, N = {world}, "
                f"{'k' if scheme == 'hpz' else 'S'} = {per_node}: {formulas}. The libraries differ by P, the "
                "elements each cuts:", "", *why, "", "And by the few bytes each adds: "
                + "; ".join(EXTRA[lib] for lib in libs) + ".", ""]
    return out


EXTRA = {"minizero": "minizero all-reduces its fp64 gradient norm once per step (8 B, over its shard group)",
         "deepspeed": "DeepSpeed twice (`get_grad_norm_direct`), and its broadcasts are its check that every "
                      "rank recorded the same module order (`assert_ints_same_as_other_ranks`: int64 lists from "
                      "rank 0, once per run, in the step whose trace it records), not ZeRO's traffic",
         "torch": "FSDP2's norm is a DTensor functional collective, which the counter does not see"}
