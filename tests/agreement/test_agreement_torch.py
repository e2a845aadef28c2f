"""minizero vs PyTorch itself: ZeRO-3 vs FSDP2, ZeRO-2 vs FSDP2 without reshard, stage 0 vs DDP.

World size 2 (gloo), "tiny" GPT (108,801 params, dropout 0.1 on), 2 steps, micro-batch 4,
the same config, model, param groups and batches as the DeepSpeed agreement tests
(tests/support/agreement.py), PyTorch's side run by reference/torch_engine.py's run_torch.
docs/fsdp.md has the table and what each assertion pins.

BITWISE in fp32 (losses and final fp32 weights), stages 0, 2 and 3: the operations are the
same in the same order. The average is a sum then a division by N = 2 in minizero and an
AVG (or a pre-division) in FSDP2/DDP: dividing by 2 is exact in binary floating point, so the
order cannot show (at N = 3 it could: a bound of one rounding per element would apply).
Gradient clipping (1.0) does not fire (norms 0.89-0.98 over these 2 steps); the two norms themselves differ by
ulps (FSDP2: norm of per-tensor norms; minizero: one sum of squares), which is why clipping
that fires would need the derived bound of test_agreement_loss.py's clipping tests.

BITWISE in bf16 at stages 3 and 2 too, once the PyTorch reference rounds the initial weights
to bf16 as DeepSpeed does (its fp32 master is copied up from the bf16 module). Stage 0 bf16
is another computation (DDP + autocast): no bound claimed, the difference pinned.
"""
import math

import pytest
import torch

from tests.support import agreement as A
from tests.support.harness import max_abs_diff, max_list_diff, run_minizero
from tests.support.launcher import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("torch.distributed.fsdp")

N = 2
# 2 steps: step 0 starts from the initial weights and empty Adam moments, step 1 is the first
# from updated weights and moments, the state of every later step (tests/support/agreement.py
# says the same of its 10), so more steps repeat the same operations on equal state. The
# first step is most of a run's cost (FSDP2's DTensor ops propagate their sharding uncached
# the first time), yet two more steps would add a third to the runs' CPU (11.1 s against 8.4 s
# over the six configurations, both ranks).
STEPS = 2
PSI = 108_801
RUNS = ((3, "fp32"), (2, "fp32"), (0, "fp32"), (3, "bf16"), (2, "bf16"), (0, "bf16"))


def _record_fsdp2_gathers() -> list:
    """FSDP2's own calls, in order, from here on (this rank process only: each configuration
    is its own launch): ("pre_forward" | "pre_backward", module) from FSDPParamGroup's hooks
    and ("prefetch", "forward" | "backward", target module) from FSDPParamGroup._prefetch_unshard,
    the one place FSDP2 all-gathers a module other than the one about to run
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    events = []
    pre_forward, pre_backward, prefetch = (FSDPParamGroup.pre_forward, FSDPParamGroup.pre_backward,
                                           FSDPParamGroup._prefetch_unshard)

    def pre_forward_logged(self, *a, **k):
        events.append(("pre_forward", self._module_fqn))
        return pre_forward(self, *a, **k)

    def pre_backward_logged(self, *a, **k):
        events.append(("pre_backward", self._module_fqn))
        return pre_backward(self, *a, **k)

    def prefetch_logged(target, pass_type):
        events.append(("prefetch", pass_type, target._module_fqn))
        return prefetch(target, pass_type)
    FSDPParamGroup.pre_forward, FSDPParamGroup.pre_backward = pre_forward_logged, pre_backward_logged
    FSDPParamGroup._prefetch_unshard = staticmethod(prefetch_logged)
    return events


def _both_libraries(runs, steps):
    from reference.torch_engine import run_torch
    out = {}
    for stage, dtype in runs:
        cfg = A.make_config(stage, dtype)
        mz = run_minizero(A.MODEL_FN, cfg, A.BATCHES, steps, capture_memory=True)
        events = _record_fsdp2_gathers() if (stage, dtype) == (3, "fp32") else None
        pt = run_torch(A.MODEL_FN, cfg, A.BATCHES, steps, capture_memory=True)
        if events is not None:
            pt["fsdp2_events"] = events
        shapes = {n: tuple(p.shape) for n, p in A.MODEL_FN().named_parameters()}
        out[(stage, dtype)] = (mz, pt, shapes)
    return out


@pytest.fixture(scope="module")
def results():
    """Per rank, {(stage, dtype): (minizero, PyTorch, shapes)}. Each configuration is its own
    launch (fresh rank processes, 0.1 s each), so nothing one library's run leaves behind in a
    process (FSDP2's and DDP's objects, gloo's pending buffers) can reach the next run: in one
    of about ten two-worker suite runs, when all six ran in one pair of processes, a rank died
    with glibc's `free(): invalid pointer` at the start of the third configuration."""
    per_run = [run_ranks(_both_libraries, world_size=N, args=((run,), STEPS)) for run in RUNS]
    return [{k: v for part in per_run for k, v in part[r].items()} for r in range(N)]


def _fsdp2_padded_numel(shapes):
    """FSDP2 shards each parameter on dim 0, padded to a multiple of N rows (pos_emb's single
    row becomes 2: its whole 63 x 63 slab again)."""
    return sum(math.ceil(s[0] / N) * N * math.prod(s[1:]) for s in shapes.values())


@pytest.mark.parametrize("stage", [3, 2, 0])
def test_fp32_bitwise(results, stage):
    for mz, pt, _ in (r[(stage, "fp32")] for r in results):
        assert mz["losses"] == pt["losses"], max_list_diff(mz["losses"], pt["losses"])
        assert max_abs_diff(mz["final_state"], pt["final_state"]) == 0.0
        assert max(mz["grad_norms"]) < 1.0   # clipping never fired: the norms' ulps cannot reach the weights


@pytest.mark.parametrize("stage", [3, 2])
def test_bf16_bitwise_zero3_zero2(results, stage):
    """FSDP2's MixedPrecisionPolicy(bf16, bf16) on initial weights rounded to bf16 (as DeepSpeed's
    master is copied up from its bf16 module: reference/torch_engine.py) is minizero's bf16:
    bf16 compute on the same values, bf16 reduce (divide by 2 exact), AdamW on an fp32 shard.
    Without that rounding they part at step 1 (1.6e-5), the forward of step 0 still equal."""
    for mz, pt, _ in (r[(stage, "bf16")] for r in results):
        assert mz["losses"] == pt["losses"], max_list_diff(mz["losses"], pt["losses"])
        assert max_abs_diff(mz["final_state"], pt["final_state"]) == 0.0


def test_fsdp2_prefetches_in_backward_only(results):
    """docs/fsdp.md, "What each prefetches": FSDP2 (fully_shard per block and the root, its
    defaults) all-gathers ahead of use only in backward: each module's pre-backward, after its
    own all-gather, issues the all-gather of the module whose forward ended just before its
    own (FSDPParamGroup._backward_prefetch, post_forward_order). In forward no module gathers another: each gathers
    itself in its own pre-forward, and only set_modules_to_forward_prefetch would change that
    (the old text said FSDP2 issues the next module's all-gather when the current one's
    forward starts). The last step of the run, rank 0."""
    _, pt, _ = results[0][(3, "fp32")]
    events = pt["fsdp2_events"]
    last = max(i for i, e in enumerate(events) if e == ("pre_forward", ""))   # the root: the last step starts
    step = events[last:]
    forward = [e[1] for e in step if e[0] == "pre_forward"]
    assert forward == ["", "blocks.0", "blocks.1"]
    assert not [e for e in step if e[:2] == ("prefetch", "forward")]
    backward = [(e[1], step[i + 1][2]) for i, e in enumerate(step[:-1])
                if e[0] == "pre_backward" and step[i + 1][:2] == ("prefetch", "backward")]
    # each module's pre-backward prefetches the module whose forward ended just before its
    # own (post-forward order: blocks.0, blocks.1, then the root, which encloses them)
    assert backward == [("", "blocks.1"), ("blocks.1", "blocks.0")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp2_peaks_beside_minizeros(results, dtype):
    """Each rank's fullest moment in backward and in the step (runlog.PhasePeaks: FSDP2's from
    reference/torch_engine.py's track_peaks, minizero's from memory_track), on the same runs:
    each peak is the sum of the buffers it lists; FSDP2 without reshard (stage 2) holds every
    gathered parameter through backward (its padded Ψ in the compute dtype), with reshard
    (stage 3) less; its step holds the fp32 shard, its fp32 sharded gradient and Adam's
    moments, no gathered parameter. The bytes go to docs/deepspeed.md, "Memory at its peak"."""
    psi_pt = _fsdp2_padded_numel(results[0][(3, dtype)][2])
    lp = 4 if dtype == "fp32" else 2
    for stage in (2, 3):
        for rank, r in enumerate(results):
            mz, pt, _ = r[(stage, dtype)]
            for lib, peaks in (("minizero", mz["memory"]["peaks"]), ("torch", pt["memory"]["peaks"])):
                for phase in ("backward", "step"):
                    top = peaks[phase]
                    assert top["total"] == sum(top["by_category"].values()) == sum(top["detail"].values()), lib
            gathered = [x["detail"].get("params:gathered parameters", 0) for x in pt["memory"]["peaks"]["readings"]
                        if x["phase"] == "backward"]
            assert (max(gathered) == lp * psi_pt) if stage == 2 else (0 < max(gathered) < lp * psi_pt), stage
            step = pt["memory"]["peaks"]["step"]["detail"]
            assert "params:gathered parameters" not in step and step["grads:sharded gradients"] == 4 * psi_pt // N
            print(f"\n{dtype} stage {stage} rank {rank} peaks, backward / step: minizero "
                  f"{mz['memory']['peaks']['backward']['total']:,} / {mz['memory']['peaks']['step']['total']:,}; "
                  f"FSDP2 {pt['memory']['peaks']['backward']['total']:,} / {pt['memory']['peaks']['step']['total']:,}")


def test_bf16_stage0_ddp_is_another_computation(results):
    """DDP has no public bf16 model: the PyTorch reference runs torch.autocast(bf16) on the fp32
    model (matmuls in bf16, LayerNorm/softmax/loss in fp32), where minizero's stage 0 runs a
    bf16 model. Different operations, so no bound is claimed: the losses differ from step 0
    on (measured 1.3e-5 at step 0, 1.2e-4 at step 1), and DDP reduces fp32 gradients, twice
    minizero's bf16 bytes."""
    mz, pt, _ = results[0][(0, "bf16")]
    assert mz["losses"][0] != pt["losses"][0]
    assert _per_step(pt["comm"], "all_reduce") == 2 * 4 * PSI * (N - 1) / N


def _per_step(comm, op):
    return comm[op]["wire_bytes"] / STEPS


def test_wire_bytes_zero3_fsdp2(results):
    """3 Psi (N-1)/N elements a step in both (2 gathers + 1 reduce-scatter), each on its own
    padded Psi: minizero pads each flat unit to N, FSDP2 each parameter's dim 0."""
    mz, pt, shapes = results[0][(3, "fp32")]
    mz_gather = sum(v["bytes"] for k, v in mz["comm"].items() if k.startswith("all_gather")) / STEPS
    mz_rs = sum(v["bytes"] for k, v in mz["comm"].items() if k.startswith("reduce_scatter")) / STEPS
    psi_mz = mz_rs / 4
    assert mz_gather == 2 * mz_rs and PSI <= psi_mz < PSI + N * 12   # 12 flat units: 6 modules x 2 groups
    psi_pt = _fsdp2_padded_numel(shapes)
    assert _per_step(pt["comm"], "all_gather") == 2 * 4 * psi_pt * (N - 1) / N
    assert _per_step(pt["comm"], "reduce_scatter") == 4 * psi_pt * (N - 1) / N
    # tiny GPT (n_embd 63, block_size 63, vocab 62): pos_emb's padding slab 63 x 63 = 3,969, a row
    # of 63 for each of the 8 attention weights (504) and of 252 for the 2 mlp.2 weights (504),
    # one element for each of the 20 odd-length vectors (10 LayerNorm, 10 biases of 63): 4,997
    assert psi_pt - PSI == 3_969 + 504 + 504 + 20 == 4_997


def test_wire_bytes_zero2_fsdp2_keeps_gathered(results):
    """reshard_after_forward=False: one gather a step, 2 Psi (N-1)/N in all (ZeRO-2's volume)."""
    _, pt, shapes = results[0][(2, "fp32")]
    psi_pt = _fsdp2_padded_numel(shapes)
    assert _per_step(pt["comm"], "all_gather") == 4 * psi_pt * (N - 1) / N
    assert _per_step(pt["comm"], "reduce_scatter") == 4 * psi_pt * (N - 1) / N


def test_wire_bytes_stage0_ddp(results):
    """2 Psi (N-1)/N: one ring all-reduce of every gradient, no padding, in both."""
    mz, pt, _ = results[0][(0, "fp32")]
    mz_bytes = sum(v["bytes"] for k, v in mz["comm"].items() if k.startswith("all_reduce") and "grads" in k) / STEPS
    assert mz_bytes == 4 * PSI
    assert _per_step(pt["comm"], "all_reduce") == 2 * 4 * PSI * (N - 1) / N


def test_model_state_bytes_zero3_fsdp2(results):
    """After the step, per rank, fp32. Named differences: FSDP2's parameter shard is padded
    per parameter (Psi_pt/N, vs minizero's flat units' Psi_mz/N); FSDP2's Adam moments are
    the unpadded local views, so rank 0 holds more rows than rank 1 (together exactly 2 Psi);
    FSDP2 frees the gradient at zero_grad, minizero keeps its reduced shard buffer."""
    psi_pt = _fsdp2_padded_numel(results[0][(3, "fp32")][2])
    states = []
    for r in results:
        mz, pt, _ = r[(3, "fp32")]
        m, p = mz["memory"]["after_step"][-1], pt["memory"]["after_step"][-1]
        assert p["params"] == 4 * psi_pt // N
        # nothing left gathered at the end of backward either (torch_engine.held_bytes relies on it)
        assert pt["memory"]["after_backward"][-1]["params"] == 4 * psi_pt // N
        assert 4 * PSI // N <= m["params"] < p["params"]   # flat units pad less than dim-0 rows
        assert p["grads"] == 0 and m["grads"] > 0
        assert m["optimizer_states"] == 2 * m["params"]
        states.append(p["optimizer_states"])
    assert sum(states) == 2 * 4 * PSI and states[0] > states[1]


def test_model_state_bytes_stage0_ddp(results):
    """DDP and stage 0 hold the same: the whole model, its whole gradient, Adam's 2 Psi."""
    for r in results:
        mz, pt, _ = r[(0, "fp32")]
        m, p = mz["memory"]["after_backward"][-1], pt["memory"]["after_backward"][-1]
        assert p["params"] == 4 * PSI and p["optimizer_states"] == 2 * 4 * PSI
        assert m["optimizer_states"] == p["optimizer_states"]
