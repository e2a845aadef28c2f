"""The save folder on a cluster's file systems, with the file system faked.

- flock: only EWOULDBLOCK (BlockingIOError) means another run holds the folder. Lustre
  mounted without `-o flock` and NFS without lockd answer ENOSYS / ENOLCK / EOPNOTSUPP:
  the run warns once and goes on (before: "in use by a run that is still going", so no run
  could ever start there). Any other error is one line naming the lock file.
"""
from __future__ import annotations

import errno
import fcntl

import pytest

from minizero.train import rundir
from minizero.train.rundir import RunDirError, RunDirLock


def _flock_raising(err):
    def flock(fh, op):
        if op & fcntl.LOCK_EX:
            raise err
    return flock


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_warns_once_and_goes_on(tmp_path, monkeypatch, capsys, code):
    monkeypatch.setattr(rundir.fcntl, "flock", _flock_raising(OSError(code, "no locks here")))
    monkeypatch.setattr(rundir, "_warned_no_locking", False)
    for _ in range(2):
        lock = RunDirLock(str(tmp_path / "run")).acquire()
        lock.release()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "does not support file locks (no locks here)" in err, err


def test_a_lock_held_elsewhere_is_refused_as_in_use(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.fcntl, "flock", _flock_raising(BlockingIOError(errno.EWOULDBLOCK, "busy")))
    with pytest.raises(RunDirError, match="in use by a run that is still going"):
        RunDirLock(str(tmp_path / "run")).acquire()


def test_another_lock_error_is_one_line_naming_the_lock_file(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.fcntl, "flock", _flock_raising(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(RunDirError, match=r"cannot lock .*\.minizero\.lock: Input/output error") as e:
        RunDirLock(str(tmp_path / "run")).acquire()
    assert "in use" not in str(e.value)


def test_the_real_lock_still_refuses_a_second_holder(tmp_path):
    with RunDirLock(str(tmp_path / "run")):
        with pytest.raises(RunDirError, match="in use by a run that is still going"):
            RunDirLock(str(tmp_path / "run")).acquire()


# ----------------------------------------------------------------------------- the save folder probe
# - A save folder that is node-local (each node its own disk at that path) is refused at start,
#   in one line from every rank, by a file rank 0 creates and every rank looks for (one MAX
#   all-reduce). Before: found at the first save, after the whole run had trained.

def _claim(folders):
    from minizero import comm
    from minizero.checkpoint_files import shared_folder
    shared_folder.VISIBLE_WAIT_S = 1.0   # rank 1 of a node-local folder looks again this long first
    save = folders[comm.get_rank()]
    try:
        lock = rundir.claim_for_all_ranks(save, None, None)
    except RunDirError as e:
        return "refused", str(e)
    import os
    comm.barrier()   # rank 0 has removed its probe (refuse_unshared) before any rank looks
    probes = sorted(f for f in os.listdir(save) if f.startswith(".minizero.probe"))
    comm.barrier()   # every rank has looked before rank 0 releases (and removes the empty folder)
    if lock is not None:
        lock.release()
    return "claimed", probes


def test_two_folders_one_per_node_are_refused_at_start_on_every_rank(tmp_path):
    from tests.support.launcher import run_ranks
    out = run_ranks(_claim, world_size=2, args=([str(tmp_path / "node0"), str(tmp_path / "node1")],), timeout=120)
    assert [o[0] for o in out] == ["refused", "refused"], out
    assert out[0][1] == out[1][1].replace("node1", "node0") and "is not shared by all ranks: rank 1 on" in out[0][1]
    # The refused run leaves nothing: no probe file, and not the folder it created either.
    assert not (tmp_path / "node0").exists()


def test_one_shared_folder_is_claimed_and_the_probe_removed(tmp_path):
    from tests.support.launcher import run_ranks
    folder = str(tmp_path / "shared")
    assert run_ranks(_claim, world_size=2, args=([folder, folder],), timeout=120) == [("claimed", [])] * 2


def _claim_unwritable(folder):
    import os
    real_open = open

    def refusing_open(path, *a, **k):
        if os.path.basename(str(path)).startswith(".minizero.probe"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)
    import builtins
    builtins.open = refusing_open
    try:
        return _claim([folder, folder])
    finally:
        builtins.open = real_open


def test_a_folder_rank_0_cannot_write_into_is_one_line_on_every_rank(tmp_path):
    # rank 0 alone fails to create the probe: it must not leave the other ranks waiting
    from tests.support.launcher import run_ranks
    out = run_ranks(_claim_unwritable, world_size=2, args=(str(tmp_path / "ro"),), timeout=120)
    assert [o[0] for o in out] == ["refused", "refused"], out
    assert "cannot write into" in out[0][1] and "Permission denied" in out[0][1] and out[0][1] == out[1][1]
