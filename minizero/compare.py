"""minizero vs DeepSpeed, side by side: the same config, seed and data, stage by stage.

    python -m minizero.compare --stages 0 1 2 3 --dtype bf16 --nproc 2
    python -m minizero.compare --stages 3 --dtype fp32 --nproc 2 --max-steps 10 --synthetic-train 256

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
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys

from minizero.comm import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBS = ("minizero", "deepspeed")
STAGES = (0, 1, 2, 3)
CATEGORIES = ("params", "grads", "master_params", "optimizer_states")
PLACES = ("device", "host")
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
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun --nproc-per-node)")
    p.add_argument("--config", help="DeepSpeed JSON (default: minizero.train's built-in CPU config)")
    p.add_argument("--model", help="GPT preset (train.py's default: tiny on CPU, tutorial on GPU)")
    p.add_argument("--dataset", help="cifar10 or synthetic (train.py's default: synthetic on CPU)")
    p.add_argument("--image-size", type=int, help="8, 16 or 32")
    p.add_argument("--max-steps", type=int, default=30, help="optimizer steps per run")
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
    if args.dtype not in ("fp32", "bf16", "fp16"):
        raise CompareError(f"unknown --dtype {args.dtype!r}: choose fp32, bf16 or fp16")
    for name in ("nproc", "max_steps"):
        if getattr(args, name) < 1:
            raise CompareError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for mod in ("deepspeed", "matplotlib"):
        if importlib.util.find_spec(mod) is None:
            raise CompareError(f"{mod} is not installed: pip install -e .[dev]")
    if args.comms_logger is None:
        import torch
        args.comms_logger = not torch.cuda.is_available()
    args.out = os.path.abspath(args.out or os.path.join("reports", f"compare-{args.dtype}"))
    # Never overwrite an earlier comparison (its training runs would refuse their folders anyway).
    if os.path.isdir(args.out):
        earlier = sorted(f for f in os.listdir(args.out)
                         if f in ("report.md", "results.json") or f.startswith(tuple(f"{lib}-stage" for lib in LIBS)))
        if earlier:
            raise CompareError(f"{args.out} already holds a comparison ({', '.join(earlier[:3])}"
                               f"{', ...' if len(earlier) > 3 else ''}); pass a new --out, or remove that folder")


def pinned_knobs(args) -> dict:
    """COMPARE_DEFAULTS, less the knobs of when data moves with --own-knobs."""
    own = getattr(args, "own_knobs", False)
    return {k: v for k, v in COMPARE_DEFAULTS.items() if not (own and k in WHEN_KNOBS)}


def base_config(args) -> dict:
    """The config both libraries get: --config or train.py's default, plus COMPARE_DEFAULTS."""
    from minizero.train_args import DEFAULT_CONFIG, UserError, read_config_file
    try:
        cfg = read_config_file(args.config) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    except UserError as e:   # no such file / not JSON / not an object
        raise CompareError(str(e)) from None
    zero = cfg.get("zero_optimization")   # (--stage replaces DeepSpeed's deprecated `true` form)
    cfg["zero_optimization"] = {**pinned_knobs(args), **(zero if isinstance(zero, dict) else {})}
    # DeepSpeed logs whenever the section is present, whatever its "enabled" says
    # (docs/deepspeed.md, "comms_logger is on whenever the section is present"): off means no section.
    if getattr(args, "comms_logger", False):
        cfg["comms_logger"] = {**(cfg.get("comms_logger") or {}), "enabled": True}
    else:
        cfg.pop("comms_logger", None)
    return cfg


def run_command(lib, stage, args, extra, config_path, save_dir) -> list:
    script = ["-m", "minizero.train"] if lib == "minizero" else [os.path.join(REPO, "reference", "train.py")]
    flags = ["--config", config_path, "--stage", str(stage), "--dtype", args.dtype,
             "--seed", str(args.seed), "--save-dir", save_dir]
    for name in ("model", "dataset", "image_size", "max_steps"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script, *flags, *extra]


def run_one(cmd, save_dir, label) -> dict:
    """Run one training launch, its output into <save_dir>/run.log; return its summary.json."""
    os.makedirs(save_dir, exist_ok=True)
    log_path, summary_path = os.path.join(save_dir, "run.log"), os.path.join(save_dir, "summary.json")
    env = {"OMP_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
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


def moment_entries(summary, moment) -> list | None:
    """Per-rank model states at `moment` of the run's last step (runlog.MemoryMoments), or None."""
    moments = summary.get("memory_moments")
    return moments[moment] if moments else None


def state_entries(summary) -> list:
    """Per-rank entries the table's state columns read: the end of the last step's backward,
    measured alike in both libraries (runlog.MemoryMoments); summary.json's model_state_bytes
    for a summary without moments (one from before them)."""
    return moment_entries(summary, "after_backward") or summary["model_state_bytes"]


def state_bytes(summary) -> list:
    """Per-rank model-state bytes: the sum of the four categories."""
    return [sum(int(r.get(c) or 0) for c in CATEGORIES) for r in state_entries(summary)]


def category_bytes(entry, category, place=None) -> int:
    """One rank's bytes of `category`: in all (place None) or on the "device" / "host".
    An entry without the split (a summary from before it, or reference/train.py without
    its walker) holds everything on the device."""
    if place is None or "device" not in entry:
        return int(entry.get(category) or 0) if place in (None, "device") else 0
    return int((entry.get(place) or {}).get(category) or 0)


def placed_bytes(entry) -> dict:
    """{"device": bytes, "host": bytes} of one rank's model states."""
    return {w: sum(category_bytes(entry, c, w) for c in CATEGORIES) for w in PLACES}


def offloaded(results) -> bool:
    """Whether any run of either library holds model states in host memory (ZeRO-Offload)."""
    return any(placed_bytes(e)["host"] for runs in results.values() for s in runs.values()
               for e in state_entries(s))


def stage_row(stage, mz, ds) -> dict:
    n = min(len(mz["losses"]), len(ds["losses"]))
    diffs = [abs(a - b) for a, b in zip(mz["losses"][:n], ds["losses"][:n]) if a is not None and b is not None]
    row = {"stage": stage, "steps": n, "max_abs_dloss": max(diffs) if diffs else None}
    for lib, s in zip(LIBS, (mz, ds)):
        sb = state_bytes(s)
        where = placed_bytes(state_entries(s)[0])
        row[lib] = {"final_loss": s["final_loss"], "test_loss": s["test_loss"], "state_bytes_rank0": sb[0],
                    "device_bytes_rank0": where["device"], "host_bytes_rank0": where["host"],
                    "state_bytes_max": max(sb), "peak_mem_mb": max(s["peak_mem_mb"]),
                    "samples_per_s": s["samples_per_s"],
                    "wire_bytes_per_step": (s["comm_wire_bytes_per_step"] or {}).get("total", 0),
                    "skipped_steps": s["skipped_steps"]}
    a, b = row["minizero"]["samples_per_s"], row["deepspeed"]["samples_per_s"]
    row["speed_ratio"] = a / b if a and b else None
    return row


# ----------------------------------------------------------------------------- memory at the same moments

MOMENTS = ("after_backward", "after_step")
MOMENT_TITLES = {"after_backward": "end of backward", "after_step": "after the step"}
DOCS = "docs/deepspeed.md"
HOLDS = f'{DOCS}, "Memory DeepSpeed holds per rank"'
OFFLOAD = f"{DOCS}, \"ZeRO-Offload's extra host buffers\""
FP32_MASTER = f'{DOCS}, "fp32 ZeRO keeps a second fp32 master copy"'
# DeepSpeed buffers that have no minizero counterpart at a moment: (details source, when) -> why.
# "after_step": only after the step (minizero has dropped its gradients by then); "host": only
# in host memory (offload); "always".
DS_OVERHEADS = {
    "grads:grad_partitions_flat_buffer": {
        "after_step": f"ZeRO-3 keeps its gradient partition `grad_partitions_flat_buffer` from init to the end ({HOLDS})",
        "host": f"offload: the reduced gradient partition `grad_partitions_flat_buffer` lives on the host ({OFFLOAD})"},
    "grads:single_partition_of_fp32_groups[i].grad": {
        "always": f"offload: the fp32 master's `.grad` on the host, filled in backward, kept ({OFFLOAD})"},
    "grads:fp32_partitioned_groups_flat[i].grad": {
        "always": f"offload: each sub-group's fp32 `.grad` on the host, kept ({OFFLOAD})"},
    "grads:temp_grad_buffer_for_cpu_offload": {
        "always": f"offload: a host staging buffer of the largest parameter's size ({OFFLOAD})"},
    "grads:temp_grad_buffer_for_gpu_offload": {
        "always": f"offload: a device staging buffer of the largest parameter's size ({OFFLOAD})"},
    "grads:accumulated_grads_in_cpu": {
        "always": f"offload: gradients accumulated on the host across micro-steps ({OFFLOAD})"},
    "params:param_buffer_of_bit16_for_cpu_offload_groups": {
        "always": f"offload: a low-precision copy of the updated slice on the host ({OFFLOAD})"},
}
# bytes per element of each category; "lp": the training dtype's
ELEMENT_BYTES = {"params": "lp", "grads": "lp", "master_params": 4, "optimizer_states": 8}


def _details(entry, place) -> dict:
    """DeepSpeed's {"category:source": bytes} at `place` (None: everywhere)."""
    if place is None:
        return entry.get("details") or {}
    return (entry.get("details_by_place") or {}).get(place) or {}


def padding_bytes(stage, dtype, category, mz, ds) -> int:
    """DeepSpeed minus minizero in `category` that layout padding alone makes, from the
    two layouts' element counts ("elements": full = kept whole, shard = this rank's
    partition). DeepSpeed pads each param group to 2N elements (ZeRO-1/2) or each parameter
    to N (ZeRO-3), minizero each FlatParam to N (docs/deepspeed.md, "Memory DeepSpeed holds
    per rank"). None without the counts."""
    a, b = mz.get("elements"), ds.get("elements")
    if not a or not b:
        return None
    per = ELEMENT_BYTES[category]
    per = (4 if dtype == "fp32" else 2) if per == "lp" else per
    if category == "params":
        which = "shard" if stage == 3 else "full"
    else:
        which = "shard" if stage >= 1 else "full"
    return per * (b[which] - a[which])


def memory_differences(stage, dtype, moment, category, place, mz, ds) -> list:
    """DeepSpeed's bytes minus minizero's for one rank, category and place (None: both places
    together) at one moment, cut into named parts: [(bytes, why)], summing exactly to the
    difference. Every why names the docs/deepspeed.md section of that DeepSpeed overhead; a
    part no rule explains is returned as "unexplained" (the tests assert there is none)."""
    mz_b, ds_b = category_bytes(mz, category, place), category_bytes(ds, category, place)
    parts, left = [], ds_b - mz_b
    if not left:
        return parts
    host = place == "host"
    for source, b in sorted(_details(ds, place).items()):
        rule = DS_OVERHEADS.get(source)
        if not b or not source.startswith(category + ":") or rule is None:
            continue
        why = rule.get("always") or (rule.get("after_step") if moment == "after_step" else None) \
            or (rule.get("host") if host else None)
        if place is None and rule.get("host") and not rule.get("always") and moment != "after_step":
            b = _details(ds, "host").get(source, 0)   # both places together: only its host part
            why = rule["host"] if b else None
        if why:
            parts.append((b, why))
            left -= b
    if category == "master_params" and dtype == "fp32" and stage >= 1 and mz_b == 0 and ds_b > 0:
        parts.append((left, f"fp32: DeepSpeed's ZeRO keeps an fp32 master beside the fp32 parameters, minizero's "
                            f"shard is its master ({FP32_MASTER})"))
        return parts
    if category == "grads" and moment == "after_backward" and left:
        ds_offloads = category_bytes(ds, "grads", "host") > 0
        if place == "device" and ds_offloads and left == -mz_b:
            parts.append((left, "offload: DeepSpeed keeps no gradient partition on the device after backward (each "
                                f"piece went to the host), minizero its reduced shard until the step ({OFFLOAD})"))
            return parts
        if stage in (1, 2) and not ds_offloads:
            parts.append((left, "ZeRO-1/2's gradient partition holds the whole parameters that straddle its slice "
                                "(and, at ZeRO-1 with gradient_accumulation_steps 1, it reduces in backward hooks "
                                f"like ZeRO-2 where minizero's ZeRO-1 holds the full gradient until the step) ({HOLDS})"))
            return parts
    pad = padding_bytes(stage, dtype, category, mz, ds)
    if left and pad and left == pad:
        parts.append((left, f"padding: DeepSpeed pads each param group to 2N elements (ZeRO-1/2) or each "
                            f"parameter to N (ZeRO-3), minizero each FlatParam to N ({HOLDS})"))
        left = 0
    if left:
        parts.append((left, "unexplained"))
    return parts


def moments_table(results, dtype) -> str:
    """Rank 0's model states at both moments of the last step, category by category (and
    place by place with offload): minizero, DeepSpeed, and every byte of the difference named."""
    places = PLACES if offloaded(results) else (None,)
    lines = ["| stage | moment | category" + (" | place" if places != (None,) else "")
             + " | minizero B | DeepSpeed B | DS - mz | named difference (DeepSpeed's overhead) |"]
    lines.append("|" + "---|" * (8 if places != (None,) else 7))
    for stage in sorted(results):
        mz_run, ds_run = results[stage]["minizero"], results[stage]["deepspeed"]
        for moment in MOMENTS:
            mz, ds = moment_entries(mz_run, moment), moment_entries(ds_run, moment)
            if not mz or not ds:
                continue
            for c in CATEGORIES:
                for place in places:
                    a, b = category_bytes(mz[0], c, place), category_bytes(ds[0], c, place)
                    parts = memory_differences(stage, dtype, moment, c, place, mz[0], ds[0])
                    why = "; ".join(f"{n:+,} B {w}" for n, w in parts) if parts else "same"
                    cells = [str(stage), MOMENT_TITLES[moment], c] + ([place] if place else []) + \
                        [f"{a:,}", f"{b:,}", f"{b - a:+,}", why]
                    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def moments_step(results):
    steps = {r[lib]["memory_moments"]["step"] for r in results.values() for lib in LIBS
             if r[lib].get("memory_moments")}
    return min(steps) if steps else None


# ----------------------------------------------------------------------------- the comms summaries

OP_ORDER = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
SCALAR_BYTES = 64   # an all-reduce this small carries a few scalars (a norm, a flag), not a tensor
RS_COUNT = f'{DOCS}, "comms_logger counts reduce_scatter\'s input N times"'
RS_IS_AR = f'{DOCS}, "ZeRO-1/2 reduce-scatter is an all-reduce"'


def comms_rows(mz: dict | None, ds: dict | None) -> list:
    """The two summaries ({op: {msg bytes: record}}, the "summary" of log_summary) merged by
    (op, message size): [(op, size, minizero record or None, DeepSpeed record or None)]."""
    mz, ds = mz or {}, ds or {}
    ops = sorted(set(mz) | set(ds), key=lambda o: (OP_ORDER.index(o) if o in OP_ORDER else len(OP_ORDER), o))
    rows = []
    for op in ops:
        a, b = mz.get(op) or {}, ds.get(op) or {}
        for size in sorted({int(k) for k in a} | {int(k) for k in b}):
            rows.append((op, size, a.get(str(size), a.get(size)), b.get(str(size), b.get(size))))
    return rows


def comms_reason(stage: int, op: str, size: int, mz, ds) -> str | None:
    """Why a row differs between the libraries (None when op, size and count agree)."""
    if mz is not None and ds is not None and mz["count"] == ds["count"]:
        return None
    if op == "broadcast":
        return ("the initial weights from rank 0: DeepSpeed broadcasts each parameter tensor (`_broadcast_model`"
                + ("; ZeRO-3's zero.Init broadcasts each once more, plus a few small broadcasts of its init checks"
                   if stage == 3 else "") + "), minizero each FlatParam's flat buffer once")
    if op == "all_gather_into_tensor":
        if stage == 3:
            return ("ZeRO-3's parameter all-gathers: DeepSpeed one per parameter (message = its partition; a "
                    "module's parameters are issued together; every parameter once more at init), minizero one "
                    "per (unit, param group) FlatParam, in forward and again in backward")
        return ("the parameter all-gather after the step, one per flat buffer: DeepSpeed's per param group "
                "(2N-padded), minizero's per reduce bucket (N-padded)")
    if op == "reduce_scatter_tensor":
        if stage in (1, 2):
            return (f"gradient reduction: minizero reduce-scatters each bucket where DeepSpeed all-reduces it "
                    f"({RS_IS_AR}); the message size is the whole N-shard input, and algbw/busbw N times what "
                    f"moved ({RS_COUNT})")
        return ("ZeRO-3's gradient reduce-scatter: DeepSpeed one per reduce bucket (up to reduce_bucket_size "
                "elements), minizero one per (unit, param group) FlatParam as each unit's backward ends; the "
                f"message size is the whole N-shard input in both, algbw/busbw N times what moved ({RS_COUNT})")
    if op == "all_reduce":
        if size <= SCALAR_BYTES:
            return scalar_reason(stage, size, mz, ds)
        if stage == 0:
            return ("the stage-0 gradient average: DeepSpeed all-reduces one bucket of all gradients (up to "
                    "reduce_bucket_size elements), minizero one per FlatParam (a bucket per param group)")
        if stage in (1, 2):
            return f"gradient reduction: DeepSpeed all-reduces the whole bucket where minizero reduce-scatters ({RS_IS_AR})"
    if mz is None and "barrier" in op:
        return ("DeepSpeed times its barriers too (its checkpoint save, ZeRO-3's init, log_summary's own); "
                "minizero's logger times the four collectives that move data")
    return "unexplained"


def scalar_reason(stage: int, size: int, mz, ds) -> str:
    """A few-byte all-reduce: which scalars each library reduces at this size."""
    norm = f'{DOCS}, "The gradient norm is fp32 at ZeRO-1/2 and fp64 at ZeRO-3"'
    said = []
    if ds is not None:
        said.append({1: "DeepSpeed's overflow vote (`has_overflow`: one uint8 per step, bf16/fp16)",
                     4: f"DeepSpeed's fp32 gradient norm (`get_grad_norm_direct`, ZeRO-1/2, twice per step; {norm})",
                     8: f"DeepSpeed's fp64 gradient norm (`get_grad_norm_direct`, ZeRO-3, twice per step; {norm})",
                     20: "DeepSpeed's checkpoint tag check (`_checkpoint_tag_validation`, one per save)"}.get(
                         size, "DeepSpeed's scalar all-reduces"))
    if mz is not None:
        said.append("minizero's fp64 squared gradient norm (once per step at ZeRO-1-3) and two checks per "
                    "checkpoint save (finite, shared)" if size == 8 else "minizero's scalar all-reduces")
    return "; ".join(said)


def _comms_cell(rec, key, kind="g"):
    if rec is None:
        return "-"
    v = rec[key]
    return f"{v:,}" if kind == "d" else f"{v:.2f}"


def comms_table(stage: int, mz: dict | None, ds: dict | None) -> str:
    """One stage's comms summaries side by side, rank 0, DeepSpeed's columns for each library."""
    lines = ["| op | message size | count mz | count DS | avg latency ms mz | avg latency ms DS | busbw Gbps mz | "
             "busbw Gbps DS | why it differs |", "|" + "---|" * 9]
    from minizero.comms_logger import convert_size
    for op, size, a, b in comms_rows(mz, ds):
        why = comms_reason(stage, op, size, a, b)
        lines.append("| " + " | ".join([op, convert_size(size), _comms_cell(a, "count", "d"), _comms_cell(b, "count", "d"),
                                        _comms_cell(a, "avg_latency_ms"), _comms_cell(b, "avg_latency_ms"),
                                        _comms_cell(a, "busbw_avg_gbps"), _comms_cell(b, "busbw_avg_gbps"),
                                        why or "same op, size and count"]) + " |")
    return "\n".join(lines)


def comms_section(results) -> list:
    """report.md's collectives section: per stage, both comms summaries side by side."""
    if not any(r[lib].get("comms_summary") is not None for r in results.values() for lib in LIBS):
        return []
    out = ["## Collectives: DeepSpeed's comms summary beside minizero's", "",
           "Each library's comms logger (the `comms_logger` config section; DeepSpeed's `deepspeed.comm."
           "log_summary()`, minizero's own table from its timings, with DeepSpeed's formulas), rank 0, the whole run "
           "(init and evaluation included, sampling not). Latencies and bandwidths are timings and never agree "
           "between two runs; a row differs when its op, message size or count does, and each such row says why. "
           "Message size is the logged tensor's: all_gather's input shard, reduce_scatter's whole input. Each "
           "run's own table is in its folder (comms_summary.txt).", ""]
    for stage in sorted(results):
        out += [f"### ZeRO-{stage}", "", comms_table(stage, results[stage]["minizero"].get("comms_summary"),
                                                   results[stage]["deepspeed"].get("comms_summary")), ""]
    return out


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
    return {"python": platform.python_version(), **{p: importlib.metadata.version(p) for p in ("torch", "deepspeed")}}


def fmt(x, kind="g") -> str:
    if x is None:
        return "-"
    return {"loss": "{:.6f}", "bytes": "{:,.0f}", "d": "{:.2e}", "g": "{:.3g}"}[kind].format(x)


# (column title, key in each library's part of a row, format); one column per library
PER_LIB = [("final loss", "final_loss", "loss"), ("state B r0", "state_bytes_rank0", "bytes"),
           ("state B max", "state_bytes_max", "bytes"), ("peak MB", "peak_mem_mb", "bytes"),
           ("samples/s", "samples_per_s", "g"), ("wire B/step", "wire_bytes_per_step", "bytes")]
# with ZeRO-Offload, after "state B r0": where rank 0's model states live
PLACED = [("device B r0", "device_bytes_rank0", "bytes"), ("host B r0", "host_bytes_rank0", "bytes")]


def table(rows) -> str:
    """The markdown table, one row per stage. Device / host columns appear when a run
    offloads (some library holds model states in host memory)."""
    placed = any(r[lib]["host_bytes_rank0"] for r in rows for lib in LIBS if "host_bytes_rank0" in r[lib])
    columns = PER_LIB[:2] + (PLACED if placed else []) + PER_LIB[2:]
    speed_at = 2 + 2 * (columns.index(PER_LIB[4]) + 1)   # "mz/DS speed" after the samples/s pair
    head = ["stage", "max abs dloss/step"] + [f"{t} {lib}" for t, _, _ in columns for lib in ("mz", "DS")]
    head.insert(speed_at, "mz/DS speed")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["stage"]), fmt(r["max_abs_dloss"], "d")]
        cells += [fmt(r[lib][key], kind) for _, key, kind in columns for lib in LIBS]
        cells.insert(speed_at, fmt(r["speed_ratio"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def moments_section(results, dtype) -> list:
    """report.md's memory section: both moments, category by category, differences named."""
    step = moments_step(results)
    if step is None:
        return []
    return [f"## Model states at the same moments (rank 0, step {step})", "",
            "Both libraries read at the end of the step's backward (after `engine.backward` of its last "
            "micro-batch, before `engine.step`) and after the step (after `engine.step`), the bytes each really "
            "holds. Every difference is cut into DeepSpeed's documented overheads, to the byte.", "",
            moments_table(results, dtype), ""]


def report_md(info, args, rows, offload: bool = False, results=None) -> str:
    placed = (" device B / host B = the same split by where it lives: host memory with ZeRO-Offload."
              if offload else "")
    results = results or {}
    return "\n".join([
        f"# minizero vs DeepSpeed: ZeRO stage(s) {', '.join(map(str, args.stages))}, {args.dtype}, "
        f"{args.nproc} rank(s)", "", f"- command: `{info['command']}`", f"- machine: {info['machine']}",
        f"- date: {info['date']}", "- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
        f"- config: [config.json](config.json), each run with `--stage N --dtype {args.dtype}`", "",
        table(rows), "",
        "mz = minizero, DS = DeepSpeed. state B = model-state bytes per rank at the end of the last step's "
        "backward (params + grads + master params + optimizer states); max abs dloss/step = max over optimizer steps of |loss_mz - loss_DS|; "
        "wire B/step = ring-algorithm bytes per rank per optimizer step." + placed, "",
        note(args, offload), "", "![loss curves](loss_curves.png)", "", *moments_section(results, args.dtype),
        "![memory](memory.png)", "", *comms_section(results)])


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
        for lib, style in zip(LIBS, ("-", "--")):
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
    places = PLACES if offloaded(results) else (None,)
    timed = all(moment_entries(results[s][lib], m) for s in stages for lib in LIBS for m in MOMENTS)
    moments = MOMENTS if timed else (None,)
    fig, axes = plt.subplots(len(moments), len(places), figsize=(len(places) * max(5, 2 * len(stages)),
                                                                 4 * len(moments)),
                             squeeze=False, sharey=True)
    colors = dict(zip(CATEGORIES, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for row, moment in zip(axes, moments):
        for ax, place in zip(row, places):
            for j, (lib, hatch) in enumerate(zip(LIBS, ("", "//"))):
                xs = [i + (j - 0.5) * 0.38 for i in range(len(stages))]
                bottom = [0.0] * len(stages)
                for c in CATEGORIES:
                    entries = [(moment_entries(results[s][lib], moment) if moment else
                                results[s][lib]["model_state_bytes"])[0] for s in stages]
                    h = [category_bytes(e, c, place) / 2**20 for e in entries]
                    ax.bar(xs, h, 0.36, bottom=bottom, color=colors[c], hatch=hatch, edgecolor="black",
                           label=None if j else c)
                    bottom = [b + x for b, x in zip(bottom, h)]
            ax.set_xticks(range(len(stages)), [f"ZeRO-{s}\nmz | DS" for s in stages])
            where = f" on the {place}" if place else ""
            when = f"{MOMENT_TITLES[moment]}" if moment else ""
            ax.set(ylabel=f"model-state MiB{where} (rank 0)",
                   title=", ".join(filter(None, [when, f"on the {place}" if place else ""])) or
                   "Model states, rank 0: minizero | DeepSpeed (hatched)")
            ax.legend(fontsize=8)
    if places != (None,) or moments != (None,):
        step = moments_step(results) if moments != (None,) else None
        fig.suptitle("Model states, rank 0: minizero | DeepSpeed (hatched)" + (f", step {step}" if step else ""))
    savefig(fig, path)


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
        runs = [(s, lib) for s in args.stages for lib in LIBS]
        for stage, lib in tqdm(runs, desc="compare", unit="run"):
            save_dir = os.path.join(args.out, f"{lib}-stage{stage}")
            cmd = run_command(lib, stage, args, extra, config_path, save_dir)
            results.setdefault(stage, {})[lib] = run_one(cmd, save_dir, f"stage {stage} {lib}")
        rows = [stage_row(s, results[s]["minizero"], results[s]["deepspeed"]) for s in args.stages]
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
