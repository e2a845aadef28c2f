"""Memory at the same two moments in both libraries, N = 2, stages 0-3: what each really holds
at the end of a step's backward (after engine.backward, before engine.step) and after the
step, category by category, equal up to DeepSpeed's named overheads, to the byte.

minizero's side is memory.held_bytes (the engine's live buffers, runlog.MemoryMoments in the
trainer) taken by reference/ds_run.train_steps at both moments, the loop DeepSpeed's runs go
through too; DeepSpeed's side is reference/ds_memory's walker at the same two moments of the
agreement runs (tests/support/agreement.py: tiny GPT, reduce_bucket_size 2e4, persistence 0), shared
with test_agreement_memory. The differences are cut by minizero.compare.compare_memory.memory_differences,
the function that writes the compare report's memory section, and every part is checked here
against its own arithmetic:

    padding        DeepSpeed pads each param group to 2N (ZeRO-1/2) or each parameter to N
                   (ZeRO-3), minizero each FlatParam to N: bytes/element x the element counts
    grads, ZeRO-1/2, end of backward   DeepSpeed's partition holds whole straddling parameters
                   (zero12_grad_partition_numel); DeepSpeed's ZeRO-1 reduces at the end of
                   engine.backward (reduce_gradients), minizero's at the start of engine.step,
                   so at this moment minizero's still holds all Ψ
    grads, ZeRO-3, after the step      DeepSpeed keeps grad_partitions_flat_buffer (2S bf16)
    master, fp32 ZeRO                  DeepSpeed's second fp32 copy (4 x its shard)

And each rank's peak in the same step, during backward and during the step (runlog.PhasePeaks:
minizero's from minizero.observe.memory_track, DeepSpeed's from reference.ds_memory.track_peaks,
read at every event inside each phase): what each holds at its peak, which the compare
report lists buffer by buffer (compare_memory.peaks_section).
"""
import math

import pytest
import torch

from minizero.compare.compare_memory import CATEGORIES, MOMENTS, memory_differences
from reference.ds_estimates import zero12_grad_partition_numel, zero12_padded_numel, zero3_partition_numel
from tests.support import agreement as A

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

N = A.N
STEPS = 3            # memory is the layout's: any step after the first (Adam's state exists) reads the same
RUNS = [(s, "bf16") for s in A.STAGES] + [(1, "fp32"), (3, "fp32")]


def minizero_moments(runs):
    """Rank function: per (stage, dtype) of `runs`, minizero's held_bytes at both moments of
    each step (train_steps, the agreement runs' loop) and memory_breakdown()."""
    import minizero
    from minizero.memory import held_bytes
    from minizero.train.runlog import MinizeroPeaks
    from reference.ds_run import build_model, prepare_ds_config, train_steps

    out = {}
    for stage, dtype in runs:
        cfg = prepare_ds_config(A.make_config(stage, dtype))
        model, groups = build_model(A.MODEL_FN, cfg, seed=0)
        engine, _, _, _ = minizero.initialize(model=model, model_parameters=groups, config=cfg)
        memory = {"after_backward": [], "after_step": []}
        train_steps(engine, A.BATCHES, STEPS, lambda e: float(e.loss_scale), held_bytes, memory, MinizeroPeaks(engine))
        out[(stage, dtype)] = {**{m: memory[m][-1] for m in MOMENTS}, "breakdown": engine.memory_breakdown(),
                               "peaks": memory["peaks"]}
    return out


@pytest.fixture(scope="module")
def mz():
    from tests.support.launcher import run_ranks
    return run_ranks(minizero_moments, world_size=N, args=(RUNS,), env=A.ENV, timeout=600)


def _model_numels():
    torch.manual_seed(0)
    m = A.MODEL_FN()
    groups = [[p.numel() for p in g["params"]] for g in m.configure_param_groups(0.01)]
    return groups, [p.numel() for p in m.parameters()]


def ds_elements(stage):
    """DeepSpeed's layout in elements, from its partition arithmetic (reference/ds_estimates.py)."""
    groups, numels = _model_numels()
    if stage == 0:
        return {"full": sum(numels), "shard": sum(numels)}
    if stage in (1, 2):
        full = zero12_padded_numel([sum(g) for g in groups], N)
        return {"full": full, "shard": full // N}
    return {"full": 0, "shard": zero3_partition_numel(numels, N)}   # persistence threshold 0


@pytest.mark.parametrize("rank", range(N))
@pytest.mark.parametrize("stage, dtype", RUNS)
def test_minizero_holds_its_breakdown_at_the_end_of_backward_and_no_gradient_after_the_step(mz, stage, dtype,
                                                                                             rank):
    """The live measurement agrees with the layout formula where the formula speaks (the end
    of backward; stage 0 and ZeRO-1 hold every p.grad, gradient_accumulation_steps 1 without
    overlap_comm), and shows the gradients gone after the step (zero_grad)."""
    r = mz[rank][(stage, dtype)]
    bwd, step, formula = r["after_backward"], r["after_step"], r["breakdown"]
    strip = lambda e: {k: v for k, v in e.items() if k != "elements"}   # noqa: E731
    assert strip(bwd) == formula
    no_grads = {**formula, "grads": 0, "device": {**formula["device"], "grads": 0}}
    assert strip(step) == no_grads


@pytest.mark.parametrize("rank", range(N))
@pytest.mark.parametrize("stage, dtype", RUNS)
def test_both_moments_agree_with_deepspeed_up_to_named_overheads(mz, stage, dtype, rank):
    groups, numels = _model_numels()
    psi = sum(numels)
    lp = 4 if dtype == "fp32" else 2
    ds_el = ds_elements(stage)
    for moment in MOMENTS:
        a = mz[rank][(stage, dtype)][moment]
        b = {**A.cached_ds(stage, dtype)[rank]["memory"][moment][-1], "elements": ds_el}
        assert b["unclaimed"] == {} and b["host"] == dict.fromkeys(CATEGORIES, 0)
        mz_el = a["elements"]
        for c in CATEGORIES:
            parts = memory_differences(stage, dtype, moment, c, None, a, b)
            assert sum(n for n, _ in parts) == b[c] - a[c]
            assert not [w for _, w in parts if w == "unexplained"], (moment, c, parts)
            named = {}
            for n, why in parts:   # one part per kind of reason here (no offload)
                kind = ("padding" if why.startswith("padding") else "master" if "fp32 master" in why
                        else "partition" if "straddle" in why else "kept" if "grad_partitions_flat_buffer" in why
                        else why)
                named[kind] = named.get(kind, 0) + n
            # the arithmetic of each named part
            expect = {}
            d_full, d_shard = ds_el["full"] - mz_el["full"], ds_el["shard"] - mz_el["shard"]
            if c == "params":
                expect["padding"] = lp * (d_shard if stage == 3 else d_full)
            elif c == "master_params":
                if dtype == "fp32" and stage >= 1:
                    expect["master"] = 4 * ds_el["shard"]   # minizero's fp32 shard is its master: 0 bytes
                elif dtype != "fp32":
                    expect["padding"] = 4 * (d_shard if stage >= 1 else d_full)
            elif c == "optimizer_states":
                expect["padding"] = 8 * (d_shard if stage >= 1 else d_full)
            elif moment == "after_backward":   # grads
                if stage in (1, 2):
                    mine = psi if stage == 1 else mz_el["shard"]
                    expect["partition"] = lp * (zero12_grad_partition_numel(groups, N, rank) - mine)
                elif stage == 3:
                    expect["padding"] = lp * d_shard
            elif stage == 3:                   # grads after the step: DeepSpeed's kept partition
                expect["kept"] = lp * ds_el["shard"]
            expect = {k: v for k, v in expect.items() if v}
            assert named == expect, (moment, c, parts)
            # and the numbers themselves: minizero's layout, DeepSpeed's layout
            if c == "params":
                assert a[c] == lp * (mz_el["shard"] if stage == 3 else mz_el["full"])
            if c == "grads" and moment == "after_step":
                assert a[c] == 0 and b[c] == (lp * ds_el["shard"] if stage == 3 else 0)
    if stage in (1, 2):   # the padding itself: 2N per group against N per bucket FlatParam
        assert ds_el["full"] == sum(math.ceil(sum(g) / (2 * N)) * 2 * N for g in groups) == 108_804


# ----------------------------------------------------------------------------- peaks

def _readings(peaks, phase, at=None):
    return [r for r in peaks["readings"] if r["phase"] == phase and (at is None or r["at"] == at)]


@pytest.mark.parametrize("rank", range(N))
@pytest.mark.parametrize("stage", A.STAGES)
def test_peaks_in_backward_and_in_the_step(mz, stage, rank):
    """Each library's fullest moment in backward and in the step of one step, bf16 (the
    agreement runs' setup), read at every event inside each phase:

    - each peak is the sum of the buffers it lists (the report lists them all), and at least
      what the library holds at the moment that ends the phase (the two memory moments);
    - parameters, masters and Adam's moments at every reading are the layout's, as at the
      moments (ZeRO-3: plus the gathered unit, less than the whole model: one unit at a time);
    - stage 0 and ZeRO-1: when loss.backward has returned both libraries hold every gradient,
      2Ψ bytes, none reduced yet (DeepSpeed's ZeRO-1 reads it at reduce_gradients' start, in
      engine.backward's epilogue; minizero at the end of engine.backward, reducing in the
      step); at ZeRO-2 and ZeRO-3 p.grad never holds them all, since both reduce from the
      hooks (DeepSpeed's ZeRO-3 p.grad are views into its reduce bucket, counted there);
    - the compare report names every (stage, phase) difference (compare_memory.PEAK_WHY)."""
    from minizero.compare.compare_memory import PEAK_PHASES, PEAK_WHY, peak_pieces, peaks_section

    _, numels = _model_numels()
    psi, lp = sum(numels), 2
    mine = mz[rank][(stage, "bf16")]
    theirs = A.cached_ds(stage, "bf16")[rank]["memory"]
    peaks = {"minizero": mine["peaks"], "deepspeed": theirs["peaks"]}
    moments = {"minizero": {m: mine[m] for m in MOMENTS}, "deepspeed": {m: theirs[m][-1] for m in MOMENTS}}
    for lib, p in peaks.items():
        for phase in PEAK_PHASES:
            top = p[phase]
            assert top["total"] == sum(top["by_category"].values()) == sum(b for _, b in peak_pieces(top)), lib
            assert top["total"] == max(r["total"] for r in _readings(p, phase)), lib
            end = moments[lib]["after_backward" if phase == "backward" else "after_step"]
            held = sum(end[c] for c in CATEGORIES) + end.get("buffers", 0)
            assert top["total"] >= held, (lib, phase, top["total"], held)
            for r in _readings(p, phase):   # the layout's at every reading
                for c in ("master_params", "optimizer_states"):
                    if phase == "backward" or r["by_category"][c]:
                        assert r["by_category"][c] == end[c], (lib, phase, c, r)
                if stage < 3:
                    assert r["by_category"]["params"] == end["params"], (lib, phase, r)
                else:
                    assert end["params"] <= r["by_category"]["params"] < end["params"] + lp * psi, (lib, phase, r)
    grads = lambda p, phase, at=None: [r["by_category"]["grads"] for r in _readings(p, phase, at)]  # noqa: E731
    if stage in (0, 1):
        ds_at = "reduce_gradients (before)" if stage == 1 else "allreduce_gradients (before)"
        assert grads(peaks["deepspeed"], "backward", ds_at) and \
            all(g == lp * psi for g in grads(peaks["deepspeed"], "backward", ds_at))
        assert grads(peaks["minizero"], "backward", "phase_ends backward") == [lp * psi]
    else:   # the gradients autograd leaves in p.grad: never all at once
        autograd = {"minizero": "grads.param", "deepspeed": "grads:module p.grad"}
        for lib in peaks:
            assert max(r["detail"].get(autograd[lib], 0) for r in _readings(peaks[lib], "backward")) < lp * psi, lib
    section = "\n".join(peaks_section({stage: {lib: {"memory_moments": {"peaks": [p]}} for lib, p in peaks.items()}}))
    for phase in PEAK_PHASES:
        assert PEAK_WHY[(stage, phase)] in section
        for lib, p in peaks.items():
            assert all(f"{name} {b:,}" in section for name, b in peak_pieces(p[phase])), (lib, phase)
    print(f"\nstage {stage} rank {rank} peaks, backward / step: " + "; ".join(
        f"{lib} {p['backward']['total']:,} / {p['step']['total']:,}" for lib, p in peaks.items()))


def test_memory_moments_arm_peaks_for_the_last_step_only():
    """runlog.MemoryMoments (the trainers' side of the same comparison): the peak recorder is
    made and armed at the previous step's after_step moment, read at the last step's, and
    its result goes to summary.json's memory_moments as "peaks" (without the readings); a
    one-step run has none."""
    from minizero.train.runlog import MemoryMoments

    class Recorder:
        made = 0

        def __init__(self, engine):
            Recorder.made += 1
            self.armed = False

        def arm(self):
            self.armed = True

        def result(self):
            assert self.armed
            return {"backward": {"total": 5}, "step": {"total": 7}, "readings": [1, 2]}

    moments = MemoryMoments(lambda engine: {"params": 1}, step=3, peaks=Recorder)
    for step in (1, 2, 3):
        moments.take("after_backward", None, step)
        moments.take("after_step", None, step)
        assert Recorder.made == (0 if step == 1 else 1)
    out = moments.result(together=False)
    assert out["peaks"] == [{"backward": {"total": 5}, "step": {"total": 7}}]
    one = MemoryMoments(lambda engine: {"params": 1}, step=1, peaks=Recorder)
    one.take("after_backward", None, 1)
    one.take("after_step", None, 1)
    assert "peaks" not in one.result(together=False) and Recorder.made == 1
