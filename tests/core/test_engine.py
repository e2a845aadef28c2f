"""The engine, end to end on gloo CPU ranks: every ZeRO stage trains the same model.

Runs come from tests/support/engine_runs.py (cached per spec, shared with the other engine test
files). Model: the "micro" GPT (15,099 params; dropout off), learnable synthetic rows,
AdamW lr 1e-2, eps 1e-6, 10 optimizer steps, global batch 8 rows of 16 tokens.

Tolerances, and why (docs/agreement.md lists every tolerance in tests/):

- fp32 at N = 2 is asserted BITWISE everywhere, against the other stages and against
  plain per-parameter PyTorch (engine_runs.reference_run). With two ranks every gradient
  reduction is one fp32 addition g0/2 + g1/2 (commutative, so the all-reduce of stage 0,
  the reduce-scatter of ZeRO-1/2/3, any bucketing and any unit grouping round alike),
  and Adam is element-wise. The reference forms each step's gradient from the same
  micro-batches in the same order of additions (and clips as DeepSpeed does), so it does
  the same roundings on any CPU. Likewise N = 2 equals ONE process that accumulates the
  same two halves of the batch (gas 2): (g0/2) + (g1/2) is what both compute.
- Not compared: N ranks against one process over the WHOLE batch in one backward. That
  sums the batch in another order -- a difference of PyTorch's reductions, not of
  minizero, and the reason the previous tolerances (5e-6 / 2e-5 / 1e-5) existed.
- N = 4: gloo's ring adds the four ranks' terms in an order that depends on the chunk, so
  stage 0 and ZeRO-2 round differently; the bound there comes from the spread of the same
  kind of reordering (test_world_size_4_tiny_stage2_small_buckets_equals_stage0).
"""
import math

import pytest
import torch

from tests.support import engine_runs as er

Z3P0 = er.Z3P0
U32 = 2.0 ** -24          # fp32 unit roundoff
U64 = 2.0 ** -53          # fp64 unit roundoff
LR = er.DEFAULTS["lr"]

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


def assert_same_run(run, ref):
    """Engine run (per-rank results) == reference run, bitwise: losses, norms, weights."""
    assert er.global_losses(run) == ref["losses"]
    assert run[0]["norms"] == ref["norms"]
    assert_states_equal(state(run), ref["state"])


def moved(results) -> float:
    """Largest distance any weight travelled from its initial value."""
    init = er.get_reference(steps=0)["state"]
    return er.max_abs_diff(state(results), init)


# ----------------------------------------------------------------------------- (a) stages agree, = one process

@pytest.mark.parametrize("name", [n for n in STAGE_RUNS if n != "stage0"])
def test_fp32_stages_bitwise_equal_at_n2(name):
    base, run = er.get(**STAGE_RUNS["stage0"]), er.get(**STAGE_RUNS[name])
    assert_states_equal(state(base), state(run))
    assert er.global_losses(base) == er.global_losses(run)
    assert base[0]["norms"] == run[0]["norms"]
    for r in run:
        assert r["global_steps"] == 10


def test_fp32_n2_equals_one_process_over_the_same_micro_batches():
    """2 ranks x 4 rows == 1 process x 2 micro-batches of the same 4 rows (gas 2), bitwise:
    the ranks compute g0/2 + g1/2 in the all-reduce, the one process (g0/2) + (g1/2) by
    accumulating loss/2's gradients in p.grad -- the same numbers and one same addition."""
    two, one = er.get(stage=0), er.get(world=1, gas=2)
    assert one[0]["world"] == 1 and two[0]["world"] == 2
    assert er.global_losses(two) == er.global_losses(one)
    assert two[0]["norms"] == one[0]["norms"]
    assert_states_equal(state(two), state(one))
    # and training did something. Adam moves every weight whose gradient is well above eps
    # by ~lr on the first step alone (m/sqrt(v) = g/|g|), so after 10 steps the most-pushed
    # weight has moved more than lr; the loss falls by far more than any rounding (1e-3).
    assert moved(one) > LR
    assert one[0]["losses"][-1] < one[0]["losses"][0] - 0.3


@pytest.mark.parametrize("world", [1, 2])
def test_engine_equals_plain_pytorch(world):
    """The engine (stage 0; the others equal it, above) against plain per-parameter PyTorch
    AdamW forming the same gradient in the same order and clipping as DeepSpeed does
    (engine_runs.reference_run): bitwise, with clipping active on 6 of the 10 steps."""
    run, ref = er.get(world=world), er.get_reference(world=world)
    print(f"\n{world} process(es): engine vs torch: loss {er.max_list_diff(er.global_losses(run), ref['losses']):.3g}, "
          f"weights {er.max_abs_diff(state(run), ref['state']):.3g}")
    assert sum(n > 1.0 for n in ref["norms"]) >= 3
    assert_same_run(run, ref)


# ----------------------------------------------------------------------------- (b) accumulation

@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3_p0"])
def test_grad_accumulation_2_equals_plain_pytorch_over_the_same_micro_batches(name):
    """gas 2 x micro-batch 2 per rank against plain PyTorch accumulating the same micro-
    batches (loss / 2 each) in the stage's order of sums, bitwise. (Against gas 1 x micro-
    batch 4 it is not bitwise: 2 rows + 2 rows is another order of the same sum.)"""
    kw = STAGE_RUNS[name]
    acc, ref = er.get(gas=2, **kw), er.get_reference(gas=2, **kw)
    assert_same_run(acc, ref)
    assert acc[0]["global_steps"] == 10
    big = er.get(**kw)
    print(f"\n{name} gas2 vs doubled micro-batch (another order, not asserted): "
          f"weights {er.max_abs_diff(state(acc), state(big)):.3g}")


def test_grad_accumulation_order_of_sums_per_stage():
    """Stages 0/1 accumulate the full gradient in p.grad over the micro-steps and reduce
    once ((g0 + g0') / 2 + (g1 + g1') / 2); ZeRO-2/3 reduce every micro-step in backward
    and accumulate the shard ((g0/2 + g1/2) + (g0'/2 + g1'/2)). So 0 == 1 and 2 == 3
    bitwise, each equals plain PyTorch summing in its order (test above), and the two
    orders are really different computations (fp32 addition is not associative)."""
    runs = {n: er.get(gas=2, **STAGE_RUNS[n]) for n in ("stage0", "stage1", "stage2", "stage3_p0")}
    assert_states_equal(state(runs["stage0"]), state(runs["stage1"]))
    assert_states_equal(state(runs["stage2"]), state(runs["stage3_p0"]))
    dw = er.max_abs_diff(state(runs["stage0"]), state(runs["stage2"]))
    print(f"\ngas2 stage0 vs stage2: weights {dw:.3g}")
    assert dw > 0.0


# ----------------------------------------------------------------------------- (c) clipping / norms

@pytest.mark.parametrize("clip", [None, 0.0])   # None = the default, 1.0
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3_p0"])
def test_global_grad_norm_is_the_full_unscaled_gradient_norm(name, clip):
    """engine.get_global_grad_norm() against plain PyTorch on the same gradient, every step:
    equal bitwise to the reference's fp32 norm, and within ONE fp32 rounding of the fp64
    norm of its per-parameter fp64 norms (an order-independent computation): relative gap
    <= u = 2^-24, plus the fp64 sums' own rounding (15,099 squares, worst case 15,099 *
    2^-53 each side). The weights follow the clipped (or unclipped) trajectory bitwise."""
    run, ref = er.get(clip=clip, **STAGE_RUNS[name]), er.get_reference(clip=clip, **STAGE_RUNS[name])
    for r in run:   # every rank reports the same, global, norm
        assert r["norms"] == run[0]["norms"]
    psi = sum(f["numel"] for f in run[0]["flats"])
    dn = max(abs(a - b) / b for a, b in zip(run[0]["norms"], ref["norms64"]))
    print(f"\n{name} clip={clip}: norm vs fp64 norm {dn / U32:.2f} u")
    assert dn <= U32 + 2 * psi * U64
    assert_same_run(run, ref)


def test_clipping_changes_the_trajectory():
    """The clip really is applied: with clip 1.0 (6 of 10 norms are above 1) the run differs
    from the unclipped one, and each equals plain PyTorch with / without clipping bitwise
    (test above), so the difference is the clipping."""
    on, off = er.get(stage=0), er.get(stage=0, clip=0.0)
    assert sum(n > 1.0 for n in on[0]["norms"]) >= 3
    gap = er.max_abs_diff(state(on), state(off))
    print(f"\nclip on vs off: weights differ by {gap:.3g}")
    assert gap > 0.0


# ----------------------------------------------------------------------------- (d) no gradient = zero gradient

UNUSED_STAGES = ["stage0", "stage1", "stage2", "stage3_p0"]


def test_unused_parameters_are_zero_gradients_at_every_stage():
    """`extra` is never used; `side` only on even steps. Missing gradients must count as
    zero (DeepSpeed's ZeRO-3 reapplies a stale one): the never-used weight only decays
    (AdamW: w * (1 - lr*wd) per step, exactly as torch does it), its bias never moves, and
    `side` (momentum but no gradient on odd steps) follows plain PyTorch with zero grads."""
    init = er.get_reference(model="unused", steps=0)["state"]
    decayed = init["extra.0.weight"].clone()
    for _ in range(10):
        decayed.mul_(1 - 1e-2 * 0.1)   # torch AdamW's decoupled decay, the same op 10 times
    runs = {n: er.get(model="unused", **STAGE_RUNS[n]) for n in UNUSED_STAGES}
    for name, run in runs.items():
        st = state(run)
        assert torch.equal(st["extra.0.bias"], init["extra.0.bias"]), name
        assert torch.equal(st["extra.0.weight"], decayed), name
        assert not torch.equal(st["extra.0.weight"], init["extra.0.weight"])   # it did decay
        assert_same_run(run, er.get_reference(model="unused", **STAGE_RUNS[name]))
    for name in UNUSED_STAGES[1:]:
        assert_states_equal(state(runs["stage0"]), state(runs[name]))


# ----------------------------------------------------------------------------- (e) uneven sizes

N4 = dict(preset="tiny", world=4, steps=3, global_batch=4)
N4_PERMS = [(1, 2, 3, 0), (2, 3, 0, 1), (3, 0, 1, 2), (1, 0, 3, 2), (3, 2, 1, 0)]


def ulp32(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


def test_world_size_4_tiny_stage2_small_buckets_equals_stage0():
    """108,801 parameters over 4 ranks (decay group 99,162 = 2 mod 4, no-decay 9,639 odd):
    ZeRO-2 with 3,000-element buckets (each padded to a multiple of 4) against stage 0.

    Not bitwise: gloo's ring adds the 4 ranks' terms in an order that depends on where an
    element falls among the chunks, and ZeRO-2's buckets move the chunk boundaries. The
    bound comes from the same kind of reordering, measured here: stage 0 with
    the same rows handed to the ranks in another order (N4_PERMS: every element's 4-term
    sum is added in another order, nothing else changes). noise = the largest loss /
    weight gap of those 5 runs from stage 0; bound = 2 * noise (the gap is one more draw of
    the same kind: P <= 1/6 to exceed the max at all; measured gap / max noise 0.2-1.2 under
    AVX-512, AVX2 and plain kernels), plus, for the loss, one fp32 ulp of it: the losses
    compared are fp32 numbers whose last bit any change of the weights can move."""
    z0, z2 = er.get(stage=0, **N4), er.get(stage=2, zero={"reduce_bucket_size": 3000}, **N4)
    assert any(f["padded"] != f["numel"] for f in z2[0]["flats"])
    assert len(z2[0]["flats"]) > 10
    perms = [er.get(stage=0, perm=p, **N4) for p in N4_PERMS]
    l0 = er.global_losses(z0)
    noise_l = max(er.max_list_diff(l0, er.global_losses(p)) for p in perms)
    noise_w = max(er.max_abs_diff(state(z0), state(p)) for p in perms)
    dl = er.max_list_diff(l0, er.global_losses(z2))
    dw = er.max_abs_diff(state(z0), state(z2))
    print(f"\nN=4 tiny stage 2 (bucket 3000) vs stage 0: loss {dl:.3g}, weights {dw:.3g}; "
          f"reordering noise: loss {noise_l:.3g}, weights {noise_w:.3g}")
    assert noise_w > 0.0           # the reordering does reach the weights
    assert dl <= 2 * noise_l + ulp32(max(l0))
    assert dw <= 2 * noise_w


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
    assert all(f["persistent"] for f in run[0]["flats"])    # every micro param is < 1e5 elements
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
    """A sanity bound, first order in the rounding: bf16 keeps 8 significant bits (unit
    roundoff u = 2^-9), fp16 11 (u = 2^-12). Rounding every weight by at most u relative
    moves the loss by at most u * sum_i |w_i dL/dw_i| <= u * |w|_2 * |grad|_2 (Cauchy-
    Schwarz); rounding each layer's input once moves it by at most as much again (for a
    linear layer, sum_j |x_j dL/dx_j| <= sum_ij |W_ij x_j dL/dy_i|). Bound: 2 u |w|_2 max|grad|_2,
    from the run's own final weights and reported norms (bf16 ~0.065, fp16 ~0.008; measured
    gaps 3.9e-3 and 2.5e-3)."""
    lp, fp = er.get(dtype=dtype, stage=1), er.get(stage=1)
    u = {"bf16": 2.0 ** -9, "fp16": 2.0 ** -12}[dtype]
    w = float(sum(t.double().pow(2).sum() for t in state(lp).values()).sqrt())
    bound = 2 * u * w * max(lp[0]["norms"] + fp[0]["norms"])
    dl = er.max_list_diff(er.global_losses(lp), er.global_losses(fp))
    print(f"\n{dtype} vs fp32 losses: {dl:.3g} (bound {bound:.3g})")
    assert dl <= bound


# ----------------------------------------------------------------------------- the runs, one launch per world size

LP_NAMES = ["stage0", "stage1", "stage2", "stage3_p0"]
SPECS = ([STAGE_RUNS[n] for n in STAGE_RUNS] + [dict(world=1), dict(world=1, gas=2)]
         + [dict(gas=2, **STAGE_RUNS[n]) for n in LP_NAMES]
         + [dict(clip=0.0, **STAGE_RUNS[n]) for n in LP_NAMES]
         + [dict(model="unused", **STAGE_RUNS[n]) for n in UNUSED_STAGES]
         + [dict(dtype=d, **STAGE_RUNS[n]) for d in ("bf16", "fp16") for n in LP_NAMES]
         + [dict(stage=2, zero={"reduce_bucket_size": 3000})]
         + [dict(stage=0, **N4), dict(stage=2, zero={"reduce_bucket_size": 3000}, **N4)]
         + [dict(stage=0, perm=p, **N4) for p in N4_PERMS])
# (engine_runs.reference_spec: specs that differ only where reference_run does not read share one run)
REFERENCES = ([dict(steps=0), dict(model="unused", steps=0), dict(world=1), dict(world=2)]
              + [dict(gas=2, **STAGE_RUNS[n]) for n in LP_NAMES]
              + [dict(clip=c, **STAGE_RUNS[n]) for c in (None, 0.0) for n in LP_NAMES]
              + [dict(model="unused", **STAGE_RUNS[n]) for n in UNUSED_STAGES])


@pytest.fixture(scope="module", autouse=True)
def _runs():
    """Every run the file reads: the train runs in one launch of ranks per world size, the
    references in one process (engine_runs.prefetch), rather than a launch for each."""
    er.prefetch(specs=SPECS, references=REFERENCES)
