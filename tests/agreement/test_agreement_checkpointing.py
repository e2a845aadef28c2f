"""Activation checkpointing agreement (issue 4), world size 2, "tiny" GPT with dropout 0.1 ON.

(a) minizero with the config's `activation_checkpointing` section (the engine configures it,
    the harness sets model.checkpoint_fn = minizero.checkpointing.checkpoint) vs DeepSpeed with
    the same section (reference/ds_run.py calls deepspeed.checkpointing.configure, which
    deepspeed.initialize does not, and sets checkpoint_fn = deepspeed.checkpointing.checkpoint),
    10 steps, stages 0 and 3 in fp32 and stage 3 in bf16; partition_activations on (with
    no mpu the partition group is one rank: a plain copy).
(b) minizero only: ZeRO-3 + checkpointing == ZeRO-3 without, bitwise (same maths; the
    dropout RNG state is saved before each block's forward and restored for the recompute),
    and the comm ledger shows exactly one extra all-gather per checkpointed block FlatParam
    per step, labelled `.recompute`, and none for the root unit.
"""
import pytest

from tests.support import agreement as A

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

CASES = [(0, "fp32"), (3, "fp32"), (3, "bf16")]


@pytest.fixture(scope="module", autouse=True)
def _train_everything_once():
    A.prefetch_mz(A.ALL_MZ_KEYS)
    A.prefetch_ds(A.ALL_DS_KEYS)


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"z{s}-{d}" for s, d in CASES])
def test_checkpointed_loss_agrees_with_deepspeed(stage, dtype):
    ds, mz = A.cached_ds(stage, dtype, ckpt=True)[0], A.cached_mz(stage, dtype, ckpt=True)[0]
    ds_plain, mz_plain = A.cached_ds(stage, dtype)[0], A.cached_mz(stage, dtype)[0]
    assert A.MODEL_CFG.resid_pdrop > 0 and A.MODEL_CFG.attn_pdrop > 0 and A.MODEL_CFG.embd_pdrop > 0
    gap = A.max_list_diff(mz["losses"], ds["losses"])
    wgap = A.max_abs_diff(mz["final_state"], ds["final_state"])
    print(f"\nckpt {dtype} stage {stage}: max|dloss| {gap:.3e}, max|dw| {wgap:.3e}")
    # Tolerance 0, as in test_agreement_loss for this (stage, dtype): the same ops in the
    # same order on both sides. Both libraries' checkpoint functions restore the CPU RNG
    # state before the recompute (DS:
    # CheckpointFunction.backward fwd_cpu_rng_state; minizero: checkpointing.py), so the
    # dropout masks of the recompute are those of the forward, and both leave the RNG
    # stream where no checkpointing would: each checkpointed run equals its own plain run.
    assert gap == 0.0 and wgap == 0.0
    assert ds["losses"] == ds_plain["losses"]
    assert mz["losses"] == mz_plain["losses"]


def test_zero3_checkpointing_same_losses_weights_and_one_extra_gather_per_block():
    plain, ck = A.cached_mz(3, "fp32"), A.cached_mz(3, "fp32", ckpt=True)
    for r in range(A.N):
        assert plain[r]["losses"] == ck[r]["losses"]
        assert plain[r]["local_losses"] == ck[r]["local_losses"]
        assert A.max_abs_diff(plain[r]["final_state"], ck[r]["final_state"]) == 0.0

        cp, cc = plain[r]["comm"], ck[r]["comm"]
        lay = ck[r]["layout"]
        n_blocks = ck[r]["n_blocks"]
        block_flats = [f["label"] for f in lay if f["label"].startswith("blocks.") and not f["persistent"]]
        per_block = len(block_flats) // n_blocks
        assert n_blocks == 2 and per_block == 2        # (decay, no-decay) FlatParam per block unit

        def gathers(comm, pred=lambda k: True):
            return sum(v["calls"] for k, v in comm.items() if k.startswith("all_gather:") and pred(k))

        extra = gathers(cc) - gathers(cp)
        assert extra == n_blocks * A.STEPS * per_block                     # 2 * 10 * 2 = 40
        recompute = {k: v["calls"] for k, v in cc.items() if k.endswith(".recompute")}
        assert sum(recompute.values()) == extra
        # one recompute gather per block FlatParam per step, none for the root unit
        assert recompute == {f"all_gather:{lbl}.recompute": A.STEPS for lbl in block_flats}
        assert not any(".recompute" in k for k in cp)
        # fwd / bwd gathers unchanged: the recompute does not replace the backward's own gather
        for k in cp:
            if k.startswith("all_gather:") and (k.endswith(".fwd") or k.endswith(".bwd")):
                assert cc[k] == cp[k], k
        assert {k: v for k, v in cc.items() if not k.startswith("all_gather:")} == \
               {k: v for k, v in cp.items() if not k.startswith("all_gather:")}
