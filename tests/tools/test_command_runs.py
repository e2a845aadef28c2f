"""tests/support/command_runs.py, how the tests run a training command line: the exit
status, each rank's output (Python's and what is written to the file descriptors), and
torchrun's environment only where torchrun would have set it."""
from __future__ import annotations

import os
import sys

from tests.support.command_runs import run_command


def test_usage_error_is_rank_0s_one_line_and_exit_2_as_under_torchrun():
    """The same claim test_train_safety checks on the real torchrun: both ranks parse, only
    rank 0 prints, both exit 2, and the exit status comes back."""
    p = run_command("minizero.train", ["--stage", "7"], nproc=2)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "--stage" in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_help_is_printed_once_and_exits_0():
    p = run_command("minizero.train", ["--help"], nproc=2)
    assert p.returncode == 0 and p.stdout.count("usage:") == 1 and p.stderr == "", (p.stdout, p.stderr)


def main(argv):
    """A stand-in program: prints through Python and straight to fds 1 and 2, then exits 3 on rank 1."""
    rank = os.environ.get("RANK", "none")
    print(f"py-out {rank} world={os.environ.get('WORLD_SIZE', 'none')}")
    print(f"py-err {rank}", file=sys.stderr)
    sys.stdout.flush()
    os.write(1, f"fd-out {rank}\n".encode())
    os.write(2, f"fd-err {rank}\n".encode())
    if rank == "1":
        raise SystemExit(3)


def test_each_ranks_fds_are_captured_and_the_failing_ranks_status_returned():
    p = run_command(__name__, [], nproc=2)     # this module's main() above
    assert p.returncode == 3
    assert p.stdout.splitlines() == ["py-out 0 world=2", "fd-out 0", "py-out 1 world=2", "fd-out 1"]
    assert sorted(p.stderr.splitlines()) == ["fd-err 0", "fd-err 1", "py-err 0", "py-err 1"]
    one = run_command(__name__, [], nproc=1)   # `python -m ...` alone: no launcher's variables
    assert one.returncode == 0 and one.stdout.splitlines() == ["py-out none world=none", "fd-out none"]


def test_compares_torchrun_command_lines_are_read_back():
    """from_torchrun reads the command lines compare builds (a -m module, and a script given
    by its absolute path) into what run_command runs."""
    import argparse

    from minizero.compare import compare
    from tests.support.command_runs import ROOT, from_torchrun
    args = argparse.Namespace(dtype="fp32", seed=3, nproc=2, model="tiny", dataset=None, image_size=8, max_steps=10)
    mz = compare.run_command("minizero", 3, args, ["--num-samples", "4"], "c.json", "out")
    ds = compare.run_command("deepspeed", 0, args, [], "c.json", "out")
    assert from_torchrun(mz) == ("minizero.train", mz[mz.index("minizero.train") + 1:], 2)
    assert from_torchrun(ds)[:2] == ("reference/train.py", ds[ds.index(os.path.join(ROOT, "reference", "train.py")) + 1:])
    assert from_torchrun(mz)[1][-2:] == ["--num-samples", "4"] and "--stage" in from_torchrun(ds)[1]
    assert from_torchrun(["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          "-m", "minizero.train", "--stage", "1"]) == ("minizero.train", ["--stage", "1"], 4)
