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


def test_wrapped_subprocess_run_keeps_its_arguments_meaning(tmp_path, monkeypatch):
    """Inside torchrun_on_forked_ranks, subprocess.run of a `python -m PROGRAM` command line
    (docs/lesson/lesson_numbers.py's memory_table and torchrun launches) answers as the real
    one would: capture_output with text gives str, without it bytes, DEVNULL drops the
    output, a file gets it, check=True raises on a nonzero exit; other command lines go
    to the real subprocess.run."""
    import subprocess

    from tests.support.command_runs import torchrun_on_forked_ranks
    table = [sys.executable, "-m", "minizero.memory_table", "--paper-figure1"]
    started = []   # the command lines a real process was started for
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, *a, **kw: started.append(cmd) or real_popen(cmd, *a, **kw))
    with torchrun_on_forked_ranks():
        text = subprocess.run(table, capture_output=True, text=True, check=True)
        raw = subprocess.run(table, stdout=subprocess.PIPE)
        dropped = subprocess.run(table, stdout=subprocess.DEVNULL)
        with open(tmp_path / "log", "w") as log:
            subprocess.run(table, stdout=log, stderr=subprocess.STDOUT)
        try:
            subprocess.run([sys.executable, "-m", "minizero.memory_table", "--no-such-flag"], capture_output=True, check=True)
            raised = None
        except subprocess.CalledProcessError as e:
            raised = e
        other = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert text.returncode == 0 and "7,500,000,000 parameters" in text.stdout and isinstance(text.stdout, str)
    assert raw.stdout == text.stdout.encode() and dropped.stdout is None and dropped.returncode == 0
    assert (tmp_path / "log").read_text() == text.stdout + text.stderr
    assert raised is not None and raised.returncode == 2 and b"--no-such-flag" in raised.stderr
    assert other.returncode == 0 and int(other.stdout) != os.getpid()
    assert started == [other.args], started      # the memory_table runs started no interpreter
