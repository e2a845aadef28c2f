"""minizero.partition and minizero.memory arithmetic: pure functions, no processes.

Edge cases (numel < N, exact multiples, odd sizes, world sizes 1..8) and property-style
sweeps: shards tile the padded range, shards put back together unflatten to every tensor,
padding < N per buffer, and memory.expected_bytes differs from paper_bytes by padding only.
"""
import itertools
import random
from fractions import Fraction

import pytest

from minizero import memory
import torch

from minizero.partition import bucketize, padded_numel, shard_numel, shard_range, unflatten

WORLDS = range(1, 9)


# ----------------------------------------------------------------------------- padded / shard sizes

@pytest.mark.parametrize("numel, n, padded", [
    (0, 1, 0), (0, 4, 0),            # empty buffer: nothing to pad
    (1, 1, 1), (1, 2, 2), (1, 8, 8),  # numel < N: every rank but one holds only padding
    (3, 4, 4), (7, 8, 8),
    (4, 4, 4), (8, 2, 8), (64, 8, 64),  # exact multiples: no padding
    (5, 2, 6), (9, 4, 12), (15099, 2, 15100), (15099, 4, 15100), (108801, 8, 108808),  # odd
])
def test_padded_numel_cases(numel, n, padded):
    assert padded_numel(numel, n) == padded
    assert shard_numel(numel, n) == padded // n


@pytest.mark.parametrize("n", WORLDS)
def test_padded_numel_is_smallest_multiple(n):
    for numel in range(0, 70):
        p = padded_numel(numel, n)
        assert p % n == 0 and p >= numel
        assert p - numel < n                      # padding < N per buffer
        assert p - n < numel or p == 0            # smallest such multiple
        assert shard_numel(numel, n) * n == p


@pytest.mark.parametrize("n", WORLDS)
def test_shard_ranges_tile_padded_range(n):
    for numel in list(range(0, 40)) + [15099, 108801]:
        ranges = [shard_range(numel, n, r) for r in range(n)]
        assert ranges[0][0] == 0 and ranges[-1][1] == padded_numel(numel, n)
        for (a, b), (c, d) in zip(ranges, ranges[1:]):
            assert b == c                          # contiguous, no gap, no overlap
        assert {b - a for a, b in ranges} == {shard_numel(numel, n)}   # equal sizes


def test_shard_range_numel_smaller_than_world():
    # 3 elements over 8 ranks: one element per shard, ranks 3..7 hold padding only.
    assert [shard_range(3, 8, r) for r in range(8)] == [(r, r + 1) for r in range(8)]
    assert padded_numel(3, 8) == 8                  # ranks 3..7 hold padding only


# ----------------------------------------------------------------------------- unflatten

def _round_trip(shapes, n):
    """Lay tensors end to end, pad to a multiple of n, cut into n shards (as each rank holds
    them), put the shards back in rank order and unflatten: every tensor comes back exactly,
    as a view of the flat buffer, and whatever lies past the data is padding."""
    tensors = [torch.randn(s) for s in shapes]
    numel = sum(t.numel() for t in tensors)
    flat = torch.zeros(padded_numel(numel, n))
    flat[:numel] = torch.cat([t.reshape(-1) for t in tensors]) if tensors else flat[:0]
    shards = [flat[slice(*shard_range(numel, n, r))].clone() for r in range(n)]
    whole = torch.cat(shards)
    names = [f"t{i}" for i in range(len(shapes))]
    out = unflatten(whole, names, shapes)
    assert list(out) == names
    for name, t in zip(names, tensors):
        assert torch.equal(out[name], t)
        assert out[name].untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()   # a view
    assert not whole[numel:].any()


@pytest.mark.parametrize("n", WORLDS)
def test_shards_reassemble_every_tensor_exactly(n):
    rng = random.Random(n)
    cases = [[(1,)], [(5,)], [(n,)], [(n + 1,)], [(1,)] * 7, [(3,), (2, 2), (2,)], [(0,), (3,)], [(2,), (0, 4), (5,)]]
    cases += [[tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
              for _ in range(25)]
    for shapes in cases:
        _round_trip(shapes, n)


def test_round_trip_on_model_sized_layouts():
    # the micro preset's two param groups (decay 11,886 / no-decay 3,213) at N = 2, 3, 4, 8
    for shapes, n in itertools.product([[(21, 21)] * 20 + [(1302,), (1764,), (1764,), (1302,), (1578,)],
                                        [(21,)] * 100 + [(1323,), (1302,), (1001,)]], [2, 3, 4, 8]):
        _round_trip(shapes, n)


# ----------------------------------------------------------------------------- buckets

def test_bucketize_cases():
    assert bucketize([], 10) == []
    assert bucketize([3, 3, 3], 6) == [[0, 1], [2]]
    assert bucketize([3, 3, 3], 9) == [[0, 1, 2]]                # exact fit
    assert bucketize([10, 1], 5) == [[0], [1]]                    # larger than a bucket: own bucket
    assert bucketize([1, 10, 1], 5) == [[0], [1], [2]]
    assert bucketize([0, 0, 4], 4) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="positive"):
        bucketize([1], 0)


def test_bucketize_properties():
    rng = random.Random(0)
    for _ in range(300):
        numels = [rng.randint(1, 50) for _ in range(rng.randint(1, 15))]
        cap = rng.randint(1, 120)
        buckets = bucketize(numels, cap)
        assert [i for b in buckets for i in b] == list(range(len(numels)))   # order kept, each once
        for b in buckets:
            size = sum(numels[i] for i in b)
            assert size <= cap or len(b) == 1
        for b, nxt in zip(buckets, buckets[1:]):                             # greedy: next one didn't fit
            assert sum(numels[i] for i in b) + numels[nxt[0]] > cap


# ----------------------------------------------------------------------------- memory formulas

def _diff_expected(stage, flat_numels, n, mixed):
    """What padding alone should add to each term, as exact fractions: a partitioned term
    gains bytes_per_element * padding / N, a replicated padded buffer the whole padding."""
    nn = n if stage >= 1 else 1
    pad = sum(padded_numel(x, nn) - x for x in flat_numels)
    lp = 2 if mixed else 4
    params = Fraction(lp * pad, nn) if stage == 3 else lp * pad
    grads = Fraction(lp * pad, nn) if stage >= 2 else 0
    master = Fraction(4 * pad, nn) if mixed else 0
    opt = Fraction(8 * pad, nn)
    return {"params": params, "grads": grads, "master_params": master, "optimizer_states": opt}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mixed", [True, False])
def test_expected_bytes_is_paper_plus_padding(stage, mixed):
    rng = random.Random(stage * 10 + mixed)
    layouts = [[15099], [11886, 3213], [108801], [3, 5, 7], [1], [8, 8]]
    layouts += [[rng.randint(1, 999) for _ in range(rng.randint(1, 6))] for _ in range(20)]
    for flat in layouts:
        for n in WORLDS:
            psi = sum(flat)
            exp = memory.expected_bytes(flat, n, stage, mixed)
            paper = memory.paper_bytes(psi, n, stage, mixed)
            want = _diff_expected(stage, flat, n, mixed)
            assert exp["device"] == {k: exp[k] for k in memory.CATEGORIES}   # no offload: all on the device
            for k in memory.CATEGORIES:
                assert Fraction(exp[k]) - Fraction(paper[k]).limit_denominator(64) == want[k], (flat, n, k)
            if all(padded_numel(x, n) == x for x in flat):
                assert {k: Fraction(exp[k]) for k in memory.CATEGORIES} == \
                    {k: Fraction(v).limit_denominator(64) for k, v in paper.items()}


def test_expected_bytes_zero3_persistent_counts_params_in_full():
    flat, n = [1001, 20], 4
    none = memory.expected_bytes(flat, n, 3, persistent=[False, False])
    small = memory.expected_bytes(flat, n, 3, persistent=[False, True])
    assert small["params"] - none["params"] == 2 * (padded_numel(20, n) - padded_numel(20, n) // n)
    for k in ("grads", "master_params", "optimizer_states"):   # still partitioned
        assert small[k] == none[k]


def test_paper_bytes_16_psi_and_falling():
    psi = 1_000_000
    for n in (2, 4, 8):
        t = [memory.total(memory.paper_bytes(psi, n, s)) for s in range(4)]
        assert t[0] == 16 * psi
        assert t[1] == 4 * psi + 12 * psi / n
        assert t[2] == 2 * psi + 14 * psi / n
        assert t[3] == 16 * psi / n
        assert t[0] > t[1] > t[2] > t[3]
