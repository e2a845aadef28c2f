"""Communication volume per optimizer step, from the ledger (engine.comm_stats() and
minizero.comm.ledger.by_label), against the ZeRO paper's analysis (section 7):

    stage 0     all-reduce of the gradient                        2Ψ(N-1)/N per rank
    ZeRO-1/2    reduce-scatter (gradient) + all-gather (params)   Ψ(N-1)/N + Ψ(N-1)/N = 2Ψ(N-1)/N
    ZeRO-3      all-gather fwd + all-gather bwd + reduce-scatter  3Ψ(N-1)/N

in elements, times the element size for ring wire bytes. Ψ is the *padded* numel summed over
engine.zero.flat_params (padding travels too). The step measured is the last of a run
(after at least one warm-up step). The scalar all-reduces (the `grad_norm` sum at stages
1-3, the fp16 `overflow` vote) are control traffic: they are taken out by label.

The N = 2 runs train 2 steps (N2), the N = 4 runs 2 or 3: a step that is not skipped makes
the same collectives, calls and sizes, at every step after the first (they follow from the
FlatParam layout and the config, not from the step's numbers; the first is the warm-up,
where ZeRO-3 records its order of units), so the second step shows what the tenth did. No
step of these runs is skipped (asserted below: an fp16 overflow would drop the step's
norm). Every run of the file is trained in one launch of ranks per world size
(engine_runs.prefetch).

Checked exactly (integers), at N = 2 and N = 4, fp32 / bf16 / fp16. Also: the ledger's
`bytes` equal the sizes of the tensors actually handed to torch.distributed (recorded by
wrapping its collectives in the ranks, see engine_runs._patch_dist).
"""
from fractions import Fraction

import pytest

from tests.support import engine_runs as er

Z3P0 = er.Z3P0
SCALAR_LABELS = ("grad_norm", "overflow")
N2 = dict(steps=2)
N4 = dict(world=4, steps=2, global_batch=4)

RUNS = {
    "fp32-s0-n2": dict(stage=0, **N2), "fp32-s1-n2": dict(stage=1, **N2), "fp32-s2-n2": dict(stage=2, **N2),
    "fp32-s3p0-n2": dict(stage=3, zero=Z3P0, **N2), "fp32-s3default-n2": dict(stage=3, **N2),
    "fp32-s2bucket-n2": dict(stage=2, zero={"reduce_bucket_size": 3000}, **N2),
    "fp32-s0-gas2-n2": dict(stage=0, gas=2, **N2), "fp32-s3p0-gas2-n2": dict(stage=3, zero=Z3P0, gas=2, **N2),
    "bf16-s0-n2": dict(stage=0, dtype="bf16", **N2), "bf16-s1-n2": dict(stage=1, dtype="bf16", **N2),
    "bf16-s2-n2": dict(stage=2, dtype="bf16", **N2), "bf16-s3p0-n2": dict(stage=3, zero=Z3P0, dtype="bf16", **N2),
    "fp16-s0-n2": dict(stage=0, dtype="fp16", **N2), "fp16-s3p0-n2": dict(stage=3, zero=Z3P0, dtype="fp16", **N2),
    "bf16-s0-n4": dict(stage=0, dtype="bf16", **N4), "bf16-s1-n4": dict(stage=1, dtype="bf16", **N4),
    "bf16-s2-n4": dict(stage=2, dtype="bf16", **N4), "bf16-s3p0-n4": dict(stage=3, zero=Z3P0, dtype="bf16", **N4),
    "fp32-tiny-s0-n4": dict(preset="tiny", world=4, steps=3, global_batch=4, stage=0),
    "fp32-tiny-s2bucket-n4": dict(preset="tiny", world=4, steps=3, global_batch=4, stage=2,
                                  zero={"reduce_bucket_size": 3000}),
}


@pytest.fixture(scope="module", autouse=True)
def _runs():
    er.prefetch(specs=RUNS.values())


def volume(r):
    """(psi_padded, elem, per-op data volume of the last step with scalar all-reduces removed)."""
    n = r["world"]
    psi = sum(f["padded"] for f in r["flats"])
    elem = r["flats"][0]["elem"]
    stats, by_label = r["comm_last_step"]["stats"], r["comm_last_step"]["by_label"]
    data = {op: dict(stats.get(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})) for op in er_ops()}
    scalars = {}
    for key, v in by_label.items():
        op, label = key.split(":", 1)
        if label in SCALAR_LABELS:
            size = v["bytes"] // v["calls"]
            assert size * v["calls"] == v["bytes"] and size <= 8     # really scalars
            assert op == "all_reduce"
            data[op]["calls"] -= v["calls"]
            data[op]["bytes"] -= v["bytes"]
            data[op]["wire_bytes"] -= v["calls"] * (2 * size * (n - 1) // n)
            scalars[label] = v
    return psi, elem, data, scalars


def er_ops():
    return ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def frac_wire(k, psi, elem, n):
    """k * Ψ (N-1)/N elements, in bytes, exactly; must be an integer number of bytes."""
    w = Fraction(k * psi * elem * (n - 1), n)
    assert w.denominator == 1
    return int(w)


@pytest.mark.parametrize("name", list(RUNS))
def test_volume_per_step_matches_the_paper(name):
    spec = er.spec_of(**RUNS[name])
    run = er.get(**RUNS[name])
    stage, n = spec["stage"], spec["world"]
    persist_default = stage == 3 and dict(spec["zero"]).get("stage3_param_persistence_threshold") is None
    for r in run:
        assert r["skipped"] == [0] * spec["steps"], r["skipped"]     # every step took the full path
        psi, elem, d, scalars = volume(r)
        ag, rs, ar, bc = d["all_gather"], d["reduce_scatter"], d["all_reduce"], d["broadcast"]
        assert bc == {"calls": 0, "bytes": 0, "wire_bytes": 0}
        total_wire = ag["wire_bytes"] + rs["wire_bytes"] + ar["wire_bytes"]
        if stage == 0:
            assert ag["calls"] == rs["calls"] == 0
            assert ar["bytes"] == psi * elem
            assert ar["wire_bytes"] == frac_wire(2, psi, elem, n)
            k = 2
        elif stage in (1, 2) or persist_default:
            # ZeRO-1/2 (and ZeRO-3 when every parameter is persistent): reduce-scatter the
            # gradient once per FlatParam, all-gather the parameters: once per FlatParam at
            # ZeRO-1/2, every persistent FlatParam in one call at ZeRO-3 (flat_param.all_gather_coalesced)
            assert ar["calls"] == 0
            assert rs["calls"] == len(r["flats"])
            assert ag["calls"] == (1 if stage == 3 else len(r["flats"]))
            assert rs["bytes"] == ag["bytes"] == psi * elem
            assert rs["wire_bytes"] == ag["wire_bytes"] == frac_wire(1, psi, elem, n)
            k = 2
        else:
            assert ar["calls"] == 0
            assert rs["bytes"] == psi * elem * spec["gas"]          # reduced every micro-step
            assert ag["bytes"] == 2 * psi * elem * spec["gas"]      # gathered fwd + bwd each micro-step
            fwd = sum(v["bytes"] for k_, v in r["comm_last_step"]["by_label"].items() if k_.endswith(".fwd"))
            bwd = sum(v["bytes"] for k_, v in r["comm_last_step"]["by_label"].items() if k_.endswith(".bwd"))
            assert fwd == bwd == psi * elem * spec["gas"]
            assert ag["wire_bytes"] == frac_wire(2 * spec["gas"], psi, elem, n)
            assert rs["wire_bytes"] == frac_wire(spec["gas"], psi, elem, n)
            k = 3 * spec["gas"]
        assert total_wire == frac_wire(k, psi, elem, n), (name, total_wire)
        # control traffic: one fp64 norm sum when gradients are partitioned, one fp16 vote
        want = set()
        if stage >= 1:
            want.add("grad_norm")
        if spec["dtype"] == "fp16":
            want.add("overflow")
        assert set(scalars) == want
        assert all(v["calls"] == 1 for v in scalars.values())


def test_stage3_moves_1_5x_stage0():
    for dtype, n in (("fp32", 2), ("bf16", 2), ("bf16", 4)):
        sfx = f"-n{n}"
        z0 = er.get(**RUNS[f"{dtype}-s0{sfx}"])[0]
        z3 = er.get(**RUNS[f"{dtype}-s3p0{sfx}"])[0]
        w0 = sum(v["wire_bytes"] for v in volume(z0)[2].values())
        w3 = sum(v["wire_bytes"] for v in volume(z3)[2].values())
        psi0, psi3 = volume(z0)[0], volume(z3)[0]
        # exactly 3/2 once padding is accounted for (ZeRO-3 pads per unit and group)
        assert Fraction(w3, psi3) == Fraction(3, 2) * Fraction(w0, psi0), (dtype, n)
        print(f"\n{dtype} N={n}: stage 0 {w0} B, stage 3 {w3} B per step (Ψ {psi0} vs padded {psi3})")


@pytest.mark.parametrize("name", ["fp32-s0-n2", "fp32-s0-gas2-n2", "bf16-s0-n4", "fp16-s0-n2"])
def test_stage0_one_flat_gradient_all_reduce_per_step(name):
    """Issue 2: stage 0 all-reduces the flat gradient once per bucket (with the default
    reduce_bucket_size, one bucket per param group) per optimizer
    step (not per parameter, not per micro-step), and that buffer is the whole gradient."""
    run = er.get(**RUNS[name])
    for r in run:
        _, elem, d, _ = volume(r)
        assert len(r["flats"]) == 2                     # the two param groups
        assert d["all_reduce"]["calls"] == 2
        grads = {k: v for k, v in r["comm_last_step"]["by_label"].items() if k.endswith(".grads")}
        assert sorted(grads) == ["all_reduce:group0.bucket0.grads", "all_reduce:group1.bucket0.grads"]
        assert [grads[f"all_reduce:{f['label']}.grads"]["bytes"] for f in r["flats"]] == \
            [f["numel"] * elem for f in r["flats"]]


@pytest.mark.parametrize("name", list(RUNS))
def test_ledger_bytes_are_the_tensors_handed_to_the_collectives(name):
    """Since the engine was built, every call and byte the ledger counted was really handed
    to torch.distributed (all_reduce/broadcast: the tensor, all_gather: the output,
    reduce_scatter: the input), and every collective carries a label."""
    for r in er.get(**RUNS[name]):
        assert r["world"] > 1
        for op in er_ops():
            led = r["ledger_total"][op]
            assert {"calls": led["calls"], "bytes": led["bytes"]} == r["dist_record"][op], (name, op)
        assert r["ledger_total"]["broadcast"]["calls"] == len(r["flats"])    # the initial weight broadcast


def test_every_collective_is_labelled():
    for name in ("fp32-s0-n2", "fp32-s2bucket-n2", "bf16-s3p0-n4", "fp16-s3p0-n2"):
        for r in er.get(**RUNS[name]):
            stats, by_label = r["comm_last_step"]["stats"], r["comm_last_step"]["by_label"]
            for op, v in stats.items():
                lab = [b for k, b in by_label.items() if k.startswith(op + ":")]
                assert sum(b["calls"] for b in lab) == v["calls"]
                assert sum(b["bytes"] for b in lab) == v["bytes"]
