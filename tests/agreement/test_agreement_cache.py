"""The agreement runs' cache across pytest-xdist workers (tests/support/agreement.py, _shared):
what one worker stores the next loads, and outside xdist nothing is written."""
import os
import tempfile

import torch

from tests.support import agreement as A


def test_a_stored_run_is_loaded_by_the_next_worker_and_nothing_is_written_outside_xdist(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "run1")
    with A._shared("ds-0-fp32") as (load, store):
        assert load() is None
        store([{"losses": [1.0, 0.5], "final_state": {"w": torch.arange(3.0)}}])
    with A._shared("ds-0-fp32") as (load, store):   # another worker, later
        runs = load()
    assert runs[0]["losses"] == [1.0, 0.5] and torch.equal(runs[0]["final_state"]["w"], torch.arange(3.0))
    assert sorted(os.listdir(tmp_path / "minizero-agreement-run1")) == ["ds-0-fp32.lock", "ds-0-fp32.pt"]

    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID")
    with A._shared("mz") as (load, store):
        assert load() is None
        store({"x": 1})
    assert os.listdir(tmp_path) == ["minizero-agreement-run1"]
