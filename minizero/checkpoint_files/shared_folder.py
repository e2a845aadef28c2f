"""Does every rank see what rank 0 just created? On a shared file system, give its cache time.

Four probes ask it: the trainer's at start (a file rank 0 creates in --save-dir,
train/rundir.py), every checkpoint save's (the `<tag>.tmp` folder, checkpoint_io.py),
every load's (the tag folder rank 0 found through `latest`: only rank 0 reads `latest`,
checkpoint_io.agreed_tag), and the data's (the CIFAR-10 folder rank 0 fetched or found,
gpt/cifar10.py). A rank that cannot see it is on another disk (a node-local folder of the
same path), and the run is refused in one line before anything is written into a folder
that is not one, or read from one that is not the folder rank 0 reads.

But "cannot see it yet" is not "cannot see it". An NFS client (Linux, default mount:
`lookupcache=all`, `acdirmin=30`, `acdirmax=60`) remembers a lookup that found nothing: a
rank that looked for --save-dir before rank 0 created it is told "no such file" from its
cache until the parent folder's cached attributes expire, up to a minute later (nfs(5),
"Directory entry caching"). Opening the parent folder, as listing it does, revalidates it
(close-to-open consistency): the client sees that the folder changed and drops what it
remembered. So a rank that does not see the path at once lists each folder on its way
down to it and looks again, for up to VISIBLE_WAIT_S, before the run calls the folder
unshared; rank 0 says on stderr that it is waiting and for whom.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch

from .. import comm

# NFS's longest default cache of a folder's attributes (acdirmax, nfs(5)): a rank that still
# cannot see the path after re-reading its folders for this long is looking at another disk.
VISIBLE_WAIT_S = 60.0
RETRY_S = 0.25   # between two looks of a rank that does not see the path yet


def reread_toward(path: str) -> None:
    """List every folder from the deepest one this process sees down to `path`'s own: each
    listing opens the folder, which makes an NFS client revalidate it and forget the names
    it remembered as missing there, so the next folder down (or `path`) can be found."""
    full = os.path.abspath(path)
    missing, folder = [], os.path.dirname(full)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    for f in [folder, *reversed(missing)]:
        try:
            os.listdir(f)
        except OSError:   # still not there (or not ours to list): the next look says which
            return


def look_again(path: str, sees: Callable[[str], bool], wait_s: float) -> bool:
    """Re-read the folders toward `path` and look for it, until `sees(path)` or `wait_s` is over."""
    deadline = time.monotonic() + wait_s
    while True:
        reread_toward(path)
        if sees(path):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(RETRY_S)


def uncounted_max(flags: torch.Tensor) -> None:
    """MAX of `flags` over the ranks, in place, as control traffic (all_gather_object, which
    comm does not count): for the probes that run where the byte ledger must not change."""
    every = comm.all_gather_object(flags.tolist())
    flags.copy_(torch.tensor(every, dtype=flags.dtype).amax(dim=0))


def ranks_blind_to(path: str, sees: Callable[[str], bool], all_reduce_max: Callable[[torch.Tensor], None],
                   device) -> list[int]:
    """Collective: the ranks that do not see `path` (which rank 0 created, or sees) even after
    VISIBLE_WAIT_S of re-reading; empty when all of them see it. One MAX all-reduce of one
    flag per rank when all see it at once (the usual case); when some do not, rank 0 says
    that it waits, those ranks look again (look_again), and a second all-reduce gives the verdict."""
    rank, world = comm.get_rank(), comm.get_world_size()
    flags = torch.zeros(world, device=device)
    flags[rank] = float(not sees(path))
    all_reduce_max(flags)
    late = [r for r, v in enumerate(flags.tolist()) if v > 0]
    if not late:
        return []
    if rank == 0:
        who = ", ".join(map(str, late[:8])) + (" ..." if len(late) > 8 else "")
        print(f"minizero: rank{'s' if len(late) > 1 else ''} {who} cannot see {path} yet, which rank 0 sees; "
              f"waiting up to {VISIBLE_WAIT_S:g} s for a shared file system's cache to show it", file=sys.stderr,
              flush=True)
    still_blind = rank in late and not look_again(path, sees, VISIBLE_WAIT_S)
    flags.zero_()
    flags[rank] = float(still_blind)
    all_reduce_max(flags)
    return [r for r, v in enumerate(flags.tolist()) if v > 0]
