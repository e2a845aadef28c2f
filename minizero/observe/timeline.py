"""Draw a traced step (trace.py) as one picture: ranks as rows, time left to right.

For slides and for readers who will not open Perfetto. Each rank's row has, from top to
bottom: the units (each block's forward, backward, recompute), and the collectives, one
colour per kind, their waiting part hatched; behind both, the step's phases shaded
(forward, backward, optimizer step). Only the first traced step is drawn: one step is
what a class looks at (trace.json has them all). On several nodes (the trace's ranks_per_node
below its world size) each row names its node, a line separates the nodes, and a collective
whose bytes this rank sent to another node has a black outline.

    python -m minizero.timeline DIR     # merge DIR/rank*.json into DIR/trace.json, draw DIR/timeline.png
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

OP_COLOURS = {"all_gather": "#1f77b4", "reduce_scatter": "#d62728", "all_reduce": "#9467bd",
              "broadcast": "#8c564b", "d2h": "#7f7f7f", "h2d": "#bcbd22"}
PHASE_COLOURS = {"forward": "#cfe3f5", "backward": "#fbe0c8", "step": "#d8f0d2"}
UNIT_COLOURS = {"forward": "#6baed6", "backward": "#fd8d3c", "recompute": "#74c476"}


def has_matplotlib() -> bool:
    """The picture needs matplotlib (installed with .[dev]); the trace files do not."""
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


# Sized for a projector: 1600 px wide, and no text under 11 px (a point is DPI/72 px).
WIDTH_PX, DPI = 1600, 120
TEXT_PT = 8.0              # 13 px: unit and collective labels inside the bars
AXIS_PT = 10.0             # 17 px: ticks, axis label, legend


def short_label(label: str) -> str:
    """A collective's label without its purpose: which unit or bucket it moved
    ('blocks.0.g0.bwd' -> 'blocks.0', 'group1.bucket3.grads' -> 'g1 bucket3'; a unit's two
    param groups are one unit on the picture, a bucket belongs to one group)."""
    m = re.fullmatch(r"group(\d+)\.(bucket\d+)\..*", label)
    if m:
        return f"g{m.group(1)} {m.group(2)}"
    parts = [p for p in label.split(".") if not re.fullmatch(r"g\d+|fwd|bwd|grads|params|prefetch|recompute", p)]
    return ".".join(parts) or label


class Bars:
    """The bars of one layer of one rank's row, drawn as one collection (`draw`), each bar with
    its own face and edge colour and edge width."""

    def __init__(self):
        self.spans, self.faces, self.edges, self.widths = [], [], [], []

    def add(self, x: float, w: float, face: str, edge: str, width: float | None = None) -> None:
        self.spans.append((x, w))
        self.faces.append(face)
        self.edges.append(edge)
        self.widths.append(width)

    def draw(self, ax, yrange: tuple, linewidth: float | None = None, **style) -> None:
        if self.spans:
            widths = [linewidth if w is None else w for w in self.widths]
            ax.broken_barh(self.spans, yrange, facecolors=self.faces, edgecolors=self.edges,
                           **({} if None in widths else {"linewidths": widths}), **style)


def plot(doc: dict, path: str) -> str:
    """Draw the first traced step of a (merged) Chrome-trace document to `path` (PNG), with
    each unit's forward/backward and each collective labelled by the unit or bucket it moved."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    step = min(e["args"]["step"] for e in events)
    events = [e for e in events if e["args"].get("step") == step]
    ranks = sorted({e["pid"] for e in events})
    t0 = min(e["ts"] for e in events)
    ms = lambda us: (us - t0) / 1e3
    span_ms = ms(max(e["ts"] + e["dur"] for e in events))
    info = doc.get("otherData", {})
    per_node = int(info.get("ranks_per_node") or len(ranks))
    nodes = len({r // per_node for r in ranks})
    fig, ax = plt.subplots(figsize=(WIDTH_PX / DPI, 2.2 + 1.5 * len(ranks)))
    labels = []   # (text, start, end of its bar in ms): kept only where the text fits inside its bar
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row          # rank 0 on top
        # One broken_barh (one collection) per row and layer, not one per bar: a traced step has
        # thousands of bars, and each call costs matplotlib a collection and an autoscale.
        # Within a layer the bars keep the trace's order (later on top), each its own colours.
        phases, roots, units, moves = Bars(), Bars(), Bars(), Bars()
        waits = {}                        # per op: a collection's hatch has one colour
        for e in (e for e in events if e["pid"] == r):
            x, w = ms(e["ts"]), e["dur"] / 1e3
            if e["cat"] == "step" and e["name"] in PHASE_COLOURS:
                phases.add(x, w, PHASE_COLOURS[e["name"]], PHASE_COLOURS[e["name"]])
            elif e["cat"] == "units":   # the root unit encloses the blocks: drawn paler, behind them
                root = e["args"]["unit"] == "root"
                (roots if root else units).add(x, w, UNIT_COLOURS[e["args"]["phase"]], "white")
                if not root and w > span_ms / 60:
                    labels.append((ax.text(x + w / 2, y + 0.7, e["args"]["unit"], ha="center", va="center",
                                           fontsize=TEXT_PT, zorder=5), x, x + w))
            elif e["cat"] in ("collectives", "copies"):
                across = nodes > 1 and e["args"].get("inter_node_bytes", 0) > 0
                moves.add(x, w, OP_COLOURS[e["args"]["op"]], "black" if across else "none", 1.6 if across else 0)
                if e["cat"] == "collectives" and e["args"].get("label") and w > span_ms / 25:
                    labels.append((ax.text(x + w / 2, y + 0.26, short_label(e["args"]["label"]), ha="center",
                                           va="center", fontsize=TEXT_PT, color="white", zorder=6), x, x + w))
            elif e["cat"] == "wait":
                waits.setdefault(e["args"]["op"], Bars()).add(x, w, "white", OP_COLOURS[e["args"]["op"]])
        phases.draw(ax, (y, 0.95), zorder=0)
        roots.draw(ax, (y + 0.5, 0.4), alpha=0.35, linewidth=0.6, zorder=1)
        units.draw(ax, (y + 0.5, 0.4), linewidth=0.6, zorder=2)
        moves.draw(ax, (y + 0.08, 0.36), zorder=3)
        for op, bars in waits.items():
            bars.draw(ax, (y + 0.08, 0.36), alpha=0.55, hatch="////", linewidth=0, zorder=4)
    names = [f"rank {r}" + (f"\nnode {r // per_node}" if nodes > 1 else "") for r in ranks]
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))], names)
    if nodes > 1:   # a line where one node's rows end and the next one's begin
        for i in range(1, len(ranks)):
            if ranks[i] // per_node != ranks[i - 1] // per_node:
                ax.axhline(len(ranks) - i, color="black", linewidth=1.5, zorder=7)
    ax.tick_params(labelsize=AXIS_PT)
    ax.set_ylim(0, len(ranks))
    ax.set_xlabel("time in the step (ms)", fontsize=AXIS_PT)
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(info.get("dtype"), "")
    on = f" on {nodes} nodes" if nodes > 1 else ""
    ax.set_title(f"minizero, ZeRO stage {info.get('stage', '?')}, {dtype}, "
                 f"{len(ranks)} rank{'s' * (len(ranks) > 1)}{on}: optimizer step {step}", fontsize=AXIS_PT + 2)
    ops = sorted({e["args"]["op"] for e in events if e["cat"] in ("collectives", "copies")},
                 key=list(OP_COLOURS).index)
    handles = ([Patch(color=PHASE_COLOURS[p], label=f"phase: {p}") for p in PHASE_COLOURS]
               + [Patch(color=UNIT_COLOURS[u], label=f"unit {u}") for u in UNIT_COLOURS
                  if any(e["cat"] == "units" and e["args"]["phase"] == u for e in events)]
               + [Patch(color=OP_COLOURS[o], label=o) for o in ops]
               + [Patch(facecolor="white", edgecolor="black", hatch="////", label="waiting for other ranks")]
               + ([Patch(facecolor="white", edgecolor="black", linewidth=1.6, label="sent to another node")]
                  if nodes > 1 else []))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2 - 0.1 / len(ranks)),
              ncol=min(len(handles), 5), fontsize=AXIS_PT, frameon=False)
    fig.tight_layout()
    drop_labels_that_do_not_fit(fig, ax, labels)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def drop_labels_that_do_not_fit(fig, ax, labels) -> None:
    """Remove each label whose drawn width exceeds its bar's (a short all-reduce's
    "grad_norm" would spill over its neighbours), or that would overprint a label already
    kept (asynchronous collectives overlap in time): measured after layout, in pixels."""
    renderer = fig.canvas.get_renderer()
    kept = []
    for text, start, end in labels:
        (left, _), (right, _) = ax.transData.transform([(start, 0), (end, 0)])
        box = text.get_window_extent(renderer)
        if box.width > (right - left) - 2 or any(box.overlaps(other) for other in kept):
            text.remove()
        else:
            kept.append(box)


def merge(folder: str) -> dict:
    """The rank*.json files of a trace folder as one document (all ranks on one timeline, each
    rank's memory samples under "memoryTrack")."""
    files = sorted(glob.glob(os.path.join(folder, "rank*.json")),
                   key=lambda p: int(re.search(r"rank(\d+)\.json$", p).group(1)))
    if not files:
        raise FileNotFoundError(f"{folder} has no rank*.json files (write them with "
                                f"python -m minizero.train ... --trace {folder})")
    docs = []
    for p in files:
        try:
            with open(p) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: not a readable trace ({e})") from None
    out = {"traceEvents": [e for d in docs for e in d["traceEvents"]], "displayTimeUnit": "ms",
           "otherData": dict(docs[0].get("otherData", {}), ranks=len(docs)),
           "memoryTrack": {r: samples for d in docs for r, samples in d.get("memoryTrack", {}).items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minizero.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a trace folder holding rank0.json, rank1.json, ...")
    args = ap.parse_args(argv)
    try:
        doc = merge(args.folder)
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m minizero.timeline: error: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(args.folder, "trace.json"), "w") as f:
        json.dump(doc, f)
    if not has_matplotlib():
        print(f"python -m minizero.timeline: wrote {os.path.join(args.folder, 'trace.json')}; timeline.png needs "
              f"matplotlib: pip install -e .[dev]", file=sys.stderr)
        return 2
    print(plot(doc, os.path.join(args.folder, "timeline.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
