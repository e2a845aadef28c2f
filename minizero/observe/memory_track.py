"""Each rank's model-state memory as a step goes on: a sample at every event that can change it.

`engine.memory_breakdown()` is one number per category, the layout's; `memory.held_bytes`
reads the engine's buffers at one moment. A class watching ZeRO-3 wants the film: a unit's
full parameters appearing at its gather and gone at its release, the gradient buffer of a
bucket filling before its reduce-scatter and freed after it, the reduced shards piling up
to the step, hpZ's secondary shards cut at the first release and dropped after the step.
This observer takes that film. Subscribed through comm.py's observer seam (nothing patched,
nothing in the core knows it), it reads the engine's buffers at each event the engine and
comm announce (its phases, each unit's forward/recompute/backward, the begin, blocking wait
and end of every collective and host copy) and keeps one sample per event:

    {"t": microseconds, "event": "begin", "op": "all_gather", "label": "blocks.0.g0.fwd",
     "step": 2, "held": {"device": {"params.gathered": 3264, "params.shard": 1632, ...}, "host": {...}},
     "gathered": ["blocks.0.g0", "root.g0"]}

"gathered" names the partitioned FlatParams whose full buffer is allocated at that moment
(ZeRO-3's units between gather and release; the rest of the model is always whole).

The kinds (KINDS), each storage counted once, in the first kind that holds it, in the order
memory.held_bytes claims them (params, master_params, optimizer_states, grads), so the sums
by category (`categories`) are held_bytes' numbers at every moment:

    params.gathered     full parameter buffers allocated now (ZeRO-0/1/2 and persistent ones
                        always; a ZeRO-3 unit between its gather and its release)
    params.shard        this rank's parameter shards with storage of their own (ZeRO-3; a
                        ZeRO-0/1/2 shard is a view of the gathered buffer, counted there)
    params.secondary    hpZ's secondary shards (sharding.py), from a unit's first release to
                        the step. held_bytes does not read them; memory_breakdown counts them
    master_params       fp32 masters kept apart from the shards (bf16/fp16, or offloaded)
    optimizer_states    Adam's moments
    grads.shard         reduced gradient shards (ZeRO-2/3; stage 0's all-reduced buffer)
    grads.buffer        the flat gradient buffer a reduction reads, while it has storage
    grads.param         each parameter's .grad, as autograd leaves it

Places: "device", "host" (offload/host.py; logical, as in memory_breakdown), "nvme" (a state whose
bytes wait in its file: offload/nvme.py). Samples carry only the kinds and places that hold bytes.

The gaps are the seam's: the core announces no event when a unit releases its parameters or a
reduction frees its gradient buffer, so such a drop shows at the next event (a unit's
release after its forward is announced by the unit's own end; after its backward, by the
next collective or unit). Gradients autograd writes between two events show at the second.

Cost: nothing unless a MemoryTrack exists (no observer, no work per collective). Tracing
(trace.py, `--trace DIR`) records one for the traced steps: a walk over the FlatParams and
the optimizer state per event.
"""
from __future__ import annotations

import time

import torch

from .. import comm
from ..memory import CATEGORIES   # memory_breakdown's four categories
from . import unit_marks

KINDS = ("params.gathered", "params.shard", "params.secondary", "master_params", "optimizer_states",
         "grads.shard", "grads.buffer", "grads.param")
PLACES = ("device", "host", "nvme")


def category(kind: str) -> str:
    """The memory_breakdown category a kind belongs to ("params.shard" -> "params")."""
    return kind.split(".", 1)[0]


# ----------------------------------------------------------------------------- what the engine holds

def _buffers(engine):
    """(kind, tensor, on_host, swapped) for every model-state tensor of `engine`, in claim order.
    The one function that reads the core's internals: the FlatParams' full buffer, shard (and
    whether its storage is in host memory), hpZ secondary, gradient shard, flat gradient buffer
    and parameters' grads; the optimizer's masters, state and place; the offload's NVMe files."""
    flats, opt = engine.zero.flat_params, engine.sharded_optimizer
    offload = getattr(engine, "offload", None)
    swapped = {id(t) for _, t, _ in offload.swappable(flats, opt)} if offload is not None and offload.tier else set()
    for f in flats:
        yield "params.gathered", f.full, False, False
        yield "params.shard", f.shard, f.storage.on_host, id(f.shard) in swapped
        secondary = f.sharding.secondary(f)   # hpZ: a storage of its own (device, or host with offload_param)
        yield "params.secondary", secondary.tensor if secondary is not None else None, \
            secondary is not None and secondary.on_host, False
    for m in opt.masters:
        yield "master_params", m, opt.on_host, id(m) in swapped
    for st in opt.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:   # not Adam's scalar step
                yield "optimizer_states", v, opt.on_host, id(v) in swapped
    for f in flats:
        yield "grads.shard", f.grad_shard, False, False
        yield "grads.buffer", f.grad_buffer, False, False
        for p in f.params:
            yield "grads.param", p.grad, False, False


def gathered(engine) -> list[str]:
    """Labels of the FlatParams gathered now whose shard has a storage of its own (ZeRO-3's
    partitioned ones: a ZeRO-0/1/2 or persistent shard is a view of the full buffer)."""
    out = []
    for f in engine.zero.flat_params:
        full = f.full.untyped_storage()
        if full.nbytes() > 0 and f.shard.untyped_storage().data_ptr() != full.data_ptr():
            out.append(f.label)
    return out


def held(engine) -> dict:
    """{place: {kind: bytes}} of what `engine` holds right now, each storage once (the first
    kind to hold it); a tensor swapped out to its NVMe file counts its size under "nvme"."""
    out: dict = {}
    seen: set = set()
    for kind, t, on_host, swapped in _buffers(engine):
        if t is None:
            continue
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:   # freed (a released ZeRO-3 buffer), or its bytes are in its file
            if not swapped:
                continue
            place, nbytes = "nvme", t.numel() * t.element_size()
        else:
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            place = "host" if on_host else "device"
        where = out.setdefault(place, {})
        where[kind] = where.get(kind, 0) + nbytes
    return out


def categories(sample_held: dict) -> dict:
    """A sample's `held` in memory_breakdown's shape: the four categories' totals, then each
    place's split ("device", "host", and "nvme" when something is there)."""
    places = {p: dict.fromkeys(CATEGORIES, 0) for p in ("device", "host")}
    for place, kinds in sample_held.items():
        for kind, nbytes in kinds.items():
            places.setdefault(place, dict.fromkeys(CATEGORIES, 0))[category(kind)] += nbytes
    return {**{c: sum(p[c] for p in places.values()) for c in CATEGORIES}, **places}


def total(sample_held: dict, place: str | None = None) -> int:
    """Bytes of a sample's `held`, on one place or everywhere."""
    return sum(b for p, kinds in sample_held.items() if place in (None, p) for b in kinds.values())


# ----------------------------------------------------------------------------- the observer

class MemoryTrack:
    """The samples of one engine (this rank's), one per announced event, while subscribed.

        track = MemoryTrack(engine)          # subscribes; MemoryTrack(engine, subscribe=False) to drive it
        ... train ...
        track.close()                        # unsubscribes (also: `with MemoryTrack(engine) as track:`)
        track.events                         # the samples, plain dicts (module docstring)
        track.peak("backward")               # {kind: bytes} at the fullest moment of any backward

    clock: a function returning the time of a sample; `t` is its value (default: microseconds
    since the track was made, on this process's perf_counter). A tracer passes its own clock,
    so samples and trace events share one axis, and drives the track with `sample` instead of
    subscribing it (subscribe=False), to sample exactly the steps it records."""

    def __init__(self, engine, clock=None, subscribe: bool = True):
        self.engine = engine
        self.events: list[dict] = []
        self.step = engine.global_steps + 1 if hasattr(engine, "global_steps") else None
        if clock is None:
            t0 = time.perf_counter()
            clock = lambda: (time.perf_counter() - t0) * 1e6
        self.clock = clock
        self.subscribed = False
        if subscribe:
            comm.subscribe(self)
            unit_marks.watch(engine)
            self.subscribed = True

    def close(self) -> None:
        if self.subscribed:
            comm.unsubscribe(self)
            unit_marks.unwatch(self.engine)
            self.subscribed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---------------------------------------------------------------- one sample
    def sample(self, event: str, t=None, **fields) -> dict:
        """Read the engine now and keep the sample: `event` (the hook's name) and `fields`
        (op, label, unit, kind, phase, ...), at `t` (default: the clock now)."""
        s = {"t": self.clock() if t is None else t, "event": event, **fields, "held": held(self.engine),
             "gathered": gathered(self.engine)}
        if "step" not in s and self.step is not None:
            s["step"] = self.step
        self.events.append(s)
        return s

    # ---------------------------------------------------------------- comm.py's observer hook
    def phase_begins(self, name: str, engine) -> None:
        if engine is not self.engine:
            return
        if name == "forward" and engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            self.step = engine.global_steps + 1   # the first forward of an optimizer step
        self.sample("phase_begins", phase=name)

    def phase_ends(self, name: str, engine) -> None:
        if engine is self.engine:
            self.sample("phase_ends", phase=name)

    def unit_begins(self, engine, unit: str, kind: str) -> None:
        if engine is self.engine:
            self.sample("unit_begins", unit=unit, kind=kind)

    def unit_ends(self, engine, unit: str, kind: str) -> None:
        if engine is self.engine:
            self.sample("unit_ends", unit=unit, kind=kind)

    def begin(self, op: str, label, tensor, nbytes: int, group):
        """A collective or copy starts (its output buffer, if new, is already allocated). The
        token is the pair of names its blocking and end samples repeat."""
        self.sample("begin", op=op, label=label or "", bytes=int(nbytes))
        return (op, label or "")

    def blocking(self, token) -> None:
        self.sample("blocking", op=token[0], label=token[1])

    def end(self, token, op, label, nbytes, wire_bytes, msg_bytes) -> None:
        self.sample("end", op=op, label=label or "", bytes=int(nbytes), wire_bytes=int(wire_bytes))

    # ---------------------------------------------------------------- reading the samples
    def within(self, phase: str) -> list[dict]:
        """The samples from each phase_begins(phase) to its phase_ends, both included."""
        out, inside = [], False
        for s in self.events:
            opens = s["event"] == "phase_begins" and s.get("phase") == phase
            closes = s["event"] == "phase_ends" and s.get("phase") == phase
            if opens:
                inside = True
            if inside:
                out.append(s)
            if closes:
                inside = False
        return out

    def peak(self, phase: str | None = None, place: str = "device") -> dict:
        """{kind: bytes} on `place` at the sample of `phase` (None: any sample) where that place
        held the most (the first such sample); {} when there is none."""
        samples = self.within(phase) if phase is not None else self.events
        if not samples:
            return {}
        top = max(samples, key=lambda s: total(s["held"], place))
        return dict(top["held"].get(place, {}))

    def last(self, event: str, **fields) -> dict | None:
        """The latest sample of `event` whose fields match, e.g. last("phase_ends", phase="backward")."""
        for s in reversed(self.events):
            if s["event"] == event and all(s.get(k) == v for k, v in fields.items()):
                return s
        return None
