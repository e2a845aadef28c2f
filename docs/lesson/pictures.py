"""The lesson's slides, drawn from the project's own code (`lesson_numbers.py --img` runs this).

Every slide is 1600 px wide with no text under 11 px, for a projector, and is named by its
place in the class (docs/lesson/slides/README.md gives each its speaker note):

01 zero_figure1        the ZeRO paper's Figure 1 (memory_table.plot_figure1)
02 memory_tutorial     the class's model: bytes per rank per stage at N = 2, 8, 64 (memory_table.compute)
03 partition_strips    which rank holds which slice at each stage, N = 4, tiny GPT: the FlatParams
                       the stages build (memory_table.layout) cut by partition.shard_range
04 collectives         reduce-scatter, all-gather and all-reduce on 4 ranks, chunk by chunk
05-07 timeline_zero1..3  the lesson's stage-1, -2 and -3 runs (minizero.observe.timeline.plot)
08 wire_bytes          bytes per rank per step, payload and wire, N = 2, 4, 64, tiny GPT
09 timeline_overlap_on part 3's run with DeepSpeed's overlap, prefetch and reuse knobs
10 timeline_two_nodes_hpz  part 11's hpZ run on 2 pretended nodes of 2 ranks: rows by node,
                       the collectives a rank sent across outlined

docs/img/ keeps copies of 01 and 07 under their old names (zero_figure1.png,
timeline_zero3.png), where docs/zero.md and the README show them.
"""
from __future__ import annotations

import json
import os
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minizero.observe.memory_table import compute, layout, meta_model, plot_figure1  # noqa: E402
from minizero.observe.timeline import DPI, WIDTH_PX, merge, plot  # noqa: E402
from minizero.partition import padded_numel, shard_range  # noqa: E402

N = 4
HERE = os.path.dirname(os.path.abspath(__file__))
COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868"}
RANK_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
TEXT_PT = 11   # 18 px at 120 dpi


def lesson_buckets() -> int:
    with open(os.path.join(HERE, "stages.json")) as f:
        return json.load(f)["zero_optimization"]["reduce_bucket_size"]


def strip_title(stage: int) -> str:
    """The partition strips' title for one stage: at stage 0 nothing is cut."""
    return ["stage 0: every rank holds everything (grey boxes: the buckets, nothing cut)",
            "ZeRO-1: optimizer states partitioned (rank r holds slice r of every bucket)",
            "ZeRO-2: + gradients (rank r holds slice r of every bucket)",
            "ZeRO-3: + parameters (grey boxes: each unit; rank r holds slice r of every one)"][stage]


def partition_strips(path: str) -> None:
    """One panel per stage; per rank three bands (parameters, gradients, optimizer states)
    across the model's flat layout (x: element offset). Filled where the rank holds it."""
    model, groups = meta_model("tiny")
    fig, axes = plt.subplots(4, 1, figsize=(WIDTH_PX / DPI, 11), sharex=True)
    for stage, ax in enumerate(axes):
        plans = layout(model, groups, stage, reduce_bucket_size=lesson_buckets())
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
        ax.set_title(strip_title(stage), fontsize=TEXT_PT + 1)
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


def memory_tutorial(path: str) -> None:
    """The tutorial model's model states per rank (bf16 mixed precision, Adam), stacked by
    category, for each stage at N = 2, 8 and 64: from memory_table.compute, the layout the
    engine builds, without starting a process."""
    worlds = (2, 8, 64)
    table = compute("tutorial", worlds, "bf16")
    parts = [("parameters (bf16)", ("params",), COLOURS["parameters"]),
             ("gradients (bf16)", ("grads",), COLOURS["gradients"]),
             ("fp32 master + Adam's two moments", ("master_params", "optimizer_states"), COLOURS["optimizer states"])]
    fig, axes = plt.subplots(1, len(worlds), figsize=(WIDTH_PX / DPI, 6.4), sharey=True)
    for ax, n in zip(axes, worlds):
        bottom = [0.0] * 4
        for label, keys, colour in parts:
            mb = [sum(table[n][s][0][k] for k in keys) / 1e6 for s in range(4)]
            ax.bar([f"stage {s}" for s in range(4)], mb, bottom=bottom, color=colour, label=label)
            bottom = [b + m for b, m in zip(bottom, mb)]
        for i, t in enumerate(bottom):
            ax.text(i, t + 2, f"{t:.1f}", ha="center", fontsize=TEXT_PT + 1)
        ax.set_title(f"N = {n} ranks", fontsize=TEXT_PT + 3)
        ax.tick_params(labelsize=TEXT_PT + 1)
    axes[0].set_ylabel("model states per rank (MB = 1e6 bytes)", fontsize=TEXT_PT + 1)
    psi = table[2][0][1]
    fig.suptitle(f"The class's model (minGPT image GPT, Ψ = {psi:,} parameters, bf16, Adam): bytes per rank",
                 fontsize=TEXT_PT + 4)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=TEXT_PT + 1, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def wire_bytes(path: str) -> None:
    """Bytes per rank per step, payload (the buffers handed to collectives) and wire (what a
    rank sends on a ring), for each stage at N = 2, 4 and 64: the tiny GPT in fp32 with the
    lesson's buckets, from the layout the stages build (as lesson_numbers.volume_numbers)."""
    model, groups = meta_model("tiny")
    worlds, bucket = (2, 4, 64), lesson_buckets()
    colours = {2: "#9ecae1", 4: "#4292c6", 64: "#08519c"}
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH_PX / DPI, 6.4), sharey=True)
    for ax, kind in zip(axes, ("payload", "wire")):
        for j, n in enumerate(worlds):
            z0 = sum(padded_numel(p.numel, 1) for p in layout(model, groups, 0, bucket)) * 4
            z1 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 1, bucket)) * 4
            z3 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 3)) * 4
            f = (n - 1) / n
            values = {"payload": [z0, 2 * z1, 2 * z1, 3 * z3], "wire": [2 * f * z0, 2 * f * z1, 2 * f * z1, 3 * f * z3]}
            xs = [s + (j - 1) * 0.27 for s in range(4)]
            bars = ax.bar(xs, [b / 1e3 for b in values[kind]], width=0.26, color=colours[n], label=f"N = {n}")
            for x, b in zip(xs, values[kind]):
                ax.text(x, b / 1e3 + 15, f"{b / z0:.2f}", ha="center", fontsize=TEXT_PT - 1, rotation=90)
            del bars
        ax.set_xticks(range(4), ["stage 0\nall-reduce", "stage 1\nRS + AG", "stage 2\nRS + AG",
                                 "stage 3\nRS + 2 AG"], fontsize=TEXT_PT + 1)
        ax.set_title({"payload": "payload: the buffers handed to the collectives",
                      "wire": "wire: what one rank sends on a ring"}[kind], fontsize=TEXT_PT + 2)
        ax.tick_params(axis="y", labelsize=TEXT_PT + 1)
        ax.set_ylim(0, 1500)
    axes[0].set_ylabel("kB (1e3 bytes) per rank per step", fontsize=TEXT_PT + 1)
    axes[1].legend(fontsize=TEXT_PT + 1, loc="upper left")
    fig.suptitle("Bytes per step, tiny GPT (fp32), numbers on the bars: multiples of the model's bytes",
                 fontsize=TEXT_PT + 3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


SLIDES = ("01-zero_figure1.png", "02-memory_tutorial.png", "03-partition_strips.png", "04-collectives.png",
          "05-timeline_zero1.png", "06-timeline_zero2.png", "07-timeline_zero3.png", "08-wire_bytes.png",
          "09-timeline_overlap_on.png", "10-timeline_two_nodes_hpz.png")


def draw_all(runs: str, slides: str, img: str) -> list[str]:
    """Every slide, from the lesson's runs in `runs` (its trace-* folders), into `slides`;
    and docs/img/'s two copies."""
    os.makedirs(slides, exist_ok=True)
    paths = {name: os.path.join(slides, name) for name in SLIDES}
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):   # plot_figure1 says "wrote"; we say it once, below
        plot_figure1(paths["01-zero_figure1.png"])
    memory_tutorial(paths["02-memory_tutorial.png"])
    partition_strips(paths["03-partition_strips.png"])
    collectives(paths["04-collectives.png"])
    for s in (1, 2, 3):
        plot(merge(os.path.join(runs, f"trace-z{s}")), paths[f"0{4 + s}-timeline_zero{s}.png"])
    wire_bytes(paths["08-wire_bytes.png"])
    plot(merge(os.path.join(runs, "trace-overlap-on")), paths["09-timeline_overlap_on.png"])
    plot(merge(os.path.join(runs, "trace-nodes-hpz")), paths["10-timeline_two_nodes_hpz.png"])
    copies = [(paths["01-zero_figure1.png"], os.path.join(img, "zero_figure1.png")),
              (paths["07-timeline_zero3.png"], os.path.join(img, "timeline_zero3.png"))]
    for src, dst in copies:
        shutil.copyfile(src, dst)
    return list(paths.values()) + [dst for _, dst in copies]
