"""minizero's node-aware ZeRO-3 (minizero/sharding.py) against the libraries it copies, on 4
gloo ranks pretending to be 2 nodes x 2 (MINIZERO_RANKS_PER_NODE=2; tests/support/two_nodes.py):
hpZ against DeepSpeed 0.19.8's zero_hpz_partition_size, HSDP against FSDP2 on a (replicate,
shard) mesh, and the ledger's intra/inter-node split against the formulas.

- hpZ changes no number: minizero's hpZ is its plain ZeRO-3 bit for bit, as DeepSpeed's is its
  own. Against DeepSpeed the two ZeRO-3s differ at N = 4 by the order of the reduce-scatter's
  four-term sums (a ring sums each chunk starting at another rank, and the libraries lay the
  gradient out differently: per unit, per parameter), not by hpZ: the gap with hpZ is exactly
  the gap without. Step 0's losses are equal.
- hpZ gathers where DeepSpeed's does, phase by phase: forward over all ranks (within the node
  in the first step: the secondary cut at initialisation), backward within the node, the
  reduce-scatter over all ranks. Bytes differ by padding only (named below).
- hpZ's memory per rank is DeepSpeed's, padding named: the secondary shard is padded/k
  low-precision elements per FlatParam (per parameter in DeepSpeed).
- HSDP is FSDP2's HSDP bit for bit, fp32 and bf16: every sum in both is of two terms (a
  reduce-scatter within a node of 2, an all-reduce across 2 nodes) and every division by 2 is
  exact, so the orders cannot show.
"""
import math

import pytest

from minizero.observe.node_costs import step_traffic
from tests.support import agreement as A
from tests.support import two_nodes as T
from tests.support.harness import max_abs_diff

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.filterwarnings("ignore")

WORLD = tuple(range(T.N))
LP = {"fp32": 4, "bf16": 2}


def node_group(rank):
    return tuple(range(rank // T.PER_NODE * T.PER_NODE, rank // T.PER_NODE * T.PER_NODE + T.PER_NODE))


def gathers(phase):
    return [g for g, ops in phase["groups"].items() if "all_gather" in ops]


def test_hpz_changes_no_number():
    for hpz, plain in zip(T.minizero_runs(T.HPZ, "bf16"), T.minizero_runs(T.ZERO3, "bf16")):
        assert hpz["losses"] == plain["losses"]
        assert max_abs_diff(hpz["final_state"], plain["final_state"]) == 0.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hpz_gathers_where_deepspeeds_does(dtype):
    for rank, (mz, ds) in enumerate(zip(T.minizero_runs(T.HPZ, dtype), T.deepspeed_runs(T.HPZ, dtype))):
        mine = [(p["phase"], p["step"], sorted(p["groups"])) for p in mz["phases"]]
        theirs = [(p["phase"], p["step"], sorted(g for g, ops in p["groups"].items() if set(ops) - {"broadcast"}))
                  for p in ds["phases"]]   # DeepSpeed's own broadcasts (its loss scaler, ds_ids) are no ZeRO
        assert mine == theirs
        assert gathers(mz["phases"][0]) == [node_group(rank)]                    # step 0's forward: secondary
        assert all(gathers(p) == [WORLD] for p in mz["phases"][3::3])            # later forwards: everyone
        assert all(gathers(p) == [node_group(rank)] for p in mz["phases"][1::3])  # backwards: the node


def test_hpz_against_deepspeed_is_plain_zero3_against_deepspeed():
    """fp32: the gap between the libraries is the reduce-scatter order's, the same with hpZ."""
    for mz, ds, mz0, ds0 in zip(T.minizero_runs(T.HPZ, "fp32"), T.deepspeed_runs(T.HPZ, "fp32"),
                                T.minizero_runs(T.ZERO3, "fp32"), T.deepspeed_runs(T.ZERO3, "fp32")):
        assert mz["losses"][0] == ds["losses"][0]
        assert mz["losses"] == mz0["losses"] and ds["losses"] == ds0["losses"]
        assert max_abs_diff(mz["final_state"], ds["final_state"]) == max_abs_diff(mz0["final_state"], ds0["final_state"])


def _ds_padded(n):
    return math.ceil(n / T.N) * T.N   # DeepSpeed pads each parameter to a multiple of N


def test_hpz_memory_per_rank_is_deepspeeds_padding_named():
    numels = [p.numel() for p in A.MODEL_FN().parameters()]
    for mz, ds in zip(T.minizero_runs(T.HPZ, "bf16"), T.deepspeed_runs(T.HPZ, "bf16")):
        m, d = mz["memory"]["after_backward"][-1], ds["memory"]["after_backward"][-1]
        mz_padded = sum(f["padded"] for f in mz["layout"])            # per FlatParam
        ds_padded = sum(_ds_padded(n) for n in numels)                 # per parameter
        primary, secondary = 2 * (mz_padded - ds_padded) // T.N, 2 * (mz_padded - ds_padded) // T.PER_NODE
        assert m["params"] == d["params"] + primary + secondary
        assert m["params"] - 2 * mz_padded // T.N == 2 * mz_padded // T.PER_NODE   # the secondary: padded/k
        assert m["grads"] == d["grads"] + primary


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hsdp_is_fsdp2s_hsdp_bit_for_bit(dtype):
    for mz, pt in zip(T.minizero_runs(T.HSDP, dtype), T.fsdp2_runs(T.HSDP, dtype)):
        assert mz["losses"] == pt["losses"]
        assert max_abs_diff(mz["final_state"], pt["final_state"]) == 0.0


def assert_ledger_is_the_rings(runs, scheme, n, per_node, steps):
    for rank, mz in enumerate(runs):
        padded = [f["padded"] for f in mz["layout"]]
        for step in range(steps):
            got = {}
            for p in mz["phases"]:
                if p["step"] == step:
                    for op, v in p["ledger"].items():
                        if v["wire_bytes"]:
                            w, x = got.get(op, (0, 0))
                            got[op] = (w + v["wire_bytes"], x + v["inter_node_bytes"])
            want = step_traffic(padded, 2, n, per_node, scheme, rank, first_step=step == 0)
            assert got == want, (scheme, rank, step)
        if scheme != "zero3" and rank % per_node == 0:
            assert sum(x for _, x in got.values()) < sum(w for w, _ in got.values())   # most stays on the node


@pytest.mark.parametrize("zero, scheme", [(T.ZERO3, "zero3"), (T.HPZ, "hpz"), (T.HSDP, "hsdp")])
def test_the_ledgers_inter_node_split_is_the_rings(zero, scheme):
    """Per rank and step, the ledger's wire and inter-node bytes are node_costs.step_traffic's:
    a ring sends every byte of a rank to the next rank of its group, across nodes or not.
    2 nodes x 2 ranks."""
    assert_ledger_is_the_rings(T.minizero_runs(zero, "bf16"), scheme, T.N, T.PER_NODE, T.STEPS)


def test_the_ledgers_inter_node_split_is_the_rings_at_2_x_4():
    """The same at 2 nodes x 4 ranks (hpZ's k and HSDP's S = 4), ZeRO-3, hpZ and HSDP. hpZ two
    steps: its first forward gathers what initialisation cut, within the node; its second, over
    all N. ZeRO-3 and HSDP one step: step_traffic is the same for every one of their steps
    (first_step is hpZ's alone), and that each later step repeats the first, ledger and all,
    is the 2 x 2 test's (two steps of each)."""
    schemes = [(T.ZERO3, "zero3", 1), ({"zero_hpz_partition_size": 4}, "hpz", 2), ({"hsdp_shard_size": 4}, "hsdp", 1)]
    for (_, scheme, steps), runs in zip(schemes, T.minizero_runs_2x4([(z, n) for z, _, n in schemes], "bf16")):
        assert len(runs) == 8
        assert_ledger_is_the_rings(runs, scheme, 8, 4, steps)
