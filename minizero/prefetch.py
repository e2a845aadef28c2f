"""ZeRO-3 prefetch and reuse: gather the next units while this one computes; keep a unit
gathered when it is used again soon.

Without this file ZeRO-3 gathers each unit exactly when it is needed and frees it right
after: every all-gather is time the step waits, and the root (embeddings, head), used at
the end of forward and again at the start of backward, is gathered twice back to back.
DeepSpeed's answer (ZeRO-Infinity, Rajbhandari et al., SC'21, section 6.2, "overlap-centric
design"; deepspeed/runtime/zero/partitioned_param_coordinator.py) is a *trace*: the order in
which modules fetch their parameters is the same every step, so record it once and read ahead:

- **record**: the first forward+backward (a micro-step) appends every fetch, `(unit)`, to
  `order`, forward and backward (and recomputation) alike. From the next micro-step on the
  trace is complete, and every fetch is checked against it: a different unit (another
  branch, an eval forward) *invalidates* it: in-flight gathers are waited for, prefetched
  units freed, and the next micro-step records again. Nothing but speed depends on the trace.
- **prefetch** (`stage3_prefetch_bucket_size`, elements): after gathering the current unit,
  walk the trace ahead and issue asynchronous all-gathers for the next units not yet
  gathered, until the prefetch bucket is full, never past `stage3_max_live_parameters`.
- **reuse** (`stage3_max_reuse_distance`, elements): when a unit is done, look ahead in the
  trace over at most that many elements of fetches; if the unit comes up again, keep it
  gathered. The root, done at the end of forward and needed first in backward, is kept:
  one all-gather fewer per step. DeepSpeed's default (1e9 elements) keeps every unit from
  its forward to its backward when fewer than 1e9 elements are gathered between a unit's
  two uses (any model under a billion parameters): ZeRO-3 then moves 2Ψ per step, not the paper's 3Ψ (and
  holds the whole model at the turn, which is what the knob trades). In a larger model
  only the units within 1e9 elements of their backward stay.
- **max live** (`stage3_max_live_parameters`, elements): gathered elements of partitioned
  units (`live_numel`). minizero never exceeds it: a
  prefetch stops before a unit that would, a unit is kept for reuse only within it, and a
  fetch first frees kept, idle units to make room. Only the units being computed may go
  over it together (a unit larger than the limit must still be gathered to run).
  DeepSpeed instead may overshoot by the last prefetched parameter and by reuse (it
  checks the limit only when prefetching).

Units, not parameters: DeepSpeed traces every module that holds parameters (each Linear,
LayerNorm, Embedding); minizero traces ZeRO-3's units (zero3.py: each block and the root),
the granularity at which it gathers. Numels count padded FlatParam elements.

With prefetch 0 and reuse 0, `fetch` gathers and `release` frees: exactly the gathers of
the paper's 3Ψ, which the communication-volume tests assert. Gathers write the same
bytes whenever they run, so losses are bit-identical with prefetch on or off.

The Prefetcher only decides; the unit acts and owns its state (unit.py, `Unit`: whether
it is sharded, being gathered or gathered, whether it is being computed, and its gathers in
flight). At each of its hooks the unit asks: `before_fetch` (units to free first: the trace
was left), `make_room` (kept units to free so that this one fits under the live limit),
`ahead` (units to prefetch now), `keep` (stay gathered after use?). The Prefetcher reads
units' `state`, `in_use`, `partitioned_numel` and the units' shared record of which of them
are gathered (unit.LiveNumel); what it holds is the trace and where the step is in it, and
how far ahead every fetch is already gathered (`issued_to`), so each fetch looks only at what
is new: no answer walks every unit.
"""
from __future__ import annotations

import bisect
from enum import Enum, auto

from .unit import ShardState


class TraceMode(Enum):
    RECORD = auto()     # this micro-step appends every fetch to the trace
    COMPLETE = auto()   # the trace is read ahead (prefetch, reuse)
    INVALID = auto()    # execution left the trace: on-demand only until the next micro-step records


class Prefetcher:
    """Decides when each ZeRO-3 unit is gathered and freed; the units ask (module docstring)."""

    def __init__(self, units, prefetch_numel: int, max_live_numel: int, reuse_numel: int):
        self.prefetch_numel, self.max_live_numel, self.reuse_numel = prefetch_numel, max_live_numel, reuse_numel
        self.reads_ahead = prefetch_numel > 0 or reuse_numel > 0   # else: the paper's on-demand ZeRO-3
        self.units = units
        self.rank_of = {u: i for i, u in enumerate(units)}   # which to free first: module order
        self.live = units[0].live if units else None         # the gathered units (unit.LiveNumel)
        self.mode = TraceMode.RECORD
        self.order: list = []            # the recorded fetch order: units
        self.next = 0                    # index into order of the next fetch
        self.walked_to = -1              # the furthest trace index a prefetch walk passed this pass
        self.issued_to = -1              # every fetch from `next` to here is gathered or being gathered
        # once the trace is complete: where each unit comes in it, and the elements fetched
        # before each index (so "used again within N elements" is a lookup, not a walk)
        self.positions: dict = {}
        self.prefix: list = [0]
        self.total_numel = sum(u.partitioned_numel for u in units)
        self.all_partitioned = False     # every unit in the trace has something to gather

    # ------------------------------------------------------------------ fetch
    def before_fetch(self, unit) -> list:
        """The unit is about to run (its pre_forward / pre_backward): record it, or check it
        against the trace. The units to free first (the trace was left: what was prefetched)."""
        if not self.reads_ahead:
            return []
        if self.mode is TraceMode.RECORD:
            self.order.append(unit)
        elif self.mode is TraceMode.COMPLETE and (self.next >= len(self.order) or self.order[self.next] is not unit):
            return self.invalidate()
        return []

    def make_room(self, numel: int) -> list:
        """Kept (gathered, idle, no gather in flight) units to free until `numel` more fit
        under the live limit, in module order."""
        live, free = self.live_numel(), []
        if live + numel <= self.max_live_numel:
            return free
        for u in self._gathered():
            if live + numel <= self.max_live_numel:
                break
            if not u.in_use and u.state is ShardState.UNSHARDED:
                live -= u.partitioned_numel
                free.append(u)
                self._not_issued(u)
        return free

    def ahead(self) -> list:
        """After the current unit is gathered: the units after it in the trace to gather now,
        up to the prefetch bucket and the live limit (DeepSpeed's loop, with the limit never
        crossed). Moves the step on to the next fetch."""
        chosen = []
        order, start = self.order, self.next + 1
        if self.mode is TraceMode.COMPLETE and start < len(order):
            live = self.live_numel()
            # The fetches up to issued_to (this one's included: it is gathered) are all gathered
            # or being gathered: a walk would pass them, choosing none, so it starts after them.
            self.issued_to = max(self.issued_to, self.next)
            begin = self.issued_to + 1
            last = len(order) - 1            # passing every fetch left, choosing none
            if live == self.total_numel and self.all_partitioned:
                self.issued_to = last        # all gathered
            elif begin < len(order):
                budget = min(self.max_live_numel - live, self.prefetch_numel)
                issued, contiguous = 0, True
                for last in range(begin, len(order)):
                    u = order[last]
                    if u.state is not ShardState.SHARDED or u in chosen:   # gathered, or chosen already
                        if contiguous:
                            self.issued_to = last
                        continue
                    numel = u.partitioned_numel
                    if issued + numel > budget:
                        break
                    if numel:   # a unit of persistent parameters only is never gathered
                        chosen.append(u)
                        if contiguous:
                            self.issued_to = last
                    contiguous = contiguous and numel > 0
                    issued += numel
                    if issued >= budget:
                        break
            self.walked_to = max(self.walked_to, last)
        self.next += 1
        return chosen

    # ------------------------------------------------------------------ release
    def keep(self, unit) -> bool:
        """The unit is done (its post_forward / post_backward): keep it gathered, because it
        is used again soon (reuse) and the live limit allows?"""
        kept = (self.mode is TraceMode.COMPLETE and self._used_again_soon(unit)
                and self.live_numel() <= self.max_live_numel)
        if not kept:
            self._not_issued(unit)
        return kept

    def _not_issued(self, unit) -> None:
        """`unit` is about to be freed: its next fetch is no longer gathered ahead."""
        at = self.positions.get(unit, ())
        i = bisect.bisect_left(at, self.next)
        if i < len(at) and at[i] <= self.issued_to:
            self.issued_to = at[i] - 1

    def _used_again_soon(self, unit) -> bool:
        """Its next use is within stage3_max_reuse_distance elements of upcoming fetches
        (DeepSpeed's __params_to_release), or a prefetch walk already went past it. (The walks
        of one pass start one index later each time and pass at least one index, so together
        they passed every index from the pass's first to walked_to.)"""
        at = self.positions.get(unit, ())
        i = bisect.bisect_left(at, self.next)
        if i == len(at):
            return False
        p = at[i]
        return p <= self.walked_to or self.prefix[p] - self.prefix[self.next] < self.reuse_numel

    # ------------------------------------------------------------------ resets
    def invalidate(self) -> list:
        """Execution left the trace: free what was prefetched (its gathers are waited for by
        the unit's reshard), read nothing ahead until the next micro-step has recorded a new
        trace."""
        free = [u for u in self._gathered() if u.state is ShardState.UNSHARDING and not u.in_use]
        self.mode, self.order = TraceMode.INVALID, []
        self.issued_to = -1
        return free

    def end_of_backward(self) -> list:
        """A micro-step's forward and backward are over: nothing may stay gathered (the
        optimizer may write the shards next): the units to free. The trace starts over
        (RECORD -> COMPLETE, INVALID -> RECORD)."""
        free = self._gathered()
        if self.mode is TraceMode.RECORD and self.reads_ahead:
            self.mode = TraceMode.COMPLETE
            self._index_trace()
        elif self.mode is TraceMode.INVALID:
            self.mode, self.order = TraceMode.RECORD, []
        self.next, self.walked_to, self.issued_to = 0, -1, -1
        return free

    def _index_trace(self) -> None:
        self.positions, self.prefix = {}, [0]
        for i, u in enumerate(self.order):
            self.positions.setdefault(u, []).append(i)
            self.prefix.append(self.prefix[-1] + u.partitioned_numel)
        self.all_partitioned = all(u.partitioned_numel for u in self.order)

    def reset(self) -> list:
        """A pass ended without backward (an evaluation forward), or the optimizer has written
        new shards: every gathered unit is to be freed, so nothing stale or in flight outlives
        the pass; the next fetch is the trace's first again (a forward-only pass never
        completes a recording). The units to free."""
        free = self._gathered()
        if self.mode is TraceMode.RECORD:
            self.order = []
        self.next, self.walked_to, self.issued_to = 0, -1, -1
        return free

    def _gathered(self) -> list:
        """The units gathered or being gathered, in module order."""
        return sorted(self.live.units, key=self.rank_of.__getitem__) if self.live is not None else []

    def live_numel(self) -> int:
        """Gathered elements of partitioned units (being gathered included), as the units count them."""
        return self.live.numel if self.live is not None else 0
