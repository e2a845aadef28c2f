"""`python -m minizero.memory_table --world-size ...` computes each rank's model-state bytes
from the layout plans (buckets.bucket_plan, zero3.unit_plan) on a meta-device
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

from minizero import memory
from minizero.observe import memory_table
from tests.support import engine_runs as er
from tests.support.launcher import run_ranks

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


def _layouts_and_breakdowns(specs):
    """tests/support/engine_runs.train_run of each spec, one after the other on these ranks
    (each its own engine, model and seed): what the test reads of each, its FlatParams and its
    memory_breakdown."""
    return [{k: v for k, v in er.train_run(spec).items() if k in ("rank", "flats", "memory_breakdown")}
            for spec in specs]


@pytest.fixture(scope="module")
def real_engines():
    """{(CASES index, N): each rank's run}: every case of one world size in one launch (2,
    not 16), one optimizer step each."""
    out = {}
    for n in (2, 4):
        specs = [er.spec_of(stage=stage, dtype=dtype, zero={**zero, **memory_table.offload_section(stage, offload)},
                            steps=1, **({"world": 4, "global_batch": 4} if n == 4 else {}))
                 for stage, dtype, zero, offload in CASES]
        per_rank = run_ranks(_layouts_and_breakdowns, n, (specs,))
        out.update({(i, n): [r[i] for r in per_rank] for i in range(len(CASES))})
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage,dtype,zero,offload", CASES)
def test_computed_equals_real_engines(real_engines, stage, dtype, zero, offload, n):
    runs = real_engines[(CASES.index((stage, dtype, zero, offload)), n)]
    plans, want = computed(stage, dtype, zero, offload, n)
    for r in runs:
        assert [(p.label, p.group, p.numel, p.persistent, len(p.names)) for p in plans] == \
               [(f["label"], f["group"], f["numel"], f["persistent"], f["n_params"]) for f in r["flats"]]
        assert r["memory_breakdown"] == want, (r["rank"], r["memory_breakdown"], want)
    if zero.get("reduce_bucket_size"):
        assert len(plans) > 2                                          # the bucket plan really split
    if zero.get("stage3_param_persistence_threshold"):
        assert any(p.persistent for p in plans) and not all(p.persistent for p in plans)
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
    for bad in (["--world-size", "0"], ["--world-size", "2", "--nproc", "2"], ["--model", "nope"], ["--png", "x.png"]):
        with pytest.raises(SystemExit):
            memory_table.main(bad)


def test_paper_figure1_in_gb_of_1e9_bytes(capsys):
    totals = [row["total"] for row in memory_table.figure1()]
    assert [round(t / 1e9, 1) for t in totals] == list(memory_table.FIGURE1_PRINTED_GB)
    assert [round(t / 2**30, 1) for t in totals] != list(memory_table.FIGURE1_PRINTED_GB)   # not GiB
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]                            # 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
    memory_table.main(["--paper-figure1"])
    assert "| 3 | 234,375,000 | 234,375,000 | 1,406,250,000 | 1,875,000,000 | 1.9 |" in capsys.readouterr().out


def test_deepspeed_estimators_beside_minizero(capsys):
    """reference/ds_estimates.side_by_side: DeepSpeed's estimators with the multipliers
    docs/zero.md explains (2Ψ + 18Ψ/N; 4L + 18Ψ/N; 4L + 2Ψ/N; 4L), each beside minizero's
    exact bytes, which differ from them by the named terms plus minizero's padding only;
    and the *_all_live printouts show the same numbers in GB of 2^30 bytes."""
    pytest.importorskip("deepspeed")
    import contextlib
    import io

    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live
    from reference import ds_estimates

    rows = ds_estimates.side_by_side("tutorial", [8, 64])
    psi, big = rows[0]["total_params"], rows[0]["largest_layer_params"]
    assert psi == 10_001_664
    for r in rows:
        n = r["world"]
        pad = 16 * n * 64                     # < n padded elements per FlatParam, 16 bytes each at most
        want = {(2, "none"): 2 * psi + int(18 * psi / n), (2, "optimizer"): 2 * psi,
                (3, "none"): 4 * big + int(18 * psi / n), (3, "optimizer"): 4 * big + int(2 * psi / n),
                (3, "both"): 4 * big}[r["stage"], r["offload"]]
        assert r["gpu"] == want, r
        mz = r["minizero_device"] + r["minizero_host"]
        # what DeepSpeed adds over minizero's persistent bytes, term by term (ZeRO-2 offload:
        # DeepSpeed's per-GPU number leaves out everything but the 16-bit parameters)
        if r["offload"] == "none":
            extra = 4 * psi / n if r["stage"] == 2 else 2 * psi / n + 4 * big
            assert 0 <= (r["gpu"] - mz) - (extra - pad) <= pad + 1, r
    from minizero.gpt.model import GPT, get_preset
    model = GPT(get_preset("tutorial"))
    for fn, stage in ((estimate_zero2_model_states_mem_needs_all_live, 2),
                      (estimate_zero3_model_states_mem_needs_all_live, 3)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            fn(model, num_gpus_per_node=8, num_nodes=1)
        for r in rows:
            if r["world"] == 8 and r["stage"] == stage:
                assert f"{r['gpu'] / 2**30:6.2f}GB" in buf.getvalue(), (r, buf.getvalue())
