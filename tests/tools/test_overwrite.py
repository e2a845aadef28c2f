"""--overwrite: a lesson's command can be run again as printed, and nothing but a finished run is ever deleted.

Without the flag a save folder that holds a run is refused (tests/tools/test_train_safety.py);
with it, rank 0 (holding the folder's lock) removes that run's files, but only when the folder
holds one finished run (summary.json with a final status) and nothing a run does not write.
Anything else is refused in one line with nothing removed: a folder with a user's files in
it, a run killed before its end (no summary.json), a run still going (its lock), and
--overwrite into the folder that --resume continues.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from minizero.train import rundir
from minizero.train.rundir import RunDirError, RunDirLock, claim
from tests.support.command_runs import run_command


def _finished_run(folder, status="completed"):
    """A save folder as a run leaves it (the files of runlog.finish and checkpoint_io.save)."""
    os.makedirs(os.path.join(folder, "global_step3"))
    for name, text in [("metrics.csv", "step\n3\n"), ("latest", "global_step3"), ("samples.png", "png"),
                       ("global_step3/mp_rank_00_model_states.pt", "x"), ("comms_summary.txt", "t")]:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    if status is not None:
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump({"library": "minizero", "status": status}, f)
    return str(folder)


def _files(folder):
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


@pytest.mark.parametrize("status", ["completed", "interrupted", "diverged"])
def test_overwrite_replaces_a_finished_run(tmp_path, status):
    save = _finished_run(tmp_path / "run", status)
    lock = claim(save, None, overwrite=True)
    try:
        assert _files(save) == [rundir.LOCK_FILE], "only this run's lock is left"
    finally:
        lock.release()


def test_without_overwrite_a_finished_run_is_still_refused(tmp_path):
    save = _finished_run(tmp_path / "run")
    before = _files(save)
    with pytest.raises(RunDirError, match="already holds a run .*replace it with --overwrite"):
        claim(save, None)
    assert _files(save) == before


@pytest.mark.parametrize("case,why", [
    ("a user's file beside the run", "also holds files no training run writes \\(notes.txt\\)"),
    ("a run killed before its end", "its run did not finish"),
    ("a summary without a status", "its run did not finish"),
])
def test_overwrite_never_replaces_anything_else(tmp_path, case, why):
    save = _finished_run(tmp_path / "run", status=None if "killed" in case else "completed")
    if "user" in case:
        (tmp_path / "run" / "notes.txt").write_text("mine")
    if "without a status" in case:
        (tmp_path / "run" / "summary.json").write_text(json.dumps({"library": "minizero"}))
    before = _files(save)
    with pytest.raises(RunDirError) as e:
        claim(save, None, overwrite=True)
    assert "\n" not in str(e.value) and "--overwrite replaces only the folder of a finished run" in str(e.value)
    assert re.search(why, str(e.value)), str(e.value)
    assert _files(save) == before, "nothing was removed"


def test_overwrite_leaves_a_folder_without_a_run_as_it_is(tmp_path):
    """A folder that holds no run (only a user's files) is not a run to replace: the new
    run writes beside them, exactly as without the flag, and nothing is deleted."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    lock = claim(str(tmp_path / "run"), None, overwrite=True)
    lock.release()
    assert _files(tmp_path / "run") == ["notes.txt"]


def test_overwrite_of_a_run_still_going_is_refused_as_in_use(tmp_path):
    save = _finished_run(tmp_path / "run")
    before = _files(save)
    with RunDirLock(save):
        with pytest.raises(RunDirError, match="in use by a run that is still going"):
            claim(save, None, overwrite=True)
    assert _files(save) == before


def test_overwrite_with_resume_into_the_same_folder_is_refused(tmp_path):
    save = _finished_run(tmp_path / "run")
    before = _files(save)
    with pytest.raises(RunDirError, match="would delete the checkpoint that --resume"):
        claim(save, save, overwrite=True)
    assert _files(save) == before


def test_the_same_command_runs_twice_with_overwrite(tmp_path):
    """The command line end to end: the second run replaces the first; a third without the
    flag is refused in one line."""
    save = str(tmp_path / "run")
    argv = ["--model", "micro", "--synthetic-train", "64", "--synthetic-test", "16", "--max-steps", "1",
            "--num-samples", "0", "--save-dir", save]
    for flags in ([], ["--overwrite"]):
        p = run_command("minizero.train", argv + flags)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    p = run_command("minizero.train", argv)
    errors = [ln for ln in p.stderr.splitlines() if ": error:" in ln]
    assert p.returncode == 1 and len(errors) == 1 and "--overwrite" in errors[0], p.stderr[-3000:]
