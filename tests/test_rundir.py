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

from minizero import rundir
from minizero.rundir import RunDirError, RunDirLock


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
