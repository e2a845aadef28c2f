"""minizero's half of the agreement tests: `run_minizero` mirrors reference/ds_run.py's
`run_deepspeed`, so the two can be compared number for number.

Same model (`torch.manual_seed(seed)` right before `model_fn()`), same param groups with
the weight decay DeepSpeed would apply (`default_weight_decay`), same JSON config (both
libraries get `prepare_ds_config(config)`: torch_adam inside optimizer.params, ZeRO-3
memory_efficient_linear off), same batches (`get_batch`), same loss bookkeeping (mean over
micro-batches, fp64 all_reduce, divided by the world size).

The test modules share one cache (`cached_ds`, `cached_mz`, a dict in this module that
lives for the whole pytest session), so each configuration is trained once per library.

    DS_ACCELERATOR=cpu .venv/bin/python -m tests.agreement      # prints docs/agreement.md's tables
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from minizero.model import GPT, get_preset  # noqa: E402
from reference.ds_run import (SyntheticBatches, build_model, prepare_ds_config,  # noqa: E402
                              train_steps)
from tests import probes  # noqa: E402

N = 2
STEPS = 20
MICRO_BS = 4
LR = 1e-3
BUCKET = 20_000          # reduce_bucket_size: keeps DS's ZeRO-3 bucket (allocated at init) small
ENV = {"DS_ACCELERATOR": "cpu"}
STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")

MODEL_CFG = get_preset("tiny")  # 108,801 params, dropout 0.1 everywhere (on: RNG must replay)
MODEL_FN = functools.partial(GPT, MODEL_CFG)
BATCHES = SyntheticBatches(MODEL_CFG.vocab_size, MODEL_CFG.block_size, MICRO_BS, seed=11)

CKPT_SECTION = {"partition_activations": True, "contiguous_memory_optimization": False,
                "cpu_checkpointing": False, "number_checkpoints": None,
                "synchronize_checkpoint_boundary": False, "profile": False}


def make_config(stage: int, dtype: str = "fp32", ckpt: bool = False, clip: Optional[float] = None) -> Dict[str, Any]:
    """One config for both libraries. gradient_clipping is left at DeepSpeed's default (1.0)
    unless `clip` is given (the gradient norm of this run is 0.85-0.98, so at 1.0 clipping
    never fires; at 0.5 the first 10 of 20 steps clip)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BS,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                              "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10 ** 9,
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    if ckpt:
        cfg["activation_checkpointing"] = dict(CKPT_SECTION)
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


# ----------------------------------------------------------------------------- the run

def run_minizero(model_fn: Callable[[], torch.nn.Module], config: Dict[str, Any], batches, steps: int, *,
                 capture_memory: bool = False, seed: int = 0, weight_decay: Optional[float] = None,
                 return_final_state: bool = True, variant: str = "minizero") -> Dict[str, Any]:
    """Train `steps` optimizer steps with minizero on this rank; the same keys as run_deepspeed
    (losses, local_losses, loss_scales, grad_norms, lrs, skipped_steps, global_steps,
    final_state, memory, init_seconds, step_seconds, rank, world_size, zero_stage, config)
    plus `comm` (the ledger's by_label since initialize, before the final-state gather) and
    `layout` (one dict per FlatParam).

    `variant` (test harness only; the patches are in tests/probes.py): "minizero", the
    engine as it is; "ds_norm", the clip factor from DeepSpeed's norm arithmetic for this
    stage (`patch_clip`; `ds_grad_norms` holds the norms); "jitter<k>", minizero's clip factor moved by a random whole number
    of fp32 ulps in [-3, 3] on every step that clips (seed k); "ds_stage0", stage 0 with
    DeepSpeed's stage-0 bf16/fp16 arithmetic, quirks included (`ds_stage0_arithmetic`);
    "ds_grown_scale", fp16 gradients unscaled by the loss scale as updated by this step
    (`unscale_by_updated_scale`)."""
    import minizero
    from minizero import comm

    cfg = prepare_ds_config(config)
    model, model_parameters = build_model(model_fn, cfg, seed, weight_decay)

    t0 = time.perf_counter()
    engine, _, _, _ = minizero.initialize(model=model, model_parameters=model_parameters, config=cfg)
    init_seconds = time.perf_counter() - t0
    ds_norms = probes.apply_variant(engine, variant)
    comm.ledger.reset()

    rank, world = comm.get_rank(), comm.get_world_size()
    memory = None
    if capture_memory:
        memory = {"after_init": engine.memory_breakdown(), "after_backward": [], "after_step": []}
    out = train_steps(engine, batches, steps, lambda e: float(e.loss_scale),
                      lambda e: e.memory_breakdown(), memory)
    out.update({
        "skipped_steps": int(engine.skipped_steps), "global_steps": int(engine.global_steps),
        "init_seconds": init_seconds, "rank": rank, "world_size": world,
        "zero_stage": int(engine.zero_optimization_stage()), "config": cfg,
        "comm": {k: dict(v) for k, v in comm.ledger.by_label.items()},
        "layout": probes.flat_layout(engine),
        "n_blocks": len(getattr(model, "blocks", [])),
    })
    if ds_norms is not None:
        out["ds_grad_norms"] = ds_norms
    if return_final_state:
        out["final_state"] = {k: v.detach().cpu().clone() for k, v in engine.full_fp32_state_dict().items()}
    if memory is not None:
        out["memory"] = memory
    return out


def run_minizero_many(jobs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Several run_minizero calls in the same rank processes (one fork for many configs).
    Safe because minizero patches nothing process-wide: every run builds a fresh model, and
    the comm ledger is reset after each initialize. (DeepSpeed runs each get their own
    processes: ZeRO-3 patches torch process-wide.)"""
    return [run_minizero(**job) for job in jobs]


# ----------------------------------------------------------------------------- session cache

_CACHE: Dict[Any, Any] = {}


def _key(stage, dtype, ckpt=False, clip=None, variant="minizero"):
    return (stage, dtype, bool(ckpt), clip, variant)


def cached_ds(stage: int, dtype: str, ckpt: bool = False, clip: Optional[float] = None) -> List[Dict[str, Any]]:
    """DeepSpeed's per-rank results for one configuration, trained once per session."""
    key = ("ds",) + _key(stage, dtype, ckpt, clip)[:4]
    if key not in _CACHE:
        from reference.ds_run import run_deepspeed
        from tests.launcher import run_ranks

        _CACHE[key] = run_ranks(run_deepspeed, world_size=N,
                                args=(MODEL_FN, make_config(stage, dtype, ckpt, clip), BATCHES, STEPS),
                                kwargs={"capture_memory": True}, env=ENV, timeout=600)
    return _CACHE[key]


def prefetch_mz(keys) -> None:
    """Train every not-yet-cached minizero configuration in `keys` in ONE pair of rank processes."""
    from tests.launcher import run_ranks

    todo = [k for k in dict.fromkeys(_key(*k) for k in keys) if ("mz",) + k not in _CACHE]
    if not todo:
        return
    jobs = [{"model_fn": MODEL_FN, "config": make_config(*k[:4]), "batches": BATCHES, "steps": STEPS,
             "capture_memory": True, "variant": k[4]} for k in todo]
    per_rank = run_ranks(run_minizero_many, world_size=N, args=(jobs,), env=ENV, timeout=600)
    for i, k in enumerate(todo):
        _CACHE[("mz",) + k] = [per_rank[r][i] for r in range(N)]


def cached_mz(stage: int, dtype: str, ckpt: bool = False, clip: Optional[float] = None,
              variant: str = "minizero") -> List[Dict[str, Any]]:
    prefetch_mz([(stage, dtype, ckpt, clip, variant)])
    return _CACHE[("mz",) + _key(stage, dtype, ckpt, clip, variant)]


CLIP_ACTIVE = 0.5
CLIP_STAGES = (1, 3)
JITTER_SEEDS = range(6)
# Every minizero configuration any agreement test needs: trained in ONE pair of processes.
ALL_MZ_KEYS = ([(s, d, False, None) for d in DTYPES for s in STAGES]
               + [(s, d, False, CLIP_ACTIVE, n) for d in ("fp32", "bf16") for s in CLIP_STAGES
                  for n in ("minizero", "ds_norm")]
               + [(1, d, False, CLIP_ACTIVE, f"jitter{k}") for d in ("fp32", "bf16") for k in JITTER_SEEDS]
               + [(0, d, False, None, "ds_stage0") for d in ("bf16", "fp16")]
               + [(0, "fp32", True, None), (3, "fp32", True, None), (3, "bf16", True, None)])


# ----------------------------------------------------------------------------- comparisons

def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def state_max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def ds_inter_stage_weight_drift(dtype: str, stages=(0, 1, 2, 3), clip: Optional[float] = None) -> float:
    W = {s: cached_ds(s, dtype, clip=clip)[0]["final_state"] for s in stages}
    return max(state_max_diff(W[s], W[t]) for s in stages for t in stages)


def ds_inter_stage_drift(dtype: str, stages=(0, 1, 2, 3), clip: Optional[float] = None) -> float:
    """max over stages s,t of max_step |loss_ds[s] - loss_ds[t]|: DeepSpeed's own disagreement."""
    L = {s: cached_ds(s, dtype, clip=clip)[0]["losses"] for s in stages}
    return max(max_abs_diff(L[s], L[t]) for s in stages for t in stages)


# ----------------------------------------------------------------------------- the table

def gap_table() -> str:
    prefetch_mz([(s, d, False) for d in DTYPES for s in STAGES])
    lines = ["| dtype | stage | max_step abs(loss_mz - loss_ds) | max abs(w_mz - w_ds) | "
             "DS inter-stage drift (stages 1-3; 0-3) | final loss DS |",
             "|---|---|---|---|---|---|"]
    for d in DTYPES:
        drift13 = ds_inter_stage_drift(d, (1, 2, 3))
        drift03 = ds_inter_stage_drift(d)
        for s in STAGES:
            ds, mz = cached_ds(s, d)[0], cached_mz(s, d)[0]
            lines.append(f"| {d} | {s} | {max_abs_diff(mz['losses'], ds['losses']):.3e} | "
                         f"{state_max_diff(mz['final_state'], ds['final_state']):.3e} | "
                         f"{drift13:.3e}; {drift03:.3e} | {ds['losses'][-1]:.6f} |")
    return "\n".join(lines)


def memory_table() -> str:
    lines = ["| stage | rank | category | minizero bwd / step | DeepSpeed bwd / step |", "|---|---|---|---|---|"]
    for s in STAGES:
        for r in range(N):
            mz, ds = cached_mz(s, "bf16")[r]["memory"], cached_ds(s, "bf16")[r]["memory"]
            for c in ("params", "master_params", "optimizer_states", "grads"):
                lines.append(f"| {s} | {r} | {c} | {mz['after_backward'][-1][c]:,} / {mz['after_step'][-1][c]:,} | "
                             f"{ds['after_backward'][-1][c]:,} / {ds['after_step'][-1][c]:,} |")
            lines.append(f"| {s} | {r} | buffers (DS) | - | {ds['after_backward'][-1]['buffers']:,} / "
                         f"{ds['after_step'][-1]['buffers']:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    print(gap_table())
    print()
    print(memory_table())
    print(f"\n({time.perf_counter() - t0:.0f} s)")
