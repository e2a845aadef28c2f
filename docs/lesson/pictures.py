"""The lesson's slides, drawn from the project's own code (`lesson_numbers.py --img` runs this).

- partition_strips.png: which rank holds which slice of parameters, gradients and optimizer
  states at each stage, N = 4, for the tiny GPT: the FlatParams the stages build
  (memory_table.layout) cut by partition.shard_range, exactly as the engine cuts them.
- collectives.png: reduce-scatter, all-gather and all-reduce on 4 ranks, chunk by chunk.
- timeline_zero2.png, timeline_zero3.png: the lesson's stage-2 and stage-3 runs
  (minizero.observe.timeline.plot); the README shows the stage-3 one.

All are 1600 px wide with no text under 11 px, for a projector.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minizero.observe.memory_table import layout, meta_model  # noqa: E402
from minizero.observe.timeline import DPI, WIDTH_PX, merge, plot  # noqa: E402
from minizero.partition import padded_numel, shard_range  # noqa: E402

N = 4
COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868"}
RANK_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
TEXT_PT = 11   # 18 px at 120 dpi


def partition_strips(path: str) -> None:
    """One panel per stage; per rank three bands (parameters, gradients, optimizer states)
    across the model's flat layout (x: element offset). Filled where the rank holds it."""
    model, groups = meta_model("tiny")
    fig, axes = plt.subplots(4, 1, figsize=(WIDTH_PX / DPI, 11), sharex=True)
    for stage, ax in enumerate(axes):
        plans = layout(model, groups, stage, reduce_bucket_size=20_000)
        # which categories are partitioned at this stage (ZeRO paper: P_os, P_os+g, P_os+g+p)
        sharded = {"optimizer states": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
        for rank in range(N):
            for band, (what, colour) in enumerate(COLOURS.items()):
                y = (N - 1 - rank) * 4 + (2 - band)
                start = 0
                for plan in plans:
                    size = padded_numel(plan.numel, N)
                    lo, hi = shard_range(plan.numel, N, rank) if sharded[what] else (0, size)
                    ax.broken_barh([(start + lo, hi - lo)], (y, 0.85), color=colour)
                    ax.broken_barh([(start, size)], (y, 0.85), facecolor="none", edgecolor="#999999", linewidth=0.5)
                    start += size
        ax.set_yticks([(N - 1 - r) * 4 + 1.4 for r in range(N)], [f"rank {r}" for r in range(N)], fontsize=TEXT_PT)
        name = ["stage 0: everything on every rank", "ZeRO-1: optimizer states partitioned",
                "ZeRO-2: + gradients", "ZeRO-3: + parameters"][stage]
        unit = "unit" if stage == 3 else "bucket"
        ax.set_title(f"{name} (grey boxes: each {unit}; rank r holds slice r of every one)", fontsize=TEXT_PT + 1)
        ax.tick_params(axis="x", labelsize=TEXT_PT)
    axes[-1].set_xlabel("position in the flat parameter layout (elements, tiny GPT, N = 4)", fontsize=TEXT_PT)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, [f"{w} (band {i + 1} of each rank, top to bottom)" for i, w in enumerate(COLOURS)],
               loc="lower center", ncol=3, fontsize=TEXT_PT, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def collectives(path: str) -> None:
    """Each rank's buffer as N chunks, before and after each collective. A chunk's colour is
    the rank whose data it holds; a chunk holding the sum over ranks is black, "Σ"."""
    ops = [("reduce-scatter", "each rank sends (N-1)/N of its buffer", "full", "sum_own"),
           ("all-gather", "each rank sends (N-1)/N of the buffer", "own", "gathered"),
           ("all-reduce = reduce-scatter + all-gather", "2(N-1)/N of the buffer", "full", "sum_all")]
    fig, axes = plt.subplots(1, 3, figsize=(WIDTH_PX / DPI, 5.2))
    for ax, (title, cost, before, after) in zip(axes, ops):
        for col, state in enumerate((before, after)):
            for rank in range(N):
                for chunk in range(N):
                    x, y = col * (N + 1.5) + chunk, N - 1 - rank
                    if state == "full":
                        face, text = RANK_COLOURS[rank], f"g{rank}"
                    elif state == "own":
                        face, text = (RANK_COLOURS[rank], f"p{rank}") if chunk == rank else ("white", "")
                    elif state == "gathered":
                        face, text = RANK_COLOURS[chunk], f"p{chunk}"
                    elif state == "sum_own":
                        face, text = ("black", "Σ") if chunk == rank else ("white", "")
                    else:
                        face, text = "black", "Σ"
                    ax.add_patch(plt.Rectangle((x, y), 0.92, 0.8, facecolor=face, edgecolor="#555555"))
                    ax.text(x + 0.46, y + 0.4, text, ha="center", va="center", color="white", fontsize=TEXT_PT)
            ax.text(col * (N + 1.5) + N / 2, N + 0.2, ["before", "after"][col], ha="center", fontsize=TEXT_PT)
        ax.annotate("", xy=(N + 1.4, N / 2), xytext=(N + 0.1, N / 2), arrowprops=dict(arrowstyle="->", lw=2))
        for rank in range(N):
            ax.text(-0.2, N - 1 - rank + 0.4, f"rank {rank}", ha="right", va="center", fontsize=TEXT_PT)
        ax.set_xlim(-2.2, 2 * N + 1.6)
        ax.set_ylim(-1.2, N + 0.8)
        ax.set_title(title, fontsize=TEXT_PT + 1)
        ax.text(N + 0.75, -0.8, f"wire per rank: {cost}", ha="center", fontsize=TEXT_PT)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def draw_all(runs: str, img: str) -> list[str]:
    os.makedirs(img, exist_ok=True)
    paths = [os.path.join(img, name) for name in ("partition_strips.png", "collectives.png",
                                                  "timeline_zero2.png", "timeline_zero3.png")]
    partition_strips(paths[0])
    collectives(paths[1])
    plot(merge(os.path.join(runs, "trace-z2")), paths[2])
    plot(merge(os.path.join(runs, "trace-z3")), paths[3])   # the README's picture
    return paths
