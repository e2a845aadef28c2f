"""fp16 overflow at every stage, forced on ONE rank (engine_runs.overflow_run, N = 2):

    step 0  clean
    step 1  rank 1's loss is multiplied by inf before engine.backward (its gradients become
            inf/NaN and are reduced into everyone's)
    step 2  rank 1 alone writes inf into one element of its *reduced* gradient, right after
            the engine's gradient reduction (zero.reduce_gradients: the stage-0 all-reduce,
            the ZeRO-1 reduce-scatter, a no-op at ZeRO-2/3 whose shards were reduced in
            backward). No collective carries it to rank 0 afterwards except the overflow
            vote (and, at stages 1-3, the norm all-reduce): at stage 0 the vote alone must
            make rank 0 skip too
    step 3  clean

Both ranks must skip steps 1 and 2 (weights and Adam state untouched, gradients dropped),
count them (skipped_steps, global_steps as DeepSpeed), keep the scale on the first
overflow (hysteresis 2 uses up its budget) and halve it on the second, and rank 0 must log
DeepSpeed's OVERFLOW line each time. Step 3 trains normally at the halved scale.
"""
import math

import pytest

from tests.support import engine_runs as er

INIT = 2.0 ** 16
STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module", autouse=True)
def _runs():
    er.prefetch(overflow_stages=STAGES)    # the four stages in one launch of two ranks


@pytest.mark.parametrize("stage", STAGES)
def test_forced_overflow_on_one_rank_skips_everywhere(stage):
    res = er.get_overflow(stage)
    for r in res:
        log = r["log"]
        s0, s1, s2, s3 = log
        # step 0: clean
        assert s0["changed"] > 0 and s0["scale"] == INIT and s0["skipped"] == 0 and s0["global_steps"] == 1
        assert s0["opt_steps"] == [1.0] and math.isfinite(s0["norm"])
        # step 1: skipped on both ranks, scale kept (hysteresis 2 -> 1)
        assert s1["changed"] == 0.0, (r["rank"], s1["changed"])
        assert s1["skipped"] == 1 and s1["global_steps"] == 2
        assert s1["scale"] == INIT
        assert s1["opt_steps"] == [1.0]                      # Adam did not step
        assert s1["grads_left"] == 0                          # the bad gradients were dropped
        assert s1["norm"] == float("inf")
        # step 2: second consecutive overflow halves the scale
        assert s2["changed"] == 0.0 and s2["skipped"] == 2 and s2["global_steps"] == 3
        assert s2["scale"] == INIT / 2 and s2["opt_steps"] == [1.0] and s2["grads_left"] == 0
        # step 3: trains again, at the halved scale
        assert s3["changed"] > 0 and s3["skipped"] == 2 and s3["global_steps"] == 4
        assert s3["scale"] == INIT / 2 and s3["opt_steps"] == [2.0]
        assert math.isfinite(s3["norm"]) and math.isfinite(s3["loss"])
    # both ranks end with the same weights (nothing diverged), losses of clean steps finite
    assert [s["changed"] for s in res[0]["log"]] == [s["changed"] for s in res[1]["log"]]


@pytest.mark.parametrize("stage", STAGES)
def test_overflow_logged_on_rank_0_only(stage):
    r0, r1 = er.get_overflow(stage)
    msgs0 = [m for s in r0["log"] for m in s["msgs"] if "OVERFLOW" in m]
    assert [len([m for m in s["msgs"] if "OVERFLOW" in m]) for s in r0["log"]] == [0, 1, 1, 0]
    first, second = msgs0
    assert "OVERFLOW! Rank 0 Skipping step." in first
    assert "Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1" in first
    assert "Attempted loss scale: 65536, reducing to 32768" in second
    assert not [m for s in r1["log"] for m in s["msgs"] if "OVERFLOW" in m]
