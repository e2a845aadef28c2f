"""`python -m minizero.selftest`, the one-minute check of an install: it passes on a sound
install (every stage bit-identical to plain PyTorch and to DeepSpeed), and it fails, naming
the stages, when the reduce-scatter is broken."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from minizero.runtime import selftest

HAS_DS = importlib.util.find_spec("deepspeed") is not None


def _rows(out: str) -> dict:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    return {int(r[0]): r[1:] for r in rows[1:]}


@pytest.mark.skipif(not HAS_DS, reason="DeepSpeed not installed")
def test_selftest_passes_against_pytorch_and_deepspeed(capsys, monkeypatch, tmp_path):
    """Run from another folder, with the checkout off sys.path: reference/ comes from the
    install (pyproject installs it beside minizero), not from the current folder."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != repo])
    for name in [m for m in sys.modules if m == "reference" or m.startswith("reference.")]:
        monkeypatch.delitem(sys.modules, name)
    assert selftest.main([]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert sorted(rows) == [0, 1, 2, 3]
    assert all(r[1:] == ["equal", "equal"] for r in rows.values()), out
    assert "all checks passed" in out


def _broken_reduce_scatter_rank(stages):
    """selftest's minizero ranks with a reduce-scatter that hands each rank its neighbour's
    chunk (the sum is right, the shard is not): stages 1-3 reduce-scatter gradients, stage
    0 all-reduces them."""
    import torch.distributed as dist

    from tests.support.engine_runs import torch_names
    for name in torch_names("reduce_scatter"):   # both spellings: comm.py calls torch's current one
        def neighbours_chunk(output, input, *a, _real=getattr(dist, name), **k):
            return _real(output, input.roll(output.numel()), *a, **k)
        setattr(dist, name, neighbours_chunk)
    return selftest.minizero_rank(stages)


def test_selftest_fails_on_a_broken_reduce_scatter(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "minizero_rank", _broken_reduce_scatter_rank)
    assert selftest.main(["--no-deepspeed"]) == 1
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows[0][1] == "equal", out                       # stage 0 never reduce-scatters
    for s in (1, 2, 3):
        assert rows[s][1].startswith("FAIL: "), out
    assert "FAILED: 3 check(s)" in out


def test_a_rank_that_raises_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "minizero_rank", _raising_rank)
    assert selftest.main(["--no-deepspeed"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["selftest: FAILED: a rank raised: rank 1: ValueError: rank 1 is broken"], err


def _raising_rank(stages):
    from minizero import comm
    if comm.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    return selftest.minizero_rank(stages)
