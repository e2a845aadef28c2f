"""A traced step's collectives as a table: op, label, calls, payload bytes, wire bytes.

    python -m minizero.observe.ledger_table runs/trace-z3       # any trace folder (rank0.json)

A run with --trace prints it itself, on rank 0, once the trace is written (train.py), so a
class sees where each number of a stage's traffic comes from without opening a JSON file.
It reads the trace's own files: one row per (op, label) from rank 0's collective and copy
events, then one total per op. The totals are `otherData.ledger`, the ledger's count over
the step (comm.py), which the events sum to exactly (tests/tools/test_trace.py); a table
whose rows did not add up to it would say so under the table.

Payload bytes are the buffer handed to the collective; wire bytes are what this rank sends
on a ring: (N-1)/N of the buffer for a reduce-scatter or an all-gather, 2(N-1)/N for an
all-reduce (comm.py says why these two counts differ).

On more than one node (the trace's `ranks_per_node` below its world size: torchrun's
--nnodes, or MINIZERO_RANKS_PER_NODE=k to rehearse k ranks per node on one machine) each row
also gives its inter-node bytes: the wire bytes this rank sent to another node. On a ring a
rank sends everything to the next rank of the collective's group, so a row's bytes cross
between nodes all or not at all (comm.py); rank 0 sends to rank 1, on its own node, and it is
each node's last rank that sends across on a ring over all ranks. So under the table, from
every rank's file (rank<r>.json, each rank's own ledger), what each node sent to the next one
in the step: the bytes on each link between nodes, the number a slow network multiplies.
"""
from __future__ import annotations

import json
import os
import sys

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "d2h", "h2d")


def read(folder: str, rank: int = 0) -> dict:
    """The trace document of one rank: `<folder>/rank<rank>.json`."""
    with open(os.path.join(folder, f"rank{rank}.json")) as f:
        return json.load(f)


def rows(doc: dict, step: int) -> list[tuple[str, str, int, int, int, int]]:
    """(op, label, calls, payload bytes, wire bytes, inter-node bytes) per (op, label) of one
    traced step, in the order of each label's first call."""
    table: dict[tuple[str, str], list[int]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("collectives", "copies") or e["args"].get("step") != step:
            continue
        a = e["args"]
        row = table.setdefault((a["op"], a.get("label") or "-"), [0, 0, 0, 0])
        row[0] += 1
        row[1] += a.get("bytes", 0)
        row[2] += a.get("wire_bytes", a.get("bytes", 0))
        row[3] += a.get("inter_node_bytes", 0)
    return [(op, label, *v) for (op, label), v in table.items()]


def nodes_of(doc: dict) -> tuple[int, int]:
    """(nodes, ranks per node) of the traced run; one node when the trace does not say."""
    other = doc.get("otherData", {})
    world = int(other.get("world_size", 1))
    per_node = int(other.get("ranks_per_node") or world)
    return world // per_node, per_node


def format_table(doc: dict, source: str = "") -> str:
    """The table of every traced step in `doc` (rank0.json's document): each op's rows in the
    order of their first call, then the op's total, the ops in the order of their first call."""
    other = doc.get("otherData", {})
    nodes, per_node = nodes_of(doc)
    split = nodes > 1
    out = []
    for step, ledger in sorted(other.get("ledger", {}).items(), key=lambda kv: int(kv[0])):
        step = int(step)
        body = rows(doc, step)
        where = f" ({nodes} nodes of {per_node} ranks)" if split else ""
        out.append(f"collectives of step {step} on rank 0 of {other.get('world_size', '?')}{where}, stage "
                   f"{other.get('stage', '?')}{' (' + source + ')' if source else ''}:")
        width = max([24] + [len(r[1]) + 2 for r in body])   # HSDP's "<unit>.grads.replicas" is longer
        out.append(f"  {'op':<16}{'label':<{width}}{'calls':>6}{'payload bytes':>16}{'wire bytes':>14}"
                   + (f"{'inter-node':>14}" if split else ""))
        ops = list(dict.fromkeys([r[0] for r in body] + [op for op in OPS if (ledger.get(op) or {}).get("calls")]))
        mismatch = []
        for op in ops:
            mine = [r for r in body if r[0] == op]
            for _, label, calls, payload, wire, inter in mine:
                out.append(f"  {op:<16}{label:<{width}}{calls:>6}{payload:>16,}{wire:>14,}" + (f"{inter:>14,}" if split else ""))
            total = ledger.get(op) or {"calls": 0, "bytes": 0, "wire_bytes": 0}
            out.append(f"  {op:<16}{'(total)':<{width}}{total['calls']:>6}{total['bytes']:>16,}{total['wire_bytes']:>14,}"
                       + (f"{total.get('inter_node_bytes', 0):>14,}" if split else ""))
            if (sum(r[2] for r in mine), sum(r[3] for r in mine)) != (total["calls"], total["bytes"]):
                mismatch.append(op)
        if mismatch:
            out.append(f"  (the events of {', '.join(mismatch)} do not add up to the ledger's total: "
                       f"the trace missed some)")
    return "\n".join(out)


def link_bytes(docs: list[dict], step: int) -> list[int] | None:
    """Per node, the inter-node bytes its ranks sent in `step` (every rank's document, rank
    order; each rank's own ledger): what the link from that node to the next carried. None
    when a rank's document lacks the step."""
    nodes, per_node = nodes_of(docs[0])
    sent = [0] * nodes
    for rank, doc in enumerate(docs):
        ledger = doc.get("otherData", {}).get("ledger", {}).get(str(step))
        if ledger is None:
            return None
        sent[rank // per_node] += sum(v.get("inter_node_bytes", 0) for v in ledger.values())
    return sent


def format_links(folder: str, doc: dict) -> str:
    """Under the table of a run on several nodes: what each node sent to the next, per traced
    step, from every rank's file in `folder`; "" on one node, or when a rank's file is not
    there (nodes without a shared file system each keep their own)."""
    nodes, per_node = nodes_of(doc)
    world = int(doc.get("otherData", {}).get("world_size", 1))
    if nodes < 2:
        return ""
    docs = []
    for rank in range(world):
        try:
            docs.append(read(folder, rank))
        except (OSError, ValueError):
            return f"  (bytes between nodes: rank{rank}.json is not in {folder}; each node's ranks wrote their own)"
    out = []
    for step in sorted(int(s) for s in doc.get("otherData", {}).get("ledger", {})):
        sent = link_bytes(docs, step)
        if sent is None:
            continue
        links = ", ".join(f"node {a} -> {(a + 1) % nodes}: {b:,}" for a, b in enumerate(sent))
        out.append(f"  bytes each node sent to the next in step {step} (every rank's ledger): {links}")
    return "\n".join(out)


def print_table(folder: str) -> None:
    """Print the table of the trace in `folder` (rank 0's file), and on several nodes what
    crossed each link between them (every rank's file)."""
    doc = read(folder)
    links = format_links(folder, doc)
    print(format_table(doc, source=os.path.join(folder, "rank0.json")) + ("\n" + links if links else ""), flush=True)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minizero.observe.ledger_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a trace folder (python -m minizero.train ... --trace DIR)")
    args = ap.parse_args(argv)
    try:
        print_table(args.folder)
    except (OSError, ValueError, KeyError) as e:
        print(f"{ap.prog}: error: {args.folder} holds no readable rank0.json ({e}); write one with "
              f"python -m minizero.train ... --trace {args.folder}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
