"""prefetch.py as a unit: the Prefetcher's decisions on fake units, no process, no tensor.

A fake unit has what the Prefetcher reads (state, in_use, partitioned_numel, the shared record
of gathered units and elements) and acts on the answers as the real Unit does (unit.py, `_fetch` /
`_release`), so a whole forward + backward can be replayed and the gathers counted.
"""
from __future__ import annotations

from minizero.prefetch import Prefetcher, TraceMode
from minizero.unit import LiveNumel, ShardState

class FakeUnit:
    def __init__(self, name: str, numel: int, live: LiveNumel | None = None):
        self.name, self.partitioned_numel = name, numel
        self.state, self.in_use, self.live = ShardState.SHARDED, False, live or LiveNumel()

    def set(self, state: ShardState) -> None:
        """As Unit.unshard / wait_unshard / reshard change it, the shared record with it."""
        gathered = lambda st: st is not ShardState.SHARDED
        self.live.numel += self.partitioned_numel * (gathered(state) - gathered(self.state))
        if gathered(state):
            self.live.units[self] = None
        else:
            self.live.units.pop(self, None)
        self.state = state

    def __repr__(self):
        return self.name


class Run:
    """Replays fetches and releases as Unit._fetch / Unit._release do; logs the gathers."""

    def __init__(self, prefetcher: Prefetcher):
        self.p, self.gathers, self.max_live = prefetcher, [], 0

    def fetch(self, u: FakeUnit) -> None:
        for v in self.p.before_fetch(u):
            self.reshard(v)
        if u.state is ShardState.UNSHARDING:
            u.set(ShardState.UNSHARDED)
        elif u.state is ShardState.SHARDED:
            for v in self.p.make_room(u.partitioned_numel):
                self.reshard(v)
            u.set(ShardState.UNSHARDED)
            self.gathers.append(u.name)
        u.in_use = True
        for v in self.p.ahead():
            v.set(ShardState.UNSHARDING)
            self.gathers.append(v.name + ".prefetch")
        self.max_live = max(self.max_live, self.p.live_numel())

    def release(self, u: FakeUnit) -> None:
        u.in_use = False
        if not self.p.keep(u):
            self.reshard(u)

    @staticmethod
    def reshard(u: FakeUnit) -> None:
        u.set(ShardState.SHARDED)
        u.in_use = False

    def micro_step(self, blocks, root) -> None:
        """The root's forward wraps the blocks'; backward runs them in reverse."""
        self.fetch(root)
        for b in blocks:
            self.fetch(b)
            self.release(b)
        self.release(root)
        self.fetch(root)
        for b in reversed(blocks):
            self.fetch(b)
            self.release(b)
        self.release(root)
        for u in self.p.end_of_backward():
            self.reshard(u)


def units(n_blocks=3, numel=10):
    live = LiveNumel()
    return [FakeUnit(f"b{i}", numel, live) for i in range(n_blocks)], FakeUnit("root", numel, live)


def test_on_demand_gathers_every_unit_twice_per_micro_step():
    blocks, root = units()
    run = Run(Prefetcher(blocks + [root], prefetch_numel=0, max_live_numel=10**9, reuse_numel=0))
    for _ in range(2):
        run.micro_step(blocks, root)
    assert run.gathers == 2 * ["root", "b0", "b1", "b2", "root", "b2", "b1", "b0"]
    assert run.p.mode is TraceMode.RECORD   # nothing is read ahead: no trace kept


def test_reuse_keeps_every_unit_from_forward_to_backward_once_the_trace_is_recorded():
    blocks, root = units()
    run = Run(Prefetcher(blocks + [root], prefetch_numel=0, max_live_numel=10**9, reuse_numel=10**9))
    run.micro_step(blocks, root)                  # records: on demand
    assert run.p.mode is TraceMode.COMPLETE and run.gathers.count("root") == 2
    run.gathers.clear()
    run.micro_step(blocks, root)
    assert run.gathers == ["root", "b0", "b1", "b2"]   # backward reuses what forward gathered


def test_prefetch_reads_ahead_within_its_bucket_and_never_over_the_live_limit():
    blocks, root = units(n_blocks=4)
    run = Run(Prefetcher(blocks + [root], prefetch_numel=20, max_live_numel=30, reuse_numel=0))
    run.micro_step(blocks, root)
    run.gathers.clear()
    run.micro_step(blocks, root)
    assert any(g.endswith(".prefetch") for g in run.gathers)
    assert run.max_live <= 30
    # every unit gathered once or twice, never more: a unit a prefetch walk already passed
    # on its way to the unit's next use stays gathered (DeepSpeed's rule), so fewer than 2 each
    names = [g.split(".")[0] for g in run.gathers]
    assert all(1 <= names.count(u) <= 2 for u in ["root", "b0", "b1", "b2", "b3"])
    assert len(names) < 10


def test_leaving_the_trace_frees_what_was_prefetched_and_records_again():
    blocks, root = units(n_blocks=3)
    p = Prefetcher(blocks + [root], prefetch_numel=10, max_live_numel=10**9, reuse_numel=0)
    run = Run(p)
    run.micro_step(blocks, root)
    run.fetch(root)
    run.fetch(blocks[0])                          # b1 is prefetched now
    assert blocks[1].state is ShardState.UNSHARDING
    run.release(blocks[0])
    run.fetch(blocks[2])                          # the trace said b1: invalidated
    assert p.mode is TraceMode.INVALID and blocks[1].state is ShardState.SHARDED
    assert root.state is ShardState.UNSHARDED     # in use: never freed under a computing unit
    run.release(blocks[2])
    run.release(root)
    for u in p.end_of_backward():
        run.reshard(u)
    assert p.mode is TraceMode.RECORD and p.order == []


def test_end_of_backward_and_reset_free_every_gathered_unit():
    blocks, root = units()
    p = Prefetcher(blocks + [root], prefetch_numel=0, max_live_numel=10**9, reuse_numel=10**9)
    run = Run(p)
    run.micro_step(blocks, root)
    run.fetch(root)
    for b in blocks:
        run.fetch(b)
        run.release(b)
    run.release(root)                             # an evaluation forward: all kept for reuse
    assert all(u.state is ShardState.UNSHARDED for u in blocks + [root])
    assert set(p.reset()) == set(blocks + [root])
    assert p.next == 0


def test_make_room_frees_only_idle_gathered_units():
    live = LiveNumel()
    a, b, c = FakeUnit("a", 10, live), FakeUnit("b", 10, live), FakeUnit("c", 10, live)
    p = Prefetcher([a, b, c], prefetch_numel=0, max_live_numel=20, reuse_numel=10**9)
    a.set(ShardState.UNSHARDED)
    b.set(ShardState.UNSHARDED)
    b.in_use = True
    assert p.make_room(10) == [a]                 # b is being computed
    c.set(ShardState.UNSHARDING)
    a.set(ShardState.SHARDED)
    assert p.make_room(10) == []                  # c's gather is in flight: waited for first elsewhere
