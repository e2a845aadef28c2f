"""--num-samples 0: a run that draws no sample grid, and minizero.compare's runs, which draw none.

The grid is one sequential forward per pixel (63 at 8x8, 1,023 at 32x32), each through
ZeRO-3's gathers; nothing in a comparison looks at it, so compare asks for none unless told.
"""
from __future__ import annotations

import argparse
import os

from minizero.compare.compare import run_command as compare_command
from tests.support.command_runs import run_command

SMALL = ["--model", "micro", "--image-size", "8", "--synthetic-train", "64", "--synthetic-test", "16",
         "--max-steps", "2"]


def _train(args):
    p = run_command("minizero.train", args, timeout=240)
    return p.returncode, p.stdout, p.stderr


def test_zero_samples_draws_no_grid_and_says_what_it_wrote(tmp_path):
    save = str(tmp_path / "run")
    code, out, err = _train([*SMALL, "--num-samples", "0", "--data-dir", str(tmp_path / "data"), "--save-dir", save])
    assert code == 0, err[-3000:]
    assert not os.path.exists(os.path.join(save, "samples.png"))
    assert os.path.exists(os.path.join(save, "summary.json")) and os.path.exists(os.path.join(save, "metrics.csv"))
    assert f"wrote metrics.csv, summary.json to {save}" in out


def test_bad_sample_counts_are_one_line(tmp_path):
    for args, says in ((["--num-samples", "-1"], "--num-samples must be >= 0"),
                       (["--num-samples", "0", "--sample-every", "1"], "give --num-samples >= 1")):
        code, out, err = _train([*SMALL, *args, "--data-dir", str(tmp_path / "data"),
                                 "--save-dir", str(tmp_path / "never")])
        lines = [ln for ln in err.splitlines() if ": error:" in ln]
        assert code == 2 and len(lines) == 1 and says in lines[0], err[-2000:]
        assert not os.path.exists(tmp_path / "never")


def test_compare_asks_for_no_grid_unless_told():
    args = argparse.Namespace(stage=3, dtype="bf16", seed=0, nproc=2, model=None, dataset=None, image_size=None,
                              max_steps=None)
    cmd = compare_command("minizero", 3, args, [], "cfg.json", "out")
    assert cmd[cmd.index("--num-samples") + 1] == "0"
    cmd = compare_command("deepspeed", 3, args, ["--num-samples", "4"], "cfg.json", "out")
    assert cmd.count("--num-samples") == 1 and cmd[cmd.index("--num-samples") + 1] == "4"
    cmd = compare_command("minizero", 3, args, ["--num-samples=2"], "cfg.json", "out")
    assert "--num-samples" not in cmd and "--num-samples=2" in cmd
