"""A timeline of chosen training steps, rank by rank: every collective and every compute phase.

The ledger (comm.py) says how many bytes each collective moved; a class on ZeRO also needs
to *see* when: ZeRO-3 gathering each block just before its forward and again before its
backward, ZeRO-2 reduce-scattering a bucket while backward goes on, a rank idling in an
all-gather because another rank is still computing. This module records that, for the
optimizer steps you choose, as Chrome-trace JSON (open it in https://ui.perfetto.dev or
chrome://tracing): one file per rank, rank0.json, rank1.json, ..., and on rank 0 the merged
trace.json (every rank on one timeline) and timeline.png (timeline.py draws it).

Tracks, per rank:
  step         the step, and the engine's phases: forward, backward, step, and inside the
               step reduce_gradients, grad_norm, optimizer, after_step (the four parts of
               `_take_model_step`), all announced by the engine through comm.py's observer hook
  units        each unit's forward, backward, and recompute (activation checkpointing
               re-running a block's forward inside backward), announced by the engine while a
               tracer listens (observe/unit_marks.py). Units are ZeRO-3's: every block of the model's
               outermost ModuleList, and the root (unit.find_units)
  collectives  one event per collective: op, label (FlatParam or bucket), payload bytes,
               wire bytes and inter-node bytes (the wire bytes this rank sends to another
               node: all or none of them, comm.py) exactly as the ledger counts them, and
               wait_us, the part of it spent waiting for the last rank to arrive (drawn as a
               nested "wait")
  copies       ZeRO-Offload's device<->host copies (offload/host.py)
  memory       each rank's model-state bytes by kind and place at every event above
               (memory_track.py): Chrome-trace counters, so Perfetto draws them, and the
               samples themselves, with the event each was taken at, under the document's
               "memoryTrack" key ({rank: [samples]}), on the same clock

Each collective's args also say which ranks it ran among ("ranks", the ring in its order)
and its place in the step ("seq": the i-th collective or copy this rank issued); the
memory samples of its begin, blocking wait and end carry the same seq.

A unit's backward starts when the first gradient reaches its outputs and ends when the
gradients reach its inputs (observe/unit_marks.py says how); the root's inputs are token ids, which
get no gradient: its backward ends with the engine's.

Times: microseconds since the trace started, on one axis for all ranks: every rank
records its clock right after a barrier at the start of the first traced step (so ranks
agree to within the barrier's exit skew; on one host, microseconds). On a GPU, times are
CUDA events on the current stream, read once at the end of each traced step (a device
sync, only in traced steps): the timeline is when the GPU ran things, not when Python
queued them.

Waiting: a collective cannot finish before every rank has started it. At the end of each
traced step the ranks exchange when each of their collectives began (control traffic, not
in the ledger); the i-th collective's wait on rank r is (latest start among ranks) minus
(r's start), at most its duration. A rank with a large wait was idle, its peer was late.
An asynchronous collective (overlap_comm, prefetch, and the buckets that stage 0-2 issue back
to back at the step) runs from its issue to the end of its wait(), while the rank computes;
its wait is the time the rank spent blocked in wait(), and its args say "async": true. So the
time a rank could not compute for communication is a synchronous collective's whole event
plus an asynchronous one's wait.

Switch it on with `python -m minizero.train --trace DIR [--trace-steps 2 3]`, the config
section `"minizero_trace": {"enabled": true, "output_path": DIR, "steps": [2]}`, or around
code: `with trace.start(engine, DIR): ...` (every step inside the block).

The tracer is an observer of comm.py's hook and nothing else (the engine imports nothing
from here): it hears the engine's phases, each unit's phases, and each collective's begin,
blocking wait and end, and at each takes a memory sample (memory_track.MemoryTrack, driven
by the tracer so that it samples exactly the traced steps, at the tracer's own marks).
At close rank 0 also writes replay.html, the step replayed in a browser (minizero/replay/).
"""
from __future__ import annotations

import json
import os
import time
import weakref

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .. import comm
from . import unit_marks
from .memory_track import MemoryTrack

TRACKS = ("step", "units", "collectives", "copies", "memory")   # tid = index
_open_tracers: dict = {}   # id(engine) -> its open Tracer (one at a time per engine)
_last_tracer = weakref.WeakKeyDictionary()   # engine -> its latest Tracer, open or closed (tracer_of)


def start(engine, out_dir: str, steps=None) -> "Tracer":
    """Record a timeline of optimizer steps `steps` (1-based; None: every step until the
    tracer is closed) into out_dir. Use as `with trace.start(engine, DIR): ...`, or keep the
    tracer and call .close(); with `steps` it closes itself after the last one. A collective
    at the end of each traced step and at close: call on every rank."""
    return Tracer(engine, out_dir, steps)


def tracer_of(engine) -> "Tracer | None":
    """The latest tracer started on `engine` (open, or closed after its last step), or None:
    the trainer aims it and prints its table (train.py). The engine holds no reference to it."""
    return _last_tracer.get(engine)


class _Clock:
    """Marks on one axis for every rank: host perf_counter, or CUDA events (module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
        self.t0 = time.perf_counter()

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def us(self, m) -> float:
        """A mark in microseconds since start (CUDA: after the device has reached it)."""
        if self.cuda:
            return self.ref.elapsed_time(m) * 1e3
        return (m - self.t0) * 1e6

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Tracer:
    """Records the chosen optimizer steps (1-based; None: every step until close) of one engine."""

    def __init__(self, engine, out_dir: str, steps=None):
        if id(engine) in _open_tracers:
            raise RuntimeError("minizero: this engine is already tracing; close that trace first")
        self.engine, self.out_dir = engine, out_dir
        self.steps = None if steps is None else sorted({int(s) for s in steps})
        self.rank, self.world = comm.get_rank(), comm.get_world_size()
        self.clock = _Clock(engine.device)
        self.started = self.recording = self.closed = False
        self.events: list[dict] = []       # finished steps, microseconds
        self.ledger: dict[int, dict] = {}  # step -> the ledger's counts over that step
        self.traced_steps: list[int] = []
        os.makedirs(out_dir, exist_ok=True)
        self._phases: dict[str, object] = {}   # phase -> its begin mark, while open
        # the model-state samples, at the tracer's marks, of the traced steps only
        self.memory = MemoryTrack(engine, clock=self.clock.mark, subscribe=False)
        self.memory_events: list[dict] = []   # finished steps' samples, microseconds
        self._groups: dict = {}                # process group -> its ranks, in ring order
        _open_tracers[id(engine)] = self
        _last_tracer[engine] = self
        comm.subscribe(self)
        unit_marks.watch(engine)   # each unit's forward and backward, while the trace lives

    # ---------------------------------------------------------------- steps
    def wants(self, step: int) -> bool:
        return not self.closed and (self.steps is None or step in self.steps)

    def step_begins(self, step: int) -> None:
        """Called by the engine before the first forward of optimizer step `step` (1-based)."""
        if not self.wants(step):
            return
        if not self.started:   # one axis for all ranks: every rank starts its clock after a barrier
            comm.barrier()
            self.clock.start()
            self.started = True
        self.recording, self.step = True, step
        self._marks: list[tuple] = []      # (track, name, begin, end, args) of this step
        self._open: dict[tuple, tuple] = {}
        self._ledger_before = comm.ledger.snapshot()
        self._seq = 0                      # collectives and copies issued so far in this step
        self._samples_from = len(self.memory.events)
        self._step_begin = self.clock.mark()

    def step_ends(self, step: int) -> None:
        """Called by the engine after the engine.step() that ended optimizer step `step`."""
        if not self.recording:
            return
        end = self.clock.mark()
        self._close_open_backward(end)
        self.recording = False
        after = comm.ledger.snapshot()
        self.ledger[step] = {op: {k: after[op][k] - self._ledger_before[op][k] for k in after[op]}
                             for op in after}
        self._marks.append(("step", f"step {step}", self._step_begin, end, {"step": step}))
        self._settle(step)
        self.traced_steps.append(step)
        if self.steps is not None and step >= self.steps[-1]:
            self.close()

    # ---------------------------------------------------------------- comm.py's observer hook
    def phase_begins(self, name: str, engine) -> None:
        if engine is not self.engine:
            return
        if name == "forward" and engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            self.step_begins(engine.global_steps + 1)   # the first forward of an optimizer step
        if self.recording:
            self._phases[name] = mark = self.clock.mark()
            self._sample("phase_begins", mark, phase=name)

    def phase_ends(self, name: str, engine) -> None:
        if engine is not self.engine:
            return
        if self.recording and name in self._phases:
            mark = self.clock.mark()
            self.add_phase(name, self._phases.pop(name), mark)
            self._sample("phase_ends", mark, phase=name)
        if name == "step":   # the accumulation boundary's step: the optimizer step is done
            self.step_ends(engine.global_steps)

    # ---------------------------------------------------------------- what is recorded
    def _sample(self, event: str, mark, **fields) -> None:
        """A memory sample at `mark` (the trace event's own), in this step."""
        self.memory.sample(event, t=mark, step=self.step, **fields)

    def _ranks(self, group) -> list[int]:
        """The global ranks of `group` (None: all), in its ring's order."""
        if group not in self._groups:
            self._groups[group] = dist.get_process_group_ranks(group) if group is not None \
                else list(range(self.world))
        return self._groups[group]

    def add_phase(self, name: str, begin, end) -> None:
        self._marks.append(("step", name, begin, end, {}))
        if name == "backward":   # a unit whose inputs get no gradient (the root) ends here
            self._close_open_backward(end)

    def begin(self, op: str, label: str | None, tensor, nbytes: int, group):
        """comm.py's observer: a collective or copy starts. The token: [its start, when this rank
        began to block on it (an asynchronous one's wait), or None; does this rank send to
        another node on the collective's ring (comm.sends_across_nodes, as the ledger counts);
        its seq in the step; the ranks it runs among (a copy: this rank)]."""
        if not self.recording:
            return None
        collective = op in comm.OPS
        token = [self.clock.mark(), None, collective and comm.sends_across_nodes(group), self._seq,
                 self._ranks(group) if collective else [self.rank]]
        self._seq += 1
        self._sample("begin", token[0], op=op, label=label or "", seq=token[3], bytes=int(nbytes))
        return token

    def blocking(self, token) -> None:
        if token is not None:
            token[1] = self.clock.mark()
            self._sample("blocking", token[1], seq=token[3])

    def end(self, token, op, label, nbytes, wire_bytes, msg_bytes) -> None:
        if token is None:
            return
        track = "copies" if op in comm.COPIES else "collectives"
        args = {"op": op, "label": label or "", "bytes": int(nbytes), "wire_bytes": int(wire_bytes),
                "seq": token[3], "ranks": token[4]}
        if track == "collectives":   # the part of wire_bytes that leaves this rank's node (comm.py)
            args["inter_node_bytes"] = int(wire_bytes) if token[2] else 0
        if token[1] is not None:
            args["blocked_from"] = token[1]   # a mark until _settle makes it microseconds
        mark = self.clock.mark()
        self._marks.append((track, f"{op} {label}" if label else op, token[0], mark, args))
        self._sample("end", mark, op=op, label=label or "", seq=token[3], bytes=int(nbytes),
                     wire_bytes=int(wire_bytes))

    def unit_begins(self, engine, unit: str, kind: str) -> None:
        if engine is not self.engine or not self.recording:
            return
        mark = self.clock.mark()
        if kind == "backward":
            self._open.setdefault((unit, "backward"), ("backward", mark))
        else:
            self._open[(unit, "forward")] = (kind, mark)
        self._sample("unit_begins", mark, unit=unit, kind=kind)

    def unit_ends(self, engine, unit: str, kind: str) -> None:
        if engine is not self.engine or not self.recording:
            return
        mark = self.clock.mark()
        if kind == "backward":
            self._close_backward(unit, mark)
        elif (unit, "forward") in self._open:
            kind, begin = self._open.pop((unit, "forward"))
            self._marks.append(("units", f"{unit}.{kind}", begin, mark, {"unit": unit, "phase": kind}))
        self._sample("unit_ends", mark, unit=unit, kind=kind)

    def _close_backward(self, unit: str, end) -> None:
        if self.recording and (unit, "backward") in self._open:
            _, begin = self._open.pop((unit, "backward"))
            self._marks.append(("units", f"{unit}.backward", begin, end, {"unit": unit, "phase": "backward"}))

    def _close_open_backward(self, end) -> None:
        for unit, what in [k for k in self._open if k[1] == "backward"]:
            self._close_backward(unit, end)

    # ---------------------------------------------------------------- end of a step: times, waits
    def _settle(self, step: int) -> None:
        """Marks -> events in microseconds; every collective's wait, from all ranks' start times."""
        self.clock.settle()
        events = []
        for track, name, begin, end, args in self._marks:
            ts = self.clock.us(begin)
            args = dict(args, step=step)
            if "blocked_from" in args:   # asynchronous: issued at ts, this rank blocked on it from here
                args["blocked_from"] = self.clock.us(args["blocked_from"])
            events.append({"name": name, "cat": track, "ph": "X", "ts": ts, "dur": max(self.clock.us(end) - ts, 0.0),
                           "pid": self.rank, "tid": TRACKS.index(track), "args": args})
        colls = sorted((e for e in events if e["cat"] == "collectives"), key=lambda e: e["ts"])
        starts = [e["ts"] for e in colls]
        everyone = [starts]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, starts)
        if all(len(s) == len(starts) for s in everyone):
            for i, e in enumerate(colls):
                if "blocked_from" in e["args"]:
                    # asynchronous: the rank computed while it ran; it waited only inside wait()
                    since = min(max(e["args"].pop("blocked_from"), e["ts"]), e["ts"] + e["dur"])
                    wait, at = e["ts"] + e["dur"] - since, since
                    e["args"]["async"] = True
                else:
                    wait, at = min(max(max(s[i] for s in everyone) - e["ts"], 0.0), e["dur"]), e["ts"]
                e["args"]["wait_us"] = wait
                if wait > 0:
                    events.append({"name": "wait", "cat": "wait", "ph": "X", "ts": at, "dur": wait,
                                   "pid": self.rank, "tid": e["tid"], "args": {"step": step, "op": e["args"]["op"]}})
        elif self.rank == 0:   # ranks issued different collectives: no i-th pairing to compare
            print(f"minizero trace: step {step}: ranks issued {sorted({len(s) for s in everyone})} collectives; "
                  f"waits not computed (MINIZERO_DEBUG_COLLECTIVES=1 names the first difference)")
        self.events += sorted(events, key=lambda e: (e["ts"], -e["dur"]))
        samples = self.memory.events[self._samples_from:]
        del self.memory.events[self._samples_from:]   # the track keeps only what is still marks
        for s in samples:
            s["t"] = self.clock.us(s["t"])
        self.memory_events += samples

    # ---------------------------------------------------------------- files
    def document(self, events=None, memory=None) -> dict:
        """A Chrome-trace JSON object of `events` (default: this rank's), tracks named, with
        `memory` ({rank: samples}; default: this rank's) as counters and under "memoryTrack"."""
        events = self.events if events is None else events
        memory = {self.rank: self.memory_events} if memory is None else memory
        ranks = sorted({e["pid"] for e in events} | {self.rank})
        meta = []
        for r in ranks:
            meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
            meta += [{"name": "thread_name", "ph": "M", "pid": r, "tid": i, "args": {"name": t}}
                     for i, t in enumerate(TRACKS)]
        e = self.engine
        zero = e.config.zero
        return {"traceEvents": meta + events + counters(memory), "displayTimeUnit": "ms",
                "otherData": {"library": "minizero", "stage": e.zero_optimization_stage(), "dtype": str(e.dtype),
                              "world_size": self.world, "ranks_per_node": comm.ranks_per_node(),
                              "steps": self.traced_steps,
                              "ledger": {str(k): v for k, v in self.ledger.items()},
                              # what the paper's formulas beside the measured numbers need (minizero/replay/)
                              "params": sum(f["numel"] for f in e.layout()),
                              "element_bytes": torch.tensor([], dtype=e.dtype).element_size(),
                              "gradient_accumulation_steps": e.gradient_accumulation_steps(),
                              "hpz_partition_size": int(zero.zero_hpz_partition_size),
                              "hsdp_shard_size": int(zero.hsdp_shard_size)},
                "memoryTrack": {str(r): samples for r, samples in sorted(memory.items())}}

    def close(self, failed: bool | None = None) -> list[str]:
        """Write this rank's file; with all ranks here, rank 0 also writes the merged trace and
        the picture. Returns the paths written on this rank. Safe to call twice. While an
        exception propagates (`failed`; default: one is being handled), only the rank's own
        file is written: the other ranks may be gone, and the merge would wait for them."""
        import sys
        if failed is None:
            failed = sys.exc_info()[0] is not None
        if self.closed:
            return []
        self.closed = True
        self.recording = False   # a run that ended inside a traced step: keep what it recorded
        comm.unsubscribe(self)
        unit_marks.unwatch(self.engine)
        _open_tracers.pop(id(self.engine), None)
        paths = [self._write(f"rank{self.rank}.json", self.document())]
        if failed:
            return paths
        everyone = [(self.events, self.memory_events)]
        if self.world > 1:
            everyone = [None] * self.world if self.rank == 0 else None
            dist.gather_object((self.events, self.memory_events), everyone, dst=0)
        if self.rank == 0:
            merged = [ev for evs, _ in everyone for ev in evs]
            doc = self.document(merged, {r: samples for r, (_, samples) in enumerate(everyone)})
            paths.append(self._write("trace.json", doc))
            from .timeline import has_matplotlib, plot
            if merged and has_matplotlib():
                paths.append(plot(doc, os.path.join(self.out_dir, "timeline.png")))
            elif merged:   # the picture is optional (matplotlib comes with .[dev]); the trace is not
                print(f"minizero trace: no timeline.png (needs matplotlib: pip install -e .[dev], then "
                      f"python -m minizero.timeline {self.out_dir})")
            if merged:   # the page is a view of the files above: a problem with it loses none of them
                from ..replay.page import write_page
                try:
                    paths.append(write_page([doc], os.path.join(self.out_dir, "replay.html")))
                except (OSError, ValueError, KeyError) as e:
                    print(f"minizero trace: no replay.html ({e}); python -m minizero.replay {self.out_dir} "
                          f"writes it from the trace")
        return paths

    def _write(self, name: str, doc: dict) -> str:
        path = os.path.join(self.out_dir, name)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
        return path

    # ---------------------------------------------------------------- with trace.start(engine, DIR): ...
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
        return False


def counters(memory: dict) -> list[dict]:
    """Memory samples ({rank: samples}) as Chrome-trace counter events, one counter per place
    ("model states on device", ...) with a series per kind, so Perfetto draws each rank's
    stack over time. Every kind the rank ever held appears in each of its samples (0 where
    none), so each series is drawn as steps."""
    out = []
    for rank, samples in sorted(memory.items()):
        places: dict = {}
        for s in samples:
            for place, kinds in s["held"].items():
                places.setdefault(place, set()).update(kinds)
        for s in samples:
            for place, kinds in sorted(places.items()):
                args = {k: s["held"].get(place, {}).get(k, 0) for k in sorted(kinds)}
                out.append({"name": f"model states on {place} (bytes)", "cat": "memory", "ph": "C", "ts": s["t"],
                            "pid": rank, "tid": TRACKS.index("memory"), "args": args})
    return out
