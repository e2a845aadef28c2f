"""ZeRO-Offload's traffic, both libraries side by side: the bytes each copies device -> host
(d2h) and host -> device (h2d), per micro-step and per step, at ZeRO-1, -2 and -3, with
gradient accumulation 1 and 4, counted in the same runs.

minizero counts its copies in its ledger (engine.comm_stats()["d2h"], ["h2d"]); DeepSpeed's
are counted by reference/ds_copies.py, which wraps each of its methods that copies between
the two and adds the bytes its copy lines move. One launch runs every minizero case, then every
DeepSpeed case (ZeRO-3 last: it patches torch for the rest of the process). bf16, N = 2,
2 optimizer steps, the second read; `offload_optimizer: cpu` (+ `offload_param: cpu` in the
ZeRO-3 "oo+op" cases), every ZeRO-3 parameter partitioned, prefetch and reuse off (the
paper's two gathers per micro-step), clipping off. The suite runs the micro GPT (Ψ = 15,099);

    DS_ACCELERATOR=cpu python -m tests.agreement.test_offload_traffic tiny   # docs/offload.md's table

prints the table for any preset. The symbols (elements per rank, b = 2 bytes in bf16):
  s    minizero's shard: Σ padded/N over its FlatParams
  S    DeepSpeed ZeRO-3's partition: Σ ceil(n/N) over the parameters; S_r its real elements
       (S less the padding on the last ranks)
  P/N  DeepSpeed ZeRO-1/2's partition (each param group padded to 2N)
  w    DeepSpeed ZeRO-1/2: the whole-parameter numel of the parameters in this rank's partition
  q    DeepSpeed ZeRO-1/2: their elements inside the partition (w less what straddles out)
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")

N, STEPS, MICRO = 2, 2, 2
ALL = [(stage, op, gas) for stage, op in ((1, False), (2, False), (3, False), (3, True)) for gas in (1, 4)]
# (stage, offload_param too, gradient_accumulation_steps); the suite runs accumulation 4,
# whose formulas are those of 1 with more terms (each case costs a DeepSpeed initialize)
SUITE = [c for c in ALL if c[2] == 4]
ENV = {"DS_ACCELERATOR": "cpu"}


def model_fn(preset: str):
    from tests.support.harness import NO_DROPOUT, make_model
    return functools.partial(make_model, preset, "gpt", **NO_DROPOUT)


def config(stage: int, gas: int, op: bool) -> dict:
    from tests.support.harness import make_config
    zero = {"reduce_bucket_size": 20_000, "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    if op:
        zero["offload_param"] = {"device": "cpu"}
    return make_config(stage, "bf16", micro_batch=MICRO, lr=1e-3, gas=gas, zero=zero, clip=0.0)


def batches(preset: str, gas: int):
    from minizero.gpt.model import get_preset
    from tests.support.harness import PatternBatches
    cfg = get_preset(preset)
    return PatternBatches(cfg.vocab_size, min(cfg.block_size, 16), MICRO * N * gas, gas)


def _loop(engine, preset, gas, read_micro, read_step):
    """STEPS optimizer steps; read_micro() after each micro-step's backward, read_step() after
    the boundary step, of the last step only; returns the losses."""
    import torch.distributed as dist
    data, losses = batches(preset, gas), []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        for micro in range(gas):
            x, y = data(step, micro, rank, world)
            loss = engine(x, y)[1]
            engine.backward(loss)
            if step == STEPS - 1:
                read_micro()
            engine.step()
            losses.append(float(loss.detach().float()))
        if step == STEPS - 1:
            read_step()
    return losses


def _ds_runs(preset: str, cases) -> dict:
    """Each case under DeepSpeed, on this rank: per micro-step and step bytes each way, and
    the layout numbers the formulas need."""
    import deepspeed

    from reference.ds_copies import track_copies
    from reference.ds_run import build_model, prepare_ds_config
    out = {}
    for stage, op, gas in sorted(cases):   # ZeRO-3 last
        cfg = prepare_ds_config(config(stage, gas, op))
        model, groups = build_model(model_fn(preset), cfg, 0)
        engine = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)[0]
        counter = track_copies(engine)
        losses = _loop(engine, preset, gas, lambda: None, lambda: None)
        got = counter.step_totals(STEPS - 1, gas)
        opt = engine.optimizer
        if stage < 3:
            import deepspeed.comm as dist
            mine = [p for g in opt.params_in_partition for p in g]
            got["w"] = sum(p.numel() for p in mine)
            got["q"] = sum(opt.grad_position[opt.get_param_id(p)][3] for p in mine)
            got["P/N"] = sum(g[dist.get_rank(group=opt.real_dp_process_group[i])].numel()
                             for i, g in enumerate(opt.parallel_partitioned_bit16_groups))
            held = getattr(opt, "accumulated_grads_in_cpu", {}) or {}
            got["accumulated_grads_in_cpu"] = sum(t.numel() * t.element_size() for t in held.values())
        else:
            params = list(engine.module.parameters())
            got["S"] = sum(p.partition_numel() for p in params)
            # the partition's real elements: the last ranks' padding is not copied
            got["S_real"] = sum(max(0, min(p.partition_numel(), p.ds_numel - opt._get_param_partition_rank(p)
                                           * p.partition_numel())) for p in params)
        got["losses"] = losses
        out[(stage, op, gas)] = got
        del engine, opt
    return out


def _mz_runs(preset: str, cases) -> dict:
    import minizero
    from minizero import comm
    from reference.ds_run import build_model, prepare_ds_config
    out = {}
    for stage, op, gas in cases:
        cfg = prepare_ds_config(config(stage, gas, op))
        model, groups = build_model(model_fn(preset), cfg, 0)
        engine = minizero.initialize(model=model, model_parameters=groups, config=cfg)[0]
        snap = lambda: {d: comm.ledger.snapshot()[d]["bytes"] for d in ("d2h", "h2d")}   # noqa: E731
        got, last = {"micro": []}, {}

        def read_micro():
            now = snap()
            got["micro"].append({d: now[d] - last[d] for d in now})
            last.update(now)

        def read_step():
            now = snap()
            got["step"] = {d: now[d] - last[d] for d in now}

        # the last step's bytes start where the previous step ended
        first = {"done": False}
        step_fn = engine.step

        def step():
            step_fn()
            if engine.micro_steps == (STEPS - 1) * gas and not first["done"]:
                first["done"] = True
                last.update(snap())
        engine.step = step
        got["losses"] = _loop(engine, preset, gas, read_micro, read_step)
        got["s"] = sum(f.shard_numel for f in engine.zero.flat_params if f.num_shards > 1 or stage < 3)
        out[(stage, op, gas)] = got
        engine.destroy()
    return out


def _both_runs(preset: str, cases) -> tuple:
    """minizero's cases, then DeepSpeed's, on this rank: minizero first, since DeepSpeed's
    ZeRO-3 patches torch for the rest of the process and minizero patches nothing; every
    number equal to the same run's in a launch of its own library alone."""
    mz = _mz_runs(preset, cases)
    return _ds_runs(preset, cases), mz


@functools.lru_cache(maxsize=None)
def runs(preset: str = "micro", cases: tuple = tuple(SUITE)) -> tuple:
    """(DeepSpeed's, minizero's) per rank: both libraries in one launch of N ranks."""
    from tests.support.launcher import run_ranks
    per_rank = run_ranks(_both_runs, world_size=N, args=(preset, cases), env=ENV, timeout=900)
    return [ds for ds, _ in per_rank], [mz for _, mz in per_rank]


def per_step(got: dict) -> dict:
    """Bytes each way over the whole step: its micro-steps and the boundary engine.step."""
    return {d: sum(m[d] for m in got["micro"]) + got["step"][d] for d in ("d2h", "h2d")}


def table(preset: str = "micro", cases: tuple = tuple(ALL)) -> str:
    ds, mz = runs(preset, cases)
    lines = ["| stage | offload | A | library | d2h per micro-step | h2d per micro-step | d2h in the step "
             "| h2d in the step | d2h per step | h2d per step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for stage, op, gas in cases:
        for lib, res in (("minizero", mz), ("DeepSpeed", ds)):
            got = res[0][(stage, op, gas)]
            micro = lambda d: " / ".join(f"{m[d]:,}" for m in got["micro"])   # noqa: E731
            tot = per_step(got)
            lines.append(f"| {stage} | {'oo + op' if op else 'oo'} | {gas} | {lib} | {micro('d2h')} | "
                         f"{micro('h2d')} | {got['step']['d2h']:,} | {got['step']['h2d']:,} | "
                         f"{tot['d2h']:,} | {tot['h2d']:,} |")
    for rank in range(N):
        layout = {k: v for c in cases for k, v in {**ds[rank][c], **mz[rank][c]}.items()
                  if k in ("w", "q", "P/N", "S", "S_real", "s")}
        held = {f"z{c[0]}-A{c[2]}": ds[rank][c]["accumulated_grads_in_cpu"] for c in cases if c[0] < 3}
        lines.append(f"\nrank {rank}: elements {layout}; DeepSpeed's accumulated_grads_in_cpu bytes {held}")
    return "\n".join(lines)


def expected_deepspeed(stage: int, op: bool, gas: int, got: dict, b: int = 2) -> dict:
    """DeepSpeed's bytes as reference/ds_copies.py derives them from the source, from the
    run's layout (w, q, P/N at ZeRO-1/2; S at ZeRO-3): {"micro": [...], "step": {...}}."""
    zero = {"d2h": 0, "h2d": 0}
    if stage == 1:   # reduced once, at the boundary, from the device's accumulated p.grad
        micro = [dict(zero) for _ in range(gas - 1)] + [{"d2h": 4 * got["q"], "h2d": 0}]
        return {"micro": micro, "step": {"d2h": 0, "h2d": b * got["P/N"]}}
    if stage == 2:   # each micro-step's reduced whole parameters to the host, and back from the second on
        bw = b * got["w"] if gas > 1 else 0
        micro = [{"d2h": bw, "h2d": bw if m else 0} for m in range(gas)]
        micro[-1]["d2h"] += 4 * got["q"]
        return {"micro": micro, "step": {"d2h": 0, "h2d": b * got["P/N"]}}
    # ZeRO-3: each micro-step the gradient partition (its real elements, S_r) down and back,
    # the fp32 partition at the end; offload_param: each of the two gathers brings the
    # parameter partitions up (padding included, S); without it the step copies them up
    bs, br = b * got["S"], b * got["S_real"]
    micro = [{"d2h": br, "h2d": br + (2 * bs if op else 0)} for _ in range(gas)]
    micro[-1]["d2h"] += 4 * got["S_real"]
    return {"micro": micro, "step": {"d2h": 0, "h2d": 0 if op else bs}}


def expected_minizero(op: bool, gas: int, got: dict, b: int = 2) -> dict:
    """minizero's: the reduced gradient shard down once per step and the new parameter shard
    up (offload_param: the shards live on the host, and each of the two gathers per
    micro-step brings one up instead)."""
    bs = b * got["s"]
    return {"micro": [{"d2h": 0, "h2d": 2 * bs if op else 0} for _ in range(gas)],
            "step": {"d2h": bs, "h2d": 0 if op else bs}}


@pytest.mark.parametrize("case", SUITE, ids=lambda c: f"z{c[0]}{'-op' if c[1] else ''}-A{c[2]}")
def test_offload_traffic_both_libraries(case):
    """docs/offload.md, "What crosses, both libraries": each library's copies per micro-step
    and per step, on both ranks, equal to the formulas of its source (minizero's ledger; the
    methods reference/ds_copies.py wraps): minizero moves the bf16 gradient shard down and
    the bf16 parameter shard up once per step at every stage and accumulation; DeepSpeed's
    ZeRO-1 sends the gradient in fp32 once per step (its accumulation stays in the device's
    p.grad), ZeRO-2 with accumulation adds each micro-step's whole-parameter round trip
    through `accumulated_grads_in_cpu`, ZeRO-3 sends its gradient partition down and back
    every micro-step plus the fp32 partition at the boundary. Both train to the same losses."""
    ds, mz = runs()
    stage, op, gas = case
    for rank in range(N):
        d, m = ds[rank][case], mz[rank][case]
        assert {k: d[k] for k in ("micro", "step")} == expected_deepspeed(stage, op, gas, d), rank
        assert {k: m[k] for k in ("micro", "step")} == expected_minizero(op, gas, m), rank
        if stage == 2:   # the pinned host buffers of that round trip, one per parameter in the partition, kept
            assert d["accumulated_grads_in_cpu"] == 2 * d["w"]
        elif stage == 1:
            assert d["accumulated_grads_in_cpu"] == 0
        assert m["losses"] == d["losses"], (rank, m["losses"], d["losses"])


if __name__ == "__main__":
    print(table(sys.argv[1] if len(sys.argv) > 1 else "micro"))
