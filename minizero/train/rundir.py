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
minizero deletes a run only when told to: `--overwrite` replaces a folder that holds one
finished run and nothing else (a lesson's command, run again in class), and refuses any
other folder in one line (replace_finished_run); otherwise `rm -r` it yourself.

A run that ends, however it ends, removes its lock file (a lock file left with a pid in it
reads as a stale lock), and a folder this run created and left empty (a run refused before
its first file: a missing dataset, a foreign checkpoint) is removed too, so a refused run
leaves nothing behind. Removing the file races with a run waiting on it: that run may hold
the lock of a file no longer in the folder, so acquire() checks that the file it locked is
still the one the path names, and tries again if not.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import socket
import sys

import torch
import torch.distributed as dist

from minizero import comm
from minizero.checkpoint_files import shared_folder
from minizero.checkpoint_files.checkpoint_folder import later_tags
from minizero.train import output_dir
from minizero.train.output_dir import missing_parts

LOCK_FILE = ".minizero.lock"
# What a run writes; anything else (a compare run.log, a user's notes) is not a run.
RUN_FILES = ("metrics.csv", "summary.json", "samples.png", "latest")
# flock's answers for "this file system cannot lock" (Lustre mounted without -o flock, NFS
# without lockd): no lock to take, which is not the same as a lock another run holds.
NO_LOCKING = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
_warned_no_locking = False
# Locks this process holds; main() releases what a run that failed during setup still holds.
HELD: list["RunDirLock"] = []


def _warn_no_locking(folder: str, e: OSError) -> None:
    """Once per process (a run takes its lock once): the folder cannot be locked."""
    global _warned_no_locking
    if not _warned_no_locking:
        print(f"minizero: warning: the file system of {folder} does not support file locks "
              f"({e.strerror or e}); going on without the lock, so nothing stops a second run "
              f"started into this folder at the same time", file=sys.stderr, flush=True)
        _warned_no_locking = True


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
        self.locked = False            # False where the file system has no locks (NO_LOCKING)
        self.created: list[str] = []   # the folders acquire() made, deepest first

    def acquire(self) -> "RunDirLock":
        folder = os.path.dirname(self.path) or "."
        self.created = missing_parts(folder)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create the save folder {folder}: {e.strerror}; pass another --save-dir") from None
        while True:
            fh = open(self.path, "a+")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:   # EWOULDBLOCK: the only answer that means another process holds it
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                fh.close()
                raise RunDirError(f"{os.path.dirname(self.path)} is in use by a run that is still going ({holder}); "
                                  f"wait for it to finish, or pick another --save-dir") from None
            except OSError as e:
                if e.errno not in NO_LOCKING:
                    fh.close()
                    raise RunDirError(f"cannot lock {self.path}: {e.strerror or e}; check that the folder is "
                                      f"writable, or pick another --save-dir") from None
                _warn_no_locking(os.path.dirname(self.path), e)
                self.locked = False   # the file still says who runs here, and goes at release
                break
            if _same_file(fh, self.path):
                self.locked = True
                break
            fh.close()   # the run before us removed the file we locked (release): lock the new one
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        self.fh = fh
        HELD.append(self)
        return self

    def release(self) -> None:
        """Unlock and remove the lock file, and the folders acquire() made if nothing else
        was written there. The file goes before the lock: a run that waited on it then
        finds the path gone or new (acquire)."""
        if self.fh is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.locked:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()
        self.fh = None
        HELD.remove(self)
        for folder in self.created:
            try:
                os.rmdir(folder)   # only if empty: never a file of this run or anyone else's
            except OSError:
                break

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _same_file(fh, path: str) -> bool:
    try:
        return os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def release_all() -> None:
    """Release every lock this process still holds (a run that stopped before its loop)."""
    for lock in list(HELD):
        lock.release()


def claim(save_dir: str, resume_dir: str | None, overwrite: bool = False) -> RunDirLock:
    """Rank 0: lock save_dir, then refuse it if it holds a run this one does not continue
    (with `overwrite`: replace it, if it is a finished run's folder and nothing else:
    replace_finished_run).

    Lock first, check second: two runs started at once both see an empty folder, but only
    one gets the lock."""
    lock = RunDirLock(save_dir).acquire()
    try:
        found = previous_run(save_dir)
        continuing = resume_dir is not None and os.path.realpath(resume_dir) == os.path.realpath(save_dir)
        if overwrite and continuing:
            raise RunDirError(f"--overwrite would delete the checkpoint that --resume {resume_dir} continues; "
                              f"drop --overwrite, or resume into a new --save-dir")
        if found and overwrite:
            replace_finished_run(save_dir)
            found = []
        if found and not continuing:
            shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise RunDirError(f"{save_dir} already holds a run ({shown}); continue it with --resume {save_dir}, "
                              f"replace it with --overwrite, or pass a new --save-dir (minizero never "
                              f"overwrites a run's results unless told to)")
    except BaseException:
        lock.release()
        raise
    return lock


def refuse_unusable(save_dir: str) -> None:
    """Rank 0, before it creates anything: the save folder's one-line refusal (a file, under
    a file, not writable). Looked up by rank 0 alone, after the group is up: a multi-rank
    command line leaves it unchecked (train_args.launched_ranks says why)."""
    if why := output_dir.problem(save_dir, "--save-dir"):
        raise RunDirError(why)


def claim_for_all_ranks(save_dir: str, resume_dir: str | None, resume_tag: str | None,
                        overwrite: bool = False) -> RunDirLock | None:
    """Rank 0 claims the folder (claim) and also refuses to resume an older checkpoint into
    the folder that holds later ones; every rank gets the verdict, so all of them stop with
    the same one line. Then every rank checks that it sees the folder rank 0 claimed
    (refuse_unshared). Returns the lock on rank 0 (None elsewhere)."""
    lock, err, probe = None, None, None
    if comm.get_rank() == 0:
        try:
            refuse_unusable(save_dir)
            lock = claim(save_dir, resume_dir, overwrite)
            if resume_tag is not None and lock is not None:
                later = later_tags(save_dir, resume_tag) if os.path.realpath(save_dir) == \
                    os.path.realpath(resume_dir) else []
                if later:
                    lock.release()
                    raise RunDirError(f"resuming {resume_tag} into {save_dir} would overwrite its later checkpoints "
                                      f"({', '.join(later)}); pass a new --save-dir for the resumed run")
            if comm.get_world_size() > 1:
                probe = PROBE_FILE.format(os.urandom(8).hex())
                open(os.path.join(save_dir, probe), "w").close()
        except RunDirError as e:
            err = str(e)
        except OSError as e:   # rank 0 alone: raising here would leave the others waiting below
            if lock is not None:
                lock.release()
            err = f"cannot write into {save_dir}: {e.strerror or e}; pick a writable --save-dir"
    err, probe = comm.broadcast_object((err, probe))
    if err is not None:
        raise RunDirError(err)
    if probe is not None:
        try:
            refuse_unshared(save_dir, os.path.join(save_dir, probe), "file")
        except RunDirError:
            if lock is not None:
                lock.release()
            raise
    return lock


# ----------------------------------------------------------------------------- --overwrite
# What one run of the training script writes into its save folder (runlog.py, checkpoint_io.py,
# DeepSpeed's save_checkpoint), as glob patterns. --overwrite replaces a folder that holds
# these and nothing else.
RUN_WRITES = ("metrics.csv", "summary.json", "samples.png", "samples-step*.png", "latest", "global_step*",
              "comms_summary.json", "comms_summary.txt", "zero_to_fp32.py", LOCK_FILE, ".minizero.probe-*")
# summary.json's status when the run is over (runlog.finish writes it however a run ends)
FINISHED = ("completed", "diverged", "failed", "interrupted")


def not_replaceable(save_dir: str) -> str | None:
    """Why --overwrite must not replace save_dir (None: it holds one finished run and nothing
    else). A run still going holds the lock, which claim() took before asking; a run killed
    before its end has no summary.json, and a folder with other files in it is not only a run."""
    import fnmatch
    import json
    others = sorted(e for e in os.listdir(save_dir) if not any(fnmatch.fnmatch(e, p) for p in RUN_WRITES))
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        return f"it also holds files no training run writes ({shown})"
    try:
        with open(os.path.join(save_dir, "summary.json")) as f:
            status = json.load(f).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status not in FINISHED:
        return "its run did not finish (no summary.json with a status: a run killed before its end)"
    return None


def replace_finished_run(save_dir: str) -> None:
    """--overwrite: remove the files of the finished run in save_dir (rank 0, holding its lock),
    or refuse in one line. summary.json goes last: a removal stopped half-way leaves a folder
    that still reads as a finished run, so the next --overwrite finishes the job."""
    import shutil
    why = not_replaceable(save_dir)
    if why is not None:
        raise RunDirError(f"--overwrite replaces only the folder of a finished run, and {save_dir} is not one: "
                          f"{why}; remove what you no longer need yourself, or pass a new --save-dir")
    for entry in sorted(os.listdir(save_dir), key=lambda e: e == "summary.json"):
        path = os.path.join(save_dir, entry)
        if entry == LOCK_FILE:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# A file of a name no earlier run left behind: a node-local folder of the same path on
# another node may well hold an old lock file, but never this.
PROBE_FILE = ".minizero.probe-{}"


def refuse_unshared(save_dir: str, path: str, what: str) -> None:
    """Collective: does every rank see `path`, which rank 0 just created in save_dir? If not,
    save_dir is node-local (each node its own disk at that path): every rank raises the same
    one line, and rank 0 removes `path` either way. One MAX all-reduce of one flag per rank;
    a rank that does not see `path` at once re-reads its folders for a while first (a shared
    file system's cache: checkpoint_files/shared_folder.py).

    The trainer runs it at start (claim_for_all_ranks), so a run on node-local disks is
    refused before it trains, not at its first save after hours; checkpoint_io.save checks
    each checkpoint folder the same way (for the engine's own save_checkpoint)."""
    rank = comm.get_rank()
    # torch.distributed, not comm.all_reduce: the run's bookkeeping stays out of the engine's
    # comm ledger and profiler labels (runlog.py says why)
    blind = shared_folder.ranks_blind_to(path, os.path.exists, lambda f: dist.all_reduce(f, op=dist.ReduceOp.MAX),
                                         comm.get_device())
    if rank == 0:
        os.remove(path)
    if not blind:
        return
    hosts = comm.all_gather_object(socket.gethostname())
    where = ", ".join(f"rank {r} on {hosts[r]}" for r in blind[:4]) + (" ..." if len(blind) > 4 else "")
    raise RunDirError(f"save folder {save_dir} is not shared by all ranks: {where} cannot see the {what} rank 0 "
                      f"(on {hosts[0]}) created in it, after {shared_folder.VISIBLE_WAIT_S:g} s of looking. Every "
                      f"rank writes its shard into one folder: put --save-dir on a filesystem all nodes mount "
                      f"(NFS, Lustre, ...)")
