"""Host time per optimizer step: what each library's Python costs when compute is negligible,
split by phase, with the Python calls and tensor ops it launches per step.

    python3 launch/bench_host.py                                   # every cell below: ~10 min on 2 busy CPU cores
    python3 launch/bench_host.py --minizero-checkout ../before     # adds a column "minizero@before"
    python3 launch/bench_host.py --stages 0,3 --dtypes bf16 --world-sizes 1 --libs minizero,torch

Why: a fast GPU finishes a small model's forward and backward before the host has issued
the next step, so the step costs what the library's Python costs (docs/gpu.md: in bf16 on an
H200 minizero's step was 1.5-2.1x its floor). With compute made negligible (the tutorial GPT's
12 layers at width 16, 63 tokens: `--model tutorial --n-embd 16 --seq 63`, the flags of
`python -m minizero.train --model tutorial --n-embd 16 --image-size 8`) a CPU shows that host
time.

What it runs, per ranks (`--world-sizes`, 1 and 2), dtype (fp32, bf16), ZeRO stage (0-3) and
library: minizero, DeepSpeed, PyTorch (DDP at stage 0; FSDP2 with reshard_after_forward=False
at 2, which gathers once per step and reduce-scatters, ZeRO-2's traffic; FSDP2 at 3; no
ZeRO-1), and minizero again from each `--minizero-checkout DIR` (that folder's `minizero`
package, this file's loop, in a process of its own: the column "minizero@<folder name>", so
a change is measured against the code before it in the same run). Each run is a launch of
fresh ranks (launch/kit.py), the same model, data and config in every library (torch's AdamW,
the same overlap and prefetch knobs: DeepSpeed's defaults, reduce_bucket_size 500,000). Per
run: `--warmup` untimed steps, then

  timed    `--steps` steps with nothing watching: the wall time of each (the host time: the
           compute is negligible, and on a GPU nothing here waits for it but the sync at the
           step's end), the host seconds of each call (forward, backward, step), and the
           seconds spent inside torch.distributed's collectives (issued, and waited for when
           synchronous), by the call they fell in
  plain    after each timed step, the same model without a library, forward and backward on
           the same batch: the compute (timed beside the step it is subtracted from)
  counted  `--count-steps` steps under sys.setprofile (Python function calls), then as many
           under a TorchDispatchMode (tensor ops dispatched to a kernel, forward and backward)

and the split of a step's host time (medians over steps, the mean over ranks):

  compute              the plain model's forward + backward, in the run's dtype (DDP's bf16 is
                       autocast on fp32 weights: its casts land in its forward and backward hooks)
  forward hooks        forward - plain forward - collectives in it (ZeRO-3's gathers' bookkeeping)
  backward hooks       backward - plain backward - collectives in it (hooks, bucketing, copies)
  collectives          time inside torch.distributed's collective calls, where each library's
                       reduction bookkeeping ends (at one rank minizero makes none: a local copy)
  optimizer step       step - collectives in it (clipping, the optimizer, rounding, gathers' setup)
  everything else      the step's wall time - forward - backward - step (the loop, the sync)

and, beside the wall time, the library's own CPU time: the main thread's CPU seconds
(time.thread_time) for the step's forward, backward and step less the bare model's. On a
CPU the forward, the backward and every hook run on that thread, so this is the host work
the library adds; waiting is not in it (for a partner rank, for gloo's threads, for the
scheduler of a busy machine), which makes it the steadier of the two at two ranks on two
cores, and the part a fast GPU exposes. For scale, each run also times PyTorch alone doing
the optimizer's part on the plain model (clip_grad_norm_ and a foreach AdamW step over its
parameter tensors, CPU time): what any library's step must at least do; and the same work
done over flat buffers by hand, with nothing else (`flat_floor_cpu_s`): the floor of
minizero's design, which no bookkeeping cut can go below.

It prints a table of host ms/step side by side and one of the added CPU ms/step (each with
minizero's column over the others), then the split and the counts per run; `--json` keeps
every number. On a shared machine the milliseconds swing by tens of percent: compare columns
of one run, never runs of two hours. The counts do not swing.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `python3 launch/bench_host.py` from anywhere
import kit  # noqa: E402
from kit import BenchError, fmt, md_table  # noqa: E402

if __name__ == "__main__" and "--worker" in sys.argv:
    kit.bootstrap(Path(sys.argv[sys.argv.index("--worker") + 1]))   # another checkout's minizero first
else:
    kit.bootstrap()

DTYPES = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
PHASES = ("compute", "forward_hooks", "backward_hooks", "collectives", "optimizer_step", "else")
PHASE_TITLES = {"compute": "compute", "forward_hooks": "forward hooks", "backward_hooks": "backward hooks & bucketing",
                "collectives": "collectives", "optimizer_step": "optimizer step", "else": "everything else"}
# the config's AdamW (minGPT's), which every library gets and the bare and floor steps use too;
# its weight decay is torch's default, which "torch_adam" keeps
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.01
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
               "_reduce_scatter_base", "all_gather", "reduce_scatter", "broadcast", "all_reduce_coalesced",
               "all_gather_single", "reduce_scatter_single")


def parse_args(argv=None):
    p = kit.OneLineParser(prog="python3 launch/bench_host.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--libs", default="minizero,deepspeed,torch", help="comma-separated, of minizero, deepspeed, torch")
    p.add_argument("--minizero-checkout", action="append", default=[], metavar="DIR",
                   help="also time the minizero package of this checkout (a column minizero@<folder>); repeatable")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages (default 0,1,2,3)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32, bf16, fp16 (default fp32,bf16)")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated rank counts (default 1,2)")
    kit.add_model_flags(p, "tutorial", 16, 63)
    p.add_argument("--micro-batch", type=int, default=8, help="train_micro_batch_size_per_gpu (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--count-steps", type=int, default=2, help="steps counted per way of counting (default 2)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every cell, interleaved (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1, as torchrun's)")
    kit.add_output_flags(p)
    return p.parse_args(argv)


def check_args(args, cuda: bool | None = None, gpus: int | None = None) -> None:
    args.libs = kit.comma_list(args.libs, kit.LIBS, "libs")
    args.stages = kit.comma_list(args.stages, STAGES, "stages", int)
    args.dtypes = kit.comma_list(args.dtypes, DTYPES, "dtypes")
    try:
        args.world_sizes = sorted({int(w) for w in args.world_sizes.split(",") if w.strip()})
    except ValueError:
        raise BenchError(f"--world-sizes {args.world_sizes!r}: comma-separated rank counts, e.g. 1,2") from None
    if not args.world_sizes or min(args.world_sizes) < 1:
        raise BenchError(f"--world-sizes {args.world_sizes}: give rank counts >= 1")
    args.checkouts = []
    for d in args.minizero_checkout:
        root = Path(d).resolve()
        if not (root / "minizero" / "__init__.py").is_file():
            raise BenchError(f"--minizero-checkout {d}: no minizero package there (want {root}/minizero/__init__.py)")
        args.checkouts.append({"column": f"minizero@{root.name}", "root": str(root)})
    if len({c["column"] for c in args.checkouts}) < len(args.checkouts) or \
            any(c["column"] == lib for c in args.checkouts for lib in args.libs):
        raise BenchError("--minizero-checkout: two checkouts with the same folder name; rename one")
    args.world_size = max(args.world_sizes)
    kit.check_launch(args, args.libs, cuda, gpus)
    kit.at_least(args, 1, ("steps", "count_steps", "reps", "micro_batch", "threads", "n_embd", "seq"))
    kit.at_least(args, 0, ("warmup",))


def columns(args) -> list[dict]:
    """Every column: the libraries of this checkout, then each other checkout's minizero."""
    return [{"column": lib, "lib": lib, "root": None} for lib in args.libs] + \
        [{"column": c["column"], "lib": "minizero", "root": c["root"]} for c in args.checkouts]


def runs_here(lib: str, stage: int, dtype: str) -> bool:
    return lib != "torch" or (stage != 1 and dtype != "fp16")


def make_config(stage: int, dtype: str, args) -> dict:
    """The same config in every library: minGPT's AdamW as minizero.train's default, the
    overlap and prefetch knobs at DeepSpeed's defaults, a 500,000-element reduce bucket."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500_000, "memory_efficient_linear": False}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def schedule(args) -> list[dict]:
    """Every run in order: per repetition, ranks, dtype and stage, each column once, the
    columns rotating which goes first."""
    runs, cols, turns = [], columns(args), {}
    for rep in range(args.reps):
        for world in args.world_sizes:
            for dtype in args.dtypes:
                for stage in args.stages:
                    here = [c for c in cols if runs_here(c["lib"], stage, dtype)]
                    k = turns[len(here)] = turns.get(len(here), -1) + 1   # per set of columns: each goes first
                    k %= len(here)
                    runs += [{**col, "rep": rep, "world": world, "dtype": dtype, "stage": stage,
                              "config": make_config(stage, dtype, args)} for col in here[k:] + here[:k]]
    return runs


# ----------------------------------------------------------------------------- one rank

class CollectiveClock:
    """Seconds inside torch.distributed's collectives (the outermost call of a chain: torch
    calls one from another), charged to whichever phase is running. Installed before the
    library is built: DeepSpeed keeps the functions it finds at initialize."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        self.phase, self.seconds, self.depth, self.originals = "else", {}, 0, []
        for mod in (dist, c10d):
            for name in COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is not None and not getattr(fn, "_host_clock", False):
                    self.originals.append((mod, name, fn))
                    setattr(mod, name, self.wrap(fn))

    def uninstall(self) -> None:
        """The functions back, for the counted steps (a library that cached a wrapper keeps it)."""
        for mod, name, fn in self.originals:
            setattr(mod, name, fn)

    def wrap(self, fn):
        def timed(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth, t0 = 1, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth = 0
                self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + time.perf_counter() - t0
        timed._host_clock = True
        return timed


def count_python_calls(fn) -> int:
    """Python function calls while fn runs (sys.setprofile: this thread, where a CPU backward
    runs too; on a GPU autograd's device thread runs the backward hooks and is not seen)."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def count_tensor_ops(fn) -> int:
    """Tensor ops dispatched while fn runs, forward and backward (a TorchDispatchMode sees each
    op after autograd, as it goes to a kernel; a tensor subclass's own inner ops, FSDP2's
    DTensor's, count once, as the op the subclass was called with)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def plain_model(args_d: dict, dtype: str, device):
    """The model alone (no library), in the run's dtype, for the compute part."""
    import torch
    torch.manual_seed(args_d["seed"])
    model = kit.build_gpt(args_d["model"], args_d["model_kw"]).to(device)
    return model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]) if dtype != "fp32" else model


def plain_step(model, x, y) -> tuple:
    """Forward and backward seconds of the model alone, and the CPU seconds of both."""
    c0, t0 = time.thread_time(), time.perf_counter()
    loss = model(x, y)[1]
    t1 = time.perf_counter()
    loss.float().backward()
    t2, c2 = time.perf_counter(), time.thread_time()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, c2 - c0


def bare_optimizer_cpu_s(model, batches: list, steps: int) -> float:
    """CPU seconds per step of what any library's step must at least do, done by PyTorch
    alone on the plain model: clip_grad_norm_ and AdamW (foreach, the config's
    hyperparameters) over its parameters, then zero_grad. Median over `steps` steps, each
    after a forward and backward (not counted)."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True)
    took = []
    for x, y in batches[:steps]:
        model(x, y)[1].float().backward()
        c0 = time.thread_time()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        took.append(time.thread_time() - c0)
    return statistics.median(took)


def flat_floor_cpu_s(model, batches: list, steps: int) -> float:
    """CPU seconds per step of the tensor work a step over flat buffers cannot skip, written out
    by hand on the plain model with no bookkeeping at all: per param group (minGPT's decay and
    no-decay), the parameters' gradients copied into one flat buffer and set to None, the squared
    norm in fp64, the clip factor, the gradient in fp32 divided by it, AdamW on one fp32 master,
    and in bf16 the master rounded into a flat low-precision copy. That is minizero's step at
    one rank (stage 0/1) with everything but the arithmetic taken away: the floor of its design.
    Median over `steps` steps, each after a forward and backward (not counted)."""
    import torch
    flats = []
    for g in model.configure_param_groups(WEIGHT_DECAY):
        params = [p for p in g["params"] if p.requires_grad]
        numel = sum(p.numel() for p in params)
        grads = torch.zeros(numel, dtype=params[0].dtype)
        views = [v.view_as(p) for v, p in zip(grads.split([p.numel() for p in params]), params)]
        master = torch.cat([p.detach().reshape(-1) for p in params]).float()
        flats.append((params, views, grads, master, torch.zeros_like(master), torch.zeros_like(master),
                      torch.empty_like(grads), g["weight_decay"]))
    took = []
    for x, y in batches[:steps]:
        model(x, y)[1].float().backward()
        c0 = time.thread_time()
        for params, views, *_ in flats:
            torch._foreach_copy_(views, [p.grad for p in params])
            for p in params:
                p.grad = None
        norm_sq = None
        for _, _, grads, *_ in flats:
            part = grads.double().pow_(2).sum()
            norm_sq = part if norm_sq is None else norm_sq.add_(part)
        float(norm_sq)   # the step's one host sync
        inverse = 1.0 / torch.clamp((norm_sq.sqrt().float() + 1e-6) / 1.0, min=1.0)
        for _, _, grads, master, exp_avg, exp_avg_sq, weights, wd in flats:
            g = grads.float() if grads.dtype != torch.float32 else grads
            g.mul_(inverse)
            if wd:
                master.mul_(1 - LR * wd)
            exp_avg.lerp_(g, 1 - BETAS[0])
            exp_avg_sq.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            # Adam's bias corrections as fixed stand-ins: scalars, the same cost whatever they are
            master.addcdiv_(exp_avg, exp_avg_sq.sqrt().div_(0.5).add_(1e-8), value=-LR / 0.1)
            if weights.dtype != torch.float32:
                weights.copy_(master)
        took.append(time.thread_time() - c0)
    return statistics.median(took)


def host_run(run: dict, args_d: dict) -> dict:
    """One rank of one run: warm up, time, count (module docstring)."""
    import torch

    from minizero import comm
    kit.quiet_rank(args_d["verbose"])
    clock = CollectiveClock()
    engine = kit.make_engine(run["lib"], run["config"], args_d)
    cuda = torch.cuda.is_available()
    n_warm, n_time, n_count = args_d["warmup"], args_d["steps"], args_d["count_steps"]
    total = n_warm + n_time + 2 * n_count
    batches = kit.make_batches(args_d, total, 1, comm.get_rank(), kit.engine_device(engine))
    engine.train()
    kit.timed_steps(engine, batches, 0, n_warm, 1, cuda)
    plain = plain_model(args_d, run["dtype"], kit.engine_device(engine))
    plain_step(plain, *batches[0])
    phase_s, wall_s, comm_s, cpu_s = {"forward": [], "backward": [], "step": []}, [], [], []
    plain_s = {"forward": [], "backward": []}
    for step in range(n_warm, n_warm + n_time):
        clock.seconds = {}
        x, y = batches[step]
        clock.phase = "forward"
        c0, t0 = time.thread_time(), time.perf_counter()
        t1 = t0
        loss = engine(x, y)[1]
        clock.phase = "backward"
        t2 = time.perf_counter()
        engine.backward(loss)
        clock.phase = "step"
        t3 = time.perf_counter()
        engine.step()
        t4, c4 = time.perf_counter(), time.thread_time()
        clock.phase = "else"
        if cuda:
            torch.cuda.synchronize()
        wall_s.append(time.perf_counter() - t0)
        for k, v in zip(phase_s, (t2 - t1, t3 - t2, t4 - t3)):
            phase_s[k].append(v)
        comm_s.append(dict(clock.seconds))
        # the compute alone right after, on the same batch: the load of a shared machine
        # changes between steps, and a part is a difference of two times taken together
        *plain_fb, plain_cpu = plain_step(plain, x, y)
        for k, v in zip(plain_s, plain_fb):
            plain_s[k].append(v)
        cpu_s.append((c4 - c0) - plain_cpu)
    clock.uninstall()
    bare_opt_s = bare_optimizer_cpu_s(plain, batches[n_warm:n_warm + n_time], n_time)
    floor_s = flat_floor_cpu_s(plain, batches[n_warm:n_warm + n_time], n_time)
    first = n_warm + n_time
    py_calls = count_python_calls(lambda: [kit.one_step(engine, batches, s, 1) for s in range(first, first + n_count)])
    first += n_count
    ops = count_tensor_ops(lambda: [kit.one_step(engine, batches, s, 1) for s in range(first, first + n_count)])
    return {"wall_s": wall_s, "phase_s": phase_s, "comm_s": comm_s, "added_cpu_s": cpu_s, "bare_optimizer_s": bare_opt_s,
            "flat_floor_s": floor_s,
            "plain_s": {k: statistics.median(v) for k, v in plain_s.items()},
            "python_calls": py_calls / n_count, "tensor_ops": ops / n_count}


def split(per_rank: list[dict]) -> dict:
    """A step's host time by part (module docstring), ms: medians over steps, mean over
    ranks; host_ms is the slowest rank's median step."""
    med = lambda xs: 1e3 * statistics.median(xs)
    parts = []
    for r in per_rank:
        comm = {ph: med([c.get(ph, 0.0) for c in r["comm_s"]]) for ph in ("forward", "backward", "step")}
        fwd, bwd, stp = (med(r["phase_s"][k]) for k in ("forward", "backward", "step"))
        pf, pb = 1e3 * r["plain_s"]["forward"], 1e3 * r["plain_s"]["backward"]
        wall = med(r["wall_s"])
        parts.append({"compute": pf + pb, "forward_hooks": fwd - pf - comm["forward"],
                      "backward_hooks": bwd - pb - comm["backward"], "collectives": sum(comm.values()),
                      "optimizer_step": stp - comm["step"], "else": wall - fwd - bwd - stp})
    out = {k: statistics.fmean(p[k] for p in parts) for k in PHASES}
    out["host_ms"] = kit.step_ms([r["wall_s"] for r in per_rank])[0]
    out["added_cpu_ms"] = statistics.fmean(med(r["added_cpu_s"]) for r in per_rank)
    out["bare_optimizer_cpu_ms"] = statistics.fmean(1e3 * r["bare_optimizer_s"] for r in per_rank)
    out["flat_floor_cpu_ms"] = statistics.fmean(1e3 * r["flat_floor_s"] for r in per_rank)
    out["python_calls"] = statistics.fmean(r["python_calls"] for r in per_rank)
    out["tensor_ops"] = statistics.fmean(r["tensor_ops"] for r in per_rank)
    return out


# ----------------------------------------------------------------------------- running

def args_dict(args, world: int) -> dict:
    d = {k: v for k, v in vars(args).items() if k not in ("libs", "checkouts", "minizero_checkout")}
    d.update(world_size=world, seq=args.seq)
    return d


def run_here(run: dict, args) -> list[dict]:
    what = f"{run['column']} {run['world']} rank(s) {run['dtype']} stage {run['stage']}"
    return kit.run_on_ranks(host_run, run["world"], (run, args_dict(args, run["world"])), what, args.cuda,
                            args.threads, timeout=1800)


def run_elsewhere(run: dict, args) -> list[dict]:
    """The run in a process whose `minizero` is the checkout's (its folder first on sys.path)."""
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        spec, out = Path(tmp) / "run.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"run": run, "args": args_dict(args, run["world"]), "cuda": args.cuda}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [run["root"], os.environ.get("PYTHONPATH")]))}
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", run["root"], str(spec), str(out)],
                           cwd=run["root"], env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0 or not out.is_file():
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            raise BenchError(f"{run['column']} {run['world']} rank(s) {run['dtype']} stage {run['stage']} failed: "
                             f"{lines[-1] if lines else f'exit {r.returncode}'}")
        return json.loads(out.read_text())


def worker(root: str, spec: str, out: str) -> int:
    """`--worker ROOT SPEC OUT`: one run with ROOT's minizero; its per-rank results to OUT."""
    job = json.loads(Path(spec).read_text())
    import minizero
    if not str(Path(minizero.__file__).resolve()).startswith(str(Path(root).resolve())):
        print(f"bench_host: error: minizero came from {minizero.__file__}, not {root}", file=sys.stderr)
        return 1
    kit.preload(["minizero"])
    try:
        per_rank = kit.run_on_ranks(host_run, job["run"]["world"], (job["run"], job["args"]), job["run"]["column"],
                                    job["cuda"], job["args"]["threads"], timeout=1800)
    except BenchError as e:
        print(f"bench_host: error: {e}", file=sys.stderr)
        return 1
    Path(out).write_text(json.dumps(per_rank))
    return 0


# ----------------------------------------------------------------------------- the report

def side_by_side(results: list[dict], args, key: str = "host_ms", bare: bool = False) -> str:
    """`key` (ms per step) per column, each cell's median over repetitions, and minizero over
    the others; bare: then the bare optimizer's CPU ms (bare_optimizer_cpu_s) and the flat step's floor
    (flat_floor_cpu_s), each the median over every run of the cell."""
    cols = [c["column"] for c in columns(args)]
    mz = "minizero" if "minizero" in cols else None
    ratio_cols = [c for c in cols if c != mz] if mz else []
    head = ["ranks", "dtype", "stage"] + [f"{c} ms" for c in cols] + [f"minizero / {c}" for c in ratio_cols] + \
        (["bare AdamW + clip ms", "flat step floor ms"] if bare else [])
    rows = []
    for world in args.world_sizes:
        for dtype in args.dtypes:
            for stage in args.stages:
                here = {c: [r[key] for r in results if (r["column"], r["world"], r["dtype"], r["stage"]) ==
                            (c, world, dtype, stage)] for c in cols}
                med = {c: statistics.median(v) if v else None for c, v in here.items()}
                cell = [r for r in results if bare and (r["world"], r["dtype"], r["stage"]) == (world, dtype, stage)]
                rows.append([str(world), dtype, str(stage)] + [fmt(med[c], ".2f") for c in cols]
                            + [fmt(med[mz] / med[c], ".2f") if med[mz] and med[c] else "-" for c in ratio_cols]
                            + ([fmt(statistics.median(r[k] for r in cell), ".2f") if cell else "-"
                                for k in ("bare_optimizer_cpu_ms", "flat_floor_cpu_ms")] if bare else []))
    return md_table(head, rows)


def split_table(results: list[dict]) -> str:
    head = ["ranks", "dtype", "stage", "library", "host ms/step"] + [f"{PHASE_TITLES[p]}, ms" for p in PHASES] + \
        ["Python calls/step", "tensor ops/step"]
    rows = [[str(r["world"]), r["dtype"], str(r["stage"]), r["column"], fmt(r["host_ms"], ".2f")]
            + [fmt(r[p], ".2f") for p in PHASES] + [fmt(r["python_calls"], ",.0f"), fmt(r["tensor_ops"], ",.0f")]
            for r in results]
    return md_table(head, rows)


def report(info: dict, results: list[dict], args) -> str:
    m = info["model"]
    lines = [f"# Host time per step: {', '.join(c['column'] for c in columns(args))}, {info['device']}", "",
             f"- command: `{info['command']}`", f"- machine: {info['machine']}", f"- versions: {info['versions']}",
             f"- date: {info['date']}",
             f"- model: {args.model} with {m['config']} ({m['psi']:,} parameters); micro-batch {args.micro_batch} of "
             f"{args.seq} tokens per rank; {args.warmup} warmup + {args.steps} timed + 2 x {args.count_steps} counted "
             f"steps per run, {args.reps} repetition(s)",
             "- torch: DDP at stage 0, FSDP2 reshard_after_forward=False at 2, FSDP2 at 3 (no ZeRO-1, no fp16)", "",
             "Host ms per optimizer step (the slowest rank's median step; median over repetitions):", "",
             side_by_side(results, args), "",
             "The library's own CPU ms per step: the main thread's CPU time for forward, backward and step, "
             "less the bare model's forward and backward right after (median over steps, mean over ranks; median "
             "over repetitions). Waiting is not in it (for a partner rank, for gloo's threads), nor being "
             "descheduled on a busy machine: it is the host work a GPU would expose. For scale, the last two "
             "columns: what PyTorch alone spends on the plain model's clip_grad_norm_ and AdamW (foreach) step, "
             "the work any library's step must at least do; and the flat step's floor, the tensor work of "
             "minizero's step at one rank written out by hand with no bookkeeping (flat_floor_cpu_s).", "",
             side_by_side(results, args, "added_cpu_ms", bare=True), "",
             "Where the host time goes (ms per step, medians over steps, mean over ranks; launch/bench_host.py's "
             "docstring defines each part) and what a step launches:", "",
             split_table(results)]
    return "\n".join(lines)


log = kit.logger("bench_host")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:4])
    try:
        args = parse_args(argv)
        check_args(args)
    except BenchError as e:
        print(f"bench_host: error: {e}", file=sys.stderr)
        return 2
    os.environ["DS_ACCELERATOR"] = "cuda" if args.cuda else "cpu"   # before any rank imports deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    info = {"command": "python3 launch/bench_host.py " + " ".join(argv), "machine": kit.machine(),
            "versions": kit.versions(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "device": "GPU (NCCL)" if args.cuda else "CPU (gloo)", "model": kit.model_numbers(args),
            "checkouts": args.checkouts}
    t_start, results = time.perf_counter(), []
    try:
        kit.preload(args.libs)
        runs = schedule(args)
        for i, run in enumerate(runs):
            per_rank = run_elsewhere(run, args) if run["root"] else run_here(run, args)
            res = {k: run[k] for k in ("column", "lib", "world", "dtype", "stage", "rep")}
            res.update(split(per_rank))
            results.append(res)
            log(f"[{i + 1}/{len(runs)}] {run['column']} {run['world']} rank(s) {run['dtype']} stage {run['stage']}: "
                f"{res['host_ms']:.2f} ms/step, {res['python_calls']:,.0f} Python calls, "
                f"{res['tensor_ops']:,.0f} tensor ops")
    except BenchError as e:
        print(f"bench_host: error: {e}", file=sys.stderr)
        return 1
    kit.write_outputs(report(info, results, args), {"info": info, "args": vars(args), "results": results},
                      args.out, args.json)
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
