"""minizero vs DeepSpeed 0.19.8: per-step loss and final fp32 weights, stages 0-3 x fp32/bf16/fp16.

World size 2 (gloo), "tiny" GPT (108,801 params, dropout 0.1 on), 20 steps, micro-batch 4,
torch.optim.AdamW (lr 1e-3, weight decay 0.01 on the decay group) via `torch_adam`,
gradient_clipping = DeepSpeed's default 1.0, reduce_bucket_size 2e4,
stage3_param_persistence_threshold 0, ZeRO-3 memory_efficient_linear off (tests/agreement.py).

Measured (docs/agreement.md has the table): minizero equals DeepSpeed BITWISE -- losses and
final fp32 master weights -- at every stage in fp32 and at stages 1-3 in bf16 and fp16, and
DeepSpeed's own inter-stage drift over stages 0-3 (fp32) / 1-3 (bf16, fp16) is exactly 0.

One caveat found while measuring: with these settings the gradient norm is 0.85-0.98 < 1.0,
so clipping never fires and the gradient-norm arithmetic (where minizero and DeepSpeed do
differ by ulps, see test_grad_norm_*) cannot reach the weights. `test_clipping_active_*`
reruns stages 1 and 3 with gradient_clipping 0.5 (steps 0-9 clip) to expose it.

Stage 0 in bf16/fp16 does NOT agree, because of two DeepSpeed quirks (FP16_UnfusedOptimizer,
runtime/fp16/unfused_optimizer.py, is what stage 0 + torch_adam gives):
  1. "one step ahead": FP16_UnfusedOptimizer.__init__ -> initialize_optimizer_states() sets
     every grad to zeros and calls optimizer.step() once. AdamW's step counter becomes 1
     (so every later bias correction uses step+1) and the zero-grad step already applies
     weight decay (w *= 1 - lr*wd). Losses agree at step 0 and drift from step 1 on.
  2. fp16 only: FP16_UnfusedOptimizer is a DeepSpeedOptimizer, not a ZeROOptimizer, so
     DeepSpeedEngine.backward never calls scale_if_loss: the loss is NOT multiplied by the
     loss scale, while step() -> unscale_and_clip_grads still divides the gradients by
     cur_scale (65536). The gradients reaching AdamW are 65536x too small (~1e-8, the size
     of eps), and the fp16 backward itself runs unscaled (small gradients flush to zero);
     its reported norm is the unscaled one (not divided by the scale), which is why it is
     close to stage 1's but not equal.
minizero has neither quirk, so its stage 0 equals its stage 1 bitwise; we pin both facts.
"""
import pytest

from tests import agreement as A

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

FP32_ULP_REL = 2.0 ** -23


@pytest.fixture(scope="module", autouse=True)
def _train_everything_once():
    A.prefetch_mz(A.ALL_MZ_KEYS)  # all minizero configurations, one pair of processes


def _r0(results):
    return results[0]


# ----------------------------------------------------------------------------- fp32

@pytest.mark.parametrize("stage", A.STAGES)
def test_fp32_loss_within_deepspeeds_own_inter_stage_drift(stage):
    drift = A.ds_inter_stage_drift("fp32")
    wdrift = A.ds_inter_stage_weight_drift("fp32")
    ds, mz = _r0(A.cached_ds(stage, "fp32")), _r0(A.cached_mz(stage, "fp32"))
    gap = A.max_abs_diff(mz["losses"], ds["losses"])
    wgap = A.state_max_diff(mz["final_state"], ds["final_state"])
    print(f"\nfp32 stage {stage}: max|dloss| {gap:.3e} (DS drift {drift:.3e}); "
          f"max|dw| {wgap:.3e} (DS drift {wdrift:.3e})")
    # Measured: drift == 0 and gap == 0. DeepSpeed fp32 stages 0-3 are bitwise equal (fp32
    # sums of two ranks' halves commute; ZeRO-3 equals ZeRO-2 once memory_efficient_linear is
    # off) and minizero does the same arithmetic: per-rank grads averaged as (g0+g1)/2 in
    # the pre-divided buffer, clip factor clamp((norm+1e-6)/1.0, min=1) == 1 here, AdamW.
    assert gap <= drift
    assert wgap <= wdrift
    assert ds["losses"][0] != ds["losses"][-1]  # the model does move


# ----------------------------------------------------------------------------- bf16 / fp16

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_low_precision_loss_and_weights_bitwise(stage, dtype):
    ds, mz = _r0(A.cached_ds(stage, dtype)), _r0(A.cached_mz(stage, dtype))
    gap = A.max_abs_diff(mz["losses"], ds["losses"])
    wgap = A.state_max_diff(mz["final_state"], ds["final_state"])
    print(f"\n{dtype} stage {stage}: max|dloss| {gap:.3e}, max|dw| {wgap:.3e}, "
          f"DS drift stages 1-3 {A.ds_inter_stage_drift(dtype, (1, 2, 3)):.3e}")
    # Tolerance: 0, measured. DEEPSPEED_FACTS' op-order noise (bf16 2.4e-4, fp16 2.7e-5 over
    # 20 steps) is what a *different* op order (2 threads) costs; here both libraries run the
    # same ops in the same order on one thread: lp(g0/2) + lp(g1/2) (divide before the sum,
    # in the low-precision dtype: DeepSpeed's average_tensor / minizero's flat_grad), fp32
    # master = upcast copy, grad.float() * (1/(clip*S)) with clip == 1, AdamW on the
    # master, copy back to lp. The same fp16 loss-scale trajectory too (asserted below).
    # Any nonzero value means one side changed its arithmetic: find out which, don't widen.
    assert gap == 0.0
    assert wgap == 0.0
    assert mz["loss_scales"] == ds["loss_scales"]
    assert mz["skipped_steps"] == ds["skipped_steps"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_stage0_low_precision_minizero_equals_its_stage1_and_deepspeed_quirk_is_pinned(dtype):
    mz0, mz1 = _r0(A.cached_mz(0, dtype)), _r0(A.cached_mz(1, dtype))
    ds0, ds1 = _r0(A.cached_ds(0, dtype)), _r0(A.cached_ds(1, dtype))
    # minizero: stage 0 is stage 1 without partitioning, same arithmetic -> bitwise.
    assert mz0["losses"] == mz1["losses"]
    assert A.state_max_diff(mz0["final_state"], mz1["final_state"]) == 0.0
    # DeepSpeed: stage 0 is FP16_UnfusedOptimizer (see the module docstring).
    assert ds0["optimizer_kind"] == "FP16_UnfusedOptimizer"
    assert ds0["losses"][0] == ds1["losses"][0]      # same init weights, same first forward
    gap = A.max_abs_diff(ds0["losses"], ds1["losses"])
    print(f"\nDS {dtype} stage 0 vs stage 1: max|dloss| {gap:.3e} (measured bf16 2.96e-3, fp16 7.0e-3)")
    # Measured gaps are 12x (bf16) / 26x (fp16) the op-order noise bound of DEEPSPEED_FACTS:
    # not noise. When DeepSpeed fixes the quirk this fails: then compare stage 0 directly.
    noise = {"bf16": 2.4e-4, "fp16": 2.7e-5}[dtype]
    assert gap > 5 * noise
    assert A.max_abs_diff(mz0["losses"], ds1["losses"]) == 0.0  # minizero stage 0 == DS ZeRO-1
    if dtype == "fp16":
        # quirk 2: the scale never moves (no overflow is ever seen at 65536 on unscaled
        # gradients), and the reported step-0 norm is the norm of gradients computed from
        # the UNSCALED loss (fp16 underflow): close to, but not equal to, ZeRO-1's.
        assert set(ds0["loss_scales"]) == {65536.0}
        assert ds0["grad_norms"][0] != ds1["grad_norms"][0]
        assert abs(ds0["grad_norms"][0] - ds1["grad_norms"][0]) / ds1["grad_norms"][0] < 1e-4


# ----------------------------------------------------------------------------- gradient norm

@pytest.mark.parametrize("dtype", A.DTYPES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_norm_matches_to_fp32_rounding(stage, dtype):
    """get_global_grad_norm() agrees to a few fp32 ulps, not bitwise: the arithmetic differs.

    minizero (engine._take_model_step + zero0.local_grad_sq): fp64 sum of squares over each
    whole grad shard, ONE fp64 all_reduce, fp64 sqrt, then rounded once to fp32.
    DeepSpeed ZeRO-1/2 (stage_1_and_2.py get_grad_norm_direct + scaled_global_norm): per
    param-piece fp64 vector_norm, stack().pow(2).sum() ROUNDED TO fp32, fp32 all_reduce,
    fp32 sqrt per param group, then combine_grad_norm_groups = fp32 vector_norm of the
    two group norms: ~5 fp32 roundings on the way -> bound 3 ulps (measured max 1.13 ulp).
    DeepSpeed ZeRO-3 (stage3.py get_grad_norm_direct): fp64 throughout (reported as a
    float64), so the only gap is minizero's final rounding to fp32: <= half an ulp
    (2^-24 relative; measured 0.66 of it).
    """
    ds, mz = _r0(A.cached_ds(stage, dtype)), _r0(A.cached_mz(stage, dtype))
    rel = max(abs(a - b) / b for a, b in zip(mz["grad_norms"], ds["grad_norms"]))
    print(f"\n{dtype} stage {stage}: max rel grad-norm gap {rel:.3e} = {rel / FP32_ULP_REL:.2f} fp32 ulp")
    bound = 3 * FP32_ULP_REL if stage < 3 else 2.0 ** -24 + 1e-12
    assert rel <= bound


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", A.CLIP_STAGES)
def test_clipping_active_loss_within_deepspeeds_own_drift(stage, dtype):
    """gradient_clipping 0.5: the first 10 steps clip, so the norm arithmetic above reaches the weights.

    Measured: DeepSpeed's own ZeRO-1 vs ZeRO-3 drift is fp32 2.4e-7, bf16 6.8e-5 (its two
    stages compute the norm differently: fp32 vs fp64, see test_grad_norm_*); minizero vs
    DeepSpeed: fp32 2.4e-7 at both stages, bf16 2.9e-5 (stage 1), 6.8e-5 (stage 3); minizero's
    own stages agree bitwise with each other. With DeepSpeed's exact norm arithmetic
    patched into minizero (the change proposed in docs/agreement.md) the gap was measured 0
    at stages 1 and 3, fp32 and bf16: the norm arithmetic is the whole difference.
    """
    drift = A.ds_inter_stage_drift(dtype, A.CLIP_STAGES, clip=A.CLIP_ACTIVE)
    ds, mz = _r0(A.cached_ds(stage, dtype, clip=A.CLIP_ACTIVE)), _r0(A.cached_mz(stage, dtype, clip=A.CLIP_ACTIVE))
    gap = A.max_abs_diff(mz["losses"], ds["losses"])
    print(f"\nclip {A.CLIP_ACTIVE} {dtype} stage {stage}: max|dloss| {gap:.3e}, DS drift stages "
          f"{A.CLIP_STAGES}: {drift:.3e}")
    fired = sum(n > A.CLIP_ACTIVE for n in ds["grad_norms"])
    assert fired >= A.STEPS // 2  # measured: clipping fires on the first 10 of 20 steps
    assert 0.0 < drift  # DeepSpeed disagrees with itself here; fails (good news) if it stops
    assert gap <= drift
    mz_other = [_r0(A.cached_mz(s, dtype, clip=A.CLIP_ACTIVE))["losses"] for s in A.CLIP_STAGES]
    assert all(m == mz_other[0] for m in mz_other)


def _grow_config():
    cfg = A.make_config(1, "fp16")
    cfg["fp16"] = {"enabled": True, "loss_scale_window": 4, "initial_scale_power": 10}
    return cfg


def test_deepspeed_unscales_by_the_grown_loss_scale():
    """A DeepSpeed quirk, pinned. `DeepSpeedZeroOptimizer.step` (stage_1_and_2.py) calls
    `_update_scale(overflow)` *before* `unscale_and_clip_grads`, which reads
    `self.loss_scale` -- already the new value. On a step where the dynamic scale grows
    (every `loss_scale_window` clean steps) the gradients, computed with scale S, are
    divided by 2S: that step's gradient is halved. minizero unscales by the scale the
    backward used. With a window of 4: both agree bitwise through step 4 (the scale grows
    at the end of step index 4), then differ; the scale trajectories stay identical."""
    from reference.ds_run import run_deepspeed
    from tests.launcher import run_ranks

    cfg, steps = _grow_config(), 7
    ds = run_ranks(run_deepspeed, world_size=A.N, args=(A.MODEL_FN, cfg, A.BATCHES, steps), env=A.ENV)[0]
    mz = run_ranks(A.run_minizero, world_size=A.N, args=(A.MODEL_FN, cfg, A.BATCHES, steps), env=A.ENV)[0]
    assert ds["loss_scales"] == mz["loss_scales"] and ds["loss_scales"][4] == 2 * ds["loss_scales"][3]
    assert ds["losses"][:5] == mz["losses"][:5]
    assert abs(ds["losses"][5] - mz["losses"][5]) > 1e-4   # measured 5.1e-4
