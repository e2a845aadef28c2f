"""How long do ZeRO's collectives take, issued one at a time and issued back to back?

    python3 launch/bench_collectives.py                          # 2 ranks, the tutorial GPT's Ψ, fp32
    python3 launch/bench_collectives.py --buckets 500000,0 --dtype bf16

A step's gradient (Ψ elements) is cut into buckets of `reduce_bucket_size` elements and each
bucket goes through one collective: all-reduce (stage 0), reduce-scatter (ZeRO-1/2) and,
after the step, all-gather of the parameters (ZeRO-1/2). Issued one at a time (a blocking
call per bucket), each collective starts only when the previous one has returned, so every
bucket pays the backend's per-call latency in full. Issued back to back (`async_op=True`
for every bucket, then one wait per handle, in order) the next one is queued while the
previous runs: NCCL runs them in order on its stream, gloo on its worker threads. That is
what minizero does at the step without overlap_comm (buckets.GradBuckets.reduce_all,
flat_param.all_gather_params); the sums are the same, only the waiting differs.

Per op and bucket size: milliseconds for the whole Ψ (median of --reps, the slowest rank),
one at a time and back to back. `--buckets 0` means one bucket of all Ψ. On GPUs the ranks use
NCCL, one GPU each. Raw torch.distributed: this measures the backend, not minizero.

`--compute-ms T` also runs each op beside compute, as a backward interleaves them: T ms of
matmuls in all, cut into one slice before each bucket's collective (the same number of
matmuls on every rank). The table then adds what the collectives cost over that compute
alone, one at a time (ZeRO-2 without overlap_comm: each bucket's reduce-scatter returns
before the next slice computes) and back to back (overlap_comm: issued, waited at the end).
On a CPU the backend's own threads need the cores the ranks compute on, so little of the
communication can hide; on a GPU the copies and reductions run on the device beside the
kernels.

    python3 launch/bench_collectives.py --compute-ms 200 --buckets 500000
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `python3 launch/bench_collectives.py` from anywhere
import kit  # noqa: E402
from kit import BenchError  # noqa: E402

kit.bootstrap()

OPS = ("all_reduce", "reduce_scatter", "all_gather")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TUTORIAL_PSI = 9_755_904   # the tutorial GPT at 8x8 images (launch/bench_overlap.py's model)


def parse_args(argv=None):
    p = kit.OneLineParser(prog="python3 launch/bench_collectives.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--numel", type=int, default=TUTORIAL_PSI, help=f"elements in all (default {TUTORIAL_PSI:,})")
    p.add_argument("--buckets", default="500000,2000000,0",
                   help="comma-separated bucket sizes in elements; 0: one bucket (default 500000,2000000,0)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=5, help="repetitions per cell (default 5)")
    p.add_argument("--compute-ms", type=float, default=0.0, metavar="T",
                   help="also time each op beside T ms of matmuls cut into one slice per bucket (default 0: off)")
    args = p.parse_args(argv)
    try:
        args.buckets = [int(b) for b in args.buckets.split(",")]
    except ValueError:
        raise BenchError(f"--buckets {args.buckets!r}: comma-separated integers, e.g. 500000,0") from None
    kit.at_least(args, 1, ("world_size", "numel", "reps"))
    if args.compute_ms < 0:
        raise BenchError(f"--compute-ms must be >= 0, got {args.compute_ms}")
    if any(b < 0 for b in args.buckets):
        raise BenchError(f"--buckets {args.buckets}: sizes must be >= 0")
    args.buckets = [b or args.numel for b in args.buckets]
    if any(b % args.world_size for b in args.buckets):
        raise BenchError(f"--buckets {args.buckets}: every size must be a multiple of --world-size "
                         f"{args.world_size} (a bucket is cut into one slice per rank)")
    return args


def run_op(op: str | None, full: list, part: list, async_op: bool, compute=None):
    """Every bucket's collective (op None: none), each after one slice of compute if given."""
    import torch.distributed as dist
    from minizero import comm
    scatter, gather = comm.torch_reduce_scatter(), comm.torch_all_gather()   # as minizero calls them
    call = {"all_reduce": lambda i: dist.all_reduce(full[i], async_op=async_op),
            "reduce_scatter": lambda i: scatter(part[i], full[i], async_op=async_op),
            "all_gather": lambda i: gather(full[i], part[i], async_op=async_op),
            None: lambda i: None}[op]
    handles = []
    for i in range(len(full)):
        if compute is not None:
            compute()
        handles.append(call(i))
    for h in handles:
        if h is not None:
            h.wait()


def compute_slice(total_ms: float, slices: int, device):
    """A callable running the same number of fp32 256x1024 @ 1024x256 matmuls on every rank,
    about total_ms / slices ms each (calibrated here; the slowest rank's count is used)."""
    import torch
    import torch.distributed as dist
    a, b = torch.randn(256, 1024, device=device), torch.randn(1024, 256, device=device)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)   # the warm-up's kernels are not timed
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per_mm_ms = 1e3 * (time.perf_counter() - t0) / reps
    count = torch.tensor([max(1, round(total_ms / slices / per_mm_ms))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)   # the slowest rank's count: the fewest matmuls
    count = int(count.item())

    def run():
        for _ in range(count):
            a @ b
    return run


def slowest_median_ms(times: list, device) -> float:
    """The median over repetitions of the slowest rank's seconds, in ms: a collective ends
    when its slowest rank does. The timings go to the rank's device for the MAX all-reduce
    (NCCL takes no CPU tensor)."""
    import torch
    import torch.distributed as dist
    slowest = torch.tensor(times, dtype=torch.float64).to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return 1e3 * statistics.median(slowest.tolist())


def rank_main(args) -> list[dict] | None:
    """One rank (started by minizero.runtime.spawn, its process group up): every bucket size
    and op timed; rank 0 returns the rows."""
    import warnings

    import torch
    import torch.distributed as dist

    from minizero import comm
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch's rename of the *_tensor collectives
    device, dtype = comm.get_device(), getattr(torch, DTYPES[args.dtype])
    rows = []
    for bucket in args.buckets:
        n = -(-args.numel // bucket)
        full = [torch.randn(bucket, device=device).to(dtype) for _ in range(n)]
        part = [torch.empty(bucket // dist.get_world_size(), dtype=dtype, device=device) for _ in range(n)]
        compute = compute_slice(args.compute_ms, n, device) if args.compute_ms else None

        def timed(op, async_op, beside=None) -> float:
            times = []
            for _ in range(args.reps + 1):    # the first is a warm-up
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                run_op(op, full, part, async_op, beside)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            return slowest_median_ms(times[1:], device)

        alone = timed(None, False, compute) if compute else None
        for op in OPS:
            row = {"op": op, "bucket": bucket, "buckets": n, "one_at_a_time_ms": timed(op, False),
                   "back_to_back_ms": timed(op, True)}
            if compute:
                row.update(compute_ms=alone, one_at_a_time_over_compute_ms=timed(op, False, compute) - alone,
                           back_to_back_over_compute_ms=timed(op, True, compute) - alone)
            rows.append(row)
    return rows if dist.get_rank() == 0 else None


def table(rows: list[dict]) -> str:
    beside = "compute_ms" in rows[0]
    head = ["op", "bucket elements", "buckets", "one at a time, ms", "back to back, ms", "speed-up"]
    if beside:
        head += ["compute alone, ms", "beside compute, one at a time: ms over compute",
                 "beside compute, back to back: ms over compute"]
    out = []
    for r in rows:
        cells = [r["op"], f"{r['bucket']:,}", str(r["buckets"]), f"{r['one_at_a_time_ms']:.1f}",
                 f"{r['back_to_back_ms']:.1f}", f"{r['one_at_a_time_ms'] / r['back_to_back_ms']:.2f}x"]
        if beside:
            cells += [f"{r['compute_ms']:.1f}", f"{r['one_at_a_time_over_compute_ms']:.1f}",
                      f"{r['back_to_back_over_compute_ms']:.1f}"]
        out.append(cells)
    return kit.md_table(head, out)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        import torch
        cuda = torch.cuda.is_available()
        if cuda and torch.cuda.device_count() < args.world_size:
            raise BenchError(f"--world-size {args.world_size} but {torch.cuda.device_count()} GPU(s): one rank per GPU")
    except BenchError as e:
        print(f"bench_collectives: error: {e}", file=sys.stderr)
        return 2
    try:
        rows = kit.run_on_ranks(rank_main, args.world_size, (args,), "a rank", cuda, timeout=600)[0]
    except BenchError as e:   # a rank failed: its one line, not the whole traceback
        print(f"bench_collectives: error: {e}", file=sys.stderr)
        return 1
    backend = "NCCL" if cuda else "gloo"
    print(f"# Collectives on {args.world_size} ranks ({backend}), {args.numel:,} {args.dtype} elements in all\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
