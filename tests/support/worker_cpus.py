"""One CPU (or one share of the CPUs) per pytest-xdist worker, for the worker and every
process it starts: its gloo ranks, the forkserver they come from, its torchrun runs.

Why: the README's command runs two workers on this project's 2-core machine, and each
worker's tests launch ranks in pairs, so four or more busy processes share two cores.
Left to the scheduler, a rank pair is spread over both cores next to the other worker's
pair. Our reading of why that costs CPU (the measurement below is what we know): every
collective wakes a peer on the other core, and each process keeps losing its core (and
its caches) to the other worker's. Kept to its own core, a worker's two ranks take turns
on it: one computes while the other waits in its collective, the other worker never
intrudes. Measured on the 2-core machine, whole suite (`python -m pytest -q -n 2`),
runs in a row: each unpinned run used 7-10% more CPU than the pinned run next to it (650
against 606 core-seconds; 608 against 548) and took 3-5% longer (README, "Tests and CI").

Only when there are at least as many CPUs as workers; each worker gets an equal, disjoint
share (the first `len(cpus) // count` CPUs for gw0, the next for gw1, ...; a remainder is
left to whichever process the scheduler gives it). MINIZERO_TEST_PIN=0 turns it off.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Set, Tuple


def worker_cpus(index: int, count: int, cpus: Sequence[int]) -> Optional[Set[int]]:
    """The CPUs worker `index` of `count` keeps to, out of `cpus`; None when there are
    fewer CPUs than workers (nothing to split) or a single worker."""
    cpus = sorted(cpus)
    if count < 2 or len(cpus) < count or not 0 <= index < count:
        return None
    share = len(cpus) // count
    return set(cpus[index * share:(index + 1) * share])


# (the CPUs this process started with, the share it keeps to or None): what the conftest did
PINNED: Optional[Tuple[Set[int], Optional[Set[int]]]] = None


def pin_this_worker() -> Optional[Set[int]]:
    """Keep this xdist worker (PYTEST_XDIST_WORKER gwN of PYTEST_XDIST_WORKER_COUNT) to its
    share of the CPUs; what it set, or None (not a worker, not Linux, switched off)."""
    global PINNED
    name, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not hasattr(os, "sched_setaffinity"):
        return None
    started = set(os.sched_getaffinity(0))
    mine = None
    if name.startswith("gw") and count.isdigit() and os.environ.get("MINIZERO_TEST_PIN") != "0":
        mine = worker_cpus(int(name[2:]), int(count), started)
        if mine:
            os.sched_setaffinity(0, mine)
    PINNED = (started, mine)
    return mine
