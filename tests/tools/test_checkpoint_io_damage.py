"""Damaged and incomplete checkpoints: which folders count, and one clear line, on every rank,
naming the file, when a file cannot be read (resume and zero_to_fp32)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from minizero.checkpoint_files.checkpoint_folder import CheckpointError, complete_tags, describe_tags, optim_file
from tests.support.launcher import run_ranks
from tests.tools.test_checkpoint_io import _one_step, checkpoint_engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK1 = optim_file(1)


def _save_two_steps(d):
    engine = checkpoint_engine(1, "fp32")
    for s in range(2):
        _one_step(engine, s)
        engine.save_checkpoint(d)   # global_step1, global_step2


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A ZeRO-1 run on 2 ranks with two complete checkpoints; tests work on copies."""
    d = str(tmp_path_factory.mktemp("run") / "run")
    run_ranks(_save_two_steps, 2, (d,), timeout=120)
    assert complete_tags(d) == ["global_step1", "global_step2"]
    return d


def _copy(src, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


def test_complete_tags_skips_tmp_and_incomplete_folders(two_rank_run, tmp_path):
    d = _copy(two_rank_run, tmp_path)
    step = lambda name: os.path.join(d, name)
    for name in ("global_step10", "global_step3.tmp", "global_step4", "global_step5", "global_step6"):
        shutil.copytree(step("global_step2"), step(name))
    os.remove(os.path.join(step("global_step4"), RANK1))                  # rank 1's shard missing
    _truncate(os.path.join(step("global_step5"), "mp_rank_00_model_states.pt"))
    os.remove(os.path.join(step("global_step6"), "mp_rank_00_model_states.pt"))
    open(step("notes.txt"), "w").close()
    # global_step10 holds step 2 too: equal steps sort by name, global_step2 before global_step10
    assert complete_tags(d) == ["global_step1", "global_step2", "global_step10"]
    os.remove(step("latest"))
    assert describe_tags(d) == (f"complete checkpoints in {d}: global_step1, global_step2, global_step10 "
                                "(pick one with --tag TAG)")
    assert complete_tags(str(tmp_path / "nowhere")) == []


def _load_damaged(d):
    engine = checkpoint_engine(1, "fp32")
    before = engine.full_fp32_state_dict()
    try:
        engine.load_checkpoint(d)
        msg = None
    except CheckpointError as e:
        msg = str(e)
    after = engine.full_fp32_state_dict()     # a collective: every rank is still in step
    untouched = all(torch.equal(before[k], after[k]) for k in before)
    path, _ = engine.load_checkpoint(d, tag="global_step1")   # another complete tag still loads
    return msg, untouched, path, engine.global_steps


def test_truncated_shard_of_rank1_is_one_error_on_every_rank(two_rank_run, tmp_path):
    d = _copy(two_rank_run, tmp_path)
    bad = os.path.join(d, "global_step2", RANK1)
    _truncate(bad)
    results = run_ranks(_load_damaged, 2, (d,), timeout=120)   # a hang would time out
    for rank, (msg, untouched, path, steps) in enumerate(results):
        # rank 0 prints the trainer's errors: it names rank 1's file too
        assert msg is not None and msg.count("\n") == 0, (rank, msg)
        assert msg.startswith(f"{bad}: damaged or incomplete checkpoint file (truncated or overwritten: "), (rank, msg)
        assert msg.endswith(f"other complete checkpoints in {d}: global_step1 (pick one with --tag TAG)"), msg
        assert untouched, rank          # nothing was loaded half-way
        assert path == os.path.join(d, "global_step1") and steps == 1


def test_zero_to_fp32_on_a_missing_folder_says_so(tmp_path, capsys):
    from minizero.checkpoint_files.zero_to_fp32 import main
    missing = str(tmp_path / "nope")
    assert main([missing, str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m minizero.zero_to_fp32: error: {missing}: no such directory\n"


def test_zero_to_fp32_on_a_truncated_shard_is_one_line(two_rank_run, tmp_path):
    d = _copy(two_rank_run, tmp_path)
    bad = os.path.join(d, "global_step2", RANK1)
    _truncate(bad)
    out = str(tmp_path / "out.pt")
    p = subprocess.run([sys.executable, "-m", "minizero.zero_to_fp32", d, out], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{bad}: damaged or incomplete checkpoint file" in lines[0]
    assert "other complete checkpoints" in lines[0] and ": global_step1 (pick one with --tag TAG)" in lines[0]
    assert not os.path.exists(out)
    # the other checkpoint still consolidates
    from minizero.checkpoint_files.zero_to_fp32 import main
    assert main([d, out, "--tag", "global_step1"]) == 0 and os.path.exists(out)


def _save_node_local(d):
    """Rank 1 plays a rank on another node whose local disk has its own, empty `d`: it does
    not see the `<tag>.tmp` folder rank 0 creates (os.path.isdir is what save asks)."""
    import torch.distributed as dist
    from minizero.checkpoint_files import checkpoint_io as checkpoint
    from minizero.checkpoint_files import shared_folder
    shared_folder.VISIBLE_WAIT_S = 1.0   # rank 1 looks again this long before the refusal
    engine = checkpoint_engine(1, "fp32")
    _one_step(engine, 0)
    if dist.get_rank() == 1:
        real = os.path.isdir
        checkpoint.os.path.isdir = lambda p: False if str(p).startswith(d) else real(p)
    try:
        engine.save_checkpoint(d)
    except CheckpointError as e:
        return str(e), sorted(os.listdir(d)) if os.path.isdir(d) else None
    return None, None


def test_save_folder_not_shared_by_all_ranks_is_one_error_on_every_rank(tmp_path):
    d = str(tmp_path / "local")
    for msg, left in run_ranks(_save_node_local, 2, (d,), timeout=120):
        assert msg is not None and "is not shared by all ranks" in msg and "rank 1 on " in msg, msg
        assert "filesystem all nodes mount" in msg
    assert os.listdir(d) == []           # rank 0 removed its .tmp; nothing else was written
