"""Every combination of features the config accepts trains and equals its simpler twin bit for
bit, or is refused by initialize in one line (tests/combinations.py: the axes, the twins, why the
bound is 0).

The suite runs a sample: the cells a greedy covering picks so that every pair of values of any
two axes that some accepted cell holds appears at least once (29 cells), plus HSDP with
offload_param on the host and in NVMe files, against HSDP without offload; all with their twins,
2 optimizer steps each (tests/combinations.py says why 2 show what more would), in one launch of 4
gloo ranks (2 nodes of 2). A twin runs once however many cells share it: 31 cells and 19 twins,
two of which are sample cells themselves, are 48 runs. `python -m tests.combinations --all` runs
every cell; docs/results/combinations.md is the record of one such run (at 3 steps).
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests import combinations as C

HSDP_OFFLOAD = [C.parse_cell("stage=3,hierarchy=hsdp,offload_param=cpu"),
                C.parse_cell("stage=3,hierarchy=hsdp,offload_param=nvme,offload_optimizer=nvme")]
SAMPLE = C.covering_sample() + HSDP_OFFLOAD


@pytest.fixture(scope="module")
def verdicts():
    return {C.name(r["cell"]): r for r in C.verdicts(SAMPLE)}


@pytest.mark.parametrize("cell", [C.name(c) for c in SAMPLE])
def test_cell_trains_and_equals_its_twin_or_is_refused_in_one_line(verdicts, cell):
    r = verdicts[cell]
    assert r["verdict"] in ("equal", "trains", "refused"), f"{cell} (twin: {C.name(r['twin'])}): {r['note']}"


def test_hsdp_with_offload_param_equals_hsdp_without_bit_for_bit(verdicts):
    """The combination that crashed on its first gather (the host shard gathered over every rank
    instead of its shard group)."""
    for cell in HSDP_OFFLOAD:
        r = verdicts[C.name(cell)]
        assert r["twin"] == C.parse_cell("stage=3,hierarchy=hsdp") and r["verdict"] == "equal", r


def test_the_sample_covers_every_pair_of_values():
    possible = set().union(*(C.pairs_of(c) for c in C.all_cells()))
    covered = set().union(*(C.pairs_of(c) for c in SAMPLE))
    assert possible <= covered, sorted(possible - covered)[:5]
    assert len(C.covering_sample()) <= 40


def test_twins_keep_what_changes_numbers_and_drop_the_rest():
    cell = C.parse_cell("stage=3,dtype=bf16,offload_optimizer=nvme,offload_param=cpu,hierarchy=hpz,"
                        "activation=partition,overlap=on,accumulation=2,clipping=on")
    assert C.twin(cell) == C.parse_cell("stage=3,dtype=bf16,accumulation=2,clipping=on")
    hsdp = C.parse_cell("stage=3,hierarchy=hsdp,offload_param=nvme")
    assert C.twin(hsdp) == C.parse_cell("stage=3,hierarchy=hsdp") and C.is_root(C.twin(hsdp))
    assert all(C.is_root(C.twin(c)) for c in C.all_cells())


def _switches():
    """Every key of the sections below that changes what runs: acts=True, not an alias, and
    accepting more than one value (a key only accepted at minizero's value is no switch)."""
    from minizero.config import ActivationCheckpointingConfig, BF16Config, FP16Config
    from minizero.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
    tables = [(C.Z, ZeroConfig), (f"{C.Z}.offload_optimizer", OffloadOptimizerConfig),
              (f"{C.Z}.offload_param", OffloadParamConfig), (C.AC, ActivationCheckpointingConfig),
              ("fp16", FP16Config), ("bf16", BF16Config)]
    for section, table in tables:
        for f in dataclasses.fields(table):
            check = f.metadata.get("check")
            if check is None or not f.metadata["acts"] or "only.<locals>" in check.__qualname__:
                continue
            yield f"{section}.{f.metadata['name'] or f.name}"


def test_every_switch_of_the_config_is_an_axis_or_named_with_its_test():
    """A key the config gains is a key the matrix must name: an axis, or NOT_AXES with why."""
    switches = set(_switches())
    axes = set(itertools.chain.from_iterable(a.covers for a in C.AXES))
    assert switches <= axes | set(C.NOT_AXES), sorted(switches - axes - set(C.NOT_AXES))
    assert set(C.NOT_AXES) <= switches | {"optimizer.params.torch_adam"}, sorted(set(C.NOT_AXES) - switches)
