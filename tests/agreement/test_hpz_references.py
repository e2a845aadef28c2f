"""hpZ in the two reference libraries, on 2 "nodes" x 2 gloo ranks: what minizero's hpZ must match.

DeepSpeed 0.19.8's zero_hpz_partition_size k (ZeRO++, arXiv 2306.10209), as read in its source
and written down in reference/hpz.py, pinned here run by run:
- the "node" is a block of k consecutive ranks (no topology is detected);
- each parameter keeps a secondary partition, padded/k elements in its low-precision dtype,
  built when a gathered parameter is released (partition_parameters.py: _partition_param_sec)
  and dropped after every optimizer step (stage3.py: _post_step -> invalidate_secondary_tensor);
- an all-gather reads the secondary when it exists: backward's always (forward built it),
  forward's only in the first step (initialization's release built one) -- later forwards
  gather over all N ranks;
- the numbers do not change: the secondary holds the same values as the primary shards.
FSDP2's reshard_after_forward=k (reference/torch_engine.py) does the same for backward's gathers.

Runs (tests/support/two_nodes.py, 2 steps): DeepSpeed hpZ in fp32 and bf16, plain DeepSpeed
ZeRO-3 in bf16, FSDP2 with and without reshard_after_forward=2 in fp32; each library's runs
in one launch of 4 ranks, shared with test_hierarchy.py and test_hsdp_fsdp2.py.
"""
import math

import pytest

from reference import hpz
from tests.support import agreement as A
from tests.support import two_nodes as T
from tests.support.harness import max_abs_diff

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.filterwarnings("ignore")

WORLD = tuple(range(T.N))
LP_BYTES = {"fp32": 4, "bf16": 2}


def node_group(rank):
    return tuple(range(T.node_of(rank) * T.PER_NODE, (T.node_of(rank) + 1) * T.PER_NODE))


def phases(result, phase):
    return [p for p in result["phases"] if p["phase"] == phase]


def secondary_elements() -> int:
    """Σ over parameters of padded/k: each parameter padded to a multiple of N
    (partition_parameters.py: _aligned_size), then cut into k node-local pieces."""
    return hpz.secondary_elements([p.numel() for p in A.MODEL_FN().parameters()], T.N, T.PER_NODE)


def test_secondary_elements_of_the_tiny_gpt():
    assert secondary_elements() == 54_426 == 2 * sum(math.ceil(p.numel() / T.N) for p in A.MODEL_FN().parameters())
    assert hpz.node_groups(T.N, T.PER_NODE) == [(0, 1), (2, 3)]


def test_hpz_changes_no_number():
    """bf16: DeepSpeed's hpZ and plain ZeRO-3 give the same losses and weights, bit for bit."""
    for hpz, plain in zip(T.deepspeed_runs(T.HPZ, "bf16"), T.deepspeed_runs(T.ZERO3, "bf16")):
        assert hpz["losses"] == plain["losses"]
        assert max_abs_diff(hpz["final_state"], plain["final_state"]) == 0.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_which_all_gather_reads_the_secondary(dtype):
    for rank, r in enumerate(T.deepspeed_runs(T.HPZ, dtype)):
        for p in phases(r, "backward"):   # every step: within the node
            assert [g for g, ops in p["groups"].items() if "all_gather" in ops] == [node_group(rank)], p
            assert [g for g, ops in p["groups"].items() if "reduce_scatter" in ops] == [WORLD], p
        forward = phases(r, "forward")
        assert [g for g, ops in forward[0]["groups"].items() if "all_gather" in ops] == [node_group(rank)]
        for p in forward[1:]:              # after the first step: over every rank
            assert [g for g, ops in p["groups"].items() if "all_gather" in ops] == [WORLD], p


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_secondary_partition_lives_from_forward_to_the_step(dtype):
    expected = secondary_elements() * LP_BYTES[dtype]
    for r in T.deepspeed_runs(T.HPZ, dtype):
        assert r["memory"]["after_init"]["details"]["params:ds_secondary_tensor"] == expected
        for p in r["phases"]:
            assert p["secondary_bytes"] == (0 if p["phase"] == "step" else expected), p


def test_secondary_partition_is_counted_as_params():
    """The memory walker (reference/ds_memory.py) adds the secondary to params: hpZ holds
    exactly padded/k low-precision elements more than plain ZeRO-3, after backward; after the
    step nothing more."""
    for hpz, plain in zip(T.deepspeed_runs(T.HPZ, "bf16"), T.deepspeed_runs(T.ZERO3, "bf16")):
        for moment, extra in (("after_backward", 2 * secondary_elements()), ("after_step", 0)):
            a, b = hpz["memory"][moment][-1], plain["memory"][moment][-1]
            assert a["params"] - b["params"] == extra
            assert {c: a[c] for c in ("master_params", "optimizer_states", "grads")} == \
                {c: b[c] for c in ("master_params", "optimizer_states", "grads")}


def test_inter_node_gathers_halve_after_the_first_step():
    """bf16, per rank and step after the first: plain ZeRO-3 all-gathers twice over all ranks,
    hpZ once (forward), and backward's gather stays inside the node; the gradient
    reduce-scatter crosses nodes in both."""
    for hpz, plain in zip(T.deepspeed_runs(T.HPZ, "bf16"), T.deepspeed_runs(T.ZERO3, "bf16")):
        for step in range(1, T.STEPS):
            def world(result, op):
                return sum(p["groups"].get(WORLD, {}).get(op, {}).get("bytes", 0)
                           for p in result["phases"] if p["step"] == step)
            assert world(plain, "all_gather") == 2 * world(hpz, "all_gather") > 0
            assert world(plain, "reduce_scatter") == world(hpz, "reduce_scatter") > 0
            backward = {}
            for p in hpz["phases"]:
                if p["step"] == step and p["phase"] == "backward":
                    T.add(backward, p["groups"])
            split = T.split(backward)
            assert "all_gather" not in split["inter"] and split["intra"]["all_gather"]["bytes"] > 0


def test_fsdp2_reshard_after_forward_k_is_its_hpz():
    """FSDP2's reshard_after_forward=2: forward gathers over all ranks, backward within the
    node (no copy built at initialization, so from the first step); weights bit for bit plain
    FSDP2's."""
    for rank, (hpz, plain) in enumerate(zip(T.fsdp2_runs(T.HPZ, "fp32"), T.fsdp2_runs(T.ZERO3, "fp32"))):
        assert hpz["losses"] == plain["losses"]
        assert max_abs_diff(hpz["final_state"], plain["final_state"]) == 0.0
        for p in phases(hpz, "forward"):
            assert [g for g, ops in p["groups"].items() if "all_gather" in ops] == [WORLD], p
        for p in phases(hpz, "backward"):
            gathers = [g for g, ops in p["groups"].items() if "all_gather" in ops]
            assert gathers == [node_group(rank)], p
