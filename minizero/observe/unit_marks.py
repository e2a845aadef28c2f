"""Each ZeRO-3 unit's forward, recompute and backward, announced on comm's observer seam
(`unit_begins`, `unit_ends`): the trace's unit bars and the memory track's samples at a unit's
edges. The engine knows nothing of them: a tool that wants them calls `watch(engine)` when it
starts listening and `unwatch(engine)` when it stops; the hooks are on the units' modules only
while some tool watches, so an engine nobody watches pays nothing. Units are the engine's own
(unit.find_units: every block of the model, then the root), at every stage.
"""
from __future__ import annotations

import weakref

import torch

from .. import checkpointing, comm
from ..unit import find_units, on_backward

_marks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> its UnitMarks


def watch(engine) -> None:
    """Announce `engine`'s units from now on (each watch needs its unwatch)."""
    marks = _marks.get(engine)
    if marks is None:
        marks = _marks[engine] = UnitMarks(engine)
    if marks.watched == 0:
        marks.attach()
    marks.watched += 1


def unwatch(engine) -> None:
    marks = _marks.get(engine)
    if marks is None or marks.watched == 0:
        return
    marks.watched -= 1
    if marks.watched == 0:
        marks.detach()


def watched(engine) -> bool:
    """Are `engine`'s units announced now?"""
    marks = _marks.get(engine)
    return marks is not None and marks.watched > 0


class UnitMarks:
    """One engine's marks: hooks on its units' modules (unit.find_units) while `watched`.

    A unit's backward starts when the first gradient reaches its outputs and ends when the
    gradients reach its inputs (on_backward on each); the root's inputs are token ids, which
    get no gradient: its backward ends with the engine's. The forward hook runs before the
    unit's own (prepend), so its span includes a ZeRO-3 gather."""

    def __init__(self, engine):
        self.engine, self.units, self.handles, self.watched = engine, find_units(engine.module), [], 0

    def attach(self) -> None:
        for name, m in self.units:
            self.handles.append(m.register_forward_pre_hook(self._pre_forward(name), prepend=True))
            self.handles.append(m.register_forward_hook(self._post_forward(name)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre_forward(self, name: str):
        def pre_forward(module, args):
            kind = "recompute" if checkpointing.in_recompute() else "forward"
            comm.announce("unit_begins", self.engine, name, kind)
            if torch.is_grad_enabled():   # gradients reaching the inputs: the unit's backward is done
                return on_backward(args, lambda: comm.announce("unit_ends", self.engine, name, "backward"))
            return None
        return pre_forward

    def _post_forward(self, name: str):
        def post_forward(module, args, output):
            kind = "recompute" if checkpointing.in_recompute() else "forward"
            comm.announce("unit_ends", self.engine, name, kind)
            if torch.is_grad_enabled():   # the first gradient reaching the outputs: its backward starts
                return on_backward(output, lambda: comm.announce("unit_begins", self.engine, name, "backward"))
            return None
        return post_forward
