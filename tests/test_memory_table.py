"""`python -m minizero.memory_table --world-size ...` computes each rank's model-state bytes
from the layout plans (zero1.group_plan, zero2.bucket_plan, zero3.unit_plan) on a meta-device
model, without a process group. Checked here against real multi-process engines:

- at N = 2 and 4, stages 0-3 in bf16, plus several ZeRO-2 buckets, ZeRO-3 persistent
  parameters, offload and fp32: the computed FlatParam layout (label, group, numel,
  persistence) equals the engine's, and the computed breakdown equals every rank's
  `engine.memory_breakdown()` byte for byte, per category and place;
- N = 1024 for the largest preset finishes in well under 10 s (no processes);
- the ZeRO paper's Figure 1 numbers (120, 31.4, 16.6, 1.9 GB) come out of memory.paper_bytes,
  in GB of 1e9 bytes (in GiB they would not).
"""
import time

import pytest

from minizero import memory, memory_table
from tests import engine_runs as er

# (stage, dtype, zero_optimization extras, --offload): extras the plan must see too
CASES = [
    (0, "bf16", {}, "none"),
    (1, "bf16", {}, "none"),
    (2, "bf16", {}, "none"),
    (3, "bf16", er.Z3P0, "none"),
    (2, "bf16", {"reduce_bucket_size": 3000}, "none"),                 # micro: 6 buckets over 2 groups
    (3, "bf16", {"stage3_param_persistence_threshold": 500}, "both"),  # persistent + partitioned, all offloaded
    (2, "fp32", {"reduce_bucket_size": 3000}, "optimizer"),
    (3, "fp32", {"stage3_param_persistence_threshold": 500}, "both"),
]


def computed(stage, dtype, zero, offload, world):
    model, groups = memory_table.meta_model("micro")
    plans = memory_table.layout(model, groups, stage, zero.get("reduce_bucket_size", 500_000_000),
                                zero.get("stage3_param_persistence_threshold", 0))
    return plans, memory_table.computed_breakdown(plans, world, stage, dtype, offload)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage,dtype,zero,offload", CASES)
def test_computed_equals_real_engines(stage, dtype, zero, offload, n):
    extra = {**zero, **memory_table.offload_section(stage, offload)}
    kw = dict(stage=stage, dtype=dtype, zero=extra, steps=1)
    if n == 4:
        kw.update(world=4, global_batch=4)
    runs = er.get(**kw)
    plans, want = computed(stage, dtype, zero, offload, n)
    for r in runs:
        assert [(p.label, p.group, p.numel, p.keep_full, len(p.names)) for p in plans] == \
               [(f["label"], f["group"], f["numel"], f["keep_full"], f["n_params"]) for f in r["flats"]]
        assert r["memory_breakdown"] == want, (r["rank"], r["memory_breakdown"], want)
    if zero.get("reduce_bucket_size"):
        assert len(plans) > 2                                          # the bucket plan really split
    if zero.get("stage3_param_persistence_threshold"):
        assert any(p.keep_full for p in plans) and not all(p.keep_full for p in plans)
    if offload != "none":
        assert memory.total(want["host"]) > 0


def test_world_size_1024_is_fast_and_pads():
    t0 = time.perf_counter()
    res = memory_table.compute("igpt-s", [8, 64, 1024])
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed
    psi = res[8][0][1]
    for n, by_stage in res.items():
        totals = [memory.total(by_stage[s][0]) for s in range(4)]
        assert totals[0] == 16 * psi and totals[0] > totals[1] > totals[2] > totals[3]
        paper = [memory.total(memory.paper_bytes(psi, n, s)) for s in range(4)]
        # padding only adds: each FlatParam pads fewer than N elements, 16 bytes each at most
        nflat = len(memory_table.layout(*memory_table.meta_model("igpt-s"), 3))
        assert all(0 <= t - p < 16 * n * nflat for t, p in zip(totals, paper))


def test_cli_computed_rows(capsys):
    memory_table.main(["--model", "micro", "--world-size", "3", "1024", "--stage", "1", "3", "--offload", "both"])
    rows = [ln.split("|")[1:-1] for ln in capsys.readouterr().out.splitlines() if ln[:3].strip("| ").isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(3, 1), (3, 3), (1024, 1), (1024, 3)]
    num = lambda c: int(c.strip().split(" ")[0].replace(",", ""))
    for r in rows:
        assert num(r[7]) + num(r[8]) == num(r[6])


def test_paper_figure1_in_gb_of_1e9_bytes(capsys):
    totals = [row["total"] for row in memory_table.figure1()]
    assert [round(t / 1e9, 1) for t in totals] == list(memory_table.FIGURE1_PRINTED_GB)
    assert [round(t / 2**30, 1) for t in totals] != list(memory_table.FIGURE1_PRINTED_GB)   # not GiB
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]                            # 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
    memory_table.main(["--paper-figure1"])
    assert "| 3 | 234,375,000 | 234,375,000 | 1,406,250,000 | 1,875,000,000 | 1.9 |" in capsys.readouterr().out
