"""Model-state memory per rank: engine.memory_breakdown() against

- memory.expected_bytes(): the ZeRO paper's formula on minizero's actual flat layout (Ψ of
  each FlatParam, padded to a multiple of N; ZeRO-3 persistence flags = FlatParam.persistent),
- the bytes really held, found by walking the live tensors (flat buffers, shards, p.grad,
  grad shards, fp32 masters, Adam moments; deduplicated by storage) at the end of backward,
  which is when `grads` is counted (probes.measured_bytes),
- memory.paper_bytes(Ψ): differs by exactly the padding,

for stages 0-3 in bf16 at N = 2 and N = 4 (ZeRO-3 with stage3_param_persistence_threshold 0),
and strictly falling totals from stage 0 to stage 3.

Each run trains 2 steps: the breakdown is fixed at initialize (checked equal before the first
step and after the last), and what lives at the end of a backward or a step is the same at
every step once Adam's moments exist, which the first step makes; so the second step's
backward and step show what the tenth's did. The file's runs are the 2-step runs of
test_comm_volume.py, trained in one launch of ranks per world size (engine_runs.prefetch).
"""
from fractions import Fraction

import pytest

from minizero import memory
from minizero.partition import padded_numel
from tests.support import engine_runs as er

Z3P0 = er.Z3P0
STAGES = {0: {}, 1: {}, 2: {}, 3: Z3P0}


def spec_for(stage, n, dtype="bf16"):
    kw = dict(stage=stage, dtype=dtype, zero=STAGES[stage], steps=2)
    if n == 4:
        kw.update(world=4, global_batch=4)
    return kw


def run_for(stage, n, dtype="bf16"):
    return er.get(**spec_for(stage, n, dtype))


@pytest.fixture(scope="module", autouse=True)
def _runs():
    er.prefetch(specs=[spec_for(s, n) for s in STAGES for n in (2, 4)] + [spec_for(s, 2, "fp32") for s in STAGES])


def flat(mb):
    """The four per-category totals of a breakdown (without its device/host split)."""
    return {k: mb[k] for k in memory.CATEGORIES}


def expected(r, stage, mixed=True):
    return memory.expected_bytes([f["numel"] for f in r["flats"]], r["world"], stage, mixed=mixed,
                                 persistent=[f["persistent"] for f in r["flats"]])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_breakdown_equals_layout_formula_and_live_tensors(stage, n):
    for r in run_for(stage, n):
        mb = r["memory_breakdown"]
        assert mb == expected(r, stage)
        assert mb == r["memory_breakdown_init"]                  # persistent: same before the first step
        assert r["measured_after_backward"] == flat(mb), (r["measured_after_backward"], mb)
        assert mb["device"] == flat(mb) and memory.total(mb["host"]) == 0   # no offload: all on the device
        if stage == 3:
            assert not any(f["persistent"] for f in r["flats"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_breakdown_has_no_separate_master(stage):
    """fp32: the fp32 parameters are the masters (K = 8 bytes of Adam state per element)."""
    for r in run_for(stage, 2, dtype="fp32"):
        mb = r["memory_breakdown"]
        assert mb["master_params"] == 0
        assert mb == expected(r, stage, mixed=False)
        assert r["measured_after_backward"] == flat(mb)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_breakdown_is_paper_plus_padding(stage, n):
    r = run_for(stage, n)[0]
    psi = sum(f["numel"] for f in r["flats"])
    assert psi == 15099
    nn = n if stage >= 1 else 1
    pad = sum(padded_numel(f["numel"], nn) - f["numel"] for f in r["flats"])
    assert pad == sum(f["padded"] - f["numel"] for f in r["flats"])
    if stage >= 1:
        assert 0 < pad < n * len(r["flats"])                  # micro's odd sizes always pad
    want = {"params": Fraction(2 * pad, nn) if stage == 3 else 2 * pad,
            "grads": Fraction(2 * pad, nn) if stage >= 2 else 0,
            "master_params": Fraction(4 * pad, nn), "optimizer_states": Fraction(8 * pad, nn)}
    paper = memory.paper_bytes(psi, n, stage)
    # Exact: paper_bytes divides integers below 2^53 by N = 2 or 4, so each float is a
    # dyadic rational held exactly, and Fraction(float) recovers it without rounding.
    got = {k: Fraction(v) - Fraction(paper[k]) for k, v in flat(r["memory_breakdown"]).items()}
    assert got == want, (got, want)


@pytest.mark.parametrize("n", [2, 4])
def test_memory_strictly_falls_with_the_stage(n):
    totals = [memory.total(run_for(s, n)[0]["memory_breakdown"]) for s in range(4)]
    paper = [memory.total(memory.paper_bytes(15099, n, s)) for s in range(4)]
    print(f"\nN={n} bf16 bytes per rank, stages 0-3: {totals} (paper {[round(p) for p in paper]})")
    assert totals[0] > totals[1] > totals[2] > totals[3]
    assert totals[0] == 16 * 15099


def test_zero3_live_params_are_shards_only_between_steps():
    """After the step, a ZeRO-3 rank holds only its parameter shards (all units resharded)."""
    for n in (2, 4):
        for r in run_for(3, n):
            shard_bytes = sum(f["shard"] * f["elem"] for f in r["flats"])
            assert r["measured_after_step"]["params"] == shard_bytes
            assert r["measured_after_step"]["grads"] == 0           # zeroed by the step
