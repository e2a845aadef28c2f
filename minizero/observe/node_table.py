"""`python -m minizero.memory_table --nodes 2 64 --ranks-per-node 4 8`: ZeRO-3, hpZ and HSDP on
M nodes of L ranks, what each rank holds and what each step sends, and what crosses between nodes.

Three numbers per scheme, per optimizer step (gradient accumulation 1, every parameter
partitioned and gathered at each use: no prefetch, reuse or persistence), with hpZ's k and
HSDP's S set to L, the ranks of one node (minizero/sharding.py says what each scheme does):

- model-state bytes per rank (parameters, gradients, fp32 masters, Adam's moments; hpZ's
  secondary shard included: it lives from the first forward to the step);
- wire bytes per rank: what one rank sends on the rings of the step's collectives;
- bytes per inter-node link: nodes are blocks of consecutive ranks and every ring runs in
  rank order, so every byte that leaves node a goes to node a+1, on one link; this is what
  that link carries in one step (the sum of the inter-node bytes of node a's ranks), the
  number that sets the step's time when the link between nodes is the slow one.

Each comes twice. "paper": node_costs.paper_costs, the papers' accounting (no padding, the
gradient norm's few bytes left out): ZeRO (Rajbhandari et al., SC'20) for ZeRO-3, ZeRO++
(Wang et al., arXiv 2306.10209, section 3.2) for hpZ, PyTorch FSDP (Zhao et al., arXiv
2304.11277, section 3.2.2) for HSDP. "layout": the same quantities exactly, from the
FlatParams minizero builds for the model (zero3.unit_plan on a meta-device model, each padded
to a multiple of the ranks it is cut over: N, or S with HSDP), memory.expected_bytes and
node_costs.step_traffic: byte for byte what a real run's engine.memory_breakdown() and
engine.comm_stats() say (tests/tools/test_node_table.py runs one at 2 x 2).
"""
from __future__ import annotations

from ..memory import expected_bytes, total
from .node_costs import paper_costs, step_traffic
from ..partition import padded_numel

SCHEMES = ("zero3", "hpz", "hsdp")
QUANTITIES = ("states", "wire", "link")


def human(nbytes: float) -> str:
    """A byte count as people read it: 1.5 KiB, 31.4 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def scheme_name(scheme: str, per_node: int) -> str:
    return {"zero3": "ZeRO-3", "hpz": f"hpZ, k = {per_node}", "hsdp": f"HSDP, S = {per_node}"}[scheme]


def layout_costs(flat_numels: list[int], nodes: int, per_node: int, dtype: str = "bf16") -> dict:
    """{scheme: {"states", "wire", "link"}} in bytes, exact for this layout (`flat_numels`: each
    FlatParam's elements, unpadded). states: one rank's model states (every rank holds the
    same); wire: one rank's wire bytes per step (every rank sends the same); link: the bytes
    one link between nodes carries per step."""
    if nodes < 2 or per_node < 1:
        raise ValueError(f"{nodes} x {per_node}: give at least 2 nodes of at least 1 rank")
    world, mixed = nodes * per_node, dtype != "fp32"
    lp = 2 if mixed else 4
    out = {}
    for scheme in SCHEMES:
        shards = per_node if scheme == "hsdp" else world      # the ranks a parameter is cut over
        padded = [padded_numel(x, shards) for x in flat_numels]
        states = total(expected_bytes(flat_numels, shards, 3, mixed=mixed))
        if scheme == "hpz":   # the secondary shard: padded/k low-precision elements per FlatParam
            states += sum(p // per_node for p in padded) * lp
        wire, link = set(), 0
        for rank in range(per_node):   # node 0's ranks; every node is the same
            traffic = step_traffic(padded, lp, world, per_node, scheme, rank)
            wire.add(sum(w for w, _ in traffic.values()))
            link += sum(x for _, x in traffic.values())
        (wire,) = wire   # a ring sends as much from every rank
        out[scheme] = {"states": states, "wire": wire, "link": link}
    return out


def formulas(per_node: int, dtype: str = "bf16") -> dict:
    """The paper formulas as text, {scheme: (states, wire, link)}: Ψ parameters, N ranks, L per node,
    R = N/L nodes; b bytes per low-precision element, s bytes of model states per parameter."""
    b, s = (2, 16) if dtype != "fp32" else (4, 16)
    return {"zero3": (f"{s}Ψ/N", f"3·{b}Ψ(N-1)/N", f"3·{b}Ψ(N-1)/N"),
            "hpz": (f"{s}Ψ/N + {b}Ψ/k", f"{b}Ψ(2(N-1)/N + (k-1)/k)", f"2·{b}Ψ(N-1)/N"),
            "hsdp": (f"{s}Ψ/S", f"{b}Ψ(3(S-1)/S + 2(R-1)/(RS))", f"2·{b}Ψ(R-1)/R")}


def rows(psi: int, flat_numels: list[int] | None, nodes: int, per_node: int, dtype: str = "bf16") -> list[dict]:
    """The table's rows for one nodes x per_node: per scheme the paper's row, then the
    layout's (when flat_numels is given)."""
    paper = paper_costs(psi, nodes, per_node, mixed=dtype != "fp32")
    exact = layout_costs(flat_numels, nodes, per_node, dtype) if flat_numels is not None else None
    text = formulas(per_node, dtype)
    out = []
    for scheme in SCHEMES:
        out.append({"scheme": scheme, "counted": "paper", **{q: paper[scheme][q] for q in QUANTITIES},
                    "formula": text[scheme]})
        if exact is not None:
            out.append({"scheme": scheme, "counted": "layout", **exact[scheme]})
    return out


def format_table(psi: int, flat_numels: list[int] | None, shapes: list[tuple[int, int]], dtype: str = "bf16") -> str:
    """The markdown table for each (nodes, ranks per node) in `shapes`."""
    lines = ["| nodes x ranks | scheme | counted | model states per rank | wire bytes per rank per step | "
             "bytes per inter-node link per step | the same in units | formula (paper) |",
             "|---|---|---|---|---|---|---|---|"]
    for nodes, per_node in shapes:
        for r in rows(psi, flat_numels, nodes, per_node, dtype):
            units = " / ".join(human(r[q]) for q in QUANTITIES)
            formula = "; ".join(r["formula"]) if "formula" in r else "padded FlatParams, exact"
            lines.append(f"| {nodes} x {per_node} | {scheme_name(r['scheme'], per_node)} | {r['counted']} | "
                         + " | ".join(f"{r[q]:,.0f}" for q in QUANTITIES) + f" | {units} | {formula} |")
    return "\n".join(lines)


def main(what: str, psi: int, flat_numels: list[int] | None, nodes: list[int], per_node: list[int],
         dtype: str) -> None:
    """Print the table: with a model's FlatParam sizes (paper and layout rows) or for a bare Ψ (paper rows).
    memory_table's --nodes view builds the model and calls this."""
    shapes = list(zip(nodes, per_node))
    print(f"{what} dtype={dtype}; ZeRO-3, hpZ and HSDP on nodes x ranks per node (hpZ's k and HSDP's S = the "
          f"ranks of one node), per optimizer step, every parameter gathered at each use\n")
    print(format_table(psi, flat_numels, shapes, dtype))
    print("\nN ranks, k = S = L ranks per node, R = N/L nodes. wire: what one rank sends on the step's rings "
          "(layout rows: the gradient norm's all-reduce included); link: what the link from one node to the next "
          "carries (every inter-node byte of a ring crosses one). hpZ's forward all-gathers over all N (its first "
          "step's forward reads the secondary shard, which initialisation cut); backward gathers in the node.")
