"""How a comparison's results are shown: the table (a column per library), the model states
at the same moments per library, and the two pictures (loss curves, model states by
category). The numbers come from compare.py's runs; nothing here runs a library."""
from __future__ import annotations

from minizero.compare.compare_memory import (CATEGORIES, LIBS, MOMENT_TITLES, MOMENTS, PLACES, category_bytes,
                                             moment_entries, moments_step, offloaded)

SHORT = {"minizero": "mz", "deepspeed": "DS", "torch": "PT"}   # the table's column suffixes


def fmt(x, kind="g") -> str:
    if x is None:
        return "-"
    return {"loss": "{:.6f}", "bytes": "{:,.0f}", "d": "{:.2e}", "g": "{:.3g}"}[kind].format(x)


# (column title, key in each library's part of a row, format); one column per library
PER_LIB = [("final loss", "final_loss", "loss"), ("state B r0", "state_bytes_rank0", "bytes"),
           ("state B max", "state_bytes_max", "bytes"), ("peak MB", "peak_mem_mb", "bytes"),
           ("samples/s", "samples_per_s", "g"), ("wire B/step", "wire_bytes_per_step", "bytes")]


# with --hpz / --hsdp (pretended nodes), after "wire B/step": what crossed from node 0 to node 1
LINK = [("link B/step", "link_bytes_per_step", "bytes")]

# with ZeRO-Offload, after "state B r0": where rank 0's model states live
PLACED = [("device B r0", "device_bytes_rank0", "bytes"), ("host B r0", "host_bytes_rank0", "bytes")]
NVME = [("NVMe B r0", "nvme_bytes_rank0", "bytes")]


def table(rows) -> str:
    """The markdown table, one row per stage, a column per library for each number. Device /
    host columns appear when a run offloads (some library holds model states in host memory)."""
    libs = rows[0].get("libs", list(LIBS))
    first, others = SHORT[libs[0]], libs[1:]
    placed = any(r[lib]["host_bytes_rank0"] or r[lib].get("nvme_bytes_rank0")
                 for r in rows for lib in libs if "host_bytes_rank0" in r[lib])
    # "device": "nvme" (minizero/offload/nvme.py): a third place, the states in swap files
    nvme = any(r[lib].get("nvme_bytes_rank0") for r in rows for lib in libs)
    nodes = any(r[lib].get("link_bytes_per_step") is not None for r in rows for lib in libs)
    columns = PER_LIB[:2] + (PLACED if placed else []) + (NVME if nvme else []) + PER_LIB[2:] + (LINK if nodes else [])
    dloss = ["max abs dloss/step"] if len(others) == 1 else [f"max abs dloss/step {first}-{SHORT[o]}" for o in others]
    speed_at = 1 + len(dloss) + len(libs) * (columns.index(PER_LIB[4]) + 1)   # after the samples/s group
    head = ["stage"] + dloss + [f"{t} {SHORT[lib]}" for t, _, _ in columns for lib in libs]
    head[speed_at:speed_at] = [f"{first}/{SHORT[o]} speed" for o in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["stage"])] + [fmt(r.get("dloss", {}).get(o, r["max_abs_dloss"]), "d") for o in others]
        cells += [fmt(r[lib].get(key), kind) for _, key, kind in columns for lib in libs]
        cells[speed_at:speed_at] = [fmt(r.get("speed", {}).get(o, r["speed_ratio"])) for o in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


NAMES = {"minizero": "minizero", "deepspeed": "DeepSpeed", "torch": "PyTorch (DDP / FSDP2)"}


def moments_by_lib(results, libs) -> list:
    """Rank 0's model states at the two moments, one column per library (no byte naming: that
    is moments_section's, minizero against DeepSpeed)."""
    stages = sorted(results)
    if not all(moment_entries(results[s][lib], m) for s in stages for lib in libs for m in MOMENTS):
        return []
    head = ["stage", "moment", "category"] + [SHORT[lib] for lib in libs]
    lines = [f"## Model states at the same moments, every library (rank 0, step {moments_step(results, libs)})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in stages:
        for m in MOMENTS:
            for c in CATEGORIES:
                cells = [fmt(category_bytes(moment_entries(results[s][lib], m)[0], c), "bytes") for lib in libs]
                lines.append("| " + " | ".join([str(s), MOMENT_TITLES[m], c] + cells) + " |")
    return lines + [""]


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def savefig(fig, path) -> None:
    fig.tight_layout(), fig.savefig(path, dpi=100), pyplot().close(fig)


def plot_losses(path, results) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.5), squeeze=False)
    for ax, (stage, runs) in zip(axes[0], sorted(results.items())):
        for lib, style in zip(runs, ("-", "--", ":")):
            ax.plot(range(1, len(runs[lib]["losses"]) + 1), runs[lib]["losses"], style, label=lib)
        ax.set(title=f"ZeRO-{stage}", xlabel="optimizer step", ylabel="train loss")
        ax.legend()
    savefig(fig, path)


def plot_memory(path, results) -> None:
    """Rank 0's model states per stage, minizero | DeepSpeed, stacked by category: one row of
    panels per moment (end of backward, after the step) when the summaries have them, else
    summary.json's model_state_bytes; with offload two panels per row on one scale, the
    device's and the host's."""
    plt = pyplot()
    stages = sorted(results)
    libs = list(results[stages[0]])
    places = PLACES if offloaded(results) else (None,)
    timed = all(moment_entries(results[s][lib], m) for s in stages for lib in libs for m in MOMENTS)
    moments = MOMENTS if timed else (None,)
    fig, axes = plt.subplots(len(moments), len(places), figsize=(len(places) * max(5, len(libs) * len(stages)),
                                                                 4 * len(moments)),
                             squeeze=False, sharey=True)
    name = NAMES if len(libs) <= 2 else SHORT   # three full names do not fit above the panels
    title = " | ".join(name[lib] + (" (hatched)" if j == 1 else " (dotted)" if j == 2 else "")
                       for j, lib in enumerate(libs))
    colors = dict(zip(CATEGORIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for row, moment in zip(axes, moments):
        for ax, place in zip(row, places):
            width = 0.76 / len(libs)
            for j, (lib, hatch) in enumerate(zip(libs, ("", "//", ".."))):
                xs = [i + (j - (len(libs) - 1) / 2) * width for i in range(len(stages))]
                bottom = [0.0] * len(stages)
                for c in CATEGORIES:
                    entries = [(moment_entries(results[s][lib], moment) if moment else
                                results[s][lib]["model_state_bytes"])[0] for s in stages]
                    h = [category_bytes(e, c, place) / 2**20 for e in entries]
                    ax.bar(xs, h, width * 0.95, bottom=bottom, color=colors[c], hatch=hatch, edgecolor="black",
                           label=None if j else c)
                    bottom = [b + x for b, x in zip(bottom, h)]
            ax.set_xticks(range(len(stages)), [f"ZeRO-{s}\n" + " | ".join(SHORT[lib] for lib in libs) for s in stages])
            where = f" on the {place}" if place else ""
            when = f"{MOMENT_TITLES[moment]}" if moment else ""
            ax.set(ylabel=f"model-state MiB{where} (rank 0)",
                   title=", ".join(filter(None, [when, f"on the {place}" if place else ""])) or
                   "Model states, rank 0: " + title)
            ax.legend(fontsize=8)
    if places != (None,) or moments != (None,):
        step = moments_step(results, libs) if moments != (None,) else None
        fig.suptitle("Model states, rank 0: " + title + (f", step {step}" if step else ""))
    savefig(fig, path)
