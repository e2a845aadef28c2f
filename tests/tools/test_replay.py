"""The memory track (observe/memory_track.py) and the replay page (minizero/replay/), in a real browser.

Two traced runs of the micro image GPT, made once for the whole file: ZeRO-3 on 2 ranks (bf16,
2 micro-steps: masters, accumulated gradient shards) and ZeRO-3 with hpZ on 2 pretended nodes of
2 ranks (MINIZERO_RANKS_PER_NODE=2: secondary shards, gathers inside and across nodes). Each
rank also reads memory.held_bytes and engine.memory_breakdown at the moments the memory
comparison uses (runlog.MemoryMoments: after the step's last backward, after the step) and
engine.comm_stats() over the traced step. Checked:

- the memory track's sums by category at those moments equal held_bytes and, at the end of
  backward, memory_breakdown (hpZ's secondary shards included in all three);
  an untraced engine has no observer on its collectives;
- the page's data has every collective, copy and unit span of the trace;
- in headless Chromium (Playwright; skipped, with the line to install them, where either is
  missing): the page loads with the network off and asks for nothing; the collectives and
  units it draws are the trace's; its ledger at the end equals comm_stats() on every rank;
  its memory stacks at chosen events equal the memory track; a step forward and back lands
  on the same state; two runs side by side share one clock. With MINIZERO_REPLAY_SHOTS=DIR
  it saves three 1280 x 720 screenshots there (docs/img/replay_*.png are made so).

Cost: the two traced runs (about 2 s of rank time), the browser about 3 s.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from minizero.observe.memory_track import categories
from tests.support.harness import NO_DROPOUT, PatternBatches, make_config, micro_engine
from tests.support.browser import offline_chromium
from tests.support.launcher import run_ranks

STEP = 2   # the traced step, the last: the one MemoryMoments reads
CATS = ("params", "grads", "master_params", "optimizer_states")
RUNS = {   # name: (world size, dtype, micro-steps, zero_optimization extras, environment)
    "zero3": (2, "bf16", 2, {}, {}),
    "hpz": (4, "fp32", 1, {"zero_hpz_partition_size": 2}, {"MINIZERO_RANKS_PER_NODE": "2"}),
}
ON_DEMAND = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def _traced_run(out: str, dtype: str, gas: int, zero: dict) -> dict:
    """Rank function: ZeRO-3 (every unit gathered on use) for STEP steps, STEP traced into out;
    what the memory comparison reads at its two moments of STEP, and comm_stats over STEP."""
    from minizero import comm, memory
    from minizero.observe import trace
    engine, _ = micro_engine(make_config(3, dtype, micro_batch=2, lr=1e-2, gas=gas, zero={**ON_DEMAND, **zero}),
                             **NO_DROPOUT)
    untraced = list(comm._watchers)   # what each collective announces to without a trace
    trace.start(engine, out, steps=[STEP])
    world, rank = comm.get_world_size(), comm.get_rank()
    batches = PatternBatches(62, 16, global_batch=2 * world * gas, gas=gas)
    moments = {}
    for step in range(1, STEP + 1):
        before = engine.comm_stats()
        for micro in range(gas):
            _, loss = engine(*batches(step, micro, rank, world))
            engine.backward(loss)
            if micro == gas - 1:
                moments["after_backward"] = (memory.held_bytes(engine), engine.memory_breakdown())
            engine.step()
        moments["after_step"] = (memory.held_bytes(engine), engine.memory_breakdown())
    after = engine.comm_stats()
    return {"untraced": untraced, "after_close": list(comm._watchers), "moments": moments,
            "comm_stats": {op: {k: after[op][k] - before[op][k] for k in after[op]} for op in after}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: {"dir": trace folder, "ranks": per-rank results, "docs": per-rank trace documents}}."""
    out = {}
    for name, (world, dtype, gas, zero, env) in RUNS.items():
        folder = str(tmp_path_factory.mktemp("replay") / name)
        ranks = run_ranks(_traced_run, world, args=(folder, dtype, gas, zero), env=env)
        docs = []
        for r in range(world):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                docs.append(json.load(f))
        out[name] = {"dir": folder, "ranks": ranks, "docs": docs}
    return out


def _samples(doc: dict, rank: int) -> list[dict]:
    return [s for s in doc["memoryTrack"][str(rank)] if s["step"] == STEP]


def _last(samples: list[dict], event: str, phase: str) -> dict:
    return [s for s in samples if s["event"] == event and s.get("phase") == phase][-1]


def _split(d: dict) -> dict:
    """A breakdown's four categories and its device/host split (held_bytes adds "elements")."""
    return {k: d[k] for k in CATS + ("device", "host")}


# ----------------------------------------------------------------------------- the memory track

@pytest.mark.parametrize("name", list(RUNS))
def test_memory_track_equals_held_bytes_and_memory_breakdown(runs, name):
    run = runs[name]
    for rank, (r, doc) in enumerate(zip(run["ranks"], run["docs"])):
        assert r["untraced"] == [] and r["after_close"] == []   # no trace: nothing listens to a collective
        samples = _samples(doc, rank)
        held, layout = r["moments"]["after_backward"]
        at = _last(samples, "phase_ends", "backward")["held"]
        assert _split(categories(at)) == _split(held) == _split(layout), (name, rank)
        held, _ = r["moments"]["after_step"]
        assert _split(categories(_last(samples, "phase_ends", "step")["held"])) == _split(held)
        # the film, not just the end: a unit gathered during forward, the gradient buffer in backward
        kinds = {k for s in samples for k in s["held"].get("device", {})}
        assert {"params.gathered", "params.shard", "grads.buffer", "grads.shard", "optimizer_states"} <= kinds
        assert any(s["gathered"] for s in samples) and not samples[0]["gathered"]
        # each collective's begin and end samples carry its seq, as its trace event does
        colls = [e for e in doc["traceEvents"] if e.get("cat") in ("collectives", "copies")
                 and e["args"].get("step") == STEP]
        for event in ("begin", "end"):
            assert sorted(s["seq"] for s in samples if s["event"] == event) == list(range(len(colls)))
        assert sorted(e["args"]["seq"] for e in colls) == list(range(len(colls)))
    if name == "hpz":   # hpZ: the secondary shards, cut at each unit's release, held into the step
        secondary = [_last(_samples(d, i), "phase_ends", "backward")["held"]["device"].get("params.secondary", 0)
                     for i, d in enumerate(run["docs"])]
        assert all(b == secondary[0] > 0 for b in secondary)   # padded/k of each partitioned FlatParam
        assert "params.secondary" not in _last(_samples(run["docs"][0], 0), "phase_ends", "step")["held"]["device"]
    else:   # bf16: fp32 masters apart from the shards
        assert "master_params" in samples[0]["held"]["device"]


def test_memory_track_on_its_own():
    """One process: MemoryTrack(engine) subscribes while it is open and leaves nothing behind; its
    samples are in time order and tell the phases apart (peak); the end of backward's equals
    held_bytes read there."""
    from minizero import comm, memory
    from minizero.observe.memory_track import MemoryTrack, total
    engine, _ = micro_engine(make_config(3, "bf16", micro_batch=2, lr=1e-2, zero=ON_DEMAND), **NO_DROPOUT)
    x, y = PatternBatches(62, 16, global_batch=2)(1, 0, 0, 1)
    assert comm._watchers == ()
    with MemoryTrack(engine) as track:
        assert comm._watchers == (track,)
        _, loss = engine(x, y)
        engine.backward(loss)
        held = memory.held_bytes(engine)
        engine.step()
    assert comm._watchers == () and track not in comm.observers
    times = [s["t"] for s in track.events]
    assert times == sorted(times) and {s["step"] for s in track.events} == {1}
    assert [s["event"] for s in track.events[:2]] == ["phase_begins", "unit_begins"]
    end = track.last("phase_ends", phase="backward")
    assert _split(categories(end["held"])) == _split(held)
    forward, backward = track.peak("forward"), track.peak("backward")
    assert "params.gathered" in forward and "grads.param" not in forward
    assert {"params.gathered", "grads.param", "grads.buffer"} <= set(backward)
    assert sum(backward.values()) > total(end["held"], "device")   # the gathered units and .grads are gone by then
    assert track.peak("no such phase") == {}


def test_memory_track_places_host_and_nvme(tmp_path):
    """One process, ZeRO-3 with both offloads to NVMe files: the parameter shards live in host
    memory, and between uses the shards, masters and moments wait in their files, which the
    samples count under "nvme", as held_bytes does."""
    from minizero import memory
    from minizero.observe.memory_track import MemoryTrack
    where = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {**ON_DEMAND, "offload_optimizer": dict(where), "offload_param": dict(where)}
    engine, _ = micro_engine(make_config(3, "bf16", micro_batch=2, lr=1e-2, zero=zero), **NO_DROPOUT)
    batches = PatternBatches(62, 16, global_batch=2)
    try:
        with MemoryTrack(engine) as track:
            for step in (1, 2):
                _, loss = engine(*batches(step, 0, 0, 1))
                engine.backward(loss)
                engine.step()
                if step == 1:
                    held = memory.held_bytes(engine)   # (it waits for the step's writes to their files)
                    first = len(track.events)
    finally:
        engine.destroy()
    resting = track.events[first]["held"]   # step 2's first sample: nothing moved since held_bytes
    assert track.events[first]["event"] == "phase_begins"
    assert {"params.shard", "master_params", "optimizer_states"} <= set(resting["nvme"])
    assert resting.keys() == {"nvme"}   # nothing on the device or in host memory between steps
    assert {k: v for k, v in categories(resting).items() if k != "host"} == \
        {k: v for k, v in _split(held).items() if k != "host"} | {"nvme": held["nvme"]}
    gathering = [s for s in track.events if s["event"] == "begin" and s.get("op") == "h2d"]
    assert gathering and all("params.shard" in s["held"]["host"] for s in gathering)   # read back for the gather


def test_page_data_has_every_event_of_the_trace(runs):
    from minizero.replay.build import load, run_data
    for name, run in runs.items():
        data = run_data(load(run["dir"]), name)
        for rank, doc in enumerate(run["docs"]):
            xs = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["args"].get("step") == STEP]
            for cat, key in (("collectives", lambda c: not c["copy"]), ("copies", lambda c: c["copy"])):
                assert len([e for e in xs if e["cat"] == cat]) == \
                    len([c for c in data["colls"] if c["r"] == rank and key(c)])
            assert len([e for e in xs if e["cat"] == "units"]) == \
                len([s for s in data["spans"] if s["r"] == rank and not s["phase"]])
            assert len(data["samples"][str(rank)]) == len(_samples(doc, rank))
        assert len(data["moments"]) == sum(len(v) for v in data["samples"].values())
        for c in data["colls"]:
            assert 0 <= c["m0"] < c["m1"] < len(data["moments"])
        ranks = {tuple(c["ranks"]) for c in data["colls"] if c["op"] == "all_gather"}
        world = len(run["docs"])
        assert ranks == ({(0, 1), (2, 3), (0, 1, 2, 3)} if name == "hpz" else {tuple(range(world))})


def test_replay_command(runs, tmp_path, capsys):
    """python -m minizero.replay: a trace folder, a run folder naming its trace, two runs; bad input
    is one line."""
    from minizero.replay.replay import main
    z3, hpz = runs["zero3"]["dir"], runs["hpz"]["dir"]
    assert main([z3, "--out", str(tmp_path / "one.html")]) == 0
    assert "bytes, written in" in capsys.readouterr().out
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"config": {"minizero_trace": {"output_path": hpz}}}))
    assert main([str(run_dir), z3, "--names", "hpZ", "ZeRO-3", "--out", str(tmp_path / "two.html")]) == 0
    text = (tmp_path / "two.html").read_text()
    assert "hpZ: minizero ZeRO-3 + hpZ (k = 2)" in text
    assert not re.search(r"<link|@import|(src|href)\s*=|url\((?!#)", text)   # everything inline
    (tmp_path / "untraced").mkdir()
    (tmp_path / "untraced" / "summary.json").write_text(json.dumps({"config": {}}))
    capsys.readouterr()
    assert main([str(tmp_path / "untraced")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "was not traced (run it with --trace DIR)" in err
    assert main([z3, "--step", "1", "--out", str(tmp_path / "x.html")]) == 2
    assert "step 1 was not traced; the trace holds step 2" in capsys.readouterr().err


# ----------------------------------------------------------------------------- in a browser

@pytest.fixture(scope="module")
def browser():
    """One headless Chromium, offline, for every page of the file (tests/support/browser.py);
    yields (context, requests): every URL any page asked for."""
    with offline_chromium("replay-chromium-") as (context, requests):
        yield context, requests


def _wait(page, condition: str, seconds: float = 10.0) -> None:
    """Poll `condition` (page.wait_for_function evaluates a string, which the page's policy forbids)."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(f"() => {condition}"):
        assert time.monotonic() < deadline, f"the page never reached: {condition}"
        page.wait_for_timeout(20)


def _open(context, requests, path: str):
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    url = "file://" + os.path.abspath(path)
    before = len(requests)
    page.goto(url)
    _wait(page, "window.replay !== undefined")
    assert errors == [], errors
    assert requests[before:] == [url], requests[before:]          # nothing but the page itself
    assert page.evaluate("window.replay.blocked") == []          # nor anything its policy stopped
    return page


def _expected_stacks(doc_samples: dict, index: int) -> dict:
    """(rank, place, kind) -> bytes that the memory track says each rank holds at the page's
    moment `index`: every rank's samples in time order, each rank's latest at or before it."""
    order = sorted((s["t"], r, i) for r, samples in doc_samples.items() for i, s in enumerate(samples))
    latest = {r: samples[0] for r, samples in doc_samples.items()}
    for _, r, i in order[:index + 1]:
        latest[r] = doc_samples[r][i]
    return {(r, p, k): b for r, s in latest.items() for p, kinds in s["held"].items() for k, b in kinds.items() if b}


def _expected_ledger(doc_samples: dict, xs: list[dict], rank: int, index: int) -> dict:
    """{op: {calls, bytes, wire_bytes}} of `rank`'s collectives and copies whose end sample comes
    at or before the page's moment `index` (the trace's events, matched to their samples by seq)."""
    order = sorted((s["t"], r, i) for r, samples in doc_samples.items() for i, s in enumerate(samples))
    ended = {doc_samples[r][i]["seq"] for _, r, i in order[:index + 1]
             if r == rank and doc_samples[r][i]["event"] == "end"}
    out: dict = {}
    for e in xs:
        if e["pid"] == rank and e["cat"] in ("collectives", "copies"):
            row = out.setdefault(e["args"]["op"], {"calls": 0, "bytes": 0, "wire_bytes": 0})
            if e["args"]["seq"] in ended:
                row["calls"] += 1
                row["bytes"] += e["args"]["bytes"]
                row["wire_bytes"] += e["args"]["wire_bytes"]
    return out


def _shown_ledger(page, run: int = 0) -> dict:
    rows = page.eval_on_selector_all(f".ledger[data-run='{run}'] tbody tr[data-op] td[data-field]",
                                     "tds => tds.map(td => [td.parentElement.dataset.op, td.dataset.field, "
                                     "+td.dataset.value])")
    shown: dict = {}
    for op, field, value in rows:
        shown.setdefault(op, {})[field] = value
    return shown


def _shown_stacks(page) -> dict:
    segs = page.eval_on_selector_all(".run[data-run='0'] .seg", "els => els.map(e => [e.dataset.rank, "
                                                                  "e.dataset.place, e.dataset.kind, +e.dataset.bytes])")
    return {(int(r), p, k): b for r, p, k, b in segs if b}


def _state(page) -> str:
    return page.evaluate("document.getElementById('runs').innerHTML + document.getElementById('caption').innerHTML")


def _moment(page, run: int, rank: int, event: str, **fields) -> int:
    """The page's index of the first moment of `run` on `rank` whose sample matches."""
    return page.evaluate("""([run, rank, event, fields]) => {
        const data = JSON.parse(document.getElementById('replay-data').textContent).runs[run];
        return window.replay.moments.findIndex(([, k, li]) => {
            if (k !== run) return false;
            const [, r, si] = data.moments[li];
            const s = data.samples[r][si];
            return r === rank && s.event === event &&
                Object.entries(fields).every(([f, v]) => f === 'label_end' ? (s.label || '').endsWith(v) : s[f] === v);
        });
    }""", [run, rank, event, fields])


@pytest.mark.parametrize("name", list(RUNS))
def test_page_in_a_browser(runs, browser, name):
    context, requests = browser
    run = runs[name]
    page = _open(context, requests, os.path.join(run["dir"], "replay.html"))
    docs, world = run["docs"], len(run["docs"])
    xs = [e for d in docs for e in d["traceEvents"] if e.get("ph") == "X" and e["args"].get("step") == STEP]
    # what it draws is the trace's: every collective, copy and unit span, rank by rank
    for selector, cat in ((".gantt .coll", "collectives"), (".gantt .copy", "copies"), (".gantt .unit", "units")):
        for r in range(world):
            shown = page.locator(f"{selector}[data-rank='{r}']").count()
            assert shown == len([e for e in xs if e["cat"] == cat and e["pid"] == r]), (selector, r)
    assert page.locator(".gantt .coll").count() > 0 and page.locator(".gantt .unit").count() > 0
    count = page.evaluate("window.replay.count")
    samples = {r: _samples(d, r) for r, d in enumerate(docs)}
    assert count == sum(len(s) for s in samples.values())
    # the memory stacks at chosen events are the memory track's
    chosen = {0, count - 1, count // 3, _moment(page, 0, world - 1, "end", op="all_gather", label_end=".fwd"),
              _moment(page, 0, 0, "begin", op="reduce_scatter"), _moment(page, 0, 0, "phase_ends", phase="backward")}
    assert -1 not in chosen
    for i in sorted(chosen):
        page.evaluate(f"window.replay.go({i})")
        assert _shown_stacks(page) == _expected_stacks(samples, i), (name, i)
        shown = {op: {k: v for k, v in row.items() if k != "inter_node_bytes"} for op, row in _shown_ledger(page).items()}
        assert shown == _expected_ledger(samples, xs, 0, i), (name, i)   # the running ledger, rank 0's
        # one step forward and one back (at the end: back and forward): the same state
        state = _state(page)
        there, back = ("ArrowRight", "ArrowLeft") if i < count - 1 else ("ArrowLeft", "ArrowRight")
        page.keyboard.press(there)
        assert _state(page) != state
        page.keyboard.press(back)
        assert _state(page) == state and page.evaluate("window.replay.index()") == i
    # at the end, each rank's ledger is comm_stats() over the step
    page.keyboard.press("End")
    for r, res in enumerate(run["ranks"]):
        page.evaluate(f"window.replay.ledgerRank(0, {r})")
        shown = _shown_ledger(page)
        other = docs[0]["otherData"]
        nodes = other["world_size"] // other["ranks_per_node"]   # the inter-node column: on several nodes only
        expected = {op: {k: v for k, v in s.items() if k != "inter_node_bytes" or nodes > 1}
                    for op, s in res["comm_stats"].items() if s["calls"]}
        assert shown == expected, (name, r)
    assert page.locator(".ledger .paper").count() > 0     # the paper's column, at the step's end only
    page.keyboard.press("Home")
    assert page.locator(".ledger .paper").count() == 0
    # playing moves on by itself; Space stops it
    page.keyboard.press("Space")
    _wait(page, "window.replay.index() > 2")
    page.keyboard.press("Space")
    assert page.evaluate("document.body.dataset.playing") == "no"
    shots = os.environ.get("MINIZERO_REPLAY_SHOTS")
    if shots and name == "zero3":
        page.evaluate("window.replay.ledgerRank(0, 0)")
        # the moments every rank has reached: block 1 gathered for its forward, its gradients' reduce-scatter
        gathered = max(_moment(page, 0, r, "end", op="all_gather", label_end="blocks.1.g1.fwd") for r in range(world))
        scatter = max(_moment(page, 0, r, "begin", op="reduce_scatter", label_end="blocks.1.g0.grads") for r in range(world))
        for what, i in (("forward_gather", gathered), ("backward_reduce_scatter", scatter), ("step", count - 1)):
            page.evaluate(f"window.replay.go({i})")
            path = os.path.join(shots, f"replay_{what}.png")
            page.screenshot(path=path)
            from PIL import Image   # a palette of 256 colours: the page has fewer, the file a third the size
            Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    page.close()


def test_two_runs_side_by_side_on_one_clock(runs, browser, tmp_path):
    """Plain ZeRO-3 beside hpZ: both panels, every moment of both in one order by time since
    each step began, and each run's own ledger at the end."""
    from minizero.replay.build import load
    from minizero.replay.page import write_page
    context, requests = browser
    path = write_page([load(runs["zero3"]["dir"]), load(runs["hpz"]["dir"])], str(tmp_path / "both.html"),
                      ["ZeRO-3", "hpZ"])
    page = _open(context, requests, path)
    assert page.locator(".run").count() == 2
    times = page.evaluate("window.replay.moments.map(m => m[0])")
    assert times == sorted(times)
    assert len(times) == sum(len(_samples(d, r)) for run in runs.values() for r, d in enumerate(run["docs"]))
    page.keyboard.press("End")
    for k, name in enumerate(("zero3", "hpz")):
        calls = page.eval_on_selector_all(f".ledger[data-run='{k}'] tr.total td[data-field='calls']",
                                          "tds => tds.map(td => td.textContent)")
        assert calls == [str(sum(s["calls"] for s in runs[name]["ranks"][0]["comm_stats"].values()))]
    page.close()
