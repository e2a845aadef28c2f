"""One-minute check of an install: every ZeRO stage once on 2 ranks, against plain PyTorch
and, where DeepSpeed is installed, against DeepSpeed.

    python -m minizero.selftest

Each stage (0, 1, 2, 3) trains the micro GPT (15,099 parameters, dropout off) for STEPS
fp32 AdamW steps on 2 gloo ranks, each rank on its own random tokens. Plain PyTorch does
the same arithmetic in one process: per-parameter AdamW on the ranks' average gradient
g0/2 + g1/2 (one addition of two numbers, so the all-reduce and every reduce-scatter
round alike). Same operations in the same order, so the losses and the final weights must
be equal to the bit, not close: any difference is a broken stage. DeepSpeed, under the
same config (torch's AdamW, the paper's ZeRO-3: no prefetch, no persistence), agrees to
the bit in fp32 too (docs/agreement.md); it runs through reference/ds_run.py, so minizero
itself never imports it.

It prints one row per stage and exits 1 when any check fails, 0 otherwise. The full suite
(`python -m pytest`) is the thorough check; this is the quick one a fresh install runs.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time

STAGES = (0, 1, 2, 3)
STEPS = 3
WORLD = 2
MICRO_BATCH = 4
LR = 1e-2            # large enough that every weight moves: a stage that drops an update shows
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which DeepSpeed's torch_adam uses too


def config(stage: int) -> dict:
    """The DeepSpeed config both libraries get. gradient_clipping 0: no clipping, so the
    plain-PyTorch side needs no norm arithmetic to match."""
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}


def model_fn():
    from minizero.gpt.model import GPT, get_preset
    return GPT(get_preset("micro", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))


class Batches:
    """Picklable random tokens, a function of (step, rank) only (reference/ds_run.py's batch
    convention: batches(step, micro, rank, world_size) -> (x, y))."""

    def __call__(self, step: int, micro: int, rank: int, world_size: int):
        import torch
        from minizero.gpt.model import get_preset
        cfg = get_preset("micro")
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        seq = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.block_size + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _built():
    """The model and minGPT's decay/no-decay groups, from seed 0 (as reference/ds_run.py's build_model)."""
    import torch
    torch.manual_seed(0)
    model = model_fn()
    return model, model.configure_param_groups(WEIGHT_DECAY)


# ----------------------------------------------------------------------------- inside the ranks

def minizero_rank(stages) -> dict:
    """On each rank: every stage in turn; per stage the mean loss per step over the ranks
    (fp64 all-reduce / world, as reference/ds_run.py's train_steps) and, on rank 0, the
    full fp32 weights after the last step."""
    import torch
    import torch.distributed as dist

    import minizero
    from minizero import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    out = {}
    for stage in stages:
        model, groups = _built()
        engine, *_ = minizero.initialize(model=model, model_parameters=groups, config=config(stage))
        losses = []
        for step in range(STEPS):
            x, y = Batches()(step, 0, rank, world)
            loss = engine(x, y)[1]
            engine.backward(loss)
            engine.step()
            t = torch.tensor([float(loss.detach())], dtype=torch.float64)
            dist.all_reduce(t)
            losses.append(float(t.item()) / world)
        state = {k: v.detach().clone() for k, v in engine.full_fp32_state_dict().items()}
        out[stage] = {"losses": losses, "state": state if rank == 0 else None}
        del engine, model
    return out


def deepspeed_rank(stages) -> dict:
    """The same runs under DeepSpeed (reference/ds_run.py's run_deepspeed), stage after stage
    in the same ranks. ZeRO-3 patches torch process-wide, so it runs last; with
    memory_efficient_linear off (run_deepspeed's default) it leaves F.linear alone anyway."""
    from reference.ds_run import run_deepspeed, skip_inference_shm_op
    skip_inference_shm_op()     # an op for inference only, compiled on first use: a minute
    out = {}
    for stage in stages:
        r = run_deepspeed(model_fn, config(stage), Batches(), STEPS, weight_decay=WEIGHT_DECAY)
        # a plain dict: final_state is reference.ds_run's PortableTensorDict
        out[stage] = {"losses": r["losses"], "state": dict(r["final_state"]) if r["rank"] == 0 else None}
    return out


# ----------------------------------------------------------------------------- plain PyTorch

def plain_pytorch() -> dict:
    """One process, the ranks' batches: per-parameter AdamW on g0/2 + g1/2. The loss per
    step is the ranks' mean, as the ranks report it."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # as each rank runs: a matmul's bits can depend on the thread count
    try:
        return _plain_pytorch()
    finally:
        torch.set_num_threads(threads)


def _plain_pytorch() -> dict:
    import torch
    model, groups = _built()
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        grads, total = None, 0.0
        for r in range(WORLD):
            loss = model(*Batches()(step, 0, r, WORLD))[1]
            got = torch.autograd.grad(loss, params, allow_unused=True)
            got = [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]
            grads = [g / WORLD for g in got] if grads is None else [a + g / WORLD for a, g in zip(grads, got)]
            total += float(loss.detach())
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / WORLD)
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ----------------------------------------------------------------------------- checks and table

def difference(a: dict, b: dict) -> str | None:
    """None when the two runs are bit-identical (losses and weights); else what differs."""
    if a["losses"] != b["losses"]:
        step = next(i for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if x != y)
        return f"loss at step {step}: {a['losses'][step]:.7f} vs {b['losses'][step]:.7f}"
    if set(a["state"]) != set(b["state"]):
        return f"different parameters: {sorted(set(a['state']) ^ set(b['state']))[:3]}"
    for k in sorted(a["state"]):
        d = float((a["state"][k].float() - b["state"][k].float()).abs().max())
        if d != 0.0:
            return f"weights {k}: max |diff| {d:.2e}"
    return None


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None and importlib.util.find_spec("reference") is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minizero.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-deepspeed", action="store_true", help="compare with plain PyTorch only")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""      # a CPU check, on any machine: gloo ranks
    from minizero.runtime import selftest as this     # the ranks pickle its functions by module name, not __main__
    from minizero.runtime import spawn
    with_ds = deepspeed_available() and not args.no_deepspeed
    if with_ds:
        spawn.preload("deepspeed")
    t0 = time.perf_counter()
    ref = this.plain_pytorch()
    try:
        mz = spawn.run_ranks(this.minizero_rank, WORLD, (STAGES,), backend="gloo", env={"DS_ACCELERATOR": "cpu"})[0]
        ds = {}
        if with_ds:
            ds = spawn.run_ranks(this.deepspeed_rank, WORLD, (sorted(STAGES),), backend="gloo",
                                 env={"DS_ACCELERATOR": "cpu"})[0]
    except spawn.RankError as e:
        print(f"selftest: FAILED: a rank raised: {e}", file=sys.stderr)
        return 1
    failed = 0
    print(f"minizero selftest: {len(STAGES)} ZeRO stages x {STEPS} fp32 steps of the micro GPT on {WORLD} ranks; "
          f"bit-identical losses and weights required\n")
    print("| stage | final loss | vs plain PyTorch | vs DeepSpeed |")
    print("|---|---|---|---|")
    for s in STAGES:
        cells = []
        for other in (ref, ds.get(s)):
            if other is None:
                cells.append("not installed" if not with_ds else "not run")
                continue
            diff = this.difference(mz[s], other)
            failed += diff is not None
            cells.append("equal" if diff is None else f"FAIL: {diff}")
        print(f"| {s} | {mz[s]['losses'][-1]:.6f} | {cells[0]} | {cells[1]} |")
    took = time.perf_counter() - t0
    print(f"\n{'FAILED: ' + str(failed) + ' check(s)' if failed else 'all checks passed'} in {took:.0f} s"
          + ("" if with_ds else " (DeepSpeed not installed: `pip install -e .[dev]` adds it)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
