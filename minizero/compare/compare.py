"""minizero vs DeepSpeed (and PyTorch), side by side: the same config, seed and data, stage by stage.

    python -m minizero.compare --stages 0 1 2 3 --dtype bf16 --nproc 2
    python -m minizero.compare --stages 3 --dtype fp32 --nproc 2 --max-steps 10 --synthetic-train 256
    python -m minizero.compare --libs minizero deepspeed torch --stages 0 3 --dtype fp32

--libs picks the libraries (default minizero deepspeed); torch is PyTorch's own DDP (stage 0)
and FSDP2 (stages 2, 3) through reference/torch_train.py (docs/fsdp.md). The table, the loss
and memory pictures take one column per library; the sections that name every byte of
DeepSpeed's difference (memory moments, comms summaries) need minizero and deepspeed.

ZeRO for several nodes (k, S: ranks of one node; --nproc a multiple of it):

    python -m minizero.compare --libs minizero deepspeed torch --stages 3 --nproc 4 --hpz 2   # hpZ
    python -m minizero.compare --libs minizero torch --stages 3 --nproc 4 --hsdp 2            # HSDP

--hpz k sets zero_optimization.zero_hpz_partition_size (DeepSpeed's hpZ; torch runs FSDP2's
reshard_after_forward=k), --hsdp S sets hsdp_shard_size (minizero's HSDP and FSDP2's; DeepSpeed
has none). Either key may also come in --config. A library that lacks the setting is refused in
one line. Every run then pretends nodes of k (or S) ranks (MINIZERO_RANKS_PER_NODE), the table
gains each library's bytes on the link between nodes, and the report a section that predicts
every byte of each library from its own padding (compare_nodes.py).

Per stage: `torchrun ... -m minizero.train`, then `... reference/train.py` (real DeepSpeed)
with identical flags; unknown flags go to both. Writes into --out (default reports/compare-<dtype>):
report.md (command, machine, versions, one table row per stage; the model states of both
libraries at the same two moments of the last step, end of backward and after the step,
category by category, every byte of difference named as one of DeepSpeed's documented
overheads; both comms summaries side by side per stage, each differing row explained),
loss_curves.png, memory.png (rank 0's model states stacked by category, a row of panels per
moment; with ZeRO-Offload in the config, one panel for the device and one for the host, and
the table gains device and host columns), results.json (every number, both summaries),
config.json (the config both got), and <lib>-stage<N>/ (each run's save dir and run.log).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import shlex
import subprocess
import sys

from minizero.train import output_dir
from minizero.comm import free_port
from minizero.process_group import RANKS_PER_NODE_ENV as NODE_ENV   # the runs pretend nodes of k (or S) ranks
from minizero.compare import REPO
from minizero.compare.compare_nodes import HIERARCHY, hierarchy_keys, link_bytes, ranks_per_node
from minizero.compare.compare_memory import LIBS, offloaded, placed_bytes, state_bytes, state_entries
# How the results are shown: the report's words in report.py, the table and pictures in render.py.
from minizero.compare.report import machine, report_md, versions
from minizero.compare.render import plot_losses, plot_memory, table

STAGES = (0, 1, 2, 3)
ALL_LIBS = ("minizero", "deepspeed", "torch")
SCRIPTS = {"minizero": ["-m", "minizero.train"], "deepspeed": [os.path.join(REPO, "reference", "train.py")],
           "torch": [os.path.join(REPO, "reference", "torch_train.py")]}
# So both libraries run the same algorithm: DeepSpeed's ZeRO-3 otherwise replaces F.linear
# (different rounding), keeps small parameters gathered, allocates a 5e8-element bucket,
# and, with max_live/reuse_distance at 1e9, keeps a small model gathered from forward into
# backward (one all-gather per step instead of the paper's two; measured in docs/agreement.md).
COMPARE_DEFAULTS = {"memory_efficient_linear": False, "stage3_param_persistence_threshold": 0,
                    "reduce_bucket_size": 500_000, "stage3_max_live_parameters": 0,
                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
# The knobs of *when* data moves: with --own-knobs the config's own values (or DeepSpeed's
# defaults, which minizero follows: docs/zero.md, "Hiding communication") run in both libraries.
WHEN_KNOBS = ("stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size")


class CompareError(Exception):
    """Reported as one line (plus a log tail for a failed run), no traceback."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minizero.compare", description=__doc__.split("\n\n")[0],
                                epilog="Unknown flags (e.g. --synthetic-train 256) go to both training scripts.")
    p.add_argument("--stages", nargs="+", default=["0", "1", "2", "3"], help="ZeRO stages to compare")
    p.add_argument("--libs", nargs="+", default=list(LIBS), metavar="LIB",
                   help=f"libraries to run, the first is the one the others are compared to: {', '.join(ALL_LIBS)} "
                        f"(default: {' '.join(LIBS)}; torch = PyTorch's DDP / FSDP2, stages 0, 2, 3)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun --nproc-per-node)")
    p.add_argument("--config", help="DeepSpeed JSON (default: minizero.train's built-in CPU config)")
    p.add_argument("--model", help="GPT preset (train.py's default: tiny on CPU, tutorial on GPU)")
    p.add_argument("--dataset", help="cifar10 or synthetic (train.py's default: synthetic on CPU)")
    p.add_argument("--image-size", type=int, help="8, 16 or 32")
    p.add_argument("--max-steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--hpz", type=int, metavar="K", help="zero_optimization.zero_hpz_partition_size: ZeRO++'s hpZ, a "
                   "secondary parameter partition over K ranks (one node) that backward gathers from (stage 3)")
    p.add_argument("--hsdp", type=int, metavar="S", help="zero_optimization.hsdp_shard_size: HSDP, parameters sharded "
                   "over S ranks (one node) and replicated across the --nproc/S groups (stages 2, 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report folder (default reports/compare-<dtype>)")
    p.add_argument("--own-knobs", action="store_true",
                   help="run both libraries with the config's own prefetch / reuse / live-parameter knobs (DeepSpeed's "
                        "defaults unless the config sets them) instead of pinning them to 0: overlap and prefetch "
                        "in both, each moving what DeepSpeed moves")
    p.add_argument("--comms-logger", action=argparse.BooleanOptionalAction, default=None,
                   help="time every collective in both libraries (DeepSpeed's comms_logger section) and put both "
                        "comms summaries in the report. Default: on without a GPU (DeepSpeed's logger then costs "
                        "0.3-1 ms per collective on a CPU), off on a GPU, where it synchronizes the device after "
                        "every collective; --no-comms-logger drops the section")
    return p.parse_known_args(argv)


def check_args(args) -> None:
    if bad := [s for s in args.stages if s not in {str(x) for x in STAGES}]:
        raise CompareError(f"unknown stage {' '.join(bad)}: choose from {' '.join(map(str, STAGES))}")
    args.stages = sorted({int(s) for s in args.stages})
    if bad := [lib for lib in args.libs if lib not in ALL_LIBS]:
        raise CompareError(f"unknown library {' '.join(bad)}: choose from {' '.join(ALL_LIBS)}")
    if len(set(args.libs)) != len(args.libs):
        raise CompareError(f"--libs {' '.join(args.libs)} names a library twice")
    if "torch" in args.libs and 1 in args.stages:
        raise CompareError("torch has no ZeRO-1 (FSDP2 shards parameters or nothing): drop stage 1 or drop torch")
    if args.dtype not in ("fp32", "bf16", "fp16"):
        raise CompareError(f"unknown --dtype {args.dtype!r}: choose fp32, bf16 or fp16")
    if args.dtype == "fp16" and "torch" in args.libs:
        raise CompareError("torch runs fp32 and bf16 (FSDP2 has no loss scaler): --dtype bf16, or drop torch")
    for name in ("nproc", "max_steps"):
        if getattr(args, name) < 1:
            raise CompareError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for mod in ["matplotlib"] + ["deepspeed"] * ("deepspeed" in args.libs):
        if importlib.util.find_spec(mod) is None:
            raise CompareError(f"{mod} is not installed: pip install -e .[dev]")
    if args.comms_logger is None:
        import torch
        args.comms_logger = not torch.cuda.is_available()
    check_hierarchy(args)
    args.out = os.path.abspath(args.out or os.path.join("reports", f"compare-{args.dtype}"))
    if why := output_dir.problem(args.out, "--out"):
        raise CompareError(why)
    # Never overwrite an earlier comparison (its training runs would refuse their folders anyway).
    if os.path.isdir(args.out):
        earlier = sorted(f for f in os.listdir(args.out)
                         if f in ("report.md", "results.json") or f.startswith(tuple(f"{lib}-stage" for lib in ALL_LIBS)))
        if earlier:
            raise CompareError(f"{args.out} already holds a comparison ({', '.join(earlier[:3])}"
                               f"{', ...' if len(earlier) > 3 else ''}); pass a new --out, or remove that folder")


# The stages minizero has each multi-node key at (compare_nodes.HIERARCHY: the libraries and
# stages of the others), and why a library lacks one.
MINIZERO_STAGES = {"zero_hpz_partition_size": {3}, "hsdp_shard_size": {3}}
LACKS = {("deepspeed", "hsdp_shard_size"): "DeepSpeed 0.19.8 has no HSDP (its MiCS keys mics_shard_size / "
                                          "mics_hierarchical_params_gather were removed and now raise)"}


def minizero_knows(key: str) -> bool:
    """Whether minizero's config parser accepts `key` in zero_optimization (a ZeRO-3 config of
    4 ranks, the key at 2): the keys pass through to minizero as soon as its config knows them."""
    from minizero.config import ConfigError, load_config
    try:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: 2}}, 4)
    except ConfigError:
        return False
    return True


def check_hierarchy(args) -> None:
    """--hpz / --hsdp (or the keys in --config): a size that splits --nproc into nodes, a stage
    that has it, and only libraries that have it."""
    for key, size in hierarchy_keys(args).items():
        flag, libs, stages = HIERARCHY[key]
        if isinstance(size, bool) or not isinstance(size, int) or not 1 < size < args.nproc or args.nproc % size:
            raise CompareError(f"{flag} / zero_optimization.{key} {size!r}: give the ranks of one node, a divisor of "
                               f"--nproc {args.nproc} between 2 and {args.nproc // 2} (e.g. --nproc 4 {flag} 2)")
        if bad := [s for s in args.stages if s not in stages]:
            raise CompareError(f"{flag} applies to stage {' and '.join(map(str, sorted(stages)))}, not "
                               f"{' '.join(map(str, bad))}: choose --stages {' '.join(map(str, sorted(stages)))}")
        for lib in args.libs:
            if lib == "minizero" and not minizero_knows(key):
                raise CompareError(f"minizero's config has no zero_optimization.{key} yet: drop minizero from --libs "
                                   f"(the libraries that have it: {' '.join(sorted(libs))})")
            if lib == "minizero" and (bad := [s for s in args.stages if s not in MINIZERO_STAGES[key]]):
                raise CompareError(f"minizero's {key} applies to stage 3 (it shards parameters), not "
                                   f"{' '.join(map(str, bad))}: choose --stages 3, or drop minizero from --libs")
            if lib != "minizero" and lib not in libs:
                why = LACKS.get((lib, key))
                raise CompareError(f"{why or lib + ' has no ' + key}: drop {lib} from --libs (the libraries that have "
                                   f"it: {' '.join(sorted(libs))})")


def pinned_knobs(args) -> dict:
    """COMPARE_DEFAULTS, less the knobs of when data moves with --own-knobs."""
    own = getattr(args, "own_knobs", False)
    return {k: v for k, v in COMPARE_DEFAULTS.items() if not (own and k in WHEN_KNOBS)}


def base_config(args) -> dict:
    """The config both libraries get: --config or train.py's default, plus COMPARE_DEFAULTS."""
    from minizero.train.train_args import DEFAULT_CONFIG, UserError, read_config_file
    try:
        cfg = read_config_file(args.config) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    except UserError as e:   # no such file / not JSON / not an object
        raise CompareError(str(e)) from None
    zero = cfg.get("zero_optimization")   # (--stage replaces DeepSpeed's deprecated `true` form)
    cfg["zero_optimization"] = {**pinned_knobs(args), **(zero if isinstance(zero, dict) else {}),
                                **{key: getattr(args, flag[2:]) for key, (flag, _, _) in HIERARCHY.items()
                                   if getattr(args, flag[2:], None) is not None}}
    # DeepSpeed logs whenever the section is present, whatever its "enabled" says
    # (docs/deepspeed.md, "comms_logger is on whenever the section is present"): off means no section.
    if getattr(args, "comms_logger", False):
        cfg["comms_logger"] = {**(cfg.get("comms_logger") or {}), "enabled": True}
    else:
        cfg.pop("comms_logger", None)
    return cfg


def run_command(lib, stage, args, extra, config_path, save_dir) -> list:
    script = SCRIPTS[lib]
    flags = ["--config", config_path, "--stage", str(stage), "--dtype", args.dtype,
             "--seed", str(args.seed), "--save-dir", save_dir]
    for name in ("model", "dataset", "image_size", "max_steps"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if not any(x == "--num-samples" or x.startswith("--num-samples=") for x in extra):
        # No sample grid: nothing here compares it, and drawing one is a sequential forward
        # per pixel (1,023 at 32x32, each through ZeRO-3's gathers) in every run
        flags += ["--num-samples", "0"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script, *flags, *extra]


def run_one(cmd, save_dir, label, per_node: int | None = None) -> dict:
    """Run one training launch, its output into <save_dir>/run.log; return its summary.json.
    per_node: the ranks of one pretended node (MINIZERO_RANKS_PER_NODE), so that every
    library's collectives are split into what stays on a node and what crosses."""
    os.makedirs(save_dir, exist_ok=True)
    log_path, summary_path = os.path.join(save_dir, "run.log"), os.path.join(save_dir, "summary.json")
    env = {"OMP_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           **({NODE_ENV: str(per_node)} if per_node else {})}
    with open(log_path, "w") as log:
        log.write("$ " + (f"{NODE_ENV}={per_node} " if per_node else "") + shlex.join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not os.path.isfile(summary_path):
        with open(log_path) as f:
            tail = "".join(f.readlines()[-15:])
        raise CompareError(f"{label} run failed (exit {rc}), log {log_path}; its last lines:\n{tail}")
    with open(summary_path) as f:
        summary = json.load(f)
    comms_path = os.path.join(save_dir, "comms_summary.json")
    if os.path.isfile(comms_path):   # written with a comms_logger section (runlog.write_comms_summary)
        with open(comms_path) as f:
            summary["comms_summary"] = json.load(f)
    return summary


def max_abs_dloss(a, b):
    n = min(len(a["losses"]), len(b["losses"]))
    diffs = [abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]) if x is not None and y is not None]
    return max(diffs) if diffs else None


def stage_row(stage, *summaries, libs=LIBS) -> dict:
    """One stage's numbers, a part per library (`summaries` in the order of `libs`); the
    loss gap and the speed ratio of each library after the first, against the first."""
    first = summaries[0]
    row = {"stage": stage, "libs": list(libs), "steps": min(len(s["losses"]) for s in summaries),
           "max_abs_dloss": max_abs_dloss(first, summaries[1]) if len(summaries) > 1 else None,
           "dloss": {lib: max_abs_dloss(first, s) for lib, s in zip(libs[1:], summaries[1:])}}
    for lib, s in zip(libs, summaries):
        sb = state_bytes(s)
        where = placed_bytes(state_entries(s)[0])
        row[lib] = {"final_loss": s["final_loss"], "test_loss": s["test_loss"], "state_bytes_rank0": sb[0],
                    "device_bytes_rank0": where["device"], "host_bytes_rank0": where["host"],
                    **({"nvme_bytes_rank0": where["nvme"]} if "nvme" in where else {}),
                    "state_bytes_max": max(sb), "peak_mem_mb": max(s["peak_mem_mb"]),
                    "samples_per_s": s["samples_per_s"],
                    "wire_bytes_per_step": (s["comm_wire_bytes_per_step"] or {}).get("total", 0),
                    "link_bytes_per_step": (link_bytes(s) or {}).get("total"),
                    "skipped_steps": s["skipped_steps"]}
    a = row[libs[0]]["samples_per_s"]
    row["speed"] = {lib: a / row[lib]["samples_per_s"] if a and row[lib]["samples_per_s"] else None
                    for lib in libs[1:]}
    row["speed_ratio"] = row["speed"].get(libs[1]) if len(libs) > 1 else None
    return row


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parse_args(argv)
    try:
        check_args(args)
        os.makedirs(args.out, exist_ok=True)
        config_path = os.path.join(args.out, "config.json")
        with open(config_path, "w") as f:
            json.dump(base_config(args), f, indent=1)
        from tqdm import tqdm
        results = {}
        runs = [(s, lib) for s in args.stages for lib in args.libs]
        for stage, lib in tqdm(runs, desc="compare", unit="run"):
            save_dir = os.path.join(args.out, f"{lib}-stage{stage}")
            cmd = run_command(lib, stage, args, extra, config_path, save_dir)
            results.setdefault(stage, {})[lib] = run_one(cmd, save_dir, f"stage {stage} {lib}", ranks_per_node(args))
        rows = [stage_row(s, *(results[s][lib] for lib in args.libs), libs=args.libs) for s in args.stages]
    except CompareError as e:
        print(f"python -m minizero.compare: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    command = "python -m minizero.compare " + shlex.join(argv)
    info = {"command": command, "machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "versions": versions(), "nproc": args.nproc, "dtype": args.dtype, "extra_flags": extra}
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report_md(info, args, rows, pinned_knobs(args), offloaded(results), results))
    plot_losses(os.path.join(args.out, "loss_curves.png"), results)
    plot_memory(os.path.join(args.out, "memory.png"), results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**info, "rows": rows, "summaries": {str(s): r for s, r in results.items()}}, f, indent=1)
    print(table(rows))
    print(f"report: {os.path.join(args.out, 'report.md')}")


if __name__ == "__main__":
    main()
