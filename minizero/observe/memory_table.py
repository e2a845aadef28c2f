"""`python -m minizero.memory_table --model tutorial --world-size 8 64 1024 [--stage 3] [--dtype bf16] [--offload both]`

Each rank's model-state bytes (params, grads, fp32 masters, Adam moments; on the device and
on the host) at any world size, computed from minizero's own layout code without starting
a process: the model is built on the meta device (shapes, no storage), each stage's layout
plan (each stage's `plan`: Zero0.plan, Zero3.plan, the very functions the stages
build their FlatParams from) lists its FlatParams, and memory.expected_bytes pads each to a
multiple of N. The plan does not depend on N, so N = 1024 costs what N = 2 does. Equal byte
for byte to `engine.memory_breakdown()` of real engines (tests/tools/test_memory_table.py).

`--nproc 2 4` instead builds the real engine at every stage on N gloo ranks (CPU is fine:
nothing is trained, only laid out) and prints each rank's `engine.memory_breakdown()`: the
measured table the per-stage tables in docs/zero.md come from. `--offload optimizer` adds
offload_optimizer at stages 1-3, `both` also offload_param at stage 3, `nvme` both with
`"device": "nvme"`, in a column of their own (docs/offload.md).
`--paper-figure1` prints the ZeRO paper's Figure 1 example (Ψ = 7.5B, N = 64, K = 12);
`--paper-figure1 --png docs/img/zero_figure1.png` also draws it.

`--nodes 2 64 --ranks-per-node 4 8` prints instead ZeRO-3, hpZ and HSDP on 2 x 4 and 64 x 8
ranks: model states per rank, wire bytes per rank per step, and bytes per inter-node link per
step, by the papers' formulas and exactly from the layout (node_table.py); `--psi 7.5e9`
instead of a model gives the formulas alone.
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch

from ..memory import CATEGORIES, expected_bytes, paper_bytes, total
from ..partition import FlatPlan
from .node_table import human


def offload_section(stage: int, offload: str, nvme_path: str = "nvme") -> dict:
    """The zero_optimization keys `--offload` adds at this stage (stage 0 offloads nothing,
    offload_param exists at stage 3 only). "nvme": both, with "device": "nvme" (offload/nvme.py)."""
    out = {}
    where = {"device": "nvme", "nvme_path": nvme_path} if offload == "nvme" else {"device": "cpu"}
    if offload in ("optimizer", "both", "nvme") and stage >= 1:
        out["offload_optimizer"] = dict(where)
    if offload in ("both", "nvme") and stage == 3:
        out["offload_param"] = dict(where)
    return out


# ----------------------------------------------------------------------------- computed: no processes

def meta_model(model_name: str):
    """The preset's GPT on the meta device (shapes only: a 7.5B model costs no memory), and
    its param groups exactly as the engine takes them (engine.param_groups_of)."""
    from ..engine import param_groups_of
    from ..gpt.model import GPT, get_preset
    with torch.device("meta"):
        model = GPT(get_preset(model_name))
    return model, param_groups_of(model, model.configure_param_groups(0.1))


def layout(model, param_groups, stage: int, reduce_bucket_size: int = 500_000_000,
           persistence_threshold: int = 0) -> list[FlatPlan]:
    """The FlatParams a stage builds for this model: the stage's own plan (Zero0.plan, Zero3.plan)."""
    from ..config import ZeroConfig
    from ..engine import STAGES
    if stage not in STAGES:
        raise ValueError(f"stage {stage}: use 0, 1, 2 or 3")
    zero = ZeroConfig.parse({"stage": stage, "reduce_bucket_size": reduce_bucket_size,
                             "stage3_param_persistence_threshold": persistence_threshold}, "zero_optimization")
    return STAGES[stage].plan(model, param_groups, zero)


def computed_breakdown(plans: list[FlatPlan], world: int, stage: int, dtype: str = "bf16",
                       offload: str = "none") -> dict:
    """memory_breakdown() of every rank (all ranks hold equal shards) for this layout."""
    off = offload_section(stage, offload)
    return expected_bytes([p.numel for p in plans], world, stage, mixed=dtype != "fp32",
                          persistent=[p.persistent for p in plans],
                          offload_optimizer="offload_optimizer" in off, offload_param="offload_param" in off,
                          nvme=offload == "nvme" and bool(off))


def compute(model_name: str, worlds, dtype: str = "bf16", stages=(0, 1, 2, 3), offload: str = "none",
            reduce_bucket_size: int = 500_000_000, persistence_threshold: int = 0) -> dict:
    """{world: {stage: (breakdown, Ψ)}}, in the shape measure() returns for rank 0."""
    model, groups = meta_model(model_name)
    psi = sum(p.numel() for g in groups for p in g["params"])
    plans = {s: layout(model, groups, s, reduce_bucket_size, persistence_threshold) for s in stages}
    return {n: {s: (computed_breakdown(plans[s], n, s, dtype, offload), psi) for s in stages} for n in worlds}


# ----------------------------------------------------------------------------- the ZeRO paper's Figure 1

FIGURE1 = dict(psi=7_500_000_000, world=64, k=12)
FIGURE1_PRINTED_GB = (120, 31.4, 16.6, 1.9)   # the figure's per-device numbers, stages 0-3


def figure1() -> list[dict]:
    """Figure 1 of the ZeRO paper (Rajbhandari et al., SC'20): Ψ = 7.5B, N = 64, K = 12,
    mixed precision, per stage. Its GB are 1e9 bytes: 120e9 / 2^30 would print 111.8."""
    out = []
    for stage in range(4):
        b = paper_bytes(FIGURE1["psi"], FIGURE1["world"], stage, mixed=True)
        out.append({"stage": stage, **b, "total": sum(b[k] for k in CATEGORIES)})
    return out


def print_figure1() -> None:
    print(f"ZeRO paper, Figure 1: Ψ = {FIGURE1['psi']:,} parameters, N = {FIGURE1['world']}, "
          f"K = {FIGURE1['k']} (mixed-precision Adam); memory.paper_bytes, bytes per device\n")
    print("| stage | params | grads | master + optimizer (K) | total bytes | GB (1e9) | GiB (2^30) | paper |")
    print("|---|---|---|---|---|---|---|---|")
    for row, printed in zip(figure1(), FIGURE1_PRINTED_GB):
        print(f"| {row['stage']} | {row['params']:,.0f} | {row['grads']:,.0f} | "
              f"{row['master_params'] + row['optimizer_states']:,.0f} | {row['total']:,.0f} | "
              f"{row['total'] / 1e9:.1f} | {row['total'] / 2**30:.1f} | {printed} GB |")


def plot_figure1(path: str) -> None:
    """The Figure 1 numbers as stacked bars (parameters, gradients, optimizer states) per
    stage, in GB of 1e9 bytes: docs/img/zero_figure1.png."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e .[dev]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = figure1()
    names = ["baseline\n(stage 0)", "P_os\n(stage 1)", "P_os+g\n(stage 2)", "P_os+g+p\n(stage 3)"]
    parts = [("parameters (2 bytes)", [r["params"] for r in rows], "#4c72b0"),
             ("gradients (2 bytes)", [r["grads"] for r in rows], "#dd8452"),
             ("optimizer states (K = 12 bytes)", [r["master_params"] + r["optimizer_states"] for r in rows], "#55a868")]
    # a slide: 1600 px wide at 120 dpi, no text under 11 px (as observe/timeline.py's pictures)
    from minizero.observe.timeline import DPI, WIDTH_PX
    fig, ax = plt.subplots(figsize=(WIDTH_PX / DPI, 6.4))
    bottom = [0.0] * 4
    for label, values, colour in parts:
        gb = [v / 1e9 for v in values]
        ax.bar(names, gb, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, gb)]
    for i, t in enumerate(bottom):
        ax.text(i, t + 1.5, f"{t:.1f} GB", ha="center", fontsize=14)
    ax.set_ylabel("model states per device (GB = 1e9 bytes)", fontsize=13)
    ax.tick_params(labelsize=13)
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.set_title(f"ZeRO paper, Figure 1: Ψ = 7.5B, N = {FIGURE1['world']}, K = {FIGURE1['k']}", fontsize=15)
    ax.legend(fontsize=13)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------- measured: N real ranks

def _rank(model_name, dtype, stages, offload="none"):
    """On one gloo rank: the real engine at each stage, nothing trained; its memory_breakdown()."""
    import minizero
    from minizero.gpt.model import GPT, get_preset

    import tempfile
    out = {}
    swap = tempfile.mkdtemp(prefix="minizero-memory-table-")   # --offload nvme: the swap files' folder
    for stage in stages:
        torch.manual_seed(0)
        model = GPT(get_preset(model_name))
        psi = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties the parameters
        cfg = {"train_micro_batch_size_per_gpu": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                     **offload_section(stage, offload, swap)}}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1),
                                         config=cfg)
        out[stage] = (engine.memory_breakdown(), psi)
        engine.destroy()
        del engine, model
    shutil.rmtree(swap, ignore_errors=True)
    return out


def measure(model_name: str, world: int, dtype: str, stages=(0, 1, 2, 3), offload: str = "none") -> dict:
    """{rank: {stage: (breakdown, Ψ)}} from `world` gloo ranks (runtime/spawn.py)."""
    from minizero.runtime.spawn import run_ranks
    per_rank = run_ranks(_rank, world, (model_name, dtype, list(stages), offload), backend="gloo",
                         group=True, timeout=600)
    return dict(enumerate(per_rank))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minizero.memory_table", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--world-size", type=int, nargs="+", default=None,
                    help="compute the bytes for these N from the layout code, no processes (default 8 64 1024)")
    ap.add_argument("--nproc", type=int, nargs="+", default=None,
                    help="measure instead: spawn N gloo ranks, build the real engines, read memory_breakdown()")
    ap.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--offload", default="none", choices=["none", "optimizer", "both", "nvme"],
                    help="offload_optimizer at stages 1-3; both: also offload_param at stage 3; "
                         "nvme: both, swapped to NVMe files (a third place)")
    ap.add_argument("--reduce-bucket-size", type=int, default=500_000_000,
                    help="ZeRO-2's bucket size in elements (computed mode; DeepSpeed's default 5e8)")
    ap.add_argument("--persistence-threshold", type=int, default=0,
                    help="ZeRO-3's stage3_param_persistence_threshold (computed mode; DeepSpeed's default "
                         "is 100000, the measured mode uses 0)")
    ap.add_argument("--paper-figure1", action="store_true", help="print the ZeRO paper's Figure 1 example and stop")
    ap.add_argument("--png", help="with --paper-figure1: also draw it into this PNG (needs matplotlib)")
    g = ap.add_argument_group("several nodes: ZeRO-3, hpZ and HSDP (node_table.py)")
    g.add_argument("--nodes", type=int, nargs="+", metavar="M",
                   help="nodes; with --ranks-per-node, print ZeRO-3, hpZ and HSDP per rank and per link")
    g.add_argument("--ranks-per-node", type=int, nargs="+", metavar="L",
                   help="ranks on each node, one per --nodes value (or one for all): hpZ's k and HSDP's S")
    g.add_argument("--psi", type=float, metavar="PARAMS",
                   help="with --nodes: a parameter count (e.g. 7.5e9) instead of --model: the formulas alone")
    args = ap.parse_args(argv)
    if args.nodes or args.ranks_per_node or args.psi:
        return nodes_view(ap, args, argv)
    if args.png and not args.paper_figure1:
        ap.error("--png draws the paper's Figure 1: give it with --paper-figure1")
    if args.paper_figure1:
        print_figure1()
        if args.png:
            plot_figure1(args.png)
        return
    if args.world_size and args.nproc:
        ap.error("give --world-size (computed) or --nproc (measured), not both")
    from ..gpt.model import PRESETS
    if args.model not in PRESETS:
        ap.error(f"unknown --model {args.model!r}: choose one of {', '.join(PRESETS)}")
    if any(n < 1 for n in (args.world_size or []) + (args.nproc or [])):
        ap.error("world sizes must be at least 1")
    measured = args.nproc is not None
    worlds = args.nproc if measured else (args.world_size or [8, 64, 1024])
    how = "measured on N gloo ranks: rank 0; max over ranks if different" if measured else \
        "computed from the layout plan, no processes: every rank holds the same"
    print(f"model={args.model} dtype={args.dtype} offload={args.offload}; bytes per rank ({how})\n")
    nvme = args.offload == "nvme"
    print("| N | stage | params | grads | master | optimizer | total | on device | on host | "
          + ("on NVMe | " if nvme else "") + "paper formula | total (human) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if nvme else ""))
    if not measured:
        computed = compute(args.model, worlds, args.dtype, args.stage, args.offload, args.reduce_bucket_size,
                           args.persistence_threshold)
    for n in worlds:
        res = measure(args.model, n, args.dtype, args.stage, offload=args.offload) if measured else {0: computed[n]}
        for stage in args.stage:
            b0, psi = res[0][stage]
            tmax = max(total(res[r][stage][0]) for r in res)
            paper = total(paper_bytes(psi, n, stage, mixed=args.dtype != "fp32"))
            t0 = total(b0)
            tot = f"{t0:,}" + (f" (max {tmax:,})" if tmax != t0 else "")
            print(f"| {n} | {stage} | {b0['params']:,} | {b0['grads']:,} | {b0['master_params']:,} | "
                  f"{b0['optimizer_states']:,} | {tot} | {total(b0['device']):,} | {total(b0['host']):,} | "
                  + (f"{total(b0['nvme']) if 'nvme' in b0 else 0:,} | " if nvme else "")
                  + f"{paper:,.0f} | {human(t0)} |")


def nodes_view(ap, args, argv) -> None:
    """--nodes M... --ranks-per-node L...: node_table's table; what it cannot take, one line."""
    from ..gpt.model import PRESETS
    from . import node_table
    given = argv if argv is not None else __import__("sys").argv[1:]
    if not args.nodes or not args.ranks_per_node:
        ap.error("give --nodes M and --ranks-per-node L together (e.g. --nodes 2 --ranks-per-node 4)")
    per_node = args.ranks_per_node * len(args.nodes) if len(args.ranks_per_node) == 1 else args.ranks_per_node
    if len(per_node) != len(args.nodes):
        ap.error(f"--ranks-per-node takes one value, or one per --nodes value ({len(args.nodes)}), "
                 f"not {len(args.ranks_per_node)}")
    if any(m < 2 for m in args.nodes) or any(k < 1 for k in per_node):
        ap.error("--nodes must be at least 2 (one node has no link between nodes) and --ranks-per-node at least 1")
    clash = [f for f in ("--world-size", "--nproc", "--stage", "--offload", "--persistence-threshold",
                         "--reduce-bucket-size", "--paper-figure1") if any(a.split("=")[0] == f for a in given)]
    if clash:
        ap.error(f"--nodes prints ZeRO-3, hpZ and HSDP at stage 3 with every parameter partitioned; "
                 f"drop {' '.join(clash)}")
    if args.psi is not None:
        if any(a.split("=")[0] == "--model" for a in given):
            ap.error("give --model (formulas and layout) or --psi (formulas alone), not both")
        if args.psi < 1:
            ap.error(f"--psi {args.psi:g}: give a parameter count of at least 1, e.g. 7.5e9")
        psi = int(args.psi)
        return node_table.main(f"Ψ = {psi:,} (paper formulas only: no layout)", psi, None, args.nodes, per_node,
                               args.dtype)
    if args.model not in PRESETS:
        ap.error(f"unknown --model {args.model!r}: choose one of {', '.join(PRESETS)}")
    m, groups = meta_model(args.model)
    flat_numels = [p.numel for p in layout(m, groups, 3)]
    psi = sum(flat_numels)
    return node_table.main(f"model={args.model} (Ψ = {psi:,})", psi, flat_numels, args.nodes, per_node, args.dtype)


if __name__ == "__main__":
    main()
