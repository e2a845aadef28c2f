"""launch/bench_collectives.py: bad flags give one line; a tiny run on 2 gloo ranks prints one
row per (bucket size, op) with both timings measured. Timing itself is not tested."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.script_main import run_script_main

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_collectives.py"


@pytest.mark.parametrize("argv, says", [
    (["--buckets", "3"], "multiple of --world-size 2"),
    (["--buckets", "a,b"], "comma-separated integers"),
    (["--buckets", "-2"], "must be >= 0"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--dtype", "fp8"], "--dtype"),
    (["--compute-ms", "-1"], "--compute-ms must be >= 0"),
])
def test_bad_flags_give_one_line(argv, says):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("bench_collectives: error:") and says in err[0], err


def test_tiny_run_prints_every_op_and_bucket():
    """main(argv) here, its ranks forked from the tests' preloaded forkserver
    (tests/support/script_main.py); the bad-flag cases above run the command itself."""
    r = run_script_main(SCRIPT, ["--numel", "4000", "--buckets", "1000,0", "--reps", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in r.stdout.splitlines() if x.startswith("| ")][1:]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (op, size, n) for size, n in (("1,000", "4"), ("4,000", "1"))
        for op in ("all_reduce", "reduce_scatter", "all_gather")]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 and row[5].endswith("x") for row in rows)


def test_beside_compute_adds_the_cost_over_compute_alone():
    """--compute-ms: the same rows, plus the compute alone and each op's time over it, one at a
    time and back to back (differences of two timings: they may be negative on a noisy machine,
    so only their presence is checked; the compute itself must have taken time)."""
    r = run_script_main(SCRIPT, ["--numel", "4000", "--buckets", "1000", "--reps", "1", "--compute-ms", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("| ")]
    assert lines[0].endswith("| compute alone, ms | beside compute, one at a time: ms over compute | "
                             "beside compute, back to back: ms over compute |")
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in lines[1:]]
    assert [row[0] for row in rows] == ["all_reduce", "reduce_scatter", "all_gather"]
    assert all(len(row) == 9 and float(row[6]) > 0 and all(float(c) == float(c) for c in row[7:]) for row in rows)
