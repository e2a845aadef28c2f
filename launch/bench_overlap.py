"""How far is each library's step from its floor? minizero's, DeepSpeed's and PyTorch's (DDP /
FSDP2) step against what a step must cost on this machine, and samples/s, at every ZeRO stage,
with the overlap/prefetch knobs at DeepSpeed's defaults and at 0/off.

    python3 launch/bench_overlap.py                                     # the full table: ~15 min on 2 busy CPU cores
    python3 launch/bench_overlap.py --libs minizero,deepspeed,torch --stages 0,2,3 --dtypes bf16 --reps 1
    python3 launch/bench_overlap.py --model micro --n-embd 21 --seq 16 --reps 1 --stages 0 --steps 2   # seconds
    python3 launch/bench_overlap.py --step5                             # the tutorial's step 5: ZeRO-3, both offloads, tutorial-24

What it runs: the tutorial GPT (10M parameters; the preset with --n-embd 256 and 8x8 images,
--seq 63 tokens, dropout off) on `--world-size` ranks (gloo on a CPU, NCCL on GPUs), micro-batch
8, minGPT play_image's AdamW (torch's, "torch_adam": true, in every library), for each ZeRO
stage, dtype and knob setting:

  default  the zero_optimization keys below left out, so each library applies its default:
           DeepSpeed's overlap_comm (on at stage 3 only), stage3_prefetch_bucket_size 5e7,
           stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9,
           stage3_param_persistence_threshold 1e5 (minizero's parser has the same defaults)
  off      overlap_comm false, prefetch 0, max live 0, reuse distance 0, persistence 0: the
           paper's algorithm, one gather per use, every collective synchronous (what
           minizero.compare pins)
  on       overlap_comm true at every stage (not DeepSpeed's default below stage 3), the
           ZeRO-3 knobs at their defaults: what overlap buys where the defaults leave it off.
           DeepSpeed's stage 0 has no overlap_comm (it reduces after backward either way)

`torch` (reference/torch_engine.py) is DDP at stage 0, FSDP2 with reshard_after_forward=False
at stage 2 (it gathers once per step and reduce-scatters: ZeRO-2's traffic, though its
parameters are sharded between steps) and FSDP2 at stage 3; it has no ZeRO-1, no fp16 and no
overlap knobs (DDP always overlaps its all-reduce with backward, FSDP2 always prefetches), so
it runs in the `default` rows only (the first knob setting asked for when `default` is not).

Every setting also pins what is not about overlap, as minizero.compare does:
memory_efficient_linear false (the same F.linear everywhere) and reduce_bucket_size 500,000
(DeepSpeed's 5e8 allocates a 2 GB bucket at init).

Each run is a launch of fresh ranks (minizero/runtime/spawn.py, launch/kit.py's engines and
timed steps): `--warmup` untimed steps, `--steps` timed steps; a step's time is the slowest
rank's, a run's samples/s comes from the median step. `--reps` repetitions, interleaved: every
repetition runs every cell once, libraries rotating which goes first, so a change in the load
of a shared machine hits all of them. A cell shows the median over repetitions and the spread
(min-max).

minizero's runs of the first repetition also trace one step (its timeline, minizero/observe/trace.py,
written under --trace-dir): the last warm-up step but one (step 2 by default). From the
trace, per stage and knob setting: the share of the step the rank spent blocked in
communication (a synchronous collective's whole span, an asynchronous one's wait) and, of
that, the share spent waiting for the other rank to arrive (trace_shares).

The floor (floor_ranks, floor_ms, FLOOR_NOTE) is measured in the same run, on fresh ranks with
no library, right before each stage's cells of each repetition: forward + backward with
communication off, the optimizer's arithmetic on this rank's shard, and every collective the
config requires (required_collectives: their count and size for the stage and knob setting),
each timed alone on the machine (median), all added up. `--no-floor` skips it.

It prints three markdown tables (stdout; progress on stderr). The first: per cell the floor's
parts, each library's step, step / floor, and minizero's speed over the others'; on a GPU also
each library's tokens/s and peak CUDA memory, with every time taken by CUDA events (the
device's time between syncs; the host's wall clock is kept in --json as wall_ms). The second:
samples/s per library, each stage's samples/s over the same library's stage 0, and the
trace's two shares. The third: where each library's step goes, milliseconds of forward,
backward (DeepSpeed's ZeRO-0-2 reduce their gradients in it) and step (host time between the
calls; median over timed steps, mean over ranks, median over repetitions). A benchmark that
prints numbers, not a timed test: on a shared machine samples/s swings by tens of percent
(the spread says how much).
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `python3 launch/bench_overlap.py` from anywhere
import kit  # noqa: E402
from kit import BenchError, fmt, md_table  # noqa: E402

kit.bootstrap()

LIBS = kit.LIBS
DTYPES = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
KNOBS = ("default", "off", "on")
# the knobs that decide overlap and prefetch; "default" leaves them out, "off" sets these,
# "on" turns overlap_comm on at every stage (ZeRO-3's prefetch knobs keep their defaults)
OVERLAP_ON = {"overlap_comm": True}
OVERLAP_OFF = {"overlap_comm": False, "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0,
               "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}
# DeepSpeed's defaults for the keys "default" leaves out (config/zero.py has the same)
PERSISTENCE_DEFAULT = 100_000       # stage3_param_persistence_threshold, elements
ALLGATHER_BUCKET_DEFAULT = 500_000_000   # allgather_bucket_size, elements
# --step5: the tutorial's step 5 (launch/ds_config_step5.json) moves both to the host
STEP5_OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
# pinned in every setting: not about overlap (module docstring)
PINNED = {"memory_efficient_linear": False, "reduce_bucket_size": 500_000}
MIN_WARMUP_TRACED = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = kit.OneLineParser(prog="python3 launch/bench_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default="minizero,deepspeed", help="comma-separated, of minizero, deepspeed, torch")
    p.add_argument("--stages", help="comma-separated ZeRO stages (default 0,1,2,3; --step5: 3)")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="comma-separated, of fp32, bf16, fp16 (default fp32,bf16; a CPU without AVX-512 runs bf16 "
                        "several times slower than fp32: there, --dtypes fp32 first)")
    p.add_argument("--knobs", help="comma-separated, of default, off, on (default: default,off; --step5: default)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every cell, interleaved (default 2)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2; on a GPU machine min(2, GPUs))")
    kit.add_model_flags(p, None, 256, 63)
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
    kit.add_output_flags(p, "the table")
    return p.parse_args(argv)


def check_args(args, cuda: bool | None = None, gpus: int | None = None) -> None:
    """Normalise args in place; BenchError with one line for anything that cannot run."""
    step5 = args.step5   # the tutorial's step 5 has its own defaults
    args.stages = args.stages or ("3" if step5 else "0,1,2,3")
    args.knobs = args.knobs or ("default" if step5 else "default,off")
    args.model = args.model or ("tutorial-24" if step5 else "tutorial")
    args.libs = kit.comma_list(args.libs, LIBS, "libs")
    args.stages = kit.comma_list(args.stages, STAGES, "stages", int)
    args.dtypes = kit.comma_list(args.dtypes, DTYPES, "dtypes")
    args.knobs = kit.comma_list(args.knobs, KNOBS, "knobs")
    if step5 and "torch" in args.libs:
        raise BenchError("--step5 --libs torch: the PyTorch reference does not offload; leave torch out")
    kit.check_launch(args, args.libs, cuda, gpus)
    kit.at_least(args, 1, ("reps", "world_size", "seq", "micro_batch", "gas", "steps", "threads", "n_embd"))
    kit.at_least(args, 0, ("warmup",))
    if not args.no_trace and args.warmup < MIN_WARMUP_TRACED:
        raise BenchError(f"--warmup {args.warmup}: the traced step needs --warmup >= {MIN_WARMUP_TRACED} (step 1 "
                         f"records, step 2 is traced, step 3 absorbs writing the trace), or pass --no-trace")


# ----------------------------------------------------------------------------- configs and runs

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


def trace_step(args) -> int:
    """The traced optimizer step (1-based): the last warm-up step but one. Step 1 may record
    ZeRO-3's execution order, and the traced step ends with writing the files (rank 0 also
    draws timeline.png) while the other rank waits in the next step's first collective: that
    next step must be untimed too. Hence --warmup >= MIN_WARMUP_TRACED when tracing."""
    return args.warmup - 1


def cells(args) -> list[tuple]:
    """Ordered dtype, stage, knobs: a stage's knob settings run one after the other, right
    after that stage's floor is measured (main), so a change in the machine's load hits the
    floor and every library's settings alike."""
    return [(stage, dtype, knobs) for dtype in args.dtypes for stage in args.stages for knobs in args.knobs]


def runs_here(lib: str, stage: int, dtype: str, knobs: str, args) -> bool:
    """PyTorch: no ZeRO-1, no fp16, no knobs (its one row per stage: module docstring)."""
    if lib != "torch":
        return True
    first = "default" if "default" in args.knobs else args.knobs[0]
    return stage != 1 and dtype != "fp16" and knobs == first


def schedule(args) -> list[dict]:
    """Every run, in order: repetition by repetition, each cell once per library; the
    libraries rotate which goes first from one cell to the next and from one repetition to
    the next."""
    runs = []
    for rep in range(args.reps):
        for i, (stage, dtype, knobs) in enumerate(cells(args)):
            k = (rep + i) % len(args.libs)
            for lib in args.libs[k:] + args.libs[:k]:
                if not runs_here(lib, stage, dtype, knobs, args):
                    continue
                run = {"lib": lib, "stage": stage, "dtype": dtype, "knobs": knobs, "rep": rep, "offload": "none",
                       "config": make_config(stage, dtype, knobs, args)}
                if lib == "minizero" and rep == 0 and not args.no_trace:
                    run["trace_dir"] = os.path.join(args.trace_dir, f"{dtype}-{knobs}-stage{stage}")
                    run["config"]["minizero_trace"] = {"enabled": True, "output_path": run["trace_dir"],
                                                       "steps": [trace_step(args)]}
                runs.append(run)
    return runs


def bench_run(run: dict, args_d: dict) -> dict:
    """One rank of one run: warm-up steps, then timed steps (kit.timed_steps)."""
    import torch

    from minizero import comm
    kit.quiet_rank(args_d["verbose"])
    engine = kit.make_engine(run["lib"], run["config"], args_d)
    cuda = torch.cuda.is_available()
    gas, rank = engine.gradient_accumulation_steps(), comm.get_rank()
    batches = kit.make_batches(args_d, args_d["warmup"] + args_d["steps"], gas, rank, kit.engine_device(engine))
    engine.train()
    kit.timed_steps(engine, batches, 0, args_d["warmup"], gas, cuda)
    out = kit.timed_steps(engine, batches, args_d["warmup"], args_d["steps"], gas, cuda)
    out["peak_cuda_bytes"] = kit.peak_cuda_bytes()
    return out


# ----------------------------------------------------------------------------- the floor

def unit_numels(model, world: int, persistence: int) -> list[tuple[int, int]]:
    """ZeRO-3's units as minizero and FSDP2 cut the model (each element of the outermost
    ModuleList, then the root for the rest): per unit (elements gathered on use, padded to a
    multiple of the ranks; elements of persistent parameters, at most `persistence` each)."""
    import torch
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = list(lists[0]) if lists else []
    owned, units = set(), []
    for m in [*blocks, model]:
        mine = [p for p in m.parameters() if id(p) not in owned]
        owned.update(id(p) for p in mine)
        gathered = sum(p.numel() for p in mine if p.numel() > persistence)
        units.append((-(-gathered // world) * world, sum(p.numel() for p in mine if p.numel() <= persistence)))
    return units


def required_collectives(stage: int, knobs: str, psi: int, units: dict, world: int) -> list[list]:
    """The collectives one optimizer step needs at `stage` under the knob setting, as
    [op, elements, count]: what the config asks for, whichever library runs it.

      gradients   one reduction per reduce_bucket_size bucket (PINNED: 500,000 elements),
                  padded to a multiple of the ranks: all-reduce at stage 0, reduce-scatter
                  at 1-3
      ZeRO-1/2    the updated parameters all-gathered after the step: one call per
                  allgather_bucket_size (DeepSpeed's 5e8: one call here)
      ZeRO-3      each unit's partitioned parameters all-gathered before its forward and
                  again before its backward when the reuse distance is 0 (`off`); once with
                  DeepSpeed's reuse distance (1e9 elements: every unit stays gathered from
                  its forward to its backward); parameters at or under the persistence
                  threshold (1e5 by default, 0 when `off`) stay gathered and are all-gathered
                  together once, after the step
    Overlap and prefetch change when these run, never how many: one rank needs none."""
    if world == 1:
        return []
    pad = lambda n: -(-n // world) * world
    bucket = PINNED["reduce_bucket_size"]
    sizes = [bucket] * (psi // bucket) + ([psi % bucket] if psi % bucket else [])
    out = {}
    for n in sizes:
        key = ("all_reduce", n) if stage == 0 else ("reduce_scatter", pad(n))
        out[key] = out.get(key, 0) + 1
    if stage in (1, 2):
        for a in range(0, psi, ALLGATHER_BUCKET_DEFAULT):
            key = ("all_gather", pad(min(ALLGATHER_BUCKET_DEFAULT, psi - a)))
            out[key] = out.get(key, 0) + 1
    if stage == 3:
        layout = units["off" if knobs == "off" else "default"]
        uses = 2 if knobs == "off" else 1
        for gathered, _ in layout:
            if gathered:
                out[("all_gather", gathered)] = out.get(("all_gather", gathered), 0) + uses
        persistent = sum(p for _, p in layout)
        if persistent:
            key = ("all_gather", pad(persistent))
            out[key] = out.get(key, 0) + 1
    return [[op, n, c] for (op, n), c in out.items()]


def floor_ranks(args_d: dict) -> dict:
    """One rank's measurements of what a step must cost on this machine, for one dtype and
    stage (`args_d["floor_dtype"]`, `args_d["floor_stage"]`), with no library: the parts the
    floor adds up (`floor_ms`).

      fwd_bwd    the model's forward and backward in the dtype, communication off (plain
                 torch on this rank's micro-batches; gradients dropped between steps)
      opt        the optimizer's arithmetic on this rank's shard (Ψ at stage 0, Ψ/N at 1-3):
                 the gradient in fp32, unscaled by one number, its squared norm (one fp32
                 pass), AdamW on an fp32 master (torch's, the faster of one flat tensor and
                 1 MB slices, the same numbers either way), the master rounded into the
                 shard (bf16, fp16)
      coll_s     every distinct collective of `required_collectives` (for each knob setting
                 asked for), each timed alone: "op:elements" -> seconds
      required   per knob setting, the collectives with their counts
      copies     with --step5, what offload must copy per step

    Each part is the median over timed iterations, as the libraries' steps are."""
    import functools

    import torch
    import torch.distributed as dist

    from minizero import comm
    from minizero.adam import ChunkedAdamW
    from reference.ds_run import build_model
    os.dup2(2, 1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args_d["floor_dtype"]]
    rank, world, device = dist.get_rank(), dist.get_world_size(), comm.get_device()
    model, _ = build_model(functools.partial(kit.build_gpt, args_d["model"], args_d["model_kw"]), {}, args_d["seed"])
    model.to(device=device, dtype=dtype).train()
    psi = sum(p.numel() for p in model.parameters())
    n_warm, n_time = max(1, args_d["warmup"]), args_d["steps"]
    batches = kit.make_batches(args_d, n_warm + n_time, 1, rank, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timer = kit.RegionTimer(device.type == "cuda")

    def timed(fn) -> float:
        """Median seconds per call of fn, timed as the libraries' steps are (RegionTimer)."""
        out = []
        for i in range(n_warm + n_time):
            sync()
            dist.barrier()
            timer.start()
            fn(i)
            timer.stop()
            sync()
            out.append(timer.seconds())
        return statistics.median(out[n_warm:])

    def fwd_bwd(i):
        x, y = batches[i]
        loss = model(x, y)[1]
        loss.float().backward()
        for p in model.parameters():
            p.grad = None

    res = {"psi": psi, "fwd_bwd": timed(fwd_bwd)}
    gen = torch.Generator().manual_seed(args_d["seed"])
    stage = args_d["floor_stage"]
    n = psi if stage == 0 else -(-psi // world)
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

        best = min(best, timed(opt_step))
    res["opt"] = best
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

        res["copies"] = timed(copies)
    units = {"default": unit_numels(model, world, PERSISTENCE_DEFAULT), "off": unit_numels(model, world, 0)}
    res["required"] = {k: required_collectives(stage, k, psi, units, world) for k in args_d["knobs"]}
    res["coll_s"] = {}
    for op, numel in sorted({(op, numel) for req in res["required"].values() for op, numel, _ in req}):
        full = torch.randn(numel, generator=gen).to(device=device, dtype=dtype)
        part = torch.empty(numel // world, dtype=dtype, device=device)
        scatter, gather = comm.torch_reduce_scatter(), comm.torch_all_gather()   # as minizero calls them
        call = {"all_reduce": lambda i: dist.all_reduce(full),
                "reduce_scatter": lambda i: scatter(part, full),
                "all_gather": lambda i: gather(full, part)}[op]
        res["coll_s"][f"{op}:{numel}"] = timed(call)
    return res


def floor_ms(parts: dict, knobs: str) -> dict:
    """The floor of a step from the slowest rank's parts, in ms: forward + backward + the
    optimizer (and --step5's copies) + every collective the config requires at this knob
    setting, each at its median time alone, all counted as unhidden."""
    comm_s = sum(c * parts["coll_s"][f"{op}:{n}"] for op, n, c in parts["required"][knobs])
    out = {"fwd_bwd": parts["fwd_bwd"], "optimizer": parts["opt"] + parts.get("copies", 0.0), "comm": comm_s}
    out = {k: 1e3 * v for k, v in out.items()}
    out["floor"] = sum(out.values())
    out["collectives"] = sum(c for _, _, c in parts["required"][knobs])
    return out


FLOOR_NOTE = ("floor: what a step must cost on this machine, measured in the same run with no library "
              "(floor_ranks): the model's forward + backward in the dtype with communication off, the optimizer's "
              "arithmetic on this rank's shard (fp32 gradient, unscale, norm, torch's AdamW, round to the dtype), and "
              "every collective the config requires (required_collectives: gradient reductions per 500,000-element "
              "bucket, all-reduce at stage 0 and reduce-scatter at 1-3; ZeRO-1/2 one all-gather of the updated "
              "parameters; ZeRO-3 each unit's gather before forward, and again before backward when the reuse "
              "distance is 0 (knobs off), the persistent parameters gathered once after the step), each at its "
              "median time alone on the machine, all added up as if none were hidden: a library that hides "
              "communication behind compute can go below 1. With --step5 the optimizer part also holds the copies "
              "offload must make (gradient shard out, new shard back, parameter shard in before forward and "
              "backward). Steps: the slowest rank's median step, median over repetitions. On a GPU every time is "
              "CUDA events' (the device's time between syncs), tokens/s comes from the median step and peak CUDA "
              "memory is torch.cuda.max_memory_allocated, the largest rank's, engine init included. torch: DDP at "
              "stage 0, FSDP2 at 2 (reshard_after_forward=False) and 3. minizero speed / X's: X's step over "
              "minizero's (above 1: minizero is faster).")


def run_floor(dtype: str, stage: int, args) -> dict:
    """Every part of the floor for one dtype and stage, on fresh ranks; per part the slowest rank's."""
    args_d = {k: v for k, v in vars(args).items() if k not in ("libs",)}
    args_d["floor_dtype"], args_d["floor_stage"] = dtype, stage
    per_rank = kit.run_on_ranks(floor_ranks, args.world_size, (args_d,), f"the floor's {dtype} stage-{stage} run",
                                args.cuda, args.threads)
    out = {k: max(r[k] for r in per_rank) for k in ("psi", "fwd_bwd", "opt", *(["copies"] if args.step5 else []))}
    out["coll_s"] = {k: max(r["coll_s"][k] for r in per_rank) for k in per_rank[0]["coll_s"]}
    out["required"] = per_rank[0]["required"]
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

def _of(results: list[dict], lib: str, cell: tuple) -> list[dict]:
    return [r for r in results if (r["lib"], r["stage"], r["dtype"], r["knobs"]) == (lib, *cell)]


def summarize(results: list[dict], args) -> list[dict]:
    """One row per cell: per library the median and spread of samples/s over repetitions."""
    rows = []
    for cell in cells(args):
        stage, dtype, knobs = cell
        row = {"stage": stage, "dtype": dtype, "knobs": knobs}
        for lib in args.libs:
            row[lib] = kit.spread([r["samples_per_s"] for r in _of(results, lib, cell)])
            ph = [r["phases_ms"] for r in _of(results, lib, cell)]
            row[f"{lib}_phases_ms"] = {k: statistics.median(p[k] for p in ph) for k in ph[0]} if ph else None
        traced = [r["trace"] for r in _of(results, "minizero", cell) if r.get("trace")]
        row["trace"] = traced[0] if traced else None
        rows.append(row)
    for row in rows:   # each stage over the same library's stage 0, same dtype and knobs
        base = next((r for r in rows if (r["stage"], r["dtype"], r["knobs"]) == (0, row["dtype"], row["knobs"])), None)
        for lib in args.libs:
            a, b = row[lib], base and base[lib]
            row[f"{lib}_over_stage0"] = a["median"] / b["median"] if a and b else None
        mz, ds = row.get("minizero"), row.get("deepspeed")
        row["mz_over_ds"] = mz["median"] / ds["median"] if mz and ds else None
    return rows


def others(args) -> list[str]:
    """The libraries minizero's speed is set against."""
    return [lib for lib in args.libs if lib != "minizero"] if "minizero" in args.libs else []


def floor_rows(results: list[dict], floors: list[dict], args) -> list[dict]:
    """One row per cell: the floor's parts (median over repetitions; each repetition's floor
    measured beside its runs), each library's step (median over repetitions of each run's
    median step) and the ratios."""
    rows = []
    for cell in cells(args):
        stage, dtype, knobs = cell
        per_rep = [floor_ms(f["parts"], knobs) for f in floors if (f["dtype"], f["stage"]) == (dtype, stage)]
        fl = {k: statistics.median(p[k] for p in per_rep) for k in per_rep[0]} if per_rep else None
        row = {"stage": stage, "dtype": dtype, "knobs": knobs, "floor": fl}
        for lib in args.libs:
            ms_ = [r["ms"] for r in _of(results, lib, cell)]
            row[f"{lib}_ms"] = statistics.median(ms_) if ms_ else None
            row[f"{lib}_over_floor"] = row[f"{lib}_ms"] / fl["floor"] if ms_ and fl else None
            # tokens/s from the median step: every rank's micro-batches of --seq tokens
            row[f"{lib}_tokens_per_s"] = (args.micro_batch * args.gas * args.world_size * args.seq
                                          / (row[f"{lib}_ms"] / 1e3)) if ms_ else None
            peaks = [r["peak_cuda_bytes"] for r in _of(results, lib, cell) if r.get("peak_cuda_bytes") is not None]
            row[f"{lib}_peak_cuda_mib"] = max(peaks) / 2 ** 20 if peaks else None
        mz = row.get("minizero_ms")
        for lib in others(args):
            row[f"mz_speed_over_{lib}"] = row[f"{lib}_ms"] / mz if mz and row[f"{lib}_ms"] else None
        rows.append(row)
    return rows


NAMES = {"minizero": "minizero", "deepspeed": "DeepSpeed", "torch": "PyTorch"}


def floor_table(rows: list[dict], args) -> str:
    head = ["dtype", "knobs", "stage", "floor: fwd+bwd / optimizer / comm = floor, ms", "collectives"]
    head += [f"{lib} step, ms" for lib in args.libs] + [f"{lib} step / floor" for lib in args.libs]
    head += [f"minizero speed / {NAMES[lib]}'s" for lib in others(args)]
    if args.cuda:   # on a GPU also the throughput and the memory (peak per rank, init included)
        head += [f"{lib} tokens/s" for lib in args.libs] + [f"{lib} peak CUDA MiB" for lib in args.libs]
    out = []
    for r in rows:
        fl = r["floor"]
        cells_ = [r["dtype"], r["knobs"], str(r["stage"]),
                  " / ".join(kit.ms(fl[k]) for k in ("fwd_bwd", "optimizer", "comm")) + f" = {kit.ms(fl['floor'])}"
                  if fl else "-", str(fl["collectives"]) if fl else "-"]
        cells_ += [fmt(r[f"{lib}_ms"], ".1f" if args.cuda else ".0f") for lib in args.libs]
        cells_ += [fmt(r[f"{lib}_over_floor"], ".2f") for lib in args.libs]
        cells_ += [fmt(r[f"mz_speed_over_{lib}"], ".2f") for lib in others(args)]
        if args.cuda:
            cells_ += [fmt(r[f"{lib}_tokens_per_s"], ",.0f") for lib in args.libs]
            cells_ += [fmt(r[f"{lib}_peak_cuda_mib"], ",.0f") for lib in args.libs]
        out.append(cells_)
    return md_table(head, out)


def spread_cell(cell: dict | None) -> str:
    if not cell:
        return "-"
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict], args) -> str:
    head = ["dtype", "knobs", "stage"]
    head += [f"{lib} samples/s median (min-max)" for lib in args.libs]
    if {"minizero", "deepspeed"} <= set(args.libs):
        head.append("minizero / DeepSpeed")
    head += [f"{lib} / its stage 0" for lib in args.libs]
    if "minizero" in args.libs:
        head += ["mz blocked in comm, % of step", "of it waiting for the other rank"]
    out = []
    for r in rows:
        cells_ = [r["dtype"], r["knobs"], str(r["stage"])] + [spread_cell(r[lib]) for lib in args.libs]
        if {"minizero", "deepspeed"} <= set(args.libs):
            cells_.append(fmt(r["mz_over_ds"], ".2f"))
        cells_ += [fmt(r[f"{lib}_over_stage0"], ".2f") for lib in args.libs]
        if "minizero" in args.libs:
            t = r["trace"]
            cells_ += [pct(t and t["blocked"]), pct(t and t["skew"])]
        out.append(cells_)
    return md_table(head, out)


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
    return md_table(head, out)


def report(info: dict, rows: list[dict], args, frows: list[dict] | None = None) -> str:
    m = info["model"]
    lines = [f"# Overlap benchmark: {', '.join(args.libs)}, {args.world_size} ranks, {info['device']}", "",
             f"- command: `{info['command']}`", f"- machine: {info['machine']}", f"- versions: {info['versions']}",
             f"- date: {info['date']}",
             f"- model: {args.model} with {m['config']} ({m['psi']:,} parameters); micro-batch {args.micro_batch} x "
             f"gas {args.gas} x {args.world_size} ranks of {args.seq} tokens; {args.warmup} warmup + {args.steps} "
             f"timed steps per run, {args.reps} repetition(s), interleaved",
             f"- knobs default: DeepSpeed's defaults (keys left out); off: {json.dumps(OVERLAP_OFF)}; on: "
             f"{json.dumps(OVERLAP_ON)}; all: {json.dumps(PINNED)}"]
    if "torch" in args.libs:
        lines.append("- torch: DDP at stage 0, FSDP2 reshard_after_forward=False at 2, FSDP2 at 3; no ZeRO-1, "
                     "fp16 or knobs (its one row per stage and dtype)")
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
              "minizero at stage 0-1 without overlap_comm inside step; DDP and FSDP2 inside backward."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

log = kit.logger("bench_overlap")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
    except BenchError as e:
        print(f"bench_overlap: error: {e}", file=sys.stderr)
        return 2
    os.environ["DS_ACCELERATOR"] = "cuda" if args.cuda else "cpu"   # before any rank imports deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if not args.verbose:
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    if not args.no_trace:   # --no-trace writes no trace, so it makes no folder for one
        args.trace_dir = os.path.abspath(args.trace_dir or tempfile.mkdtemp(prefix="bench_overlap_trace_"))
    t_start = time.perf_counter()
    info = {"command": "python3 launch/bench_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": kit.machine(), "versions": kit.versions(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "device": "GPU (NCCL)" if args.cuda else "CPU (gloo)", "model": kit.model_numbers(args)}
    log(f"model {args.model} {info['model']['config']}: Ψ = {info['model']['psi']:,}; {args.world_size} ranks on "
        f"{info['device']}" + ("" if args.no_trace else f"; traces in {args.trace_dir}"))
    results, floors = [], []
    args_d = {k: v for k, v in vars(args).items() if k not in ("libs",)}
    try:
        kit.preload(args.libs)
        runs = schedule(args)
        for i, run in enumerate(runs):
            key = {k: run[k] for k in ("rep", "dtype", "stage")}
            if not args.no_floor and not any({k: f[k] for k in key} == key for f in floors):
                floors.append({**key, "parts": run_floor(run["dtype"], run["stage"], args)})
                fl = floor_ms(floors[-1]["parts"], run["knobs"])
                log(f"floor {run['dtype']} stage {run['stage']} (rep {run['rep'] + 1}): fwd+bwd {fl['fwd_bwd']:.0f} "
                    f"+ optimizer {fl['optimizer']:.0f} + comm {fl['comm']:.0f} = {fl['floor']:.0f} ms "
                    f"(knobs {run['knobs']}: {fl['collectives']} collectives)")
            what = f"{run['lib']} stage {run['stage']} {run['dtype']} knobs {run['knobs']} (rep {run['rep'] + 1})"
            per_rank = kit.run_on_ranks(bench_run, args.world_size, (run, args_d), what, args.cuda, args.threads)
            ms, _ = kit.step_ms([r["step_s"] for r in per_rank])
            res = {k: run[k] for k in ("lib", "stage", "dtype", "knobs", "rep")}
            res.update(ms=ms, samples_per_s=kit.samples_per_s(ms, args.micro_batch * args.gas * args.world_size),
                       final_loss=per_rank[0]["final_loss"], phases_ms=phases_ms(per_rank),
                       wall_ms=kit.step_ms([r["step_wall_s"] for r in per_rank])[0],
                       peak_cuda_bytes=max(r["peak_cuda_bytes"] for r in per_rank) if args.cuda else None)
            if "trace_dir" in run:
                res["trace"] = trace_shares(run["trace_dir"])
            results.append(res)
            log(f"[{i + 1}/{len(runs)}] {what}: {ms:.0f} ms/step, {res['samples_per_s']:.2f} samples/s")
    except BenchError as e:
        print(f"bench_overlap: error: {e}", file=sys.stderr)
        return 1
    rows = summarize(results, args)
    frows = floor_rows(results, floors, args) if floors else None
    kit.write_outputs(report(info, rows, args, frows), {"info": info, "args": vars(args), "rows": rows,
                                                         "runs": results, "floor_rows": frows, "floors": floors},
                      args.out, args.json)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
