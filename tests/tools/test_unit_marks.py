"""observe/unit_marks.py: each ZeRO-3 unit's forward and backward announced on comm's seam while
a tool watches the engine, and not otherwise."""
from __future__ import annotations

import torch

from minizero import comm
from minizero.observe import unit_marks
from tests.support.harness import TwoBlockNet


class Engine:
    """What the marks read of an engine: its module."""

    def __init__(self, module):
        self.module = module


class Listener:
    def __init__(self):
        self.events = []

    def unit_begins(self, engine, unit, kind):
        self.events.append(("begin", unit, kind))

    def unit_ends(self, engine, unit, kind):
        self.events.append(("end", unit, kind))


def test_unit_marks_announce_each_units_phases_only_while_watched():
    net = TwoBlockNet()
    engine = Engine(net)
    net(torch.randn(2, 3)).backward()      # nobody watches: no hooks at all
    assert not unit_marks.watched(engine) and not net._forward_pre_hooks
    listener = Listener()
    comm.subscribe(listener)
    unit_marks.watch(engine)
    unit_marks.watch(engine)               # two tools watch: one set of hooks
    try:
        net(torch.randn(2, 3)).backward()
    finally:
        comm.unsubscribe(listener)
        unit_marks.unwatch(engine)
    assert unit_marks.watched(engine)      # one tool still watches
    unit_marks.unwatch(engine)
    assert not unit_marks.watched(engine) and not net._forward_pre_hooks
    forward = [e for e in listener.events if e[2] == "forward"]
    assert forward[:2] == [("begin", "root", "forward"), ("begin", "blocks.0", "forward")]
    # backward: each unit begins when its output's gradient arrives and ends when its input's
    # does; the first block's input (the data) and the root's need no gradient: no end
    backward = [e[:2] for e in listener.events if e[2] == "backward"]
    assert backward == [("begin", "root"), ("begin", "blocks.1"), ("end", "blocks.1"), ("begin", "blocks.0")]
