"""NCCL on one GPU, for real: every collective of a training step through the backend at world
size 1, each issued late, and the result bit for bit the run with no process group.

    torchrun --standalone --nproc-per-node 1 launch/nccl_ws1.py --out nccl_ws1.json
    python3 launch/nccl_ws1.py --out nccl_ws1.json        # the same on the CPU: one gloo rank
    python3 launch/nccl_ws1.py --dry-run                  # each case's engine, built: what it offloads

Why: at world size 1 minizero's collectives are local copies (comm.py), so a one-GPU box never
runs NCCL, and NCCL refuses two ranks on one device. With `MINIZERO_ONE_RANK_COLLECTIVES=backend`
(COLLECTIVES_SWITCH below, read when an engine is built) the core sends them through the process group even at
one rank: an all-reduce, reduce-scatter or all-gather of one rank is a copy done by NCCL, on
NCCL's stream, with NCCL's handles and stream waits, the machinery a job of many GPUs depends
on. What could go wrong there is timing: a result read before its collective finished, an
input freed or overwritten before the collective read it. Issued on time such a race usually
goes unseen; so here every collective is issued late:

  on a GPU   from a side stream that first waits for the caller's stream and then sleeps
             about a millisecond on the device (torch.cuda._sleep), so the collective starts
             well after the caller moved on; a caller that waits (Work.wait: its stream waits
             for NCCL's) is unaffected, one that does not reads stale data or has its input
             overwritten by whatever it queued next
  on a CPU   from one worker thread (in order, as a stream) that first sleeps a millisecond;
             a handle's wait() waits for that thread, then for gloo's work

The runs (public API only: minizero.initialize, the engine's calls and full_fp32_state_dict),
each once with no process group and once through the backend, late, must give the same
losses and the same fp32 weights, bit for bit (CASES: ZeRO 0-3 in bf16 with overlap_comm on,
ZeRO-3 with the default knobs, fp16, parameter offload with every FlatParam partitioned,
so that the copy of a shard from host memory meets NCCL's gather). A run through the backend
that issued no collective means the core did not honour the switch, and an offload case that
kept every parameter on the device offloaded nothing: each is a FAIL here, not a pass. On a GPU the kernels are deterministic (torch.use_deterministic_algorithms), or two
runs could differ by the order of their atomic adds and say nothing about NCCL.

Exit status 0 iff every case is identical and every backend run went through the backend; the
per-case result goes to --out as JSON. tests/tools/test_nccl_ws1.py runs the CPU half.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # noqa: E402

kit.bootstrap()

from minizero.process_group import ONE_RANK_ENV  # noqa: E402

# The core's switch that sends collectives through the process group at world size 1.
COLLECTIVES_SWITCH = (ONE_RANK_ENV, "backend")
DELAY_S = 1e-3            # how late each collective is issued
SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep's spin: about a millisecond at a GPU's 1.5-2 GHz
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# torch.distributed's collectives issued late, each counted under its classic name (torch
# 2.13 added all_gather_single / reduce_scatter_single, which minizero calls where they exist)
PATCHED = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather_into_tensor",
           "reduce_scatter_tensor": "reduce_scatter_tensor", "broadcast": "broadcast",
           "all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}

# name -> (stage, dtype, zero_optimization keys beyond the stage)
CASES = {
    "z0-bf16-overlap": (0, "bf16", {"overlap_comm": True}),
    "z1-bf16-overlap": (1, "bf16", {"overlap_comm": True}),
    "z2-bf16-overlap": (2, "bf16", {"overlap_comm": True}),
    "z3-bf16-overlap": (3, "bf16", {"overlap_comm": True, "stage3_param_persistence_threshold": 0}),
    "z3-bf16-default": (3, "bf16", {}),
    "z2-fp16-overlap": (2, "fp16", {"overlap_comm": True}),
    "z3-fp16-default": (3, "fp16", {}),
    # threshold 0: at the default (1e5 elements) every parameter of the micro GPT is persistent,
    # kept gathered on the device, and offload_param would move nothing to the host
    "z3-bf16-offload": (3, "bf16", {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "offload_param": {"device": "cpu", "pin_memory": True},
                                    "stage3_param_persistence_threshold": 0}),
}
OFFLOAD_CASES = ("z3-bf16-offload",)   # cases whose point is parameter shards in host memory


def config(stage: int, dtype: str, zero: dict, micro_batch: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, **zero}}
    cfg[dtype] = {"enabled": True}
    return cfg


def batches(vocab: int, seq: int, rows: int, steps: int) -> list:
    """Random tokens, the same for every run (y: x shifted by one)."""
    import torch
    data = torch.randint(0, vocab, (steps, rows, seq + 1), generator=torch.Generator().manual_seed(1234))
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def train(case: str, model: str, steps: int, micro_batch: int, seq: int) -> dict:
    """One case on this process's device: per-step losses and the final fp32 weights (CPU)."""
    import torch

    import minizero
    from minizero.gpt.model import GPT, get_preset
    stage, dtype, zero = CASES[case]
    preset = get_preset(model, block_size=seq, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    engine = minizero.initialize(model=GPT(preset), config=config(stage, dtype, zero, micro_batch))[0]
    losses = []
    for x, y in batches(preset.vocab_size, seq, micro_batch, steps):
        loss = engine(x.to(engine.device), y.to(engine.device))[1]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    state = {k: v.detach().cpu() for k, v in engine.full_fp32_state_dict().items()}
    return {"losses": losses, "state": state, "skipped": int(engine.skipped_steps), "placed": placement(engine)}


def placement(engine) -> dict:
    """Where the engine keeps its parameters (its public memory_breakdown and layout): bytes of
    parameter shards in host memory, of all parameter bytes, and FlatParams partitioned of all."""
    mem, layout = engine.memory_breakdown(), engine.layout()
    return {"host_param_bytes": int(mem["host"]["params"]), "param_bytes": int(mem["params"]),
            "partitioned": sum(not f["persistent"] for f in layout), "flat_params": len(layout)}


def dry_run(cases: list, model: str = "micro", seq: int = 16, micro_batch: int = 4) -> list[str]:
    """Each case's engine built on this process (no process group, no step, CPU if no GPU):
    one line saying what it offloads. The offload case must move parameter shards to the host."""
    import logging

    import torch

    import minizero
    from minizero.gpt.model import GPT, get_preset
    lines = []
    logger = logging.getLogger("minizero")
    level, _ = logger.level, logger.setLevel(logging.WARNING)   # the engines' own placement lines: ours instead
    with launcher_hidden():
        for case in cases:
            stage, dtype, zero = CASES[case]
            torch.manual_seed(0)
            preset = get_preset(model, block_size=seq, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
            engine = minizero.initialize(model=GPT(preset), config=config(stage, dtype, zero, micro_batch))[0]
            p = placement(engine)
            where = (f"{p['partitioned']} of {p['flat_params']} FlatParams partitioned" if stage == 3 else
                     f"ZeRO-{stage}: parameters whole on every rank")
            lines.append(f"{case}: {p['host_param_bytes']:,} of {p['param_bytes']:,} parameter bytes in host memory; "
                         f"{where}" + (" (offloads)" if p["host_param_bytes"] else
                                       " (OFFLOADS NOTHING)" if case in OFFLOAD_CASES else ""))
    logger.setLevel(level)
    return lines


@contextlib.contextmanager
def launcher_hidden():
    """As if no launcher had started this process: the engine then starts no process group."""
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class LateWork:
    """A CPU collective's handle: issued by the worker thread after its sleep."""

    def __init__(self, future):
        self.future = future

    def wait(self, timeout=None):
        work = self.future.result()
        return work.wait() if work is not None else True

    def is_completed(self) -> bool:
        return self.future.done() and self.future.result().is_completed()


@contextlib.contextmanager
def late_collectives(calls: dict):
    """Every torch.distributed collective issued late (module docstring), each counted in `calls`."""
    import torch
    import torch.distributed as dist
    cuda = dist.get_backend() == "nccl"
    originals = {name: getattr(dist, name) for name in PATCHED if hasattr(dist, name)}
    if cuda:
        side = torch.cuda.Stream()
    else:
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1, thread_name_prefix="late-collectives")

    def late(name, fn):
        def issue(*args, async_op=False, **kwargs):
            calls[PATCHED[name]] = calls.get(PATCHED[name], 0) + 1
            if cuda:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(SLEEP_CYCLES)
                    work = fn(*args, async_op=True, **kwargs)
            else:
                def on_thread():
                    time.sleep(DELAY_S)
                    return fn(*args, async_op=True, **kwargs)
                work = LateWork(pool.submit(on_thread))
            if async_op:
                return work
            work.wait()   # NCCL: the caller's stream waits for the collective, the host does not
            return None
        return issue

    for name, fn in originals.items():
        setattr(dist, name, late(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        if not cuda:
            pool.shutdown()


def same(a: dict, b: dict) -> tuple[bool, str]:
    if a["losses"] != b["losses"]:
        d = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        return False, f"losses differ (max |dloss| {d:.3g})"
    bad = [k for k in a["state"] if not a["state"][k].equal(b["state"][k])]
    if bad or set(a["state"]) != set(b["state"]):
        return False, f"weights differ: {', '.join(bad[:3]) or 'names'}"
    return True, ""


def check(cases: list, model: str = "micro", steps: int = 3, micro_batch: int = 4, seq: int = 16) -> dict:
    """In a process that may have a launcher's environment but no process group yet: every
    case without a group, then the group (NCCL on a GPU, gloo on a CPU), then every case
    through it, late. Per case: identical?, the backend's collective calls, the reason."""
    import torch

    from minizero import comm
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    with launcher_hidden():
        alone = {c: train(c, model, steps, micro_batch, seq) for c in cases}
    comm.init_distributed()
    if comm.get_world_size() != 1:
        raise SystemExit(f"nccl_ws1: error: world size {comm.get_world_size()}: run it on one rank "
                         "(torchrun --nproc-per-node 1)")
    name, value = COLLECTIVES_SWITCH
    os.environ[name] = value
    out = {"backend": torch.distributed.get_backend(), "switch": f"{name}={value}", "cases": {}}
    try:
        for c in cases:
            calls = {}
            with late_collectives(calls):
                got = train(c, model, steps, micro_batch, seq)
            ok, why = same(alone[c], got)
            if ok and not calls:
                ok, why = False, f"no collective went through {out['backend']}: the core ignored {name}={value}"
            if ok and c in OFFLOAD_CASES and not got["placed"]["host_param_bytes"]:
                ok, why = False, "offloaded nothing: every parameter stayed on the device (persistent FlatParams)"
            out["cases"][c] = {"identical": ok, "reason": why, "calls": calls, "losses": got["losses"],
                               "skipped": got["skipped"], "placed": got["placed"]}
    finally:
        os.environ.pop(name, None)
        comm.destroy()
    out["passed"] = all(r["identical"] for r in out["cases"].values())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launch/nccl_ws1.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the per-case results to this JSON file")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--model", default="micro", help="GPT preset (default micro)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dry-run", action="store_true",
                   help="build each case's engine here (no process group, no step) and say what it offloads")
    args = p.parse_args(argv)
    try:
        cases = kit.comma_list(args.cases, tuple(CASES), "cases")
    except kit.BenchError as e:
        print(f"nccl_ws1: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for line in dry_run(cases, args.model):
            print(line, flush=True)
        return 0
    if "RANK" not in os.environ:   # plain python: a one-rank group of our own
        from minizero.process_group import free_port, single_host_env
        os.environ.update(single_host_env(0, 1, free_port()))
    res = check(cases, args.model, args.steps)
    for c, r in res["cases"].items():
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items())) or "none"
        print(f"{c}: {'IDENTICAL' if r['identical'] else 'DIFFERENT: ' + r['reason']} "
              f"({res['backend']} calls: {calls})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
