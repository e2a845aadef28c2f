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


def rows(doc: dict, step: int) -> list[tuple[str, str, int, int, int]]:
    """(op, label, calls, payload bytes, wire bytes) per (op, label) of one traced step, in
    the order of each label's first call."""
    table: dict[tuple[str, str], list[int]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("collectives", "copies") or e["args"].get("step") != step:
            continue
        a = e["args"]
        row = table.setdefault((a["op"], a.get("label") or "-"), [0, 0, 0])
        row[0] += 1
        row[1] += a.get("bytes", 0)
        row[2] += a.get("wire_bytes", a.get("bytes", 0))
    return [(op, label, *v) for (op, label), v in table.items()]


def format_table(doc: dict, source: str = "") -> str:
    """The table of every traced step in `doc` (rank0.json's document): each op's rows in the
    order of their first call, then the op's total, the ops in the order of their first call."""
    other = doc.get("otherData", {})
    out = []
    for step, ledger in sorted(other.get("ledger", {}).items(), key=lambda kv: int(kv[0])):
        step = int(step)
        body = rows(doc, step)
        out.append(f"collectives of step {step} on rank 0 of {other.get('world_size', '?')}, stage "
                   f"{other.get('stage', '?')}{' (' + source + ')' if source else ''}:")
        out.append(f"  {'op':<16}{'label':<24}{'calls':>6}{'payload bytes':>16}{'wire bytes':>14}")
        ops = list(dict.fromkeys([r[0] for r in body] + [op for op in OPS if (ledger.get(op) or {}).get("calls")]))
        mismatch = []
        for op in ops:
            mine = [r for r in body if r[0] == op]
            for _, label, calls, payload, wire in mine:
                out.append(f"  {op:<16}{label:<24}{calls:>6}{payload:>16,}{wire:>14,}")
            total = ledger.get(op) or {"calls": 0, "bytes": 0, "wire_bytes": 0}
            out.append(f"  {op:<16}{'(total)':<24}{total['calls']:>6}{total['bytes']:>16,}{total['wire_bytes']:>14,}")
            if (sum(r[2] for r in mine), sum(r[3] for r in mine)) != (total["calls"], total["bytes"]):
                mismatch.append(op)
        if mismatch:
            out.append(f"  (the events of {', '.join(mismatch)} do not add up to the ledger's total: "
                       f"the trace missed some)")
    return "\n".join(out)


def print_table(folder: str) -> None:
    """Print the table of the trace in `folder` (rank 0's file)."""
    print(format_table(read(folder), source=os.path.join(folder, "rank0.json")), flush=True)


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
