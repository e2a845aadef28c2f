"""minizero's memory_breakdown() vs DeepSpeed's live model-state bytes, bf16, N = 2, per rank.

DeepSpeed's numbers come from reference/ds_memory.deepspeed_model_state_bytes on the live
engine of the 10-step bf16 runs of test_agreement_loss (probed after the last backward and
after the last step); minizero's from engine.memory_breakdown(). Every category is asserted
as   minizero == DeepSpeed + (a named, computed difference)   in exact integers.

Layouts (Ψ = 108,801 in 2 param groups: decay 99,162, no-decay 9,639; 37 tensors):
- DeepSpeed ZeRO-1/2: one flat buffer per GROUP padded to a multiple of 2N
  (stage_1_and_2.py: align_dense_tensors(nccl_start_alignment_factor=2 * dp_size)).
- minizero ZeRO-1: one FlatParam per group padded to a multiple of N; ZeRO-2: one
  FlatParam per reduce BUCKET (reduce_bucket_size 2e4 -> 7 FlatParams), each padded to N.
- DeepSpeed ZeRO-3: every PARAMETER padded on its own to ceil(n/N) per rank
  (partition_parameters.py: _partition_param).
- minizero ZeRO-3: one FlatParam per (unit, param group): 2 blocks + root = 6, each padded to N.
"""
import math

import pytest
import torch

from minizero.memory import expected_bytes, paper_bytes
from reference.ds_estimates import zero12_grad_partition_numel
from tests.support import agreement as A

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

N = A.N
CATS = ("params", "master_params", "optimizer_states", "grads")


@pytest.fixture(scope="module", autouse=True)
def _train_everything_once():
    A.prefetch_mz(A.ALL_MZ_KEYS)
    A.prefetch_ds(A.ALL_DS_KEYS)


def _model_numels():
    torch.manual_seed(0)
    m = A.MODEL_FN()
    groups = [[p.numel() for p in g["params"]] for g in m.configure_param_groups(0.01)]
    return groups, [p.numel() for p in m.parameters()]


def _ds_zero12_padded(groups):
    a = 2 * N
    return [math.ceil(sum(g) / a) * a for g in groups]


def _mem(results, rank, when):
    return results[rank]["memory"][when][-1]


def _mz_layout(stage):
    return A.cached_mz(stage, "bf16")[0]["layout"]


@pytest.mark.parametrize("rank", range(N))
@pytest.mark.parametrize("stage", A.STAGES)
def test_minizero_memory_equals_its_layout_formula_and_the_paper_up_to_padding(stage, rank):
    lay = _mz_layout(stage)
    mz = _mem(A.cached_mz(stage, "bf16"), rank, "after_backward")
    numels = [f["numel"] for f in lay]
    exp = expected_bytes(numels, N, stage, mixed=True, persistent=[f["persistent"] and stage == 3 for f in lay])
    assert mz == exp   # the four categories and their device / host split
    assert mz == _mem(A.cached_mz(stage, "bf16"), rank, "after_step")  # static: layout only
    psi = sum(numels)
    assert psi == 108_801
    paper = paper_bytes(psi, N, stage, mixed=True)
    pad = sum(f["padded"] - f["numel"] for f in lay)   # zero padding elements, all FlatParams
    n = N if stage >= 1 else 1
    # the paper's Ψ/N becomes (Ψ + padding)/N; replicated terms become Ψ + padding (params)
    assert mz["params"] - paper["params"] == 2 * pad / (N if stage == 3 else 1)
    assert mz["master_params"] - paper["master_params"] == 4 * pad / n
    assert mz["optimizer_states"] - paper["optimizer_states"] == 8 * pad / n
    assert mz["grads"] - paper["grads"] == (2 * pad / N if stage >= 2 else 0)  # grads: Ψ, unpadded, at 0/1


@pytest.mark.parametrize("rank", range(N))
@pytest.mark.parametrize("stage", A.STAGES)
def test_memory_category_by_category_against_deepspeed(stage, rank):
    groups, param_numels = _model_numels()
    psi = sum(map(sum, groups))
    lay = _mz_layout(stage)
    mz = _mem(A.cached_mz(stage, "bf16"), rank, "after_backward")
    ds_bwd = _mem(A.cached_ds(stage, "bf16"), rank, "after_backward")
    ds_step = _mem(A.cached_ds(stage, "bf16"), rank, "after_step")
    mz_padded = sum(f["padded"] for f in lay)
    mz_shard = sum(f["shard"] for f in lay)
    # named differences, in elements, minizero minus DeepSpeed
    diff = {}
    if stage == 0:
        # Same layout (nothing partitioned); DS FP16_UnfusedOptimizer keeps one fp32 copy per
        # parameter (fp32_groups, 4Ψ): minizero's fp32 master per group is the same 4Ψ.
        diff = {"params": 0, "master": 0, "grads": 0}
        assert ds_bwd["kind"] == "FP16_UnfusedOptimizer"
    elif stage in (1, 2):
        ds_padded = sum(_ds_zero12_padded(groups))              # 108,804
        # Padding: DS pads each GROUP to a multiple of 2N; minizero each FlatParam to N
        # (ZeRO-1: 2 FlatParams -> 108,802; ZeRO-2: 7 bucket FlatParams -> 108,806).
        diff["params"] = mz_padded - ds_padded                   # stage 1: -2, stage 2: +2
        diff["master"] = mz_shard - ds_padded // N               # stage 1: -1, stage 2: +1
        # after backward DS holds WHOLE parameters overlapping its slice, + padding on the last rank
        ds_grad = zero12_grad_partition_numel(groups, N, rank)  # r0 59,472 / r1 57,207
        if stage == 1:
            # Paper ZeRO-1: minizero holds the full 2Ψ gradient at the end of backward and
            # reduce-scatters at the step. DS ZeRO-1 at gradient_accumulation_steps 1 reduces
            # in the backward hooks like ZeRO-2 and keeps only its partition (whole boundary
            # parameters + padding): ZeRO-2's footprint.
            diff["grads"] = psi - ds_grad
        else:
            # Both hold the reduced shard; DS's holds whole straddling parameters + padding,
            # minizero's exactly its slice of each bucket FlatParam.
            diff["grads"] = mz_shard - ds_grad
    else:
        ds_part = sum(math.ceil(n / N) for n in param_numels)  # S = 54,415: per-PARAMETER ceil
        # DS pads 37 parameters to ceil(n/N) each; minizero pads 6 (unit, group) FlatParams.
        diff = {"params": mz_shard - ds_part, "master": mz_shard - ds_part, "grads": mz_shard - ds_part}
        # Not a model state: DS ZeRO-3 keeps its reduce bucket (reduce_bucket_size bf16
        # elements, allocated at init) persistently; minizero reduce-scatters straight from
        # each unit's flat gradient and holds no bucket.
        assert ds_bwd["buffers"] == ds_step["buffers"] == A.BUCKET * 2
    assert mz["params"] == ds_bwd["params"] + 2 * diff["params"]
    assert mz["master_params"] == ds_bwd["master_params"] + 4 * diff["master"]
    assert mz["optimizer_states"] == ds_bwd["optimizer_states"] + 8 * diff["master"]
    # grads: minizero's memory_breakdown counts what is held at the end of backward, so it is
    # compared with DS's after-backward probe. After the step DS has freed them (stages 0-2:
    # zero_grad set_to_none / partition released) while ZeRO-3 keeps grad_partitions_flat_buffer.
    assert mz["grads"] == ds_bwd["grads"] + 2 * diff["grads"]
    assert ds_step["grads"] == (ds_bwd["grads"] if stage == 3 else 0)
    # params / master / optimizer states are persistent in DS too: the same after the step
    for c in ("params", "master_params", "optimizer_states"):
        assert ds_step[c] == ds_bwd[c]
    assert ds_bwd["unclaimed"] == {} == ds_step["unclaimed"], (ds_bwd["unclaimed"], ds_step["unclaimed"])
    # without offload everything is on the device
    assert ds_bwd["host"] == dict.fromkeys(CATS, 0) and mz["host"] == dict.fromkeys(CATS, 0)
    print(f"\nstage {stage} rank {rank}: named differences (elements, minizero - DS): {diff}")


def test_zero12_transient_bucket_is_not_a_model_state():
    """DS ZeRO-1/2 allocate a reduce_bucket_size bucket at the start of every backward and
    free it at the end (track_transient_buckets): 2e4 bf16 = 40,000 bytes, never in a probe.
    minizero's ZeRO-2 reduce-scatters each bucket FlatParam's own flat gradient instead."""
    for stage in (1, 2):
        for r in A.cached_ds(stage, "bf16"):
            assert r["memory"]["transient_buckets"]["max_bytes"] == A.BUCKET * 2
            assert r["memory"]["after_backward"][-1]["buffers"] == 0
