"""The timeline trace (minizero/observe/trace.py) and DeepSpeed's comms summary (comms_logger.py).

Checked on 2 gloo ranks, a 2-block GPT, at every stage:
- every collective of a traced step is one event, and the events' payload and wire bytes
  summed per op equal engine.comm_stats() over the same step exactly (the ledger's counts);
- each unit's forward and backward appear, recompute too with activation checkpointing;
- waits are within [0, duration] and the merged trace has every rank;
- each collective names its ring (the ranks of its group) and its seq in the step, and the
  memory track (memory_track.py) has a sample at its begin and end, and at every phase, at
  the trace's own marks, also as Perfetto counters (tests/tools/test_replay.py checks the
  samples' bytes);
- losses are bit-identical with tracing on and off (the marks are identity functions);
- the comms logger's counts equal the ledger's calls, its table is DeepSpeed's format, and
  its bandwidths are DeepSpeed's formulas.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from minizero.observe import trace, unit_marks
from tests.support.harness import NO_DROPOUT, PatternBatches, make_config, make_model, micro_engine, train_step
from tests.support.launcher import run_ranks

STEPS, TRACED = 3, (2, 3)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _run(stage: int, out_dir: str | None, dtype: str = "fp32", gas: int = 2, ckpt: bool = False,
         comms_logger: bool = False, offload: bool = False, overlap: bool = False):
    """Train STEPS steps; trace TRACED into out_dir (None: no trace). Returns the losses, the
    ledger's counts over each step as engine.comm_stats() gives them, and the comms summary."""
    from minizero import comm

    # ZeRO-3 on demand (prefetch and reuse off): every unit gathered before each use
    zero = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0} if stage == 3 else {}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if overlap:   # asynchronous reductions, and at ZeRO-3 DeepSpeed's prefetch and reuse
        zero.update(overlap_comm=True, reduce_bucket_size=3000, stage3_prefetch_bucket_size=50_000_000,
                    stage3_max_reuse_distance=1_000_000_000)
    cfg = make_config(stage, dtype, micro_batch=2, lr=1e-2, gas=gas, ckpt=ckpt, zero=zero)
    if comms_logger:
        cfg["comms_logger"] = {"enabled": True}
    engine, _ = micro_engine(cfg, **NO_DROPOUT)
    tracer = trace.start(engine, out_dir, steps=TRACED) if out_dir else None
    batches = PatternBatches(62, 16, global_batch=2 * 2 * gas, gas=gas)
    losses, per_step = [], {}
    for step in range(1, STEPS + 1):
        before = engine.comm_stats()
        losses += train_step(engine, batches, step, gas)
        after = engine.comm_stats()
        per_step[step] = {op: {k: after[op][k] - before[op][k] for k in after[op]} for op in after}
    summary = comm.log_summary(return_dict=True)["summary"] if comms_logger else None
    return {"losses": losses, "per_step": per_step, "closed": tracer.closed if tracer else None,
            "summary": summary}


def _events(doc, cat=None, step=None):
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and (cat is None or e["cat"] == cat)
            and (step is None or e["args"].get("step") == step)]


def _run_each(runs):
    """_run(*args, **kwargs) for each (args, kwargs) of `runs`, one after the other on these
    ranks: each its own engine from its own seed, its tracer closed after its last step
    before the next run starts."""
    return [_run(*args, **kwargs) for args, kwargs in runs]


def _traced_runs(folder, stages, **kwargs) -> dict:
    """{stage: (its trace folder, each rank's _run)}: the stages' runs in one launch."""
    outs = {stage: str(folder / f"trace{stage}") for stage in stages}
    per_rank = run_ranks(_run_each, 2, ([((stage, outs[stage]), kwargs) for stage in stages],))
    return {stage: (outs[stage], [r[i] for r in per_rank]) for i, stage in enumerate(stages)}


@pytest.fixture(scope="module")
def ledger_runs(tmp_path_factory):
    return _traced_runs(tmp_path_factory.mktemp("ledger"), (0, 1, 2, 3))


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    return _traced_runs(tmp_path_factory.mktemp("overlap"), (2, 3), overlap=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trace_events_equal_the_ledger(stage, ledger_runs):
    out, results = ledger_runs[stage]
    assert all(r["closed"] for r in results)          # closed itself after its last step
    assert sorted(os.listdir(out)) == ["rank0.json", "rank1.json", "replay.html", "timeline.png", "trace.json"]
    for rank, r in enumerate(results):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            doc = json.load(f)
        assert doc["otherData"]["steps"] == list(TRACED)
        for step in TRACED:
            events = _events(doc, "collectives", step)
            for op in OPS:
                mine = [e for e in events if e["args"]["op"] == op]
                ledger = r["per_step"][step][op]
                assert len(mine) == ledger["calls"], (stage, rank, step, op)
                assert sum(e["args"]["bytes"] for e in mine) == ledger["bytes"]
                assert sum(e["args"]["wire_bytes"] for e in mine) == ledger["wire_bytes"]
            for e in events:
                assert 0.0 <= e["args"]["wait_us"] <= e["dur"]
            assert doc["otherData"]["ledger"][str(step)] == r["per_step"][step]
            units = {e["name"] for e in _events(doc, "units", step)}
            for unit in ("blocks.0", "blocks.1", "root"):
                assert {f"{unit}.forward", f"{unit}.backward"} <= units, (stage, units)
            phases = [e["name"] for e in _events(doc, "step", step)]
            for p in ("forward", "backward", "step", "reduce_gradients", "grad_norm", "optimizer", "after_step"):
                assert p in phases
            assert phases.count("forward") == 2            # gas 2: two micro-steps in one optimizer step
            # each collective's ring (its group's ranks) and place in the step; the memory track
            # sampled its begin and end, and every phase and unit event, at the same marks
            assert [e["args"]["seq"] for e in sorted(events, key=lambda e: e["ts"])] == list(range(len(events)))
            assert all(e["args"]["ranks"] == [0, 1] for e in events)
            samples = [s for s in doc["memoryTrack"][str(rank)] if s["step"] == step]
            at = {(s["event"], s.get("seq")): s["t"] for s in samples}
            for e in events:
                assert at[("begin", e["args"]["seq"])] == e["ts"]
                assert abs(at[("end", e["args"]["seq"])] - (e["ts"] + e["dur"])) < 1e-6
            starts = [s for s in samples if s["event"] == "phase_begins"]
            assert [s["phase"] for s in starts] == [p for p in phases if p != f"step {step}"]
            assert len([s for s in samples if s["event"] == "unit_begins"]) >= len(_events(doc, "units", step))
            counters = [e for e in doc["traceEvents"] if e.get("ph") == "C" and e["args"] and e["ts"] in
                        {s["t"] for s in samples}]
            assert len(counters) == len(samples)   # Perfetto's memory counter: one per sample (device only here)
        assert not _events(doc, step=1)                    # step 1 was not chosen
    with open(os.path.join(out, "trace.json")) as f:
        merged = json.load(f)
    assert {e["pid"] for e in _events(merged)} == {0, 1}
    # the ZeRO-3 picture: each block gathered for forward and again for backward
    if stage == 3:
        labels = [e["args"]["label"] for e in _events(doc, "collectives", 2) if e["args"]["op"] == "all_gather"]
        ends = [label.rsplit(".", 1)[1] for label in labels]
        assert ends.count("fwd") == ends.count("bwd") == 2 * 3 * 2   # 2 micro-steps x 3 units x 2 param groups


def test_trace_does_not_change_numbers_and_sees_recompute(tmp_path):
    out = str(tmp_path / "trace")
    traced = run_ranks(_run, 2, args=(3, out), kwargs=dict(dtype="bf16", ckpt=True))
    plain = run_ranks(_run, 2, args=(3, None), kwargs=dict(dtype="bf16", ckpt=True))
    assert [r["losses"] for r in traced] == [r["losses"] for r in plain]       # bitwise
    assert [r["per_step"] for r in traced] == [r["per_step"] for r in plain]   # same collectives
    with open(os.path.join(out, "rank0.json")) as f:
        doc = json.load(f)
    names = {e["name"] for e in _events(doc, "units", 2)}
    assert {"blocks.0.recompute", "blocks.1.recompute", "blocks.0.backward"} <= names
    labels = {e["args"]["label"].rsplit(".", 1)[1] for e in _events(doc, "collectives", 2)
              if e["args"]["op"] == "all_gather"}
    assert "recompute" in labels


@pytest.mark.parametrize("stage", [2, 3])
def test_asynchronous_collectives_wait_only_where_the_rank_blocked(stage, overlap_runs):
    """With overlap (and prefetch) a collective runs from its issue to the end of its wait();
    its wait_us is the time the rank blocked in wait(), inside the event; bytes still sum to
    the ledger's."""
    out, (r, _) = overlap_runs[stage]
    with open(os.path.join(out, "rank0.json")) as f:
        doc = json.load(f)
    events = _events(doc, "collectives", 2)
    for op in OPS:
        assert sum(e["args"]["bytes"] for e in events if e["args"]["op"] == op) == r["per_step"][2][op]["bytes"]
    waits = {(e["ts"], e["args"]["op"]): e for e in _events(doc, "wait", 2)}
    for e in events:
        assert 0.0 <= e["args"]["wait_us"] <= e["dur"] + 1e-6
        assert "blocked_from" not in e["args"]
    # overlap's reductions (and the gathers after the step, issued back to back) say so
    assert {e["args"]["op"] for e in events if e["args"].get("async")} >= {"reduce_scatter", "all_gather"}
    for w in waits.values():
        assert any(c["ts"] - 1e-6 <= w["ts"] and w["ts"] + w["dur"] <= c["ts"] + c["dur"] + 1e-6 for c in events)
    labels = [e["args"]["label"] for e in events]
    if stage == 3:
        assert any(label.endswith(".prefetch") for label in labels)


def test_trace_shows_offload_copies(tmp_path):
    out = str(tmp_path / "trace")
    r = run_ranks(_run, 2, args=(2, out), kwargs=dict(gas=1, offload=True))[0]
    with open(os.path.join(out, "rank0.json")) as f:
        doc = json.load(f)
    for op in ("d2h", "h2d"):
        mine = [e for e in _events(doc, "copies", 2) if e["args"]["op"] == op]
        assert mine and len(mine) == r["per_step"][2][op]["calls"]
        assert sum(e["args"]["bytes"] for e in mine) == r["per_step"][2][op]["bytes"]
    # the memory track: the optimizer's masters and moments in host memory, a counter for each place
    samples = doc["memoryTrack"]["0"]
    assert all(set(s["held"]["host"]) == {"master_params", "optimizer_states"} for s in samples)
    assert {e["name"] for e in doc["traceEvents"] if e.get("ph") == "C"} == \
        {"model states on device (bytes)", "model states on host (bytes)"}


def test_engine_trace_context_manager_single_rank(tmp_path):
    """One process: `with trace.start(engine, DIR)` records every step inside the block."""
    import minizero

    cfg = make_config(0, micro_batch=2, lr=1e-2)
    model = make_model("micro")
    engine, *_ = minizero.initialize(model=model, config=cfg)
    batches = PatternBatches(62, 8, global_batch=2)
    out = str(tmp_path / "t")
    with trace.start(engine, out):
        for step in (1, 2):
            x, y = batches(step, 0, 0, 1)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    with open(os.path.join(out, "trace.json")) as f:
        doc = json.load(f)
    assert doc["otherData"]["steps"] == [1, 2]
    assert os.path.exists(os.path.join(out, "timeline.png"))
    first = trace.start(engine, out, steps=[5])
    try:
        with pytest.raises(RuntimeError, match="already tracing"):
            trace.start(engine, out, steps=[6])
    finally:
        first.close()   # a tracer left open listens to every later engine of this process


# ----------------------------------------------------------------------------- comms logger

def test_comms_logger_counts_and_table():
    r = run_ranks(_run, 2, args=(1, None), kwargs=dict(comms_logger=True))[0]
    s = r["summary"]
    total = {op: sum(r["per_step"][k][op]["calls"] for k in r["per_step"]) for op in OPS}
    from minizero.observe.comms_logger import OP_NAMES
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert sum(v["count"] for v in s[OP_NAMES[op]].values()) == total[op]
    # the initial broadcast of the weights came before the first step
    assert "broadcast" in s


def test_calc_bw_is_deepspeeds():
    """The bandwidth formulas, checked against numbers worked by hand from DeepSpeed's
    calc_bw_log: S bytes in t ms at N ranks, Gbps = bytes/ms * 8 / 1e6."""
    from minizero.observe.comms_logger import calc_bw, convert_size, format_table, trim_mean
    assert calc_bw("all_gather_into_tensor", 1000, 2.0, 4) == (4000 / 2.0 * 8 / 1e6, 4000 / 2.0 * 0.75 * 8 / 1e6)
    assert calc_bw("reduce_scatter_tensor", 1000, 2.0, 4)[0] == 4000 / 2.0 * 8 / 1e6
    assert calc_bw("all_reduce", 1000, 2.0, 4) == (2000 / 2.0 * 8 / 1e6, 500 * 1.5 * 8 / 1e6)
    assert calc_bw("broadcast", 1000, 2.0, 4) == (500 * 8 / 1e6, 500 * 8 / 1e6)
    assert convert_size(0) == "0B" and convert_size(1536) == "1.5 KB" and convert_size(3 * 2**20) == "3.0 MB"
    assert trim_mean([100.0] + [1.0] * 8 + [-100.0]) == 1.0      # 10% off each end
    table = format_table({"all_reduce": {8: {"count": 3, "total_latency_ms": 1.5, "avg_latency_ms": 0.5,
                                             "tput_avg_gbps": 0.01, "busbw_avg_gbps": 0.01}}})
    head, name, row = table.splitlines()
    assert head.startswith("Comm. Op            Message Size        Count")
    assert name == "all_reduce" and row.split() == ["8.0", "B", "3", "1.50", "0.50", "0.01", "0.01"]


def test_comms_logger_config_errors():
    from minizero.config import ConfigError, load_config
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="minizero issues only"):
        load_config(dict(base, comms_logger={"prof_ops": ["all_to_all"]}), 1)
    with pytest.raises(ConfigError, match="unknown config key 'comms_logger.enable'"):
        load_config(dict(base, comms_logger={"enable": True}), 1)
    with pytest.raises(ConfigError, match="minizero_trace.steps"):
        load_config(dict(base, minizero_trace={"steps": [0]}), 1)


def test_without_matplotlib_the_trace_is_written_and_the_picture_is_skipped(tmp_path, monkeypatch, capsys):
    """A base install (`pip install -e .`) has no matplotlib: the trace files are written, the
    run goes on, and one line says how to draw timeline.png later."""
    import minizero
    from minizero.observe import timeline

    monkeypatch.setattr(timeline, "has_matplotlib", lambda: False)
    engine, *_ = minizero.initialize(model=make_model("micro"), config=make_config(0, micro_batch=2, lr=1e-2))
    out = str(tmp_path / "t")
    with trace.start(engine, out):
        x, y = PatternBatches(62, 8, global_batch=2)(1, 0, 0, 1)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    assert sorted(os.listdir(out)) == ["rank0.json", "replay.html", "trace.json"]
    assert "no timeline.png (needs matplotlib" in capsys.readouterr().out
    assert timeline.main([out]) == 2


def test_the_trace_only_listens_it_patches_nothing(tmp_path):
    """One process: while a trace is open the engine's objects keep their own methods, and
    the unit hooks the engine put on for it are gone at the first forward after it closes."""
    import minizero
    from minizero.observe import trace
    from tests.support.harness import make_model
    torch.manual_seed(0)
    model = make_model("micro", "gpt", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}}
    engine = minizero.initialize(model=model, config=cfg)[0]
    x = torch.randint(0, model.tok_emb.num_embeddings, (2, 8))

    def step():
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    owned = {id(o): dict(vars(o)) for o in (engine.zero, engine.sharded_optimizer)}
    with trace.start(engine, str(tmp_path)):
        step()
        assert unit_marks.watched(engine)                        # on while the trace listens
        for o in (engine.zero, engine.sharded_optimizer):
            assert set(vars(o)) == set(owned[id(o)]), "an attribute appeared on a core object"
            assert not any(callable(v) and k in type(o).__dict__ for k, v in vars(o).items())
        assert not hasattr(engine, "tracer")
    step()
    from minizero import comm
    assert not unit_marks.watched(engine), comm.observers
    events = json.load(open(tmp_path / "rank0.json"))["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "step"}
    assert {"forward", "backward", "reduce_gradients", "grad_norm", "optimizer", "after_step"} <= names
    assert any(e.get("cat") == "units" and e["name"] == "blocks.0.backward" for e in events)
