"""A run's folder: one run writes into it at a time, and a finished run is never overwritten.

A training run leaves its results in --save-dir: metrics.csv, summary.json, samples.png,
`latest` and the `global_step<N>/` checkpoints. Two things must not happen to them:

- a new run started with the same --save-dir silently replaces them (the second run of a
  tour would move `latest` from step 625 back to 40 and rewrite the metrics);
- two runs started at once interleave their files.

So rank 0 takes an exclusive lock on `<save_dir>/.minizero.lock` (fcntl.flock: the
kernel drops it when the process dies, even by kill -9, so a crashed run never leaves a
stale lock) and then refuses a folder that already holds a run, unless this run resumes
from that very folder. We refuse rather than pick a new folder name: a user who typed
--save-dir should find the results where they asked, and every refusal says what to do.
(`rm -r` the folder to start over; minizero never deletes a run for you.)
"""
from __future__ import annotations

import fcntl
import glob
import os
import socket

from minizero import comm
from minizero.checkpoint.checkpoint_folder import later_tags

LOCK_FILE = ".minizero.lock"
# What a run writes; anything else (a compare run.log, a user's notes) is not a run.
RUN_FILES = ("metrics.csv", "summary.json", "samples.png", "latest")


class RunDirError(Exception):
    """The save folder cannot be used; the message says why and what to do."""


def previous_run(save_dir: str) -> list[str]:
    """The files and checkpoint folders of an earlier run in save_dir (empty: none)."""
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(save_dir, f))]
    found += sorted(os.path.basename(p) for p in glob.glob(os.path.join(save_dir, "global_step*"))
                    if not p.endswith(".tmp"))
    return found


class RunDirLock:
    """Held by rank 0 for the whole run: `with RunDirLock(save_dir): ...`."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, LOCK_FILE)
        self.fh = None

    def acquire(self) -> "RunDirLock":
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise RunDirError(f"{os.path.dirname(self.path)} is in use by a run that is still going ({holder}); "
                              f"wait for it to finish, or pick another --save-dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        self.fh = fh
        return self

    def release(self) -> None:
        if self.fh is not None:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def claim(save_dir: str, resume_dir: str | None) -> RunDirLock:
    """Rank 0: lock save_dir, then refuse it if it holds a run this one does not continue.

    Lock first, check second: two runs started at once both see an empty folder, but only
    one gets the lock."""
    lock = RunDirLock(save_dir).acquire()
    try:
        found = previous_run(save_dir)
        continuing = resume_dir is not None and os.path.realpath(resume_dir) == os.path.realpath(save_dir)
        if found and not continuing:
            shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise RunDirError(f"{save_dir} already holds a run ({shown}); continue it with --resume {save_dir}, "
                              f"or pass a new --save-dir (minizero never overwrites a run's results)")
    except BaseException:
        lock.release()
        raise
    return lock


def claim_for_all_ranks(save_dir: str, resume_dir: str | None, resume_tag: str | None) -> RunDirLock | None:
    """Rank 0 claims the folder (claim) and also refuses to resume an older checkpoint into
    the folder that holds later ones; every rank gets the verdict, so all of them stop with
    the same one line. Returns the lock on rank 0 (None elsewhere)."""
    lock, err = None, None
    if comm.get_rank() == 0:
        try:
            lock = claim(save_dir, resume_dir)
            if resume_tag is not None and lock is not None:
                later = later_tags(save_dir, resume_tag) if os.path.realpath(save_dir) == \
                    os.path.realpath(resume_dir) else []
                if later:
                    lock.release()
                    raise RunDirError(f"resuming {resume_tag} into {save_dir} would overwrite its later checkpoints "
                                      f"({', '.join(later)}); pass a new --save-dir for the resumed run")
        except RunDirError as e:
            err = str(e)
    err = comm.broadcast_object(err)
    if err is not None:
        raise RunDirError(err)
    return lock
