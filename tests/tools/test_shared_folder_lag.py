"""A shared save folder on NFS whose other nodes see rank 0's new files late, with the file system faked.

An NFS client mounted with the defaults (`lookupcache=all`, nfs(5)) remembers a lookup that
found nothing: a node that looked for --save-dir before rank 0 created it is told "no such
file" from its cache for up to a minute, unless it opens the folder above again. Before,
every rank looked up --save-dir on the command line (train_args.check_values), before rank 0
created it, and then looked once for the probe file rank 0 wrote into it: a shared folder
was refused at start as "not shared by all ranks". The checkpoint probe (`<tag>.tmp`) the
same. Now --save-dir is looked up by rank 0 alone on a multi-rank launch, and a rank that
does not see the probe at once re-reads the folders toward it (shared_folder.py) before the
run calls the folder unshared; rank 0 says that it waits.

`LaggingNfsView` plays rank 1's node: a path under the test's folder that it found missing
stays missing (however long the test runs) until the folder holding it is listed.
"""
from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import time

from tests.support.launcher import run_ranks


class LaggingNfsView:
    """One node's view of `root` through an NFS client with lookupcache=all: os.path.exists,
    os.path.isdir and os.listdir as that node answers them. Paths outside `root` are real."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.remembered_missing: set[str] = set()
        self.real_exists, self.real_isdir, self.real_listdir = os.path.exists, os.path.isdir, os.listdir

    def sees(self, path) -> bool:
        full = os.path.abspath(path)
        if not full.startswith(self.root + os.sep):
            return self.real_exists(full)
        cur = self.root
        for part in os.path.relpath(full, self.root).split(os.sep):
            cur = os.path.join(cur, part)
            if cur in self.remembered_missing:
                return False   # the cached "no such file", even if rank 0 has created it since
            if not self.real_exists(cur):
                self.remembered_missing.add(cur)
                return False
        return True

    def isdir(self, path) -> bool:
        return self.sees(path) and self.real_isdir(path)

    def listdir(self, path="."):
        full = os.path.abspath(path)
        if not self.sees(full):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        # opening a folder revalidates it: the names remembered missing in it are forgotten
        self.remembered_missing = {p for p in self.remembered_missing if os.path.dirname(p) != full}
        return self.real_listdir(path)

    def isfile(self, path) -> bool:
        return self.sees(path) and self.real_isfile(path)

    def open(self, path, *a, **k):
        """open() of a file this node remembers missing: "no such file", as its cache says."""
        if isinstance(path, (str, os.PathLike)) and not self.sees(os.fspath(path)):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        return self.real_open(path, *a, **k)

    def install(self, files: bool = False) -> None:
        """files: also os.path.isfile and open (a file's name is remembered missing as a folder's is)."""
        os.path.exists, os.path.isdir, os.listdir = self.sees, self.isdir, self.listdir
        if files:
            self.real_isfile, self.real_open = os.path.isfile, builtins.open
            os.path.isfile, builtins.open = self.isfile, self.open


def _lagging_on_rank_1(root: str, files: bool = False) -> None:
    from minizero import comm
    if comm.get_rank() == 1:
        LaggingNfsView(root).install(files)


def _start(root: str, save: str, looked_before: str):
    """The trainer's start on 2 ranks, rank 1 on a lagging node. looked_before: "command-line"
    (every rank checks the command line, as precheck does), "script" (rank 1's node looked
    up the folder before rank 0 created it: a job script's `ls`, another tool)."""
    from minizero import comm
    from minizero.train import rundir, train_args
    _lagging_on_rank_1(root)
    parser = train_args.build_parser()
    train_args.check_values(parser, parser.parse_args(["--save-dir", save]))
    if looked_before == "script" and comm.get_rank() == 1:
        assert not os.path.exists(save)
    comm.barrier()   # every rank has looked before rank 0 creates the folder
    err, t0 = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err):
            lock = rundir.claim_for_all_ranks(save, None, None)
    except rundir.RunDirError as e:
        return "refused", str(e), err.getvalue()
    seconds = time.monotonic() - t0
    comm.barrier()
    left = sorted(f for f in os.listdir(save) if f.startswith(".minizero.probe"))
    comm.barrier()   # every rank has looked before rank 0 releases the lock (and the folder)
    if lock is not None:
        lock.release()
    return "claimed", left, err.getvalue(), seconds


def test_a_rank_that_looked_on_its_command_line_still_sees_the_shared_folder(tmp_path):
    # Before: refused, "rank 1 on ... cannot see the file rank 0 created in it".
    save = str(tmp_path / "runs" / "a")
    out = run_ranks(_start, 2, args=(str(tmp_path), save, "command-line"), timeout=120)
    assert [o[0] for o in out] == ["claimed", "claimed"], out
    assert out[0][1] == [] and out[1][1] == [], out   # the probe is gone
    assert out[0][2] == "", out   # rank 1 never looked before the folder existed: no wait at all


def test_a_rank_whose_node_remembers_the_folder_missing_looks_again(tmp_path):
    save = str(tmp_path / "runs" / "b")
    out = run_ranks(_start, 2, args=(str(tmp_path), save, "script"), timeout=120)
    assert [o[0] for o in out] == ["claimed", "claimed"], out
    assert "minizero: rank 1 cannot see" in out[0][2] and "waiting up to 60 s" in out[0][2], out[0][2]
    assert out[1][2] == "", out   # one line, from rank 0
    # re-reading the folders found it at once: the fake never forgets on its own
    assert max(o[3] for o in out) < 15, out


def _save(root: str, d: str):
    """Rank 1's node looked for the save folder before there was one (a script deciding
    whether to resume), then the engine saves into it."""
    from minizero import comm
    from minizero.checkpoint_files.checkpoint_folder import CheckpointError, complete_tags
    from tests.tools.test_checkpoint_io import _one_step, checkpoint_engine
    _lagging_on_rank_1(root)
    engine = checkpoint_engine(1, "fp32")
    _one_step(engine, 0)
    assert not os.path.exists(d)
    comm.barrier()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            engine.save_checkpoint(d)
    except CheckpointError as e:
        return "refused", str(e)
    return "saved", complete_tags(d), err.getvalue()


def test_a_checkpoint_into_a_folder_a_node_remembers_missing_is_saved(tmp_path):
    # Before: CheckpointError "save folder ... is not shared by all ranks: rank 1 on ...".
    d = str(tmp_path / "ckpt")
    out = run_ranks(_save, 2, args=(str(tmp_path), d), timeout=180)
    assert [o[0] for o in out] == ["saved", "saved"], out
    assert out[0][1] == ["global_step1"], out
    assert "minizero: rank 1 cannot see" in out[0][2], out


def _start_node_local(root: str, folders: list[str], wait_s: float):
    """Rank 1's node has its own disk at the path (never sees rank 0's files)."""
    from minizero import comm
    from minizero.checkpoint_files import shared_folder
    from minizero.train import rundir
    shared_folder.VISIBLE_WAIT_S = wait_s
    _lagging_on_rank_1(root)
    err, t0 = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err):
            rundir.claim_for_all_ranks(folders[comm.get_rank()], None, None)
    except rundir.RunDirError as e:
        return str(e), err.getvalue(), time.monotonic() - t0
    return None


def test_a_folder_that_is_not_shared_is_still_refused_in_one_line_after_the_wait(tmp_path):
    folders = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = run_ranks(_start_node_local, 2, args=(str(tmp_path), folders, 1.0), timeout=120)
    assert all(o is not None for o in out), out
    assert out[0][0] == out[1][0].replace("node1", "node0"), out
    assert "is not shared by all ranks: rank 1 on" in out[0][0] and "after 1 s of looking" in out[0][0], out
    assert "waiting up to 1 s" in out[0][1] and out[1][1] == "", out
    assert all(1 <= o[2] < 20 for o in out), out   # it waited, but no longer than asked
    assert not (tmp_path / "node0").exists()


# ----------------------------------------------------------------------------- --resume: `latest` read by rank 0 alone

def _resume(root: str, d: str):
    """Rank 1's node looked for `latest` and the tag folder before the run that saves them
    (a job script checking whether to resume); a new engine then resumes d, as --resume does,
    and the trainer's resume plan (find_checkpoint, on rank 0, told to every rank)."""
    import argparse

    from minizero import comm
    from minizero.train.runsetup import on_rank0, resume_plan
    from tests.tools.test_checkpoint_io import _one_step, checkpoint_engine
    _lagging_on_rank_1(root, files=True)
    engine = checkpoint_engine(1, "fp32")
    _one_step(engine, 0)
    if comm.get_rank() == 0:
        os.makedirs(d)
    comm.barrier()
    if comm.get_rank() == 1:   # it sees d, and remembers the names it looked up in it as missing
        assert os.path.isdir(d) and not os.path.exists(os.path.join(d, "latest"))
        assert not os.path.exists(os.path.join(d, "global_step1"))
    comm.barrier()
    with contextlib.redirect_stderr(io.StringIO()):
        engine.save_checkpoint(d)
    comm.barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        path, client = checkpoint_engine(1, "fp32").load_checkpoint(d)
        plan = on_rank0(lambda: resume_plan(argparse.Namespace(resume=d, tag=None, save_dir=None), "minizero", d))
    return path, plan, err.getvalue()


def test_a_resume_on_a_node_that_remembers_latest_missing_loads_rank_0s_tag(tmp_path):
    # Before: rank 1 read no `latest` and returned (None, None) while rank 0 loaded global_step1
    # and waited for it in a collective (this test failed with a closed connection).
    d = str(tmp_path / "ckpt")
    out = run_ranks(_resume, 2, args=(str(tmp_path), d), timeout=180)
    tag = os.path.join(d, "global_step1")
    assert [o[0] for o in out] == [tag, tag], out
    assert [o[1] for o in out] == [("global_step1", d)] * 2, out
    assert f"minizero: rank 1 cannot see {tag} yet, which rank 0 sees" in out[0][2], out   # it looked again


# ----------------------------------------------------------------------------- --save-dir looked up by rank 0 alone

def test_only_a_single_process_launch_checks_save_dir_on_the_command_line(monkeypatch):
    from minizero.train.train_args import launched_ranks
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    assert launched_ranks() == 1                           # python -m minizero.train
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    assert launched_ranks() == 8                           # srun python -m minizero.train
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert launched_ranks() == 16                          # torchrun (inside srun or not)


def test_a_save_dir_under_a_file_on_two_ranks_is_one_line_from_rank_0(tmp_path):
    """On a multi-rank launch rank 0 checks --save-dir once the group is up: still one line,
    every rank stops, nothing created."""
    from tests.support.command_runs import run_command
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    p = run_command("minizero.train", ["--model", "micro", "--image-size", "8", "--synthetic-train", "32",
                                       "--synthetic-test", "8", "--num-samples", "0", "--data-dir", str(tmp_path),
                                       "--save-dir", f"{a_file}/run"], nproc=2, timeout=180)
    assert all(rc != 0 for rc in p.rank_returncodes) and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and f"--save-dir {a_file}/run: {a_file} is a file" in lines[0], p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
