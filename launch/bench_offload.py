"""What ZeRO-Offload costs: step time with and without offload, what the offload step spends
its time on, and which Adam torch runs fastest on a CPU.

    python3 launch/bench_offload.py                                  # defaults: a few minutes on 2 CPU cores
    python3 launch/bench_offload.py --libs minizero --steps 2 --warmup 1 --n-embd 32 --seq 16
    python3 launch/bench_offload.py --world-size 4 --out bench.md --json bench.json

What it runs: for ZeRO stages 1, 2, 3 (stage 3: no offload / offload_optimizer /
offload_optimizer + offload_param), minizero and DeepSpeed train the same GPT (a preset,
shrunk by the size flags) on the same random tokens, one after the other, on `--world-size`
ranks: gloo ranks on a CPU machine, NCCL ranks (one GPU each) where CUDA is available.
Each run: `--warmup` untimed steps, `--steps` timed steps (a barrier-free loop; the time of a
step is the slowest rank's, reported as the median over steps), then `--profile-steps` steps
under torch.profiler. It prints (stdout, markdown; progress on stderr):

1. step time: ms/step and samples/s per library, the slowdown against the same stage
   without offload, minizero's host<->device copies per step (engine.comm_stats()) and
   where its model states live (memory_breakdown(): device / host); on a GPU also each
   library's peak CUDA memory per rank (torch.cuda.max_memory_allocated, init included).
2. minizero's step, broken down from the profiler's ranges: forward/backward compute,
   collectives (`minizero::<op>::<label>`, waiting for the other ranks included), copies
   (`minizero::d2h::...`, `minizero::h2d::...`), CPU Adam (torch's `Optimizer.step#...`
   range) and the rest of the optimizer step; the largest part is named. For DeepSpeed
   only its Adam range can be told apart. Ranges measure host time: on a GPU, kernels run
   asynchronously and are charged to whichever range waits for them.
3. the Adam implementations torch offers (for-loop, foreach, fused AdamW) on one fp32
   tensor of Ψ/N elements of this model and of the DeepSpeed tutorial's 24-layer GPT
   (Ψ/2 = 9,739,392), on the CPU with `--threads` threads (and on the GPU when there is
   one): ms/step, and whether each ends bit-identical to the for-loop.

Both libraries get "torch_adam": true (DeepSpeed's own CPU Adam is a C++ extension it
would compile first) and the ZeRO-3 settings minizero.compare uses (persistence 0, no
prefetch, memory_efficient_linear off) so they run the same algorithm; `--tutorial-zero`
uses the step-5 config's zero_optimization values instead. `--libs minizero-fused` adds
minizero without torch_adam: with offload it then runs torch's fused CPU AdamW
(adam.build_optimizer).

To change the number of processes: --world-size (on a GPU machine at most one rank per
visible GPU). Runs are short: on a machine shared with other jobs whole-step times swing by
more than offload adds (docs/offload.md shows two runs); the profiler's ranges are the
direct measure of what offload adds.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `python3 launch/bench_offload.py` from anywhere
import kit  # noqa: E402
from kit import BenchError, OneLineParser, fmt, md_table, mib  # noqa: E402

kit.bootstrap()
from minizero.compare.compare import COMPARE_DEFAULTS  # noqa: E402  (standard library only)

ROOT = kit.ROOT

LIBS = ("minizero", "minizero-fused", "deepspeed")
DEFAULT_LIBS = "minizero,deepspeed"
OFFLOADS = {
    "none": {},
    "optimizer": {"offload_optimizer": {"device": "cpu"}},
    "optimizer+param": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    # ZeRO-Infinity's NVMe tier (--nvme-path): the same, swapped to files between uses
    "nvme:optimizer": {"offload_optimizer": {"device": "nvme"}},
    "nvme:optimizer+param": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}
# (stage, offload): offload_param exists at stage 3 only
CASES = [(1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"),
         (3, "none"), (3, "optimizer"), (3, "optimizer+param")]
NVME_CASES = [(1, "nvme:optimizer"), (2, "nvme:optimizer"), (3, "nvme:optimizer"), (3, "nvme:optimizer+param")]


def cases_for(args) -> list:
    """CASES, and with --nvme-path the same offloads to NVMe."""
    return CASES + (NVME_CASES if getattr(args, "nvme_path", None) else [])


# minizero.compare's settings: both libraries run the same ZeRO-3 algorithm (gather on use,
# every parameter partitioned, same F.linear, a small reduce bucket)
SAME_ALGORITHM_ZERO = COMPARE_DEFAULTS
STEP5_CONFIG = ROOT / "launch" / "ds_config_step5.json"
TUTORIAL_24_HALF = 9_739_392   # Ψ/2 of the tutorial-24 GPT (19,478,784 parameters)
ADAM_IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# the parts of a step, in the order tables show them
PARTS = ("fwd_bwd", "collectives", "d2h", "h2d", "adam", "step_other", "loop")
PART_TITLES = {"fwd_bwd": "fwd+bwd compute", "collectives": "collectives (incl. waiting)",
               "d2h": "copy d2h", "h2d": "copy h2d", "adam": "CPU Adam" , "step_other": "rest of step",
               "loop": "loop/other"}


# ----------------------------------------------------------------------------- flags

def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="python3 launch/bench_offload.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default=DEFAULT_LIBS, help=f"comma-separated, of {', '.join(LIBS)} (default {DEFAULT_LIBS})")
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages of 1, 2, 3")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default 2; on a GPU machine min(2, GPUs))")
    p.add_argument("--model", default="tutorial-24", help="GPT preset (minizero/gpt/model.py PRESETS)")
    p.add_argument("--n-layer", type=int, help="override the preset's depth")
    p.add_argument("--n-embd", type=int, default=64, help="width (default 64; the preset's 256 is slow on a CPU)")
    p.add_argument("--n-head", type=int, help="heads (default: the preset's, or 4 when it does not divide --n-embd)")
    p.add_argument("--seq", type=int, default=32, help="tokens per row (default 32)")
    p.add_argument("--block-size", type=int,
                   help="the model's position table (default --seq; the preset's 1023 keeps its exact Ψ)")
    p.add_argument("--micro-batch", type=int, default=2, help="train_micro_batch_size_per_gpu (default 2)")
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps (default 1)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="default bf16 (DeepSpeed's CPU accelerator refuses fp16; patched here when asked)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per run for the breakdown (default 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank and for the Adam table (default 1, as torchrun's OMP_NUM_THREADS)")
    p.add_argument("--adam-steps", type=int, default=5, help="timed steps per Adam implementation (default 5)")
    p.add_argument("--no-adam", action="store_true", help="skip the Adam table")
    p.add_argument("--tutorial-zero", action="store_true",
                   help="zero_optimization values of launch/ds_config_step5.json instead of minizero.compare's")
    p.add_argument("--nvme-path", help="also run the offloads with \"device\": \"nvme\", swap files in this folder "
                                        "(one subfolder per run; docs/offload.md, \"ZeRO-Infinity\")")
    kit.add_output_flags(p, "the markdown report", "DeepSpeed's and minizero's")
    return p.parse_args(argv)


def check_args(args, cuda: bool | None = None, gpus: int | None = None) -> None:
    """Normalise args in place; BenchError with one line for anything that cannot run."""
    args.libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    if not args.libs or any(x not in LIBS for x in args.libs):
        raise BenchError(f"--libs {','.join(args.libs) or '(empty)'}: choose from {', '.join(LIBS)}")
    try:
        args.stages = sorted({int(s) for s in args.stages.split(",") if s.strip()})
    except ValueError:
        raise BenchError(f"--stages {args.stages!r}: give comma-separated numbers of 1, 2, 3") from None
    if not args.stages or not set(args.stages) <= {1, 2, 3}:
        raise BenchError(f"--stages {args.stages}: choose from 1, 2, 3 (offload needs ZeRO)")
    if args.block_size is not None and args.block_size < args.seq:
        raise BenchError(f"--block-size {args.block_size} < --seq {args.seq}: the model has no position for the later tokens")
    kit.check_launch(args, [lib.split("-")[0] for lib in args.libs], cuda, gpus)
    kit.at_least(args, 1, ("world_size", "seq", "micro_batch", "gas", "steps", "threads", "adam_steps", "n_embd"))
    kit.at_least(args, 0, ("warmup", "profile_steps"))
    if args.tutorial_zero and not STEP5_CONFIG.is_file():
        raise BenchError(f"--tutorial-zero: {STEP5_CONFIG.relative_to(ROOT)} is missing")


# ----------------------------------------------------------------------------- configs

def zero_section(stage: int, offload: str, tutorial_zero: bool) -> dict:
    if tutorial_zero:
        zero = json.loads(STEP5_CONFIG.read_text())["zero_optimization"]
        zero = {k: v for k, v in zero.items() if not k.startswith("offload_")}
        zero["memory_efficient_linear"] = False
    else:
        zero = dict(SAME_ALGORITHM_ZERO)
    return {**zero, "stage": stage, **json.loads(json.dumps(OFFLOADS[offload]))}


def make_config(stage: int, offload: str, args, lib: str) -> dict:
    """One DeepSpeed config; minizero-fused leaves torch_adam off (fused CPU AdamW with offload)."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": lib != "minizero-fused"}},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": zero_section(stage, offload, args.tutorial_zero)}
    if args.dtype != "fp32":
        cfg[args.dtype] = {"enabled": True}
    for section in cfg["zero_optimization"].values():
        if isinstance(section, dict) and section.get("device") == "nvme":   # a folder per run: each is locked
            section["nvme_path"] = os.path.join(os.path.abspath(args.nvme_path), f"{lib}-s{stage}-{offload[5:]}")
    return cfg


def jobs_for(args) -> list[list[dict]]:
    """Every run, as launches of fresh ranks. With DeepSpeed, one run per launch (its ZeRO-3
    patches torch process-wide), case by case (minizero, then DeepSpeed) so that a change in
    the load of a shared machine hits both libraries' runs of a case alike. minizero alone
    patches nothing process-wide: all its runs share one launch."""
    launches = []
    for stage, offload in cases_for(args):
        if stage not in args.stages:
            continue
        for lib in args.libs:
            if lib == "minizero-fused" and offload == "none":
                continue    # without offload it is the same AdamW as "minizero"
            launches.append([{"lib": lib, "stage": stage, "offload": offload,
                              "config": make_config(stage, offload, args, lib)}])
    if "deepspeed" not in args.libs:
        return [[job for launch in launches for job in launch]] if launches else []
    return launches


# ----------------------------------------------------------------------------- one rank

def bench_job(job: dict, args_d: dict) -> dict:
    """Train one config on this rank (inside the process group): timed steps, then profiled."""
    import torch

    from minizero import comm
    lib = job["lib"].split("-")[0]      # minizero-fused is minizero with another optimizer
    engine = kit.make_engine(lib, job["config"], args_d)
    cuda = torch.cuda.is_available()
    rank, world, gas = comm.get_rank(), comm.get_world_size(), engine.gradient_accumulation_steps()
    n_warm, n_time, n_prof = args_d["warmup"], args_d["steps"], args_d["profile_steps"]
    batches = kit.make_batches(args_d, n_warm + n_time + n_prof, gas, rank, kit.engine_device(engine))
    engine.train()
    kit.timed_steps(engine, batches, 0, n_warm, gas, cuda)
    comm0 = copy_counts(engine, lib)
    timed = kit.timed_steps(engine, batches, n_warm, n_time, gas, cuda)
    comm1 = copy_counts(engine, lib)
    out = {"rank": rank, "world_size": world, "step_s": timed["step_s"], "step_wall_s": timed["step_wall_s"],
           "phase_s": timed["phase_s"], "final_loss": timed["final_loss"],
           "copies_per_step": {k: (comm1[k] - comm0[k]) / n_time for k in comm1} if comm1 else None}
    if n_prof:
        from torch.profiler import ProfilerActivity, profile
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:   # host ranges only (see the docstring)
            t0 = time.perf_counter()
            for step in range(n_warm + n_time, n_warm + n_time + n_prof):
                kit.one_step(engine, batches, step, gas)
            if cuda:
                torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) * 1e6
        out["breakdown"] = breakdown(ranges_of(prof), wall_us, n_prof)
    if lib != "deepspeed":
        out["memory"] = engine.memory_breakdown()
        engine.destroy()   # "nvme": its swap files and folder
    out["peak_cuda_bytes"] = kit.peak_cuda_bytes()
    return out


def copy_counts(engine, lib: str) -> dict | None:
    """minizero's ledger: bytes each way between device and host, and collective wire bytes."""
    if lib == "deepspeed":
        return None
    st = engine.comm_stats()
    out = {"d2h": st["d2h"]["bytes"], "h2d": st["h2d"]["bytes"],
           "wire": sum(st[op]["wire_bytes"] for op in COLLECTIVES)}
    if engine.offload is not None and engine.offload.tier is not None:   # "nvme": file reads and writes
        out.update({op: st.get(op, {}).get("bytes", 0) for op in ("nvme_read", "nvme_write")})
    return out


def ranges_of(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the ranges `breakdown` reads, from a finished profile."""
    keep = ("minizero::", "Optimizer.step#")
    return [(e.name, float(e.time_range.start), float(e.time_range.end))
            for e in prof.events() if e.name.startswith(keep)]


# ----------------------------------------------------------------------------- pure helpers

def range_kind(name: str) -> str | None:
    """Which part of a step a profiler range is: forward/backward/step (minizero's engine
    ranges), a collective, a copy, or Adam; None for anything else."""
    if name in ("minizero::forward", "minizero::backward", "minizero::step"):
        return name.split("::")[1]
    if name.startswith("Optimizer.step#"):
        return "adam"
    parts = name.split("::")
    if len(parts) >= 2 and parts[0] == "minizero":
        if parts[1] in COLLECTIVES:
            return "collectives"
        if parts[1] in ("d2h", "h2d"):
            return parts[1]
    return None


def breakdown(ranges, wall_us: float, steps: int) -> dict:
    """ms per step of each part of `steps` profiled steps that took `wall_us` in all.

    ranges: (name, start_us, end_us). Collectives, copies and Adam are charged to the
    optimizer step when they lie inside a `minizero::step` range, else to forward/backward:

        fwd_bwd     = forward + backward - the collectives and copies inside them
        step_other  = step - its collectives, copies and Adam (norm, unscale, rounding, staging)
        loop        = wall - forward - backward - step - Adam outside any step (the loop, data,
                      and for DeepSpeed, which has no minizero ranges, everything but Adam)
    """
    total = {k: 0.0 for k in ("forward", "backward", "step", "collectives", "d2h", "h2d", "adam")}
    in_step = {k: 0.0 for k in ("collectives", "d2h", "h2d", "adam")}
    steps_iv = sorted((s, e) for n, s, e in ranges if n == "minizero::step")
    for name, start, end in ranges:
        kind = range_kind(name)
        if kind is None:
            continue
        total[kind] += end - start
        if kind in in_step and any(s <= start and end <= e for s, e in steps_iv):
            in_step[kind] += end - start
    moved = sum(total[k] - in_step[k] for k in ("collectives", "d2h", "h2d"))
    parts = {
        "fwd_bwd": total["forward"] + total["backward"] - moved,
        "collectives": total["collectives"], "d2h": total["d2h"], "h2d": total["h2d"], "adam": total["adam"],
        "step_other": total["step"] - sum(in_step.values()),
        "loop": wall_us - total["forward"] - total["backward"] - total["step"] - (total["adam"] - in_step["adam"]),
    }
    out = {k: v / steps / 1000.0 for k, v in parts.items()}
    out["total"] = wall_us / steps / 1000.0
    return out


def dominant(parts: dict) -> tuple[str, float]:
    """The largest part of a breakdown (copies counted together), and its share of the step."""
    merged = {"fwd+bwd compute": parts["fwd_bwd"], "collectives (incl. waiting)": parts["collectives"],
              "copies (d2h + h2d)": parts["d2h"] + parts["h2d"], "CPU Adam": parts["adam"],
              "rest of the optimizer step": parts["step_other"]}
    name = max(merged, key=merged.get)
    return name, merged[name] / parts["total"] if parts["total"] > 0 else float("nan")


def mean_breakdown(per_rank: list[dict]) -> dict:
    return {k: statistics.fmean(b[k] for b in per_rank) for k in per_rank[0]}


# ----------------------------------------------------------------------------- launching

def _launch_jobs(launch, args_d):
    """One rank of one launch: every job of the launch in turn; the per-job results."""
    kit.quiet_rank(args_d["verbose"])
    return [bench_job(job, args_d) for job in launch]


def run_launch(launch: list[dict], args, timeout: float = 3600.0) -> list[list[dict]]:
    """Run one launch's jobs on world_size fresh ranks; per job, the list of rank results."""
    args_d = {k: v for k, v in vars(args).items() if k not in ("libs",)}
    what = ", ".join(f"{j['lib']} stage {j['stage']} offload {j['offload']}" for j in launch[:1])
    what += " (and the rest of its launch)" if len(launch) > 1 else ""
    results = kit.run_on_ranks(_launch_jobs, args.world_size, (launch, args_d), what, args.cuda, args.threads,
                               timeout, group=args.world_size > 1)
    return [[results[r][i] for r in range(args.world_size)] for i in range(len(launch))]


# ----------------------------------------------------------------------------- Adam table

def adam_table(numel: int, device: str, steps: int, warmup: int = 2, seed: int = 0) -> list[dict]:
    """ms/step of each AdamW implementation on one fp32 tensor of `numel` elements, and whether
    its parameter and both moments end bit-identical to the for-loop's."""
    import torch
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(numel, generator=g).to(device)
    grads = [(torch.randn(numel, generator=g) * 1e-2).to(device) for _ in range(2)]

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    rows, ref = [], None
    for impl, kw in ADAM_IMPLS.items():
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([p], lr=3e-4, weight_decay=0.01, **kw)
        times = []
        for i in range(warmup + steps):
            p.grad = grads[i % 2]
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
        st = opt.state[p]
        final = [t.detach().cpu() for t in (p, st["exp_avg"], st["exp_avg_sq"])]
        ref = ref or final
        rows.append({"device": device, "numel": numel, "impl": impl,
                     "ms": statistics.median(times[warmup:]) * 1000.0,
                     "bitwise_equal_for_loop": all(torch.equal(a, b) for a, b in zip(final, ref)),
                     "max_abs_diff_param": float((final[0].double() - ref[0].double()).abs().max())})
        del opt, p
    for r in rows:
        r["speedup"] = rows[0]["ms"] / r["ms"]
    return rows


# ----------------------------------------------------------------------------- report

def step_rows(results: list[dict], args) -> tuple[list[str], list[list[str]]]:
    """Table 1: one row per (stage, offload)."""
    libs = [lib for lib in LIBS if lib in args.libs]
    base = {(r["lib"], r["stage"]): r["ms"] for r in results if r["offload"] == "none"}
    head = ["stage", "offload"]
    for lib in libs:
        head += [f"{lib} ms/step (min)", f"{lib} samples/s", f"{lib} vs none"]
    mz_cols = any(lib.startswith("minizero") for lib in libs)
    nvme = any(off.startswith("nvme:") for _, off in cases_for(args))
    if mz_cols:
        head += ["mz d2h MiB/step", "mz h2d MiB/step", "mz device MiB", "mz host MiB"]
        head += ["mz NVMe read / write MiB/step", "mz NVMe MiB"] if nvme else []
    if args.cuda:
        head += [f"{lib} peak CUDA MiB" for lib in libs]
    rows = []
    for stage, offload in cases_for(args):
        here = {r["lib"]: r for r in results if (r["stage"], r["offload"]) == (stage, offload)}
        if not here:
            continue
        row = [str(stage), offload]
        for lib in libs:
            r = here.get(lib)
            none = base.get(("minizero" if lib == "minizero-fused" else lib, stage))
            row += [f"{fmt(r['ms'])} ({fmt(r['ms_min'])})" if r else "-", fmt(r and r["samples_per_s"]),
                    fmt(r["ms"] / none, ".2f") + "x" if r and none else "-"]
        if mz_cols:
            mz = here.get("minizero") or here.get("minizero-fused")
            cp, mem = (mz or {}).get("copies_per_step"), (mz or {}).get("memory")
            row += [mib(cp and cp["d2h"]), mib(cp and cp["h2d"]),
                    mib(mem and sum(mem["device"].values())), mib(mem and sum(mem["host"].values()))]
            if nvme:
                row += [f"{mib(cp and cp.get('nvme_read', 0))} / {mib(cp and cp.get('nvme_write', 0))}",
                        mib(mem and sum(mem.get("nvme", {}).values()))]
        if args.cuda:
            row += [mib(here[lib]["peak_cuda_bytes"]) if lib in here else "-" for lib in libs]
        rows.append(row)
    return head, rows


def breakdown_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Table 2: minizero's step by part (ms/step, mean over ranks), DeepSpeed's Adam beside it."""
    head = ["lib", "stage", "offload", "step (profiled)"] + [PART_TITLES[p] for p in PARTS] + ["largest part"]
    rows = []
    for r in results:
        b = r.get("breakdown")
        if b is None:
            continue
        if r["lib"] == "deepspeed":
            cells = [fmt(b["adam"]) if p == "adam" else "-" for p in PARTS]
            big = "-"
        else:
            cells = [fmt(b[p]) for p in PARTS]
            name, share = dominant(b)
            big = f"{name} ({share:.0%})"
        rows.append([r["lib"], str(r["stage"]), r["offload"], fmt(b["total"])] + cells + [big])
    return head, rows


def verdicts(results: list[dict]) -> list[str]:
    """One sentence per minizero offload run: what dominates, and what offload added."""
    out = []
    base = {(r["lib"], r["stage"]): r for r in results if r["offload"] == "none"}
    for r in results:
        if r["lib"] == "deepspeed" or r["offload"] == "none" or "breakdown" not in r:
            continue
        b = r["breakdown"]
        name, share = dominant(b)
        line = (f"- {r['lib']}, stage {r['stage']}, offload {r['offload']}: {name} dominates ({share:.0%} of "
                f"{b['total']:.1f} ms); copies {b['d2h'] + b['h2d']:.2f} ms, CPU Adam {b['adam']:.1f} ms, "
                f"collectives {b['collectives']:.1f} ms")
        ref = base.get(("minizero", r["stage"]))
        if ref and "breakdown" in ref:
            rb = ref["breakdown"]
            line += (f"; against no offload: step {b['total'] - rb['total']:+.1f} ms, copies "
                     f"{(b['d2h'] + b['h2d']) - (rb['d2h'] + rb['h2d']):+.2f} ms, Adam {b['adam'] - rb['adam']:+.1f} ms, "
                     f"rest of step {b['step_other'] - rb['step_other']:+.1f} ms")
        out.append(line)
    return out


def adam_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["device", "elements", "AdamW impl", "ms/step", "x for-loop speed", "bitwise = for-loop", "max abs diff (param)"]
    return head, [[r["device"], f"{r['numel']:,}", r["impl"], fmt(r["ms"], ".2f"), fmt(r["speedup"], ".2f"),
                   "yes" if r["bitwise_equal_for_loop"] else "no", fmt(r["max_abs_diff_param"], ".1e")]
                  for r in rows]


def report(info: dict, results: list[dict], adam: list[dict], args) -> str:
    m = info["model"]
    gb = args.micro_batch * args.gas * args.world_size
    lines = [f"# ZeRO-Offload benchmark: {args.world_size} rank(s), {args.dtype}, {info['device']}", "",
             f"- command: `{info['command']}`", f"- machine: {info['machine']}", f"- date: {info['date']}",
             f"- versions: {info['versions']}",
             f"- model: {args.model} with {m['config']} ({m['psi']:,} parameters, Ψ/N = {m['psi_per_rank']:,})",
             f"- batch: micro {args.micro_batch} x gas {args.gas} x {args.world_size} ranks = {gb} samples/step of "
             f"{args.seq} tokens; "
             f"{args.warmup} warmup + {args.steps} timed steps (median of the slowest rank), {args.profile_steps} "
             f"profiled; {args.threads} torch thread(s) per rank",
             f"- zero_optimization: {'launch/ds_config_step5.json values' if args.tutorial_zero else 'minizero.compare settings'}"
             f" {json.dumps(zero_section(3, 'none', args.tutorial_zero))} (offload keys per row)",
             *([f"- NVMe rows: swap files under {args.nvme_path}, on {info.get('nvme_disk')}"] if args.nvme_path else []),
             ""]
    if results:
        head, rows = step_rows(results, args)
        lines += ["## Step time", "", md_table(head, rows), "",
                  "ms/step: median over the timed steps of the slowest rank (min in brackets); samples/s from the "
                  "median. vs none: ms/step over the same library's same stage without offload. mz d2h/h2d: bytes minizero "
                  "copied between device and host per step per rank (engine.comm_stats()); mz device/host: its "
                  "model states per rank by place (memory_breakdown())."
                  + (" peak CUDA: torch.cuda.max_memory_allocated per rank (max over ranks), init included." if args.cuda else ""),
                  ""]
        head, rows = breakdown_rows(results)
        if rows:
            lines += ["## Where the step goes (ms/step, mean over ranks, from torch.profiler ranges)", "",
                      md_table(head, rows), "", *verdicts(results), "",
                      "Ranges measure host time. minizero: collectives include waiting for the slower rank; "
                      "copies are `minizero::d2h/h2d::<label>`; CPU Adam is torch's `Optimizer.step#...` range; rest "
                      "of step = the norm, unscale/clip, rounding to the training dtype, staging buffers. "
                      "DeepSpeed has no minizero ranges: only its Adam is shown.", ""]
    if adam:
        head, rows = adam_rows(adam)
        lines += [f"## torch's AdamW implementations ({args.threads} CPU thread(s))", "", md_table(head, rows), "",
                  "One fp32 parameter tensor, lr 3e-4, weight decay 0.01, median of "
                  f"{args.adam_steps} steps after 2 warmup steps; bitwise: parameter and both moments equal the "
                  "for-loop's after all steps.", ""]
    return "\n".join(lines)


def disk_of(path: str) -> str:
    """What backs `path` (the "NVMe" of the nvme rows): its mount's device and file system from
    /proc/mounts, and whether the kernel calls the block device rotational."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                    best = (dev, fs, mnt)
    except OSError:
        return "unknown (no /proc/mounts)"
    name = os.path.basename(best[0])
    rota = f"/sys/block/{name.rstrip('0123456789') if name.startswith(('sd', 'vd')) else name}/queue/rotational"
    kind = ""
    if os.path.exists(rota):
        kind = ", rotational" if open(rota).read().strip() == "1" else ", non-rotational"
    return f"{best[0]} ({best[1]} mounted at {best[2]}{kind}); files through the page cache (no O_DIRECT)"


log = kit.logger("bench_offload")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
    except BenchError as e:
        print(f"bench_offload: error: {e}", file=sys.stderr)
        return 2
    import torch
    os.environ["DS_ACCELERATOR"] = "cuda" if args.cuda else "cpu"   # before any rank imports deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if not args.verbose:
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")   # the profiler's start/stop lines
    t_start = time.perf_counter()
    info = {"command": "python3 launch/bench_offload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": kit.machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "device": "GPU (NCCL)" if args.cuda else "CPU (gloo)", "versions": kit.versions(),
            "model": kit.model_numbers(args)}
    if args.nvme_path:
        info["nvme_disk"] = disk_of(args.nvme_path)
    log(f"model {args.model} {info['model']['config']}: Ψ = {info['model']['psi']:,}; {args.world_size} ranks on "
        f"{info['device']}")
    results = []
    try:
        kit.preload(args.libs)
        for launch in jobs_for(args):
            t0 = time.perf_counter()
            what = ", ".join(f"{j['lib']} s{j['stage']}/{j['offload']}" for j in launch)
            log(f"running {what}")
            for job, per_rank in zip(launch, run_launch(launch, args)):
                gb = args.micro_batch * args.gas * args.world_size
                ms, ms_min = kit.step_ms([r["step_s"] for r in per_rank])
                res = {"lib": job["lib"], "stage": job["stage"], "offload": job["offload"], "ms": ms, "ms_min": ms_min,
                       "samples_per_s": kit.samples_per_s(ms, gb), "final_loss": per_rank[0]["final_loss"],
                       "copies_per_step": per_rank[0]["copies_per_step"], "memory": per_rank[0].get("memory"),
                       "peak_cuda_bytes": max((r["peak_cuda_bytes"] or 0) for r in per_rank) if args.cuda else None,
                       "step_ms_per_rank": [[s * 1000 for s in r["step_s"]] for r in per_rank]}
                if "breakdown" in per_rank[0]:
                    res["breakdown"] = mean_breakdown([r["breakdown"] for r in per_rank])
                results.append(res)
                log(f"  {job['lib']} stage {job['stage']} offload {job['offload']}: {ms:.1f} ms/step, "
                    f"loss {res['final_loss']:.4f}")
            log(f"  ({time.perf_counter() - t0:.0f} s)")
    except BenchError as e:
        print(f"bench_offload: error: {e}", file=sys.stderr)
        return 1
    adam = []
    if not args.no_adam:
        torch.set_num_threads(args.threads)
        sizes = sorted({info["model"]["psi_per_rank"], TUTORIAL_24_HALF})
        devices = ["cpu"] + (["cuda"] if args.cuda else [])
        for dev in devices:
            for n in sizes:
                log(f"Adam on {dev}, {n:,} elements")
                adam += adam_table(n, dev, args.adam_steps)
    kit.write_outputs(report(info, results, adam, args), {"info": info, "args": vars(args), "results": results,
                                                          "adam": adam}, args.out, args.json)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
