"""The engine, end to end on gloo CPU ranks: every ZeRO stage trains the same model.

Runs come from tests/engine_runs.py (cached per spec, shared with the other engine test
files). Model: the "micro" GPT (15,099 params; dropout off), learnable synthetic rows,
AdamW lr 1e-2, eps 1e-6, 10 optimizer steps, global batch 8 rows of 16 tokens.

Tolerances (fp32), and why they are what they are:

- Across stages at N = 2 we assert *bitwise* equality. With two ranks every gradient
  reduction is one fp32 addition g0/2 + g1/2 (commutative, so the all-reduce of stage 0,
  the reduce-scatter of ZeRO-1/2/3, any bucketing and any unit grouping round identically),
  and Adam is element-wise, so no stage has a way to round differently. Measured: 0.0.
- N ranks against ONE process over the same global batch are not bitwise: the single
  process sums the loss over 8 rows in one reduction, the ranks over 4 rows each and
  then add. That is fp32 reduction-order noise, ~1e-7 relative in each gradient. Adam
  then divides by sqrt(v) + eps, so a gradient perturbation d moves an update by up to
  lr * d / eps; with lr 1e-2 and eps 1e-6 (chosen for that reason: eps 1e-8 amplifies the
  same noise 100x, measured 9.4e-5 in the weights) that is ~1e-6 per step. Measured
  after 10 steps: losses 6e-7, weights 2.3e-6, grad norms 1.4e-6 (norms ~1).
  Asserted: LOSS_TOL 5e-6, W_TOL 2e-5, NORM_RTOL 1e-5 (about 10x the measurement).
"""
import pytest
import torch

from tests import engine_runs as er

Z3P0 = er.Z3P0
LOSS_TOL = 5e-6
W_TOL = 2e-5
NORM_RTOL = 1e-5

STAGE_RUNS = {  # name -> zero_optimization extras
    "stage0": dict(stage=0), "stage1": dict(stage=1), "stage2": dict(stage=2),
    "stage3_p0": dict(stage=3, zero=Z3P0),       # every parameter really partitioned
    "stage3_default": dict(stage=3),               # default threshold 1e5: all persistent here
}


def state(results):
    return results[0]["state"]


def assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k] - b[k]).abs().max()))


# ----------------------------------------------------------------------------- (a) stages agree, = one process

@pytest.mark.parametrize("name", [n for n in STAGE_RUNS if n != "stage0"])
def test_fp32_stages_bitwise_equal_at_n2(name):
    base, run = er.get(**STAGE_RUNS["stage0"]), er.get(**STAGE_RUNS[name])
    assert_states_equal(state(base), state(run))
    assert er.global_losses(base) == er.global_losses(run)
    assert base[0]["norms"] == run[0]["norms"]
    for r in run:
        assert r["global_steps"] == 10


def test_fp32_n2_equals_single_process():
    two, one = er.get(stage=0), er.get(world=1)
    assert one[0]["world"] == 1 and two[0]["world"] == 2
    dl = er.max_list_diff(er.global_losses(two), one[0]["losses"])
    dw = er.max_abs_diff(state(two), state(one))
    dn = max(abs(a - b) / b for a, b in zip(two[0]["norms"], one[0]["norms"]))
    print(f"\nN=2 vs 1 process: loss {dl:.3g}, weights {dw:.3g}, norm rel {dn:.3g}")
    assert dl <= LOSS_TOL and dw <= W_TOL and dn <= NORM_RTOL
    # and training did something: the weights moved by far more than the tolerance
    init = er.get_reference(steps=0)["state"]
    assert er.max_abs_diff(state(one), init) > 1000 * W_TOL
    assert one[0]["losses"][-1] < one[0]["losses"][0] - 0.3


def test_single_process_engine_equals_plain_pytorch():
    """World size 1 engine vs torch AdamW + clip_grad_norm_ on the same model and data."""
    one, ref = er.get(world=1), er.get_reference()
    dl = er.max_list_diff(one[0]["losses"], ref["losses"])
    dw = er.max_abs_diff(state(one), ref["state"])
    dn = max(abs(a - b) / b for a, b in zip(one[0]["norms"], ref["norms"]))
    print(f"\n1-process engine vs torch: loss {dl:.3g}, weights {dw:.3g}, norm rel {dn:.3g}")
    assert dl <= LOSS_TOL and dw <= W_TOL and dn <= NORM_RTOL


# ----------------------------------------------------------------------------- (b) accumulation

@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3_p0"])
def test_grad_accumulation_2_equals_doubled_micro_batch(name):
    """gas 2 x micro-batch 2 per rank against gas 1 x micro-batch 4: same 8 rows per step.
    Not bitwise (the loss is summed over 2 rows + 2 rows instead of 4 rows): same noise
    argument and tolerances as against one process."""
    kw = STAGE_RUNS[name]
    acc, big = er.get(gas=2, **kw), er.get(**kw)
    dl = er.max_list_diff(er.global_losses(acc), er.global_losses(big))
    dw = er.max_abs_diff(state(acc), state(big))
    dn = max(abs(a - b) / b for a, b in zip(acc[0]["norms"], big[0]["norms"]))
    print(f"\n{name} gas2 vs doubled micro-batch: loss {dl:.3g}, weights {dw:.3g}, norm rel {dn:.3g}")
    assert dl <= LOSS_TOL and dw <= W_TOL and dn <= NORM_RTOL
    assert acc[0]["global_steps"] == 10


def test_grad_accumulation_order_of_sums_per_stage():
    """Stages 0/1 accumulate the full gradient in p.grad over the micro-steps and reduce
    once ((g0 + g0') / 2 + (g1 + g1') / 2); ZeRO-2/3 reduce every micro-step in backward
    and accumulate the shard ((g0/2 + g1/2) + (g0'/2 + g1'/2)). So 0 == 1 and 2 == 3
    bitwise, and the two families differ only by fp32 rounding."""
    runs = {n: er.get(gas=2, **STAGE_RUNS[n]) for n in ("stage0", "stage1", "stage2", "stage3_p0")}
    assert_states_equal(state(runs["stage0"]), state(runs["stage1"]))
    assert_states_equal(state(runs["stage2"]), state(runs["stage3_p0"]))
    dw = er.max_abs_diff(state(runs["stage0"]), state(runs["stage2"]))
    print(f"\ngas2 stage0 vs stage2: weights {dw:.3g}")
    assert dw <= W_TOL


# ----------------------------------------------------------------------------- (c) clipping / norms

@pytest.mark.parametrize("clip", [None, 0.0])   # None = the default, 1.0
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3_p0"])
def test_global_grad_norm_is_the_full_unscaled_gradient_norm(name, clip):
    """engine.get_global_grad_norm() against the norm of the full gradient of the same
    weights computed by plain PyTorch in one process (before clipping), every step; and
    the weights follow torch's clip_grad_norm_ trajectory (or the unclipped one)."""
    run, ref = er.get(clip=clip, **STAGE_RUNS[name]), er.get_reference(clip=clip)
    for r in run:   # every rank reports the same, global, norm
        assert r["norms"] == run[0]["norms"]
    dn = max(abs(a - b) / b for a, b in zip(run[0]["norms"], ref["norms"]))
    dn0 = abs(run[0]["norms"][0] - ref["norms"][0]) / ref["norms"][0]
    dw = er.max_abs_diff(state(run), ref["state"])
    print(f"\n{name} clip={clip}: norm rel max {dn:.3g} (step 0: {dn0:.3g}), weights vs torch {dw:.3g}")
    assert dn0 <= 1e-6      # identical weights at step 0: only the gradient reduction differs
    assert dn <= NORM_RTOL and dw <= W_TOL


def test_clipping_changes_the_trajectory():
    """The clip really is applied: with clip 1.0 (6 of 10 norms are above 1) the weights are
    far (vs W_TOL) from the unclipped run's."""
    on, off = er.get(stage=0), er.get(stage=0, clip=0.0)
    assert sum(n > 1.0 for n in on[0]["norms"]) >= 3
    gap = er.max_abs_diff(state(on), state(off))
    print(f"\nclip on vs off: weights differ by {gap:.3g}")
    assert gap > 50 * W_TOL


# ----------------------------------------------------------------------------- (d) no gradient = zero gradient

UNUSED_STAGES = ["stage0", "stage1", "stage2", "stage3_p0"]


def test_unused_parameters_are_zero_gradients_at_every_stage():
    """`extra` is never used; `side` only on even steps. Missing gradients must count as
    zero (DeepSpeed's ZeRO-3 reapplies a stale one): the never-used weight only decays
    (AdamW: w * (1 - lr*wd) per step, exactly as torch does it), its bias never moves, and
    `side` (momentum but no gradient on odd steps) follows plain PyTorch with zero grads."""
    ref = er.get_reference(model="unused")
    init = er.get_reference(model="unused", steps=0)["state"]
    runs = {n: er.get(model="unused", **STAGE_RUNS[n]) for n in UNUSED_STAGES}
    for name, run in runs.items():
        st = state(run)
        assert torch.equal(st["extra.0.bias"], init["extra.0.bias"]), name
        assert torch.equal(st["extra.0.weight"], ref["state"]["extra.0.weight"]), name
        assert not torch.equal(st["extra.0.weight"], init["extra.0.weight"])   # it did decay
        decayed = init["extra.0.weight"] * (1 - 1e-2 * 0.1) ** 10
        assert torch.allclose(st["extra.0.weight"], decayed, rtol=1e-6, atol=0)
        dw = er.max_abs_diff(st, ref["state"])
        print(f"\nunused params {name}: weights vs torch {dw:.3g}")
        assert dw <= W_TOL
    for name in UNUSED_STAGES[1:]:
        assert_states_equal(state(runs["stage0"]), state(runs[name]))


# ----------------------------------------------------------------------------- (e) uneven sizes

def test_world_size_4_tiny_stage2_small_buckets_equals_stage0():
    """108,801 parameters over 4 ranks (decay group 99,162 = 2 mod 4, no-decay 9,639 odd):
    ZeRO-2 with 3,000-element buckets (each padded to a multiple of 4) against stage 0."""
    kw = dict(preset="tiny", world=4, steps=3, global_batch=4)
    z0, z2 = er.get(stage=0, **kw), er.get(stage=2, zero={"reduce_bucket_size": 3000}, **kw)
    assert any(f["padded"] != f["numel"] for f in z2[0]["flats"])
    assert len(z2[0]["flats"]) > 10
    dl = er.max_list_diff(er.global_losses(z0), er.global_losses(z2))
    dw = er.max_abs_diff(state(z0), state(z2))
    print(f"\nN=4 tiny stage 2 (bucket 3000) vs stage 0: loss {dl:.3g}, weights {dw:.3g}")
    # 4-rank sums are not associative-safe across collectives (all-reduce vs reduce-scatter
    # may add the 4 terms in different orders): same noise argument as above.
    assert dl <= LOSS_TOL and dw <= W_TOL


def test_small_buckets_n2_bitwise_equal_stage0():
    z2 = er.get(stage=2, zero={"reduce_bucket_size": 3000})
    assert len(z2[0]["flats"]) >= 6
    assert_states_equal(state(er.get(stage=0)), state(z2))


# ----------------------------------------------------------------------------- (f) ZeRO-2 frees gradients

def test_zero2_frees_full_gradients_during_backward():
    run = er.get(stage=2, zero={"reduce_bucket_size": 3000})
    psi = sum(f["numel"] for f in run[0]["flats"])
    for r in run:
        ab = r["after_backward"]
        assert ab["p_grad_none"] and ab["p_grad_numel"] == 0
        assert ab["grad_shards"] == [f["shard"] for f in r["flats"]]   # every shard exists
        # at no point of backward did more than a couple of buckets of full gradient live
        print(f"\nZeRO-2 bucket 3000: max live full-gradient elements {r['max_live_grad_numel']} of {psi}")
        assert r["max_live_grad_numel"] < 2 * 3000 < psi


def test_zero1_still_holds_full_gradients_after_backward():
    run = er.get(stage=1)
    psi = sum(f["numel"] for f in run[0]["flats"])
    for r in run:
        ab = r["after_backward"]
        assert not ab["p_grad_none"] and ab["p_grad_numel"] == psi
        assert ab["grad_shards"] == [None] * len(r["flats"])
        assert r["max_live_grad_numel"] == psi


# ----------------------------------------------------------------------------- (g) ZeRO-3 holds no gathered params

def test_zero3_holds_no_gathered_parameter_between_steps():
    run = er.get(**STAGE_RUNS["stage3_p0"])
    for r in run:
        z = r["z3_between_steps"]
        assert z["n_partitioned"] == len(r["flats"]) > 0      # persistence 0: every FlatParam
        assert z["full_nbytes"] == [0] * z["n_partitioned"]
        assert z["param_numels"] and set(z["param_numels"]) == {0}   # empty placeholders
        assert set(z["shard_states"]) == {"SHARDED"}
        # forward gathers one unit at a time inside the root: root + one block, 2 groups each
        print(f"\nZeRO-3 max gathered FlatParams in forward: {r['z3_max_gathered_fwd']} of {len(r['flats'])}")
        assert r["z3_max_gathered_fwd"] <= 4 < len(r["flats"])


def test_zero3_default_threshold_keeps_small_params_gathered():
    run = er.get(**STAGE_RUNS["stage3_default"])
    assert all(f["keep_full"] for f in run[0]["flats"])    # every micro param is < 1e5 elements
    assert run[0]["z3_between_steps"]["n_partitioned"] == 0


# ----------------------------------------------------------------------------- (h) bf16 / fp16

LP_STAGES = ["stage0", "stage1", "stage2", "stage3_p0"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains_at_every_stage(dtype):
    for name in LP_STAGES:
        run = er.get(dtype=dtype, **STAGE_RUNS[name])
        losses = er.global_losses(run)
        assert er.isfinite_all(losses), (name, losses)
        assert run[0]["skipped"][-1] == 0, (name, run[0]["skipped"])
        assert losses[-1] < losses[0] - 0.3, (name, losses)
        assert er.isfinite_all(run[0]["norms"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_stages_agree(dtype):
    """At N = 2 the low-precision reduction is lp(g0/2) + lp(g1/2) at every stage (one
    addition, commutative) and the fp32 master update is element-wise, so stages 1, 2 and 3
    (and stage 0, which minizero scales and reduces the same way, unlike DeepSpeed) are
    bitwise equal. Measured: 0.0 for both bf16 and fp16."""
    base = er.get(dtype=dtype, stage=1)
    for name in ("stage0", "stage2", "stage3_p0"):
        run = er.get(dtype=dtype, **STAGE_RUNS[name])
        dw = er.max_abs_diff(state(base), state(run))
        print(f"\n{dtype} stage1 vs {name}: weights {dw:.3g}")
        assert_states_equal(state(base), state(run))
        assert er.global_losses(base) == er.global_losses(run)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_close_to_fp32(dtype):
    lp, fp = er.get(dtype=dtype, stage=1), er.get(stage=1)
    dl = er.max_list_diff(er.global_losses(lp), er.global_losses(fp))
    print(f"\n{dtype} vs fp32 losses: {dl:.3g}")
    assert dl < (0.05 if dtype == "bf16" else 0.01)
