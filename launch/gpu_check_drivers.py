"""The GPU check's checks that look inside a step (launch/gpu_check.py): they run as
`launch/gpu_check.py --driver NAME WORLD ARGS... JSON`, WORLD ranks (minizero.runtime.spawn;
one rank: this process, no process group), each training a small GPT through minizero's public
API; every rank's result goes to JSON. The consolidated state with offload_optimizer, and the
host syncs of one step.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # noqa: E402
from gpu_check_run import PY, ROOT, Check, Proc, Result, read_json  # noqa: E402
from gpu_check_training import DEBUG_ENV, STAGES  # noqa: E402


def driver(name: str, world: int, *args) -> list:
    """A check run by one of this file's drivers (`--driver`), its ranks' results in {dir}/ranks.json."""
    return [PY, "launch/gpu_check.py", "--driver", name, str(world), *map(str, args), "{dir}/ranks.json"]


def checks(n_gpus: int) -> list:
    """The driver checks, in the order they run."""
    all_gpus = max(n_gpus, 2)
    checks = []
    # engine.full_fp32_state_dict() with offload_optimizer: the gather takes each master from host memory.
    for stage in (1, 2):
        checks.append(Check(
            f"consolidate-offload-z{stage}", f"ZeRO-{stage} bf16 + offload_optimizer on all GPUs: "
                                             "full_fp32_state_dict() == the saved checkpoint consolidated, bit for bit",
            min_gpus=2, steps=[[Proc(driver("consolidate", all_gpus, stage), f"consolidate-offload-z{stage}.log",
                                     DEBUG_ENV, 300)]],
            judge=judge_ranks("{dir}/ranks.json", consolidate_verdict)))

    # One step with every host sync counted: only the engine's documented one may happen.
    for stage, dtype, knobs in [(s, d, "off") for s in STAGES for d in ("bf16", "fp16")] + [(3, "bf16", "default")]:
        name = f"sync-debug-z{stage}-{dtype}" + ("-default" if knobs == "default" else "")
        checks.append(Check(
            name, f"ZeRO-{stage} {dtype}{' with the default prefetch and reuse' if knobs == 'default' else ''} on "
                  f"{'all GPUs' if n_gpus > 1 else '1 GPU'}: one step under torch.cuda.set_sync_debug_mode('warn'): "
                  "exactly one host sync (the engine's read of the norm" + (" and the overflow vote" if dtype == "fp16"
                                                                           else "") + ")",
            steps=[[Proc(driver("sync-debug", max(n_gpus, 1), stage, dtype, knobs), f"{name}.log", timeout=300)]],
            judge=judge_ranks("{dir}/ranks.json", sync_debug_verdict)))

    return checks


# ----------------------------------------------------------------------------- the ranks

# ZeRO-3 as the paper describes it: every parameter partitioned, each unit gathered before
# each use and freed after (prefetch and reuse off)
Z3_OFF = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def small_engine(stage: int, dtype: str, zero: dict):
    """minizero's engine over the `micro` GPT (seed 0) and its synthetic batches, 8 rows a step."""
    import torch

    import minizero
    from minizero import comm
    from minizero.gpt.model import GPT, get_preset
    world = comm.get_world_size() if comm.is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": stage, **zero}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    preset = get_preset("micro", block_size=16, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    engine = minizero.initialize(model=GPT(preset), config=cfg)[0]
    g = torch.Generator().manual_seed(1 + comm.get_rank())
    data = [torch.randint(0, preset.vocab_size, (8 // world, 17), generator=g) for _ in range(4)]
    return engine, [(d[:, :-1].to(engine.device), d[:, 1:].to(engine.device)) for d in data]


def consolidate_rank(stage: int, save_dir: str) -> dict:
    """offload_optimizer at `stage`: one step, then engine.full_fp32_state_dict() (its gather
    takes each master from host memory) against the checkpoint of that step consolidated from
    the files by minizero.consolidate. On every rank: masters on the host, equal, finite?"""
    import torch

    import minizero
    from minizero import comm
    engine, batches = small_engine(stage, "bf16", {"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    x, y = batches[0]
    engine.backward(engine(x, y)[1])
    engine.step()
    gathered = engine.full_fp32_state_dict()
    engine.save_checkpoint(save_dir, tag="step1")
    comm.barrier()
    saved = minizero.consolidate(save_dir, tag="step1")
    same = set(gathered) == set(saved) and all(torch.equal(gathered[k].cpu(), saved[k].cpu()) for k in saved)
    return {"rank": comm.get_rank(), "master_on_host": engine.memory_breakdown()["host"]["master_params"] > 0,
            "equals_checkpoint": same, "finite": all(bool(torch.isfinite(t).all()) for t in gathered.values())}


SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_debug_rank(stage: int, dtype: str, knobs: str) -> dict:
    """One optimizer step (after a warm-up step) under torch.cuda.set_sync_debug_mode("warn"):
    every host sync in forward, backward and step is a warning, recorded with the line that
    made it. The engine's step has exactly one by design (the norm, with fp16's vote)."""
    import warnings

    import torch

    from minizero import comm
    engine, batches = small_engine(stage, dtype, Z3_OFF if stage == 3 and knobs == "off" else {})
    x, y = batches[0]
    engine.backward(engine(x, y)[1])   # the warm-up step: first allocations, ZeRO-3's recorded order
    engine.step()
    torch.cuda.synchronize()
    x, y = batches[1]
    # (a sync in autograd's device thread is replayed as a warning here when backward returns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = engine(x, y)[1]
            engine.backward(loss)
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in seen if SYNC_WARNING in str(w.message)]
    return {"rank": comm.get_rank(), "syncs": syncs, "loss": float(loss)}


DRIVERS = {"consolidate": (consolidate_rank, (int,)), "sync-debug": (sync_debug_rank, (int, str, str))}


def run_driver(argv: list) -> int:
    """`--driver NAME WORLD ARGS... JSON`: the driver on WORLD ranks; their results to JSON."""
    name, world, *args, path = argv
    fn, types = DRIVERS[name]
    args = [t(a) for t, a in zip(types, args)]
    if name == "consolidate":
        args.append(str(Path(path).parent / "checkpoint"))
    kit.bootstrap()
    if int(world) == 1:
        ranks = [fn(*args)]
    else:
        import torch

        from minizero.runtime.spawn import run_ranks
        kit.preload(["minizero"])   # on a CPU (a rehearsal, the tests) the ranks fork: they need this file
        ranks = run_ranks(fn, int(world), tuple(args), cuda=torch.cuda.is_available(), timeout=600)
    Path(path).write_text(json.dumps(ranks, default=float))
    return 0


# ----------------------------------------------------------------------------- verdicts

def consolidate_verdict(ranks: list) -> Result:
    """engine.full_fp32_state_dict() with offload_optimizer, every rank: its masters were in
    host memory, and the gathered state equals, bit for bit, the same step's checkpoint
    consolidated from the files (minizero.consolidate), all finite."""
    bad = [f"rank {r['rank']}: " + ", ".join(what for key, what in (
        ("master_on_host", "master not in host memory"), ("equals_checkpoint", "gathered state != the checkpoint's"),
        ("finite", "non-finite values")) if not r[key]) for r in ranks
        if not (r["master_on_host"] and r["equals_checkpoint"] and r["finite"])]
    return Result("FAIL", "; ".join(bad[:4])) if bad else Result("PASS", "", f"{len(ranks)} ranks")


def sync_debug_verdict(ranks: list) -> Result:
    """Every rank stepped under set_sync_debug_mode('warn'), each host sync a warning: exactly
    one per rank (the engine's read of the norm, with fp16's vote in the same copy)."""
    counts = [len(r["syncs"]) for r in ranks]
    if any(c != 1 for c in counts):
        where = sorted({w for r in ranks for w in r["syncs"]})
        return Result("FAIL", f"host syncs per rank {counts} (want 1 each), at {'; '.join(where[:3])}")
    return Result("PASS", "", f"{len(ranks)} rank(s); 1 host sync per step ({ranks[0]['syncs'][0]}); "
                              f"loss {ranks[0]['loss']:.4f}")


def judge_ranks(path: str, verdict):
    """A --rank-driver's per-rank results (rank 0 wrote them as JSON), judged by `verdict`."""
    return lambda ctx: verdict(read_json(ctx.path(path)))
