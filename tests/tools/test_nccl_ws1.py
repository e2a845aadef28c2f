"""launch/nccl_ws1.py's CPU half: one gloo rank, every collective through the backend (the
core's world-size-1 switch), each issued late from a worker thread that sleeps first; every
case bit for bit the run with no process group. On a GPU the same check runs under
`torchrun --nproc-per-node 1` with NCCL (docs/gpu.md, `nccl-ws1`)."""
from __future__ import annotations

import sys
from pathlib import Path

from tests.support.scripts import load_script

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
if str(LAUNCH) not in sys.path:
    sys.path.insert(0, str(LAUNCH))
check_mod = load_script(LAUNCH / "nccl_ws1.py", register=True)   # its ranks unpickle its functions by name


def _one_gloo_rank():
    from tests.support import launcher  # noqa: F401  (the forkserver's preloads)
    return check_mod.check(list(check_mod.CASES), steps=2)


def test_every_case_through_gloo_late_is_bit_identical_to_no_process_group():
    from minizero.runtime.spawn import run_ranks
    res = run_ranks(_one_gloo_rank, 1, group=False, timeout=600)[0]
    assert res["backend"] == "gloo" and set(res["cases"]) == set(check_mod.CASES)
    for case, r in res["cases"].items():
        assert r["identical"], (case, r["reason"])
        stage = check_mod.CASES[case][0]
        ops = set(r["calls"])
        assert ops >= ({"all_reduce"} if stage == 0 else {"reduce_scatter_tensor", "all_gather_into_tensor"}), (case, ops)
        if check_mod.CASES[case][1] == "fp16":
            assert "all_reduce" in ops        # the overflow vote
        if case in check_mod.OFFLOAD_CASES:   # a shard copied in from host memory meets the late gather
            placed = r["placed"]
            assert placed["host_param_bytes"] == placed["param_bytes"] > 0 and placed["partitioned"] > 0, placed
    assert res["passed"]


def test_the_dry_run_says_the_offload_case_offloads_and_would_catch_one_that_does_not(monkeypatch):
    """The offload case's engine keeps its parameter shards in host memory: every FlatParam
    of the micro GPT partitioned (stage3_param_persistence_threshold 0). At the default
    threshold every one is persistent, kept gathered on the device, and offload_param moves
    nothing (as the case was before): the dry run says so, and check() FAILs such a case."""
    line, = check_mod.dry_run(["z3-bf16-offload"])
    assert line == ("z3-bf16-offload: 28,224 of 28,224 parameter bytes in host memory; 3 of 3 FlatParams partitioned "
                    "(offloads)"), line
    stage, dtype, zero = check_mod.CASES["z3-bf16-offload"]
    default = {k: v for k, v in zero.items() if k != "stage3_param_persistence_threshold"}
    monkeypatch.setitem(check_mod.CASES, "z3-bf16-offload", (stage, dtype, default))
    line, = check_mod.dry_run(["z3-bf16-offload"])
    assert line.endswith("0 of 3 FlatParams partitioned (OFFLOADS NOTHING)"), line


def test_a_late_collective_read_before_its_wait_is_caught():
    """The delay is what makes a race visible: a handle's wait() waits for the late issue,
    and reading the output before it returns gives the old contents."""
    from minizero.runtime.spawn import run_ranks
    assert run_ranks(_read_before_wait, 1, group=True, timeout=120) == [(0.0, 1.0)]


def _read_before_wait():
    import torch
    import torch.distributed as dist
    calls = {}
    with check_mod.late_collectives(calls):
        t = torch.ones(4)
        out = torch.zeros(4)
        work = dist.all_gather_into_tensor(out, t, async_op=True)
        early = float(out[0])
        work.wait()
        return early, float(out[0])
