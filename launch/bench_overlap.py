"""How far is each library's step from its floor? minizero's and DeepSpeed's step against what
a step must cost on this machine, and samples/s, at every ZeRO stage, with both libraries'
overlap/prefetch knobs at DeepSpeed's defaults and at 0/off.

    python launch/bench_overlap.py                                     # the full table: ~15 min on 2 busy CPU cores
    python launch/bench_overlap.py --stages 0,3 --dtypes bf16 --reps 1 # a part of it
    python launch/bench_overlap.py --model micro --n-embd 21 --seq 16 --reps 1 --stages 0 --steps 2   # seconds
    python launch/bench_overlap.py --step5                             # the tutorial's step 5: ZeRO-3, both offloads, tutorial-24

What it runs: the tutorial GPT (10M parameters; the preset with --n-embd 256 and 8x8 images,
--seq 63 tokens, dropout off) on `--world-size` ranks (gloo on a CPU, NCCL on GPUs), micro-batch
8, minGPT play_image's AdamW (torch's, "torch_adam": true, in both libraries), for each ZeRO
stage, dtype and knob setting:

  default  the zero_optimization keys below left out, so each library applies its default:
           DeepSpeed's overlap_comm (on at stage 3 only), stage3_prefetch_bucket_size 5e7,
           stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9,
           stage3_param_persistence_threshold 1e5 (minizero's parser has the same defaults)
  off      overlap_comm false, prefetch 0, max live 0, reuse distance 0, persistence 0: the
           paper's algorithm, one gather per use (what minizero.compare pins)
  on       overlap_comm true at every stage (not DeepSpeed's default below stage 3), the
           ZeRO-3 knobs at their defaults: what overlap buys where the defaults leave it off.
           DeepSpeed's stage 0 has no overlap_comm (it reduces after backward either way)

Both settings also pin what is not about overlap, as minizero.compare does: memory_efficient_linear
false (the same F.linear in both) and reduce_bucket_size 500,000 (DeepSpeed's 5e8 allocates a
2 GB bucket at init).

Each run is a launch of fresh ranks (launch/bench_offload.py's run_launch and bench_job,
started by minizero/runtime/spawn.py): `--warmup` untimed steps, `--steps` timed steps; a
step's time is the slowest rank's, a run's samples/s comes from the median step. `--reps`
repetitions, interleaved: every repetition runs every cell once, libraries alternating which
goes first, so a change in the load of a shared machine hits both. A cell shows the median over
repetitions and the spread (min-max).

minizero's runs of the first repetition also trace one step (its timeline, minizero/observe/trace.py,
written under --trace-dir): the last warm-up step but one (step 2 by default). From the
trace, per stage and knob setting: the share of the step the rank spent blocked in
communication (a synchronous collective's whole span, an asynchronous one's wait) and, of
that, the share spent waiting for the other rank to arrive (trace_shares).

The floor (floor_ranks, floor_ms) is measured in the same run, on fresh ranks with no library,
right before each stage's cells of each repetition: forward + backward with communication off,
the optimizer's arithmetic on this rank's shard, and the stage's collectives at their fastest
(FLOOR_NOTE says exactly what; `--no-floor` skips it).

It prints three markdown tables (stdout; progress on stderr). The first: per cell the floor's
parts, each library's step, step / floor for both, and minizero's speed over DeepSpeed's; on a
GPU also each library's tokens/s and peak CUDA memory, with every time taken by CUDA events
(the device's time between syncs; the host's wall clock is kept in --json as wall_ms). The
second: samples/s per library,
minizero / DeepSpeed, each stage's samples/s over the same library's stage 0 (the stage-3 row
holds the stage-3/stage-0 ratio), and the trace's two shares. The third: where each
library's step goes, milliseconds of forward, backward (DeepSpeed's ZeRO-0-2 reduce their
gradients in it) and step (host time between the calls; median over timed steps, mean over
ranks, median over repetitions): a library cannot run faster than its forward and backward
compute, which bounds what hiding communication can win. A benchmark that prints numbers, not a
timed test: on a shared machine samples/s swings by tens of percent (the spread says how much).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "launch")):   # `python launch/bench_overlap.py` from anywhere
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bench_offload as bo  # noqa: E402  (its launching, timing and table helpers)
from minizero.compare.compare import machine  # noqa: E402

LIBS = ("minizero", "deepspeed")
DTYPES = ("fp32", "bf16")
STAGES = (0, 1, 2, 3)
KNOBS = ("default", "off", "on")
# the knobs that decide overlap and prefetch; "default" leaves them out, "off" sets these,
# "on" turns overlap_comm on at every stage (ZeRO-3's prefetch knobs keep their defaults)
OVERLAP_ON = {"overlap_comm": True}
OVERLAP_OFF = {"overlap_comm": False, "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0,
               "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
# --step5: the tutorial's step 5 (launch/ds_config_step5.json) moves both to the host
STEP5_OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
# pinned in both settings: not about overlap (module docstring)
PINNED = {"memory_efficient_linear": False, "reduce_bucket_size": 500_000}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise bo.BenchError(f"{message} (see --help)")


def _list(text: str, choices, what: str, cast=str) -> list:
    try:
        items = [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        items = None
    if not items or any(x not in choices for x in items):
        raise bo.BenchError(f"--{what} {text!r}: give comma-separated values of {', '.join(map(str, choices))}")
    return sorted(set(items), key=list(choices).index)


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="python launch/bench_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default="minizero,deepspeed", help="comma-separated, of minizero, deepspeed")
    p.add_argument("--stages", help="comma-separated ZeRO stages (default 0,1,2,3; --step5: 3)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32, bf16 (default both)")
    p.add_argument("--knobs", help="comma-separated, of default, off, on (default: default,off; --step5: default)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every cell, interleaved (default 2)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2; on a GPU machine min(2, GPUs))")
    p.add_argument("--model", help="GPT preset (default tutorial: 10M parameters; --step5: tutorial-24)")
    p.add_argument("--n-layer", type=int, help="override the preset's depth")
    p.add_argument("--n-embd", type=int, default=256, help="width (default 256, the tutorial's)")
    p.add_argument("--n-head", type=int, help="heads (default: the preset's, or 4 when it does not divide --n-embd)")
    p.add_argument("--seq", type=int, default=63, help="tokens per row (default 63: 8x8 images)")
    p.add_argument("--micro-batch", type=int, default=8, help="train_micro_batch_size_per_gpu (default 8)")
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps (default 1)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps per run (default 3; at least 3 unless --no-trace)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1, as torchrun's)")
    p.add_argument("--no-trace", action="store_true", help="skip minizero's traced step")
    p.add_argument("--no-floor", action="store_true", help="skip measuring the floor (floor_ranks)")
    p.add_argument("--step5", action="store_true",
                   help="the tutorial's step 5 instead: ZeRO-3 with offload_optimizer and offload_param on the "
                        "host, the tutorial-24 model, default knobs (sets --stages 3 --knobs default --model "
                        "tutorial-24 unless given); its floor adds the copies to and from the host")
    p.add_argument("--trace-dir", help="where the traces go (default: a new temporary folder)")
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--json", help="also write every number to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's and minizero's info logs (stderr)")
    return p.parse_args(argv)


def check_args(args, cuda: bool | None = None, gpus: int | None = None) -> None:
    """Normalise args in place; BenchError with one line for anything that cannot run."""
    step5 = args.step5   # the tutorial's step 5 has its own defaults
    args.stages = args.stages or ("3" if step5 else "0,1,2,3")
    args.knobs = args.knobs or ("default" if step5 else "default,off")
    args.model = args.model or ("tutorial-24" if step5 else "tutorial")
    args.libs = _list(args.libs, LIBS, "libs")
    args.stages = _list(args.stages, STAGES, "stages", int)
    args.dtypes = _list(args.dtypes, DTYPES, "dtypes")
    args.knobs = _list(args.knobs, KNOBS, "knobs")
    args.block_size, args.profile_steps = None, 0    # what bench_offload's helpers read
    bo.check_launch(args, cuda, gpus, at_least_one=("reps", "world_size", "seq", "micro_batch", "gas", "steps",
                                                    "threads", "n_embd"), at_least_zero=("warmup",))
    if not args.no_trace and args.warmup < MIN_WARMUP_TRACED:
        raise bo.BenchError(f"--warmup {args.warmup}: the traced step needs --warmup >= {MIN_WARMUP_TRACED} (step 1 "
                            f"records, step 2 is traced, step 3 absorbs writing the trace), or pass --no-trace")


# ----------------------------------------------------------------------------- configs and jobs

def zero_section(stage: int, knobs: str) -> dict:
    return {"stage": stage, **PINNED, **{"default": {}, "off": OVERLAP_OFF, "on": OVERLAP_ON}[knobs]}


def make_config(stage: int, dtype: str, knobs: str, args) -> dict:
    """minizero.train's default CPU config (minGPT play_image's AdamW), sized by the flags."""
    from minizero.train.train_args import DEFAULT_CONFIG
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=args.gas,
               steps_per_print=10 ** 9, zero_optimization=zero_section(stage, knobs))
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if args.step5:
        cfg["zero_optimization"].update(STEP5_OFFLOAD)
    return cfg


MIN_WARMUP_TRACED = 3


def trace_step(args) -> int:
    """The traced optimizer step (1-based): the last warm-up step but one. Step 1 may record
    ZeRO-3's execution order, and the traced step ends with writing the files (rank 0 also
    draws timeline.png) while the other rank waits in the next step's first collective: that
    next step must be untimed too. Hence --warmup >= MIN_WARMUP_TRACED when tracing."""
    return args.warmup - 1


def cells(args) -> list[tuple]:
    """Ordered dtype, stage, knobs: a stage's knob settings run one after the other, right
    after that stage's floor is measured (main), so a change in the machine's load hits the
    floor and both settings of both libraries alike."""
    return [(stage, dtype, knobs) for dtype in args.dtypes for stage in args.stages for knobs in args.knobs]


def schedule(args) -> list[dict]:
    """Every run, in order: repetition by repetition, each cell once per library; libraries
    alternate which goes first from one cell to the next and from one repetition to the next."""
    runs = []
    for rep in range(args.reps):
        for i, (stage, dtype, knobs) in enumerate(cells(args)):
            libs = list(reversed(args.libs)) if (rep + i) % 2 else list(args.libs)
            for lib in libs:
                run = {"lib": lib, "stage": stage, "dtype": dtype, "knobs": knobs, "rep": rep, "offload": "none",
                       "config": make_config(stage, dtype, knobs, args)}
                if lib == "minizero" and rep == 0 and not args.no_trace:
                    run["trace_dir"] = os.path.join(args.trace_dir, f"{dtype}-{knobs}-stage{stage}")
                    run["config"]["minizero_trace"] = {"enabled": True, "output_path": run["trace_dir"],
                                                       "steps": [trace_step(args)]}
                runs.append(run)
    return runs


# ----------------------------------------------------------------------------- the floor

def floor_ranks(args_d: dict) -> dict:
    """One rank's measurements of what a step must cost on this machine, for one dtype and
    stage (`args_d["floor_dtype"]`, `args_d["floor_stage"]`), with no library: the parts the
    floor adds up (`floor_ms`).

      fwd_bwd    the model's forward and backward in the dtype, communication off (plain
                 torch on this rank's micro-batches; gradients dropped between steps)
      opt_<n>    the optimizer's arithmetic on n elements, what a step must do to a shard of
                 them: the gradient in fp32, unscaled by one number, its squared norm (one fp32
                 pass), AdamW on an fp32 master (torch's, the faster of one flat tensor and 1 MB
                 slices, the same numbers either way), the master rounded into the shard
                 (bf16); n = Ψ at stage 0, Ψ/N at stages 1-3 (`opt`)
      all_reduce / reduce_scatter / all_gather   one collective of Ψ elements in the dtype,
                 the fastest of: one flat call, or 500,000-element buckets issued back to back

    Compute parts: median over timed iterations, as the libraries' steps; collectives: the
    fastest iteration (the issue's "fastest measured time")."""
    import functools

    import torch
    import torch.distributed as dist

    from minizero import comm
    from minizero.adam import ChunkedAdamW
    from reference.ds_run import build_model
    os.dup2(2, 1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args_d["floor_dtype"]]
    rank, world, device = dist.get_rank(), dist.get_world_size(), comm.get_device()
    model, _ = build_model(functools.partial(bo.build_gpt, args_d["model"], args_d["model_kw"]), {}, args_d["seed"])
    model.to(device=device, dtype=dtype).train()
    psi = sum(p.numel() for p in model.parameters())
    n_warm, n_time = max(1, args_d["warmup"]), args_d["steps"]
    batches = bo.make_batches({**args_d, "dtype": args_d["floor_dtype"]}, n_warm + n_time, 1, rank, device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    timer = bo.RegionTimer(device.type == "cuda")

    def timed(fn, reps=n_warm + n_time) -> list[float]:
        """Seconds per call of fn, timed as the libraries' steps are (bench_job's RegionTimer)."""
        out = []
        for i in range(reps):
            sync()
            dist.barrier()
            timer.start()
            fn(i)
            timer.stop()
            sync()
            out.append(timer.seconds())
        return out[n_warm:]

    def fwd_bwd(i):
        x, y = batches[i]
        loss = model(x, y)[1]
        loss.float().backward()
        for p in model.parameters():
            p.grad = None

    res = {"psi": psi, "fwd_bwd": statistics.median(timed(fwd_bwd))}
    gen = torch.Generator().manual_seed(args_d["seed"])
    stage = args_d["floor_stage"]
    for n in [psi if stage == 0 else -(-psi // world)]:
        master = torch.randn(n, generator=gen).to(device)
        lp_grad = (torch.randn(n, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        lp_shard = torch.empty(n, dtype=dtype, device=device)
        best = float("inf")
        for cls in (torch.optim.AdamW, ChunkedAdamW):
            opt = cls([master], lr=3e-4, weight_decay=0.01)

            def opt_step(i):
                # fp32: the reduced buffer itself, unscaled in place (by 1: no drift to denormals)
                g = lp_grad.float().mul_(0.5) if dtype != torch.float32 else lp_grad.mul_(1.0)
                torch.linalg.vector_norm(g)
                master.grad = g
                opt.step()
                master.grad = None
                if dtype != torch.float32:
                    lp_shard.copy_(master)

            best = min(best, statistics.median(timed(opt_step)))
        res["opt"] = best
    full = torch.randn(-(-psi // world) * world, generator=gen).to(device=device, dtype=dtype)
    shard = torch.empty(full.numel() // world, dtype=dtype, device=device)
    buckets = [(a, min(a + PINNED["reduce_bucket_size"], full.numel()))
               for a in range(0, full.numel(), PINNED["reduce_bucket_size"])]

    def bucketed(call):
        def run(i):
            for w in [call(a, b) for a, b in buckets]:
                w.wait()
        return run

    def shard_of(a, b):
        return torch.empty(-(-(b - a) // world), dtype=dtype, device=device)

    def padded(a, b):   # a bucket padded to a multiple of the ranks, as a FlatParam is
        return torch.empty(-(-(b - a) // world) * world, dtype=dtype, device=device)

    colls = {
        "all_reduce": [lambda i: dist.all_reduce(full),
                       bucketed(lambda a, b: dist.all_reduce(full[a:b], async_op=True))],
        "reduce_scatter": [lambda i: dist.reduce_scatter_tensor(shard, full),
                           bucketed(lambda a, b: dist.reduce_scatter_tensor(shard_of(a, b), padded(a, b), async_op=True))],
        "all_gather": [lambda i: dist.all_gather_into_tensor(full, shard),
                       bucketed(lambda a, b: dist.all_gather_into_tensor(padded(a, b), shard_of(a, b), async_op=True))],
    }
    if args_d["step5"]:
        # what offload must copy per step, device to host or back (on a CPU, memory to memory):
        # the gradient shard out, the new low-precision shard back, and the parameter shard in
        # before each of forward and backward (offload_param)
        host = torch.empty(-(-psi // world), dtype=dtype, pin_memory=device.type == "cuda")
        dev = torch.empty_like(host, device=device)

        def copies(i):
            host.copy_(dev, non_blocking=True)
            for _ in range(3):
                dev.copy_(host, non_blocking=True)

        res["copies"] = min(timed(copies))
    needed = {0: ("all_reduce",), 1: ("reduce_scatter", "all_gather"), 2: ("reduce_scatter", "all_gather"),
              3: ("reduce_scatter", "all_gather")}[stage] if world > 1 else ()
    for name in needed:
        res[name] = min(min(timed(way)) for way in colls[name])
    return res


def floor_ms(parts: dict, stage: int) -> dict:
    """The floor of a step at `stage`, from the ranks' parts (the slowest rank's, each part
    in ms): forward + backward + the optimizer on this rank's shard + the collectives the
    stage needs, all of them counted as unhidden (every cell of this benchmark but ZeRO-3 with
    prefetch runs them with no compute beside them; floor_note).

      stage 0   all-reduce of the gradient
      ZeRO-1/2  reduce-scatter of the gradient + all-gather of the new parameters
      ZeRO-3    all-gather before forward and again before backward + reduce-scatter"""
    comm = {0: lambda: parts["all_reduce"], 1: lambda: parts["reduce_scatter"] + parts["all_gather"],
            2: lambda: parts["reduce_scatter"] + parts["all_gather"],
            3: lambda: parts["reduce_scatter"] + 2 * parts["all_gather"]}[stage]() if parts["world_size"] > 1 else 0.0
    out = {"fwd_bwd": parts["fwd_bwd"], "optimizer": parts["opt"] + parts.get("copies", 0.0), "comm": comm}
    out = {k: 1e3 * v for k, v in out.items()}
    out["floor"] = sum(out.values())
    return out


FLOOR_NOTE = ("floor: what a step must cost on this machine, measured in the same run with no library "
              "(floor_ranks): the model's forward + backward in the dtype with communication off, the optimizer's "
              "arithmetic on this rank's shard (fp32 gradient, unscale, norm, torch's AdamW, round to bf16), and the "
              "stage's collectives at their fastest measured time (stage 0 all-reduce; ZeRO-1/2 reduce-scatter + "
              "all-gather; ZeRO-3 two all-gathers + reduce-scatter), all counted as unhidden: every cell runs them "
              "with no compute beside them except ZeRO-3 with the default knobs (prefetch and overlap_comm), whose "
              "floor is therefore an upper one. With --step5 the optimizer part also holds the copies offload "
              "must make (gradient shard out, new shard back, parameter shard in before forward and backward). "
              "Compute parts: median over timed iterations and repetitions; "
              "collectives: the fastest. Steps: the slowest rank's median step, median over repetitions. On a GPU "
              "every time is CUDA events' (the device's time between syncs), tokens/s comes from the median step and "
              "peak CUDA memory is torch.cuda.max_memory_allocated, the largest rank's, engine init included. "
              "minizero speed / DeepSpeed's: DeepSpeed's step over minizero's (above 1: minizero is faster).")


def run_floor(dtype: str, stage: int, args) -> dict:
    """Every part of the floor for one dtype and stage, on fresh ranks; per part the slowest rank's."""
    from minizero.runtime.spawn import RankError, run_ranks
    args_d = {k: v for k, v in vars(args).items() if k not in ("libs",)}
    args_d["floor_dtype"], args_d["floor_stage"] = dtype, stage
    try:
        # group=True: the floor's barriers and collectives want a process group at one rank too
        per_rank = run_ranks(floor_ranks, args.world_size, (args_d,), threads=args.threads, cuda=args.cuda,
                             timeout=3600.0, group=True)
    except RankError as e:
        raise bo.BenchError(f"the floor's {dtype} stage-{stage} run failed: {e}") from None
    out = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    out["world_size"] = args.world_size
    return out


# ----------------------------------------------------------------------------- the trace

def trace_shares(trace_dir: str) -> dict | None:
    """From each rank<r>.json, what the traced step lost to communication, as shares of the
    step (mean over ranks):

      blocked  time the rank could not compute because of a collective: a synchronous
               collective's whole event, an asynchronous one's wait only ("async": true;
               minizero/observe/trace.py), as the union of those spans (a synchronous collective can
               run while asynchronous ones are in flight; nothing is counted twice)
      skew     of that, the synchronous collectives' wait for the last rank to arrive: time
               lost to the ranks being out of step, not to the wire

    None without files."""
    per_rank = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "rank*.json"))):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        step = [e for e in events if e.get("cat") == "step" and e["name"].startswith("step ")]
        if not step:
            continue
        colls = [e for e in events if e.get("cat") == "collectives"]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in colls if not e["args"].get("async")]
        spans += [(e["ts"] + e["dur"] - e["args"].get("wait_us", 0.0), e["ts"] + e["dur"])
                  for e in colls if e["args"].get("async")]
        per_rank.append({"step_us": sum(e["dur"] for e in step), "blocked_us": union_length(spans),
                         "skew_us": sum(e["args"].get("wait_us", 0.0) for e in colls if not e["args"].get("async")),
                         "collectives": len(colls), "asynchronous": sum(1 for e in colls if e["args"].get("async"))})
    if not per_rank:
        return None
    mean = {k: statistics.fmean(r[k] for r in per_rank) for k in per_rank[0]}
    return {**mean, "blocked": statistics.fmean(r["blocked_us"] / r["step_us"] for r in per_rank),
            "skew": statistics.fmean(r["skew_us"] / r["step_us"] for r in per_rank)}


def phases_ms(per_rank: list[dict]) -> dict:
    """Per phase (forward, backward, step): median over timed steps, mean over ranks, in ms."""
    return {name: 1e3 * statistics.fmean(statistics.median(r["phase_s"][name]) for r in per_rank)
            for name in per_rank[0]["phase_s"]}


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# ----------------------------------------------------------------------------- the table

def summarize(results: list[dict], args) -> list[dict]:
    """One row per cell: per library the median and spread of samples/s over repetitions."""
    rows = []
    for stage, dtype, knobs in cells(args):
        row = {"stage": stage, "dtype": dtype, "knobs": knobs}
        for lib in args.libs:
            sps = [r["samples_per_s"] for r in results
                   if (r["lib"], r["stage"], r["dtype"], r["knobs"]) == (lib, stage, dtype, knobs)]
            row[lib] = {"median": statistics.median(sps), "min": min(sps), "max": max(sps), "n": len(sps)} if sps else None
        traced = [r["trace"] for r in results if r.get("trace") and (r["stage"], r["dtype"], r["knobs"]) ==
                  (stage, dtype, knobs)]
        row["trace"] = traced[0] if traced else None
        for lib in args.libs:
            ph = [r["phases_ms"] for r in results
                  if (r["lib"], r["stage"], r["dtype"], r["knobs"]) == (lib, stage, dtype, knobs)]
            row[f"{lib}_phases_ms"] = {k: statistics.median(p[k] for p in ph) for k in ph[0]} if ph else None
        rows.append(row)
    for row in rows:   # each stage over the same library's stage 0, same dtype and knobs
        base = next((r for r in rows if (r["stage"], r["dtype"], r["knobs"]) == (0, row["dtype"], row["knobs"])), None)
        for lib in args.libs:
            a, b = row[lib], base and base[lib]
            row[f"{lib}_over_stage0"] = a["median"] / b["median"] if a and b else None
        mz, ds = row.get("minizero"), row.get("deepspeed")
        row["mz_over_ds"] = mz["median"] / ds["median"] if mz and ds else None
    return rows


def floor_rows(results: list[dict], floors: list[dict], args) -> list[dict]:
    """One row per cell: the floor's parts (forward+backward and optimizer: median over
    repetitions; collectives: the fastest), each library's step (median over repetitions of
    each run's median step) and the ratios."""
    rows = []
    for stage, dtype, knobs in cells(args):
        per_rep = [floor_ms(f["parts"], stage) for f in floors if (f["dtype"], f["stage"]) == (dtype, stage)]
        fl = {k: statistics.median(p[k] for p in per_rep) for k in ("fwd_bwd", "optimizer")} if per_rep else None
        if fl:
            fl["comm"] = min(p["comm"] for p in per_rep)
            fl["floor"] = fl["fwd_bwd"] + fl["optimizer"] + fl["comm"]
        row = {"stage": stage, "dtype": dtype, "knobs": knobs, "floor": fl}
        for lib in args.libs:
            ms = [r["ms"] for r in results if (r["lib"], r["stage"], r["dtype"], r["knobs"]) == (lib, stage, dtype, knobs)]
            row[f"{lib}_ms"] = statistics.median(ms) if ms else None
            row[f"{lib}_over_floor"] = row[f"{lib}_ms"] / fl["floor"] if ms and fl else None
            # tokens/s from the median step: every rank's micro-batches of --seq tokens
            row[f"{lib}_tokens_per_s"] = (args.micro_batch * args.gas * args.world_size * args.seq
                                          / (row[f"{lib}_ms"] / 1e3)) if ms else None
            peaks = [r["peak_cuda_bytes"] for r in results if r.get("peak_cuda_bytes") is not None and
                     (r["lib"], r["stage"], r["dtype"], r["knobs"]) == (lib, stage, dtype, knobs)]
            row[f"{lib}_peak_cuda_mib"] = max(peaks) / 2 ** 20 if peaks else None
        mz, ds = row.get("minizero_ms"), row.get("deepspeed_ms")
        row["mz_speed_over_ds"] = ds / mz if mz and ds else None
        rows.append(row)
    return rows


def ms(x: float) -> str:
    """Milliseconds to three significant digits or whole ms, whichever is longer."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def floor_table(rows: list[dict], args) -> str:
    head = ["dtype", "knobs", "stage", "floor: fwd+bwd / optimizer / comm = floor, ms"]
    head += [f"{lib} step, ms" for lib in args.libs] + [f"{lib} step / floor" for lib in args.libs]
    if len(args.libs) == 2:
        head.append("minizero speed / DeepSpeed's")
    if args.cuda:   # on a GPU also the throughput and the memory (peak per rank, init included)
        head += [f"{lib} tokens/s" for lib in args.libs] + [f"{lib} peak CUDA MiB" for lib in args.libs]
    out = []
    for r in rows:
        fl = r["floor"]
        cells_ = [r["dtype"], r["knobs"], str(r["stage"]),
                  " / ".join(ms(fl[k]) for k in ("fwd_bwd", "optimizer", "comm")) + f" = {ms(fl['floor'])}" if fl else "-"]
        cells_ += [bo.fmt(r[f"{lib}_ms"], ".1f" if args.cuda else ".0f") for lib in args.libs]
        cells_ += [bo.fmt(r[f"{lib}_over_floor"], ".2f") for lib in args.libs]
        if len(args.libs) == 2:
            cells_.append(bo.fmt(r["mz_speed_over_ds"], ".2f"))
        if args.cuda:
            cells_ += [bo.fmt(r[f"{lib}_tokens_per_s"], ",.0f") for lib in args.libs]
            cells_ += [bo.fmt(r[f"{lib}_peak_cuda_mib"], ",.0f") for lib in args.libs]
        out.append(cells_)
    return bo.md_table(head, out)


def spread(cell: dict | None) -> str:
    if not cell:
        return "-"
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict], args) -> str:
    head = ["dtype", "knobs", "stage"]
    head += [f"{lib} samples/s median (min-max)" for lib in args.libs]
    if len(args.libs) == 2:
        head.append("minizero / DeepSpeed")
    head += [f"{lib} / its stage 0" for lib in args.libs]
    if "minizero" in args.libs:
        head += ["mz blocked in comm, % of step", "of it waiting for the other rank"]
    out = []
    for r in rows:
        cells_ = [r["dtype"], r["knobs"], str(r["stage"])] + [spread(r[lib]) for lib in args.libs]
        if len(args.libs) == 2:
            cells_.append(bo.fmt(r["mz_over_ds"], ".2f"))
        cells_ += [bo.fmt(r[f"{lib}_over_stage0"], ".2f") for lib in args.libs]
        if "minizero" in args.libs:
            t = r["trace"]
            cells_ += [pct(t and t["blocked"]), pct(t and t["skew"])]
        out.append(cells_)
    return bo.md_table(head, out)


def phase_table(rows: list[dict], args) -> str:
    """Where each library's step goes: forward / backward / step, ms."""
    head = ["dtype", "knobs", "stage"] + [f"{lib} forward / backward / step, ms" for lib in args.libs]
    out = []
    for r in rows:
        cells_ = [r["dtype"], r["knobs"], str(r["stage"])]
        for lib in args.libs:
            ph = r[f"{lib}_phases_ms"]
            cells_.append(" / ".join(f"{ph[k]:.0f}" for k in ("forward", "backward", "step")) if ph else "-")
        out.append(cells_)
    return bo.md_table(head, out)


def report(info: dict, rows: list[dict], args, frows: list[dict] | None = None) -> str:
    m = info["model"]
    lines = [f"# Overlap benchmark: minizero vs DeepSpeed, {args.world_size} ranks, {info['device']}", "",
             f"- command: `{info['command']}`", f"- machine: {info['machine']}", f"- date: {info['date']}",
             f"- model: {args.model} with {m['config']} ({m['psi']:,} parameters); micro-batch {args.micro_batch} x "
             f"gas {args.gas} x {args.world_size} ranks of {args.seq} tokens; {args.warmup} warmup + {args.steps} "
             f"timed steps per run, {args.reps} repetition(s), interleaved",
             f"- knobs default: DeepSpeed's defaults (keys left out); off: {json.dumps(OVERLAP_OFF)}; on: "
             f"{json.dumps(OVERLAP_ON)}; all: {json.dumps(PINNED)}"]
    if args.step5:
        lines.append(f"- the tutorial's step 5: every run adds {json.dumps(STEP5_OFFLOAD)}")
    lines.append("")
    if frows:
        lines += [floor_table(frows, args), "", FLOOR_NOTE, ""]
    lines += [table(rows, args), "",
             "samples/s: per run from the median step (the slowest rank's time); median over repetitions, "
             "min-max in brackets. `/ its stage 0`: the same library's samples/s at stage 0 (same dtype and knobs). "
             "mz blocked in comm: minizero's traced step (first repetition): the time its rank could not compute for "
             "communication (a synchronous collective's whole span, an asynchronous one's wait), and of it the wait "
             "for the other rank to arrive, over the step's duration, mean over ranks.", "",
             phase_table(rows, args), "",
             "Host time between the calls `engine(x, y)`, `engine.backward(loss)`, `engine.step()`: median over timed "
             "steps, mean over ranks, median over repetitions. DeepSpeed reduces ZeRO-0-2 gradients inside backward; "
             "minizero at stage 0-1 without overlap_comm inside step."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def log(msg: str) -> None:
    print(f"[bench_overlap {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
    except bo.BenchError as e:
        print(f"bench_overlap: error: {e}", file=sys.stderr)
        return 2
    os.environ["DS_ACCELERATOR"] = "cuda" if args.cuda else "cpu"   # before any rank imports deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if not args.verbose:
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    if not args.no_trace:   # --no-trace writes no trace, so it makes no folder for one
        args.trace_dir = os.path.abspath(args.trace_dir or tempfile.mkdtemp(prefix="bench_overlap_trace_"))
    t_start = time.perf_counter()
    info = {"command": "python launch/bench_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": "GPU (NCCL)" if args.cuda else "CPU (gloo)", "model": bo.model_numbers(args)}
    log(f"model {args.model} {info['model']['config']}: Ψ = {info['model']['psi']:,}; {args.world_size} ranks on "
        f"{info['device']}" + ("" if args.no_trace else f"; traces in {args.trace_dir}"))
    results, floors = [], []
    try:
        bo.preload_ranks(args)
        runs = schedule(args)
        for i, run in enumerate(runs):
            key = {k: run[k] for k in ("rep", "dtype", "stage")}
            if not args.no_floor and not any({k: f[k] for k in key} == key for f in floors):
                floors.append({**key, "parts": run_floor(run["dtype"], run["stage"], args)})
                fl = floor_ms(floors[-1]["parts"], run["stage"])
                log(f"floor {run['dtype']} stage {run['stage']} (rep {run['rep'] + 1}): fwd+bwd {fl['fwd_bwd']:.0f} "
                    f"+ optimizer {fl['optimizer']:.0f} + comm {fl['comm']:.0f} = {fl['floor']:.0f} ms")
            what = f"{run['lib']} stage {run['stage']} {run['dtype']} knobs {run['knobs']} (rep {run['rep'] + 1})"
            launch_args = argparse.Namespace(**{**vars(args), "dtype": run["dtype"]})
            per_rank = bo.run_launch([run], launch_args)[0]
            ms, _ = bo.step_ms([r["step_s"] for r in per_rank])
            res = {k: run[k] for k in ("lib", "stage", "dtype", "knobs", "rep")}
            res.update(ms=ms, samples_per_s=bo.samples_per_s(ms, args.micro_batch * args.gas * args.world_size),
                       final_loss=per_rank[0]["final_loss"], phases_ms=phases_ms(per_rank),
                       wall_ms=bo.step_ms([r["step_wall_s"] for r in per_rank])[0],
                       peak_cuda_bytes=max(r["peak_cuda_bytes"] for r in per_rank) if args.cuda else None)
            if "trace_dir" in run:
                res["trace"] = trace_shares(run["trace_dir"])
            results.append(res)
            log(f"[{i + 1}/{len(runs)}] {what}: {ms:.0f} ms/step, {res['samples_per_s']:.2f} samples/s")
    except bo.BenchError as e:
        print(f"bench_overlap: error: {e}", file=sys.stderr)
        return 1
    rows = summarize(results, args)
    frows = floor_rows(results, floors, args) if floors else None
    text = report(info, rows, args, frows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "args": vars(args), "rows": rows, "runs": results,
                                               "floor_rows": frows, "floors": floors},
                                              indent=1, default=str) + "\n")
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
