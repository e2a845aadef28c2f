"""comm.py as a unit, one process (no process group: each collective is a local copy): the
ledger's two counts, the observer seam, asynchronous handles."""
from __future__ import annotations

import types

import torch

from minizero import comm

# what a phase tells its observers about the engine (desync's check, subscribed by any engine this
# process built earlier, reads the step counters)
ENGINE = types.SimpleNamespace(global_steps=0, micro_steps=0)


def test_the_ledger_counts_calls_payload_and_no_wire_bytes_alone():
    before = comm.ledger.snapshot()
    out = torch.empty(8)
    comm.all_gather_into_tensor(out, torch.arange(8.0), label="t")
    comm.reduce_scatter_tensor(torch.empty(8), torch.ones(8), label="t")
    comm.all_reduce(torch.ones(4), label="t")
    after = comm.ledger.snapshot()
    for op, nbytes in (("all_gather", 32), ("reduce_scatter", 32), ("all_reduce", 16)):
        assert after[op]["calls"] - before[op]["calls"] == 1
        assert after[op]["bytes"] - before[op]["bytes"] == nbytes
        assert after[op]["wire_bytes"] == before[op]["wire_bytes"]      # one rank: nothing on a wire
    assert torch.equal(out, torch.arange(8.0))


class Watcher:
    def __init__(self):
        self.seen = []

    def phase_begins(self, name, engine):
        self.seen.append(("begins", name))

    def phase_ends(self, name, engine):
        self.seen.append(("ends", name))

    def begin(self, op, label, tensor, nbytes, group):
        self.seen.append(("begin", op, label))
        return op

    def blocking(self, token):
        self.seen.append(("blocking", token))

    def end(self, token, op, label, nbytes, wire_bytes, msg_bytes):
        self.seen.append(("end", op, label))


def test_observers_hear_phases_and_each_collective_an_asynchronous_one_at_its_wait():
    w = Watcher()
    others = [o for o in comm.observers if hasattr(o, "phase_begins")]   # an earlier engine's desync check
    comm.subscribe(w)
    try:
        with comm.phase("grad_norm", ENGINE):
            comm.all_reduce(torch.ones(1), label="n")
        pending = comm.all_reduce(torch.ones(1), label="late", async_op=True)
        heard_before_wait = list(w.seen)
        pending.wait()
        pending.wait()                                   # a second wait does nothing
        assert comm.listening("phase_begins") and not comm.listening("unit_begins")
    finally:
        comm.unsubscribe(w)
    assert heard_before_wait == [("begins", "grad_norm"), ("begin", "all_reduce", "n"), ("end", "all_reduce", "n"),
                                 ("ends", "grad_norm"), ("begin", "all_reduce", "late")]
    assert w.seen[len(heard_before_wait):] == [("blocking", "all_reduce"), ("end", "all_reduce", "late")]
    assert comm.listening("phase_begins") == bool(others)   # unsubscribed: only those that were here before


def test_a_phase_that_raises_announces_no_end():
    w = Watcher()
    comm.subscribe(w)
    try:
        try:
            with comm.phase("optimizer", ENGINE):
                raise ValueError("boom")
        except ValueError:
            pass
    finally:
        comm.unsubscribe(w)
    assert w.seen == [("begins", "optimizer")]
