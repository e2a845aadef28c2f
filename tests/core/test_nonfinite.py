"""bf16 and fp32: a step whose gradient norm is inf/NaN is skipped, as DeepSpeed's ZeRO does.

DeepSpeed 0.19.8's ZeRO optimizers treat an inf/NaN gradient norm as an overflow outside
fp16 too: stage_1_and_2.py (`self.dtype != torch.bfloat16 or self.check_grad_overflow`)
and stage3.py (`is_invalid_grad_norm`); `bf16.check_grad_overflow` defaults to true. The
step is dropped: weights and Adam state unchanged, skipped_steps + 1, get_global_grad_norm()
inf. Before this, minizero applied the step and every weight became NaN.

The run (N = 2, micro GPT, 3 steps): step 1 multiplies rank 1's loss by inf, so only that
rank's gradients are non-finite before the reduction. Both libraries run the same
function, and each rank reports, per step: did any fp32 weight move, the counters, the norm.
Every minizero run of the file is trained in one launch of two ranks, every DeepSpeed run in
another (`poisoned_many`): each run builds its engine from its own config and seed, so it
reports in a shared launch what it reports alone (checked field by field when it was
written), and a launch costs about a second of CPU.
"""
import importlib.util
import math

import pytest

from tests.support import agreement as A
from tests.support.launcher import run_ranks

POISONED_STEP = 1


def poisoned_run(lib: str, stage: int, dtype: str, check_grad_overflow=None) -> list[dict]:
    import torch
    import torch.distributed as dist

    cfg = A.make_config(stage, dtype)
    if check_grad_overflow is not None:
        cfg["bf16"]["check_grad_overflow"] = check_grad_overflow
    if lib == "deepspeed":
        import deepspeed
        from reference.ds_run import build_model, full_fp32_state_dict, prepare_ds_config
        cfg = prepare_ds_config(cfg)
        model, params = build_model(A.MODEL_FN, cfg, 0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        state = lambda: full_fp32_state_dict(engine)   # noqa: E731
    else:
        import minizero
        from reference.ds_run import build_model
        model, params = build_model(A.MODEL_FN, cfg, 0)
        engine, *_ = minizero.initialize(model=model, model_parameters=params, config=cfg)
        state = engine.full_fp32_state_dict
    rank, world = dist.get_rank(), dist.get_world_size()
    log = []
    for step in range(3):
        before = state()
        x, y = A.BATCHES(step, 0, rank, world)
        loss = engine(x, y)[1]
        if step == POISONED_STEP and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        after = state()
        moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in after)
        finite = all(bool(torch.isfinite(v).all()) for v in after.values())
        norm = engine.get_global_grad_norm()
        log.append(dict(moved=moved, finite=finite, skipped=int(engine.skipped_steps),
                        global_steps=int(engine.global_steps), norm=float(norm) if norm is not None else None))
    return log


def poisoned_many(jobs: list) -> list:
    """On each rank: poisoned_run(lib, stage, dtype, **kw) for every (lib, stage, dtype, kw)
    of `jobs`, one after another."""
    return [poisoned_run(lib, stage, dtype, **kw) for lib, stage, dtype, kw in jobs]


LIKE_DEEPSPEED = [(stage, dtype) for stage in (1, 3) for dtype in ("bf16", "fp32")]
MINIZERO_ONLY = [(1, "bf16", dict(check_grad_overflow=False)), (0, "fp32", {}), (2, "fp32", {})]


def _key(lib, stage, dtype, **kw):
    return (lib, stage, dtype, tuple(sorted(kw.items())))


@pytest.fixture(scope="module")
def runs():
    """Every run of the file: key -> per-rank logs; one launch per library."""
    jobs = {"minizero": [("minizero", s, d, {}) for s, d in LIKE_DEEPSPEED]
            + [("minizero", s, d, kw) for s, d, kw in MINIZERO_ONLY],
            "deepspeed": [("deepspeed", s, d, {}) for s, d in LIKE_DEEPSPEED]}
    if importlib.util.find_spec("deepspeed") is None:
        del jobs["deepspeed"]
    out = {}
    for todo in jobs.values():
        per_rank = run_ranks(poisoned_many, world_size=A.N, args=(todo,), env=A.ENV)
        for i, (lib, stage, dtype, kw) in enumerate(todo):
            out[_key(lib, stage, dtype, **kw)] = [r[i] for r in per_rank]
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 3])
def test_nonfinite_gradient_skips_the_step_like_deepspeed(runs, stage, dtype):
    pytest.importorskip("deepspeed")
    mz, ds = runs[_key("minizero", stage, dtype)], runs[_key("deepspeed", stage, dtype)]
    for lib, res in (("minizero", mz), ("deepspeed", ds)):
        for r in res:
            s0, s1, s2 = r
            assert s0["moved"] > 0 and s0["skipped"] == 0, (lib, s0)
            assert s1["moved"] == 0.0 and s1["finite"] and s1["skipped"] == 1, (lib, s1)   # skipped, untouched
            assert s1["global_steps"] == 2 and s1["norm"] == math.inf, (lib, s1)
            assert s2["moved"] > 0 and s2["finite"] and s2["skipped"] == 1, (lib, s2)       # trains again
    assert [[s["skipped"] for s in r] for r in mz] == [[s["skipped"] for s in r] for r in ds]


def test_bf16_check_grad_overflow_false_applies_the_step(runs):
    """The switch is honoured: off, the step is applied and the weights go non-finite (as DeepSpeed)."""
    for r in runs[_key("minizero", 1, "bf16", check_grad_overflow=False)]:
        assert r[POISONED_STEP]["skipped"] == 0 and not r[POISONED_STEP]["finite"]


@pytest.mark.parametrize("stage", [0, 2])
def test_minizero_skips_at_every_stage(runs, stage):
    """Stage 0 too (DeepSpeed's stage-0 fp32 path applies the NaN step: we don't copy that)."""
    for r in runs[_key("minizero", stage, "fp32")]:
        assert r[POISONED_STEP]["moved"] == 0.0 and r[POISONED_STEP]["skipped"] == 1
        assert r[2]["moved"] > 0 and r[2]["finite"]
