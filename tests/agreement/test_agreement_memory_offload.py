"""ZeRO-Offload's bytes per rank, on the device and on the host: DeepSpeed against its own
source, minizero against its formula, and the one against the other, at N = 2 and N = 4.

Runs (DeepSpeed: 2 optimizer steps, so the second backward's probe sees Adam's moments, which
its first step creates; minizero: 1, as its memory_breakdown() depends on the layout and the
place only: every probe of step 1 equals step 2's, all 120 of both world sizes, checked when
its runs went from 2 steps to 1): bf16 at
both world sizes for ZeRO-1 and ZeRO-2 with offload_optimizer, ZeRO-3 with
offload_optimizer, offload_param and both, each beside the same config without offload;
once (N = 2): fp16 ZeRO-2 + offload_optimizer, fp32 ZeRO-3 + both, and bf16 ZeRO-3 +
offload_param with every parameter persistent (stage3_param_persistence_threshold 1e5).
DeepSpeed's numbers are reference/ds_memory.deepspeed_model_state_bytes on the live engine
(reference/ds_run.run_deepspeed(capture_memory=True)), minizero's engine.memory_breakdown();
every config of one world size, minizero's then DeepSpeed's, in one launch: 2 launches.

The symbols (bytes per rank, exact integers):
  b   bytes per low-precision element (2 bf16/fp16, 4 fp32)
  P   DeepSpeed ZeRO-1/2's flat size, each param group padded to 2N (zero12_padded_numel)
  S   DeepSpeed ZeRO-3's partition, ceil(n/N) per parameter (zero3_partition_numel)
  L   the largest parameter's numel (ZeRO-1/2's offload staging buffers)
  Σs  minizero's shard, Σ padded/N over its FlatParams: Ψ/N with padding

What moves (docs/deepspeed.md, "ZeRO-Offload's extra host buffers"):
  DeepSpeed ZeRO-1/2 + offload_optimizer: device -(12P/N - bL), host +(4P/N master + 8P/N
    moments + 4P/N fp32 gradient + bP/N low-precision staging + bL gradient staging);
    in bf16 12P/N - 2L and 18P/N + 2L.
  DeepSpeed ZeRO-3 + offload_optimizer: device -(4S + 8S + bS lp gradient buffer), host
    +(that + 4S fp32 gradient); + offload_param: bS more, device -> host.
  minizero, mixed precision: exactly 12Σs (master + moments) from device to host; with
    offload_param also bΣs of partitioned parameters (persistent FlatParams stay gathered
    on the device and have no shard to move). fp32: the device keeps its fp32 shard (it is
    the parameter), so it saves 8Σs while the host holds a 12Σs master + moments.
"""
from __future__ import annotations

import functools
from typing import Dict, NamedTuple

import pytest
import torch

from minizero.memory import CATEGORIES, expected_bytes, total
from reference.ds_estimates import zero3_partition_numel, zero12_grad_partition_numel, zero12_padded_numel
from tests.support import agreement as A

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

STEPS = 2      # DeepSpeed's runs (Adam's moments appear in its first step)
MZ_STEPS = 1   # minizero's: its probes at step 1 equal step 2's (module docstring)
PLACES = ("device", "host")
WORLDS = (2, 4)
PERSIST = 100_000   # above every tiny parameter (the largest has 15,876 elements): all stay gathered


class Case(NamedTuple):
    stage: int
    dtype: str
    oo: bool = False          # offload_optimizer: {device: cpu}
    op: bool = False          # offload_param: {device: cpu} (stage 3)
    persist: int = 0          # stage3_param_persistence_threshold

    def off(self) -> "Case":
        return self._replace(oo=False, op=False)

    def __str__(self):
        return (f"z{self.stage}-{self.dtype}" + ("-oo" if self.oo else "") + ("-op" if self.op else "")
                + (f"-persist{self.persist}" if self.persist else ""))


BF16 = [Case(1, "bf16", oo=True), Case(2, "bf16", oo=True), Case(3, "bf16", oo=True),
        Case(3, "bf16", op=True), Case(3, "bf16", oo=True, op=True)]
ONCE = [Case(2, "fp16", oo=True), Case(3, "fp32", oo=True, op=True), Case(3, "bf16", op=True, persist=PERSIST)]
OFFLOAD = [(n, c) for n in WORLDS for c in BF16] + [(2, c) for c in ONCE]
ALL = OFFLOAD + list(dict.fromkeys((n, c.off()) for n, c in OFFLOAD))
IDS = [f"N{n}-{c}" for n, c in OFFLOAD]


def config(c: Case) -> dict:
    cfg = A.make_config(c.stage, c.dtype)   # reduce_bucket_size 2e4, persistence 0, torch_adam
    zero = cfg["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = c.persist
    if c.oo:
        zero["offload_optimizer"] = {"device": "cpu"}
    if c.op:
        zero["offload_param"] = {"device": "cpu"}
    return cfg


# ----------------------------------------------------------------------------- runs (cached)

_CACHE: Dict[tuple, list] = {}


def _deepspeed_many(cases: list) -> list:
    """On each rank: run_deepspeed for each case in turn, in this process (each its own engine;
    every number equal to the case's own launch, as the agreement cache's DeepSpeed runs are:
    tests/support/agreement.py, _deepspeed_many)."""
    from reference.ds_run import run_deepspeed
    return [run_deepspeed(A.MODEL_FN, config(c), A.BATCHES, STEPS, capture_memory=True, capture_peaks=False, return_final_state=False)
            for c in cases]


def _both_many(cases: list) -> tuple:
    """On each rank: every case under minizero, then every case under DeepSpeed, in this
    process. minizero first: DeepSpeed's ZeRO-3 patches torch for the rest of the process,
    minizero patches nothing. Every number of every run equals the same run's in a launch of
    its own library alone."""
    jobs = [{"model_fn": A.MODEL_FN, "config": config(k), "batches": A.BATCHES, "steps": MZ_STEPS,
             "capture_memory": True, "return_final_state": False} for k in cases]
    return A.run_minizero_many(jobs), _deepspeed_many(cases)


def _train(n: int) -> None:
    """Every configuration of world size n, both libraries, in ONE launch of n ranks."""
    from tests.support.launcher import run_ranks
    todo = [k for m, k in ALL if m == n]
    per_rank = run_ranks(_both_many, world_size=n, args=(todo,), env=A.ENV, timeout=600)
    for lib, j in (("mz", 0), ("ds", 1)):
        for i, k in enumerate(todo):
            _CACHE[(lib, n, k)] = [per_rank[r][j][i] for r in range(n)]


def ds(n: int, c: Case) -> list:
    if ("ds", n, c) not in _CACHE:
        _train(n)
    return _CACHE[("ds", n, c)]


def mz(n: int, c: Case) -> list:
    if ("mz", n, c) not in _CACHE:
        _train(n)
    return _CACHE[("mz", n, c)]


def probe(results, rank: int, when: str) -> dict:
    return results[rank]["memory"][when][-1]


@functools.lru_cache(maxsize=None)
def model_numels():
    """Per-group parameter numels (DeepSpeed's groups, in order) and every parameter's numel."""
    torch.manual_seed(0)
    m = A.MODEL_FN()
    groups = tuple(tuple(p.numel() for p in g["params"]) for g in m.configure_param_groups(0.01))
    return groups, tuple(n for g in groups for n in g)


def lp_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def zeros() -> dict:
    return {w: {k: 0 for k in CATEGORIES} for w in PLACES}


def by_attribute(terms: dict) -> dict:
    """{place: {"category:attribute": bytes}} without zero terms (the probe lists no empty source)."""
    return {w: {k: v for k, v in terms[w].items() if v} for w in PLACES}


# ----------------------------------------------------------------------------- a. DeepSpeed

def ds_terms(c: Case, n: int, rank: int, when: str) -> dict:
    """What DeepSpeed 0.19.8 holds, {place: {"category:attribute": bytes}}, from its source
    (stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__ / initialize_optimizer_states;
    stage3.py: _create_fp16_partitions_with_defragmentation, _create_fp32_partitions,
    initialize_optimizer_states; partition_parameters.py: _partition_param)."""
    groups, numels = model_numels()
    b, L = lp_bytes(c.dtype), max(numels)
    t = {w: {} for w in PLACES}
    opt = "host" if c.oo else "device"
    if c.stage in (1, 2):
        P = zero12_padded_numel([sum(g) for g in groups], n)
        t["device"]["params:bit16_groups_flat"] = b * P
        t[opt]["master_params:single_partition_of_fp32_groups"] = 4 * P // n
        t[opt]["optimizer_states:optimizer.state"] = 8 * P // n
        if c.oo:
            # cast target of the updated fp32 slice, copied from here to the device's partition
            t["host"]["params:param_buffer_of_bit16_for_cpu_offload_groups"] = b * P // n
            # backward copies each reduced piece into the master's fp32 .grad (never freed)
            t["host"]["grads:single_partition_of_fp32_groups[i].grad"] = 4 * P // n
            t["host"]["grads:temp_grad_buffer_for_cpu_offload"] = b * L
            t["device"]["grads:temp_grad_buffer_for_gpu_offload"] = b * L
        elif when == "after_backward":   # the low-precision partition, freed by the step
            t["device"]["grads:averaged_gradients"] = b * zero12_grad_partition_numel(groups, n, rank)
    else:
        S = zero3_partition_numel(numels, n)
        gathered = n * zero3_partition_numel([x for x in numels if x <= c.persist], n)
        t["device"]["params:gathered p.data"] = b * gathered   # persistent: the all-gather buffer, kept
        if c.op:
            t["host"]["params:param_groups_fp16_flat_cpu_memory"] = b * S
        else:
            t["device"]["params:lp_param_buffer"] = b * S
        t[opt]["master_params:fp32_partitioned_groups_flat"] = 4 * S
        t[opt]["optimizer_states:optimizer.state"] = 8 * S
        t[opt]["grads:grad_partitions_flat_buffer"] = b * S   # at self.device: the host with offload_optimizer
        if c.oo:
            t["host"]["grads:fp32_partitioned_groups_flat[i].grad"] = 4 * S
    return by_attribute(t)


def summed(terms: dict) -> dict:
    out = zeros()
    for w in PLACES:
        for name, v in terms[w].items():
            out[w][name.split(":")[0]] += v
    return out


def model_state_details(d: dict) -> dict:
    return {w: {k: v for k, v in d["details_by_place"][w].items() if k.split(":")[0] in CATEGORIES}
            for w in PLACES}


@pytest.mark.parametrize("n, c", OFFLOAD, ids=IDS)
def test_deepspeed_offload_bytes_by_place_and_attribute(n, c):
    """Every byte DeepSpeed holds, by place and by attribute, equals its source's arithmetic,
    with and without offload; the difference is the formula of the module docstring."""
    groups, numels = model_numels()
    b, L = lp_bytes(c.dtype), max(numels)
    P, S = zero12_padded_numel([sum(g) for g in groups], n), zero3_partition_numel(numels, n)
    for rank in range(n):
        for when in ("after_backward", "after_step"):
            on, off = probe(ds(n, c), rank, when), probe(ds(n, c.off()), rank, when)
            for case, d in ((c, on), (c.off(), off)):
                assert d["unclaimed"] == {}, (case, d["unclaimed"])
                assert model_state_details(d) == ds_terms(case, n, rank, when), (case, rank, when)
                assert {w: d[w] for w in PLACES} == summed(ds_terms(case, n, rank, when))
                assert all(d[k] == d["device"][k] + d["host"][k] for k in CATEGORIES)
            assert off["host"] == dict.fromkeys(CATEGORIES, 0)
            saved = {k: off["device"][k] - on["device"][k] for k in CATEGORIES}
            rise = {k: on["host"][k] - off["host"][k] for k in CATEGORIES}
            if c.stage in (1, 2):
                # no offload, after backward: the lp gradient partition is on the device
                lp_grad = b * zero12_grad_partition_numel(groups, n, rank) if when == "after_backward" else 0
                assert saved == {"params": 0, "master_params": 4 * P // n, "optimizer_states": 8 * P // n,
                                 "grads": lp_grad - b * L}   # temp_grad_buffer_for_gpu_offload: -bL
                assert rise == {"params": b * P // n,                         # bit16 staging
                                "master_params": 4 * P // n, "optimizer_states": 8 * P // n,
                                "grads": 4 * P // n + b * L}                  # fp32 grad + cpu staging
                if c.dtype == "bf16" and when == "after_step":   # the brief form: 12P/N - 2L, 18P/N + 2L
                    assert sum(saved.values()) == 12 * P // n - 2 * L
                    assert sum(rise.values()) == 18 * P // n + 2 * L
            else:
                oo = {"params": 0, "master_params": 4 * S, "optimizer_states": 8 * S, "grads": b * S}
                assert saved == {k: (oo[k] if c.oo else 0) + (b * S if c.op and k == "params" else 0)
                                 for k in CATEGORIES}
                assert rise == {k: (oo[k] + (4 * S if k == "grads" else 0) if c.oo else 0)
                                + (b * S if c.op and k == "params" else 0) for k in CATEGORIES}
                if c.dtype == "bf16" and c.oo:
                    assert sum(saved.values()) == 14 * S + (2 * S if c.op else 0)
                    assert sum(rise.values()) == 18 * S + (2 * S if c.op else 0)
        # the model states themselves do not change between the probes once offloaded
        if c.oo:
            assert probe(ds(n, c), rank, "after_backward")["device"] == probe(ds(n, c), rank, "after_step")["device"]


# ----------------------------------------------------------------------------- b. minizero

def layout(n: int, c: Case) -> list:
    return mz(n, c)[0]["layout"]


def flat_shards(lay: list, stage: int):
    """(Σ shard over all FlatParams, Σ shard over the partitioned (not kept full) ones)."""
    shard = sum(f["shard"] for f in lay)
    partitioned = sum(f["shard"] for f in lay if stage == 3 and not f["persistent"])
    return shard, partitioned


@pytest.mark.parametrize("n, c", OFFLOAD, ids=IDS)
def test_minizero_offload_moves_12_psi_over_n_and_the_parameter_shard(n, c):
    """engine.memory_breakdown() equals memory.expected_bytes exactly, with and without
    offload; offload moves exactly the optimizer shard (12Σs in mixed precision) and, with
    offload_param, the partitioned low-precision shard, from device to host."""
    lay = layout(n, c)
    assert lay == layout(n, c.off()), "offload must not change the layout"
    numels = [f["numel"] for f in lay]
    persistent = [f["persistent"] and c.stage == 3 for f in lay]
    mixed, b = c.dtype != "fp32", lp_bytes(c.dtype)
    shard, partitioned = flat_shards(lay, c.stage)
    psi, pad = sum(numels), sum(f["padded"] - f["numel"] for f in lay)
    assert n * shard == psi + pad   # Σs is Ψ/N with minizero's padding
    for rank in range(n):
        on, off = probe(mz(n, c), rank, "after_backward"), probe(mz(n, c.off()), rank, "after_backward")
        assert on == probe(mz(n, c), rank, "after_step")   # static: the layout and the place only
        assert on == expected_bytes(numels, n, c.stage, mixed=mixed, persistent=persistent,
                                    offload_optimizer=c.oo, offload_param=c.op)
        assert off == expected_bytes(numels, n, c.stage, mixed=mixed, persistent=persistent)
        assert total(on) == total(off) + (0 if mixed or not c.oo else 4 * shard)   # fp32: a host master
        saved = {k: off["device"][k] - on["device"][k] for k in CATEGORIES}
        rise = {k: on["host"][k] - off["host"][k] for k in CATEGORIES}
        moved_params = b * partitioned if c.op else 0
        if mixed:
            assert saved == rise == {"params": moved_params, "grads": 0,
                                     "master_params": 4 * shard if c.oo else 0,
                                     "optimizer_states": 8 * shard if c.oo else 0}
            if c.oo:
                assert 12 * (psi + pad) == n * (saved["master_params"] + saved["optimizer_states"])
        else:
            # fp32: the fp32 shard is the parameter and stays; the host gets its own master
            assert saved == {"params": moved_params, "grads": 0, "master_params": 0,
                             "optimizer_states": 8 * shard if c.oo else 0}
            assert rise == {"params": moved_params, "grads": 0, "master_params": 4 * shard if c.oo else 0,
                            "optimizer_states": 8 * shard if c.oo else 0}
        if c.persist:
            # every FlatParam stays gathered: offload_param has nothing of minizero's to move
            assert all(persistent) and moved_params == 0 and on == off


# ----------------------------------------------------------------------------- c. minizero vs DeepSpeed

def named_differences(c: Case, n: int, rank: int) -> dict:
    """minizero - DeepSpeed (after the last backward), {place: {category: {name: bytes}}};
    every byte of difference in one named term."""
    groups, numels = model_numels()
    b, L = lp_bytes(c.dtype), max(numels)
    lay = layout(n, c)
    shard, partitioned = flat_shards(lay, c.stage)
    opt = "host" if c.oo else "device"
    d = {w: {k: {} for k in CATEGORIES} for w in PLACES}
    if c.stage in (1, 2):
        P = zero12_padded_numel([sum(g) for g in groups], n)
        padded = sum(f["padded"] for f in lay)
        # DS pads each param group to 2N, minizero each FlatParam to N (ZeRO-2: per bucket)
        d["device"]["params"]["padding"] = b * (padded - P)
        master(d, c, opt, shard, P // n)
        # minizero holds the lp gradient on the device until the step: ZeRO-1 in full (the
        # paper's P_os), ZeRO-2 its reduced shard (copied to the host inside step only)
        mz_grad = b * (sum(f["numel"] for f in lay) if c.stage == 1 else shard)
        if c.oo:
            d["device"]["grads"]["minizero's lp gradient, on the device until the step"] = mz_grad
            d["device"]["grads"]["DS temp_grad_buffer_for_gpu_offload (bL)"] = -b * L
            d["host"]["params"]["DS param_buffer_of_bit16_for_cpu_offload_groups (bP/N)"] = -b * P // n
            d["host"]["grads"]["DS fp32 gradient partition (4P/N)"] = -4 * P // n
            d["host"]["grads"]["DS temp_grad_buffer_for_cpu_offload (bL)"] = -b * L
        else:
            d["device"]["grads"]["minizero's lp gradient - DS's partition of whole parameters"] = \
                mz_grad - b * zero12_grad_partition_numel(groups, n, rank)
    else:
        S = zero3_partition_numel(numels, n)
        kept = [x for x in numels if x <= c.persist]
        S_kept = zero3_partition_numel(kept, n)
        full_kept = sum(f["padded"] for f in lay if f["persistent"])
        # the premise of the terms below: both libraries keep the same parameters gathered
        assert (full_kept > 0) == bool(kept) and (not kept or len(kept) == len(numels))
        lp_place = "host" if c.op else "device"
        # DS pads each PARAMETER to ceil(n/N), minizero each (unit, group) FlatParam to N
        d[lp_place]["params"]["padding of the partitioned shards"] = b * (partitioned - (S - S_kept))
        d["device"]["params"]["padding of the gathered persistent parameters"] = b * (full_kept - n * S_kept)
        # DS keeps a partition of every persistent parameter besides its gathered copy
        d[lp_place]["params"]["DS partition of the persistent parameters"] = -b * S_kept
        master(d, c, opt, shard, S)
        if c.oo:
            # DS's grad_partitions_flat_buffer is at self.device, the host; minizero keeps the
            # reduced lp gradient shard on the device and copies it inside step
            d["device"]["grads"]["minizero's lp gradient shard, on the device until the step"] = b * shard
            d["host"]["grads"]["DS grad_partitions_flat_buffer (bS)"] = -b * S
            d["host"]["grads"]["DS fp32 gradient partition (4S)"] = -4 * S
        else:
            d["device"]["grads"]["padding"] = b * (shard - S)
    return d


def master(d: dict, c: Case, opt: str, shard: int, ds_shard: int) -> None:
    """The fp32 master and Adam's moments: minizero's Σs against DeepSpeed's P/N or S."""
    d[opt]["optimizer_states"]["padding"] = 8 * (shard - ds_shard)
    if c.dtype == "fp32" and not c.oo:
        # docs/deepspeed.md, "fp32 ZeRO keeps a second fp32 master copy"; with offload
        # minizero keeps one too, on the host (the device's shard stays the parameter)
        d[opt]["master_params"]["DS's second fp32 copy (minizero's shard is the master)"] = -4 * ds_shard
    else:
        d[opt]["master_params"]["padding"] = 4 * (shard - ds_shard)


@pytest.mark.parametrize("n, c", OFFLOAD, ids=IDS)
def test_minizero_against_deepspeed_by_place(n, c):
    """Per place and category, minizero == DeepSpeed + the named differences, for the
    offload config and the same config without it."""
    for case in (c, c.off()):
        for rank in range(n):
            m, d = probe(mz(n, case), rank, "after_backward"), probe(ds(n, case), rank, "after_backward")
            named = named_differences(case, n, rank)
            for w in PLACES:
                for k in CATEGORIES:
                    assert m[w][k] == d[w][k] + sum(named[w][k].values()), (case, rank, w, k, named[w][k])
            if rank == 0:
                terms = {f"{w}.{k}": {t: v for t, v in named[w][k].items() if v} for w in PLACES for k in CATEGORIES
                         if any(named[w][k].values())}
                print(f"\nN={n} {case} rank 0, minizero - DeepSpeed (pytest -s shows it): {terms}")


# ----------------------------------------------------------------------------- the table

def offload_table(when: str = "after_backward") -> str:
    """docs/agreement.md's offload table: rank 0, model-state bytes by place, and what
    offload moved (the same config without offload minus with it)."""
    lines = ["| N | config | minizero device / host | DeepSpeed device / host | device saved mz / DS "
             "| host added mz / DS |", "|---|---|---|---|---|---|"]

    def split(d):
        return sum(d["device"].values()), sum(d["host"].values())

    for n, c in OFFLOAD:
        (md, mh), (dd, dh) = split(probe(mz(n, c), 0, when)), split(probe(ds(n, c), 0, when))
        (md0, mh0), (dd0, dh0) = split(probe(mz(n, c.off()), 0, when)), split(probe(ds(n, c.off()), 0, when))
        lines.append(f"| {n} | {c} | {md:,} / {mh:,} | {dd:,} / {dh:,} | {md0 - md:,} / {dd0 - dd:,} "
                     f"| {mh - mh0:,} / {dh - dh0:,} |")
    return "\n".join(lines)


if __name__ == "__main__":   # DS_ACCELERATOR=cpu .venv/bin/python -m tests.agreement.test_agreement_memory_offload
    print(offload_table())
