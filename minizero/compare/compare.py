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
import contextlib
import copy
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys

from minizero.train import output_dir
from minizero.comm import free_port
from minizero.compare.compare_comms import comms_section
from minizero.compare.compare_nodes import link_bytes, nodes_section
from minizero.compare.compare_memory import (LIBS, moments_section, offloaded, placed_bytes, state_bytes,
                                             state_entries)
# How the results are shown (the table, the pictures): render.py.
from minizero.compare.render import NAMES, SHORT, moments_by_lib, plot_losses, plot_memory, table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # minizero/compare/ -> the repository
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


# The multi-node keys, the libraries that have each, and the stages it applies to (minizero's
# at stage 3 only: MINIZERO_STAGES).
HIERARCHY = {"zero_hpz_partition_size": ("--hpz", {"deepspeed", "torch"}, {3}),
             "hsdp_shard_size": ("--hsdp", {"torch"}, {2, 3})}
MINIZERO_STAGES = {"zero_hpz_partition_size": {3}, "hsdp_shard_size": {3}}
NODE_ENV = "MINIZERO_RANKS_PER_NODE"   # process_group.ranks_per_node: the runs pretend nodes of k (or S) ranks
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


def ranks_per_node(args) -> int | None:
    """The "node" the runs pretend with --hpz k / --hsdp S: k (or S) consecutive ranks, as
    both libraries group them; None without either (one node)."""
    sizes = set(hierarchy_keys(args).values())
    return min(sizes) if sizes else None


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


def machine() -> str:
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"CPU: {cpu} ({os.cpu_count()} cores), no GPU"


def versions() -> dict:
    def version(p):
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return {"python": platform.python_version(), **{p: version(p) for p in ("torch", "deepspeed")}}


def note(args, offload: bool = False) -> str:
    agreement = os.path.join(REPO, "docs", "agreement.md")   # relative when the report is inside the repo
    agreement = os.path.relpath(agreement, args.out) if args.out.startswith(REPO + os.sep) else agreement
    lines = [
        f"Known differences (details and sources: [docs/agreement.md]({agreement})):", "",
        "- Wire bytes: DeepSpeed's ZeRO-1/2 \"reduce-scatter\" is an all-reduce (`average_tensor` pre-divides "
        "the bucket and calls `all_reduce`; each rank keeps its slice): 2Ψ for gradients plus Ψ for the "
        "parameter all-gather, 1.5x the paper's 2Ψ that minizero moves. "
        + ("At ZeRO-3 both libraries run the config's own prefetch and reuse knobs (--own-knobs): with "
           "DeepSpeed's defaults each keeps every unit gathered from forward into backward and gathers once "
           "per step (2Ψ), and minizero moves DeepSpeed's bytes (docs/zero.md, \"Hiding communication\")."
           if getattr(args, "own_knobs", False) else
           "At ZeRO-3 minizero all-gathers in forward and again in backward (the paper's 3Ψ); so does "
           "DeepSpeed with the settings below (with its defaults both keep a small model gathered from forward "
           "into backward and gather once: --own-knobs)."),
        "- Memory: both libraries are measured at the same two moments of the last step, from the buffers they "
        "really hold (minizero's `memory.held_bytes`, DeepSpeed's `reference/ds_memory.py` walker): the state "
        "columns above are the end of backward; the section below has both moments, and names every byte "
        "that differs. On CPU, peak MB is the process RSS.",
        f"- This comparison adds {json.dumps(pinned_knobs(args))} "
        "to `zero_optimization` unless the config sets "
        "them: DeepSpeed's ZeRO-3 defaults replace `F.linear` (matmul then `+= bias`, which rounds differently "
        "in bf16/fp16), keep parameters under 1e5 elements unpartitioned (a small model would show no ZeRO-3 "
        "saving) and allocate a 5e8-element reduce bucket at init.",
        "- samples/s: median over logged intervals after the first; noisy (+-30%) on a shared CPU."
        + (" With the comms logger on, both libraries time every collective; DeepSpeed's wrapper costs 0.3-1 ms "
           "per collective on a CPU (measured on 2 gloo ranks: an 8 B all-reduce 0.4 -> 0.7-1.4 ms, a 200 KB one "
           "1.0-1.7 -> 1.9-2.2 ms), so its samples/s drop most at ZeRO-3, which issues the most collectives "
           "(`--no-comms-logger` for speed)." if getattr(args, "comms_logger", False) else "")]
    if offload:
        lines.append("- Offload (host B > 0): minizero moves exactly the optimizer shard (fp32 master + Adam "
                     "moments, 12 bytes per element of the rank's shard in mixed precision) to the host and, with "
                     "`offload_param`, ZeRO-3's partitioned low-precision parameters. DeepSpeed also keeps an fp32 "
                     "gradient partition on the host (4 bytes per element), at ZeRO-3 its low-precision gradient "
                     "partition there too, and at ZeRO-1/2 a low-precision staging copy of the shard plus two "
                     "staging buffers of the largest parameter's size, one on each side ("
                     """docs/deepspeed.md, "ZeRO-Offload's extra host buffers"). On a CPU-only machine """
                     "the device and the host are the same memory: the split says where the bytes would live "
                     "beside a GPU.")
    if args.dtype != "fp32" and 0 in args.stages:
        lines.append("- Stage 0 in fp16/bf16: DeepSpeed's stage-0 wrappers take one Adam step with zero gradients "
                     "at init (losses drift, bf16 up to ~6e-3 in 20 steps); its stage-0 fp16 never multiplies "
                     "the loss by the scale (gradients 1/65536 too small) and its loss scaler has no hysteresis. "
                     "minizero does not copy these quirks.")
    if args.dtype != "fp32":
        lines.append("- Expected loss agreement in low precision is op-order noise (bf16 ~2e-4, fp16 ~3e-5 "
                     "over 20 steps); fp32 agrees to ~1e-6.")
    return "\n".join(lines)


def torch_note(args) -> str:
    fsdp = os.path.join(REPO, "docs", "fsdp.md")   # relative when the report is inside the repo
    fsdp = os.path.relpath(fsdp, args.out) if args.out.startswith(REPO + os.sep) else fsdp
    return ("- PT = PyTorch itself (reference/torch_train.py, docs/fsdp.md): stage 0 is DistributedDataParallel, "
            "stage 3 FSDP2 `fully_shard` per block then the root (`reshard_after_forward=True`), stage 2 the same "
            "with `reshard_after_forward=False` (ZeRO-3's sharded states, ZeRO-2's bytes on the wire). FSDP2 pads "
            "each parameter's dim 0 to a multiple of N (minizero pads each flat unit), frees gradients at "
            "`zero_grad`, and its optimizer steps the fp32 shard itself (no separate master). Its gradient-norm "
            "all-reduce goes through DTensor's functional collectives and is not counted. "
            f"Details: [docs/fsdp.md]({fsdp})."
            + (" hsdp_shard_size S: the same on a 2-D mesh (N/S replicas, S shard ranks): gathers and the "
               "reduce-scatter inside a row of S ranks, then the gradient shard all-reduced across the rows."
               if "hsdp_shard_size" in hierarchy_keys(args) else "")
            + (" zero_hpz_partition_size k: `reshard_after_forward=k`, FSDP2's hpZ: after forward each block keeps "
               "a copy sharded over k ranks, which backward all-gathers from (freed after backward; DeepSpeed's "
               "secondary partition lives until the step)."
               if "zero_hpz_partition_size" in hierarchy_keys(args) else ""))


def report_md(info, args, rows, offload: bool = False, results=None) -> str:
    placed = (" device B / host B = the same split by where it lives: host memory with ZeRO-Offload."
              if offload else "")
    results = results or {}
    libs = getattr(args, "libs", list(LIBS))
    pair = all(lib in libs for lib in LIBS)   # minizero and deepspeed: the sections that name every byte
    ds_results = {s: {lib: r[lib] for lib in LIBS} for s, r in results.items()} if pair else {}
    return "\n".join([
        f"# {' vs '.join(NAMES[lib] for lib in libs)}: ZeRO stage(s) {', '.join(map(str, args.stages))}, {args.dtype}, "
        f"{args.nproc} rank(s)" + "".join(f", {key} {size}" for key, size in hierarchy_keys(args).items()), "", f"- command: `{info['command']}`", f"- machine: {info['machine']}",
        f"- date: {info['date']}", "- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
        f"- config: [config.json](config.json), each run with `--stage N --dtype {args.dtype}`", "",
        table(rows), "",
        ", ".join(f"{SHORT[lib]} = {NAMES[lib]}" for lib in libs) + ". state B = model-state bytes per rank at the end of the last step's "
        "backward (params + grads + master params + optimizer states); max abs dloss/step = max over optimizer steps of "
        f"|loss_{SHORT[libs[0]]} - loss_other|; "
        "wire B/step = ring-algorithm bytes per rank per optimizer step."
        + (" link B/step = the bytes node 0's ranks sent to another node per step (the section below)."
           if ranks_per_node(args) else "") + placed, "",
        *([note(args, offload)] if pair else []), *([torch_note(args)] if "torch" in libs else []), "",
        "![loss curves](loss_curves.png)", "",
        *(moments_section(ds_results, args.dtype) if pair else []),
        *(moments_by_lib(results, libs) if libs != list(LIBS) else []),
        "![memory](memory.png)", "",
        *(nodes_section(results, args, libs, ranks_per_node(args), scheme_of(args)) if ranks_per_node(args) else []),
        *(comms_section(ds_results) if pair else [])])


def scheme_of(args) -> str | None:
    """"hpz" or "hsdp": the multi-node key this comparison runs (check_hierarchy allows one size)."""
    keys = hierarchy_keys(args)
    return "hsdp" if "hsdp_shard_size" in keys else "hpz" if "zero_hpz_partition_size" in keys else None


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
        f.write(report_md(info, args, rows, offloaded(results), results))
    plot_losses(os.path.join(args.out, "loss_curves.png"), results)
    plot_memory(os.path.join(args.out, "memory.png"), results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**info, "rows": rows, "summaries": {str(s): r for s, r in results.items()}}, f, indent=1)
    print(table(rows))
    print(f"report: {os.path.join(args.out, 'report.md')}")


if __name__ == "__main__":
    main()
