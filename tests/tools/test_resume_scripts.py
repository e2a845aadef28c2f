"""Checkpoints handed between the two training scripts, through their command lines.

`reference/train.py --resume` once failed on every DeepSpeed checkpoint (DeepSpeed's
load_checkpoint returns the model-states *file*, which the data-position carry took for a
tag folder), and a folder both libraries had written stopped loading in DeepSpeed. The
library-level tests resumed DeepSpeed through the test harness, never through the script,
so nothing caught either. Here every hand-over runs as a user types it (the command lines
of `python -m minizero.train`, `reference/train.py` and `python -m minizero.export_deepspeed`),
one rank, the micro model, 8x8 images, 2-4 steps:

- DeepSpeed resumes its own checkpoint, at every stage;
- DeepSpeed resumes minizero exports: ZeRO-1 and ZeRO-3, fp32 and bf16;
- minizero resumes DeepSpeed's, saving its own checkpoints beside the DeepSpeed folder,
  never into it;
- a folder both libraries wrote (as minizero once did, its tag beside DeepSpeed's, `latest`
  moved): DeepSpeed refuses it with one line naming the conversion, and that conversion
  resumes.

The runs are forked, in order, from one process that imported everything once
(tests/support/script_runs.py).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.support.command_runs import run_command

pytest.importorskip("deepspeed")

DS_DTYPE = {0: "fp32", 1: "bf16", 2: "fp32", 3: "bf16"}   # every stage, both dtypes among them
EXPORTS = {   # name: (minizero run, export --stage, stage, dtype)
    "ex-1-fp32": ("mz1", None, 1, "fp32"),
    "ex-3-fp32": ("mz1", 3, 3, "fp32"),
    "ex-3-bf16": ("mz3", None, 3, "bf16"),
    "ex-1-bf16": ("mz3", 1, 1, "bf16"),
}


def _plan(w: str) -> list[dict]:
    small = ["--model", "micro", "--image-size", "8", "--synthetic-train", "64", "--synthetic-test", "16",
             "--num-samples", "0", "--data-dir", f"{w}/data"]   # no sample grid: nothing here looks at it

    def train(name, prog, stage, dtype, steps, *extra):
        return {"name": name, "cmd": [prog, *small, "--stage", str(stage), "--dtype", dtype, "--max-steps", str(steps),
                                      *extra]}
    plan = [train(f"ds{s}", "reference/train.py", s, d, 2, "--save-dir", f"{w}/ds{s}") for s, d in DS_DTYPE.items()]
    plan += [
        # minizero resumes DeepSpeed's folder: its own checkpoints go beside it, not into it
        train("mz-from-ds1", "minizero.train", 1, "bf16", 3, "--resume", f"{w}/ds1"),
        train("mz-into-ds1", "minizero.train", 1, "bf16", 3, "--resume", f"{w}/ds1", "--save-dir", f"{w}/ds1"),
        # the folder the old trainer left: DeepSpeed's global_step2, minizero's global_step3, latest -> 3
        {"name": "mix", "mix": [f"{w}/ds1", f"{w}/ds1-minizero/global_step3", f"{w}/mixed"]},
    ]
    plan += [train(f"ds{s}-resumed", "reference/train.py", s, d, 3, "--resume", f"{w}/ds{s}")
             for s, d in DS_DTYPE.items()]
    plan += [train("mz1", "minizero.train", 1, "fp32", 2, "--save-dir", f"{w}/mz1"),
             train("mz3", "minizero.train", 3, "bf16", 2, "--save-dir", f"{w}/mz3")]
    for name, (src, stage, _, _) in EXPORTS.items():
        plan.append({"name": name, "cmd": ["minizero.export_deepspeed", f"{w}/{src}", f"{w}/{name}",
                                           *(["--stage", str(stage)] if stage is not None else [])]})
    plan += [train(f"ds-{name}", "reference/train.py", stage, dtype, 3, "--resume", f"{w}/{name}")
             for name, (_, _, stage, dtype) in EXPORTS.items()]
    plan += [
        train("ds-on-mixed", "reference/train.py", 1, "bf16", 4, "--resume", f"{w}/mixed"),
        # the command that refusal names
        {"name": "mixed-export", "cmd": ["minizero.export_deepspeed", f"{w}/mixed", f"{w}/mixed-deepspeed",
                                         "--tag", "global_step3"]},
        train("ds-on-mixed-export", "reference/train.py", 1, "bf16", 4, "--resume", f"{w}/mixed-deepspeed"),
    ]
    return plan


def _mix(ds_folder: str, mz_tag: str, mixed: str) -> None:
    """What `python -m minizero.train --resume <DeepSpeed folder>` once left: minizero's tag
    written into the DeepSpeed folder, `latest` moved to it. Nothing when minizero's tag is
    missing (its run failed): the tests that read the folder then fail on their own line."""
    if not os.path.isdir(mz_tag):
        return
    shutil.copytree(ds_folder, mixed)
    tag = os.path.basename(mz_tag)
    shutil.copytree(mz_tag, os.path.join(mixed, tag))
    with open(os.path.join(mixed, "latest"), "w") as f:
        f.write(tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit status, stdout, stderr)} of every command in _plan, and the work folder.
    The plan runs in two pieces around _mix (a copy of folders, no command)."""
    w = str(tmp_path_factory.mktemp("handover"))
    plan = _plan(w)
    cut = next(i for i, step in enumerate(plan) if "mix" in step)
    results = {}
    for i, piece in enumerate((plan[:cut], plan[cut + 1:])):
        if i == 1:
            _mix(*plan[cut]["mix"])
        path = os.path.join(w, f"plan{i}.json")
        with open(path, "w") as f:
            json.dump(piece, f)
        # forked from the tests' preloaded forkserver (no imports paid); one thread per run
        p = run_command("tests.support.script_runs", [path], timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        for step in piece:
            rc, out, err = (open(os.path.join(w, f"{step['name']}.{ext}")).read() for ext in ("rc", "out", "err"))
            results[step["name"]] = (int(rc), out, err)
    return results, w


def _ok(runs, name) -> str:
    results, _ = runs
    rc, out, err = results[name]
    assert rc == 0 and "Traceback" not in err, f"{name} failed ({rc}):\n{out[-2000:]}\n{err[-4000:]}"
    return out + err


def _error_line(runs, name) -> str:
    results, _ = runs
    rc, out, err = results[name]
    assert rc != 0, f"{name} exited 0:\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in err, f"{name}:\n{err}"
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, f"{name}: expected one error line:\n{err}"
    return lines[0]


def _summary(runs, folder) -> dict:
    _, w = runs
    with open(os.path.join(w, folder, "summary.json")) as f:
        return json.load(f)


def _resumed(runs, name, folder, saved_from, library):
    """The resumed run completed its steps, in `library`, carrying the saved run's losses."""
    text = _ok(runs, name)
    assert "resumed from" in text and "at step 2" in text, text[-2000:]
    s = _summary(runs, folder)
    assert s["library"] == library and s["status"] == "completed"
    assert s["steps"] == 3 and len(s["losses"]) == 3
    if saved_from is not None:
        assert s["losses"][:2] == _summary(runs, saved_from)["losses"][:2]


@pytest.mark.parametrize("stage", sorted(DS_DTYPE))
def test_deepspeed_resumes_its_own_checkpoint(runs, stage):
    _ok(runs, f"ds{stage}")
    # ds1 was resumed by minizero first: its folder must be untouched by that
    _resumed(runs, f"ds{stage}-resumed", f"ds{stage}", None, "deepspeed")
    assert open(os.path.join(runs[1], f"ds{stage}", "latest")).read().strip() == "global_step3"


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_deepspeed_resumes_a_minizero_export(runs, name):
    src, _, stage, dtype = EXPORTS[name]
    _ok(runs, src)
    assert "wrote" in _ok(runs, name)
    _resumed(runs, f"ds-{name}", name, None, "deepspeed")
    s = _summary(runs, name)
    assert (s["stage"], s["dtype"]) == (stage, dtype)
    # the training state rode along in the export: the minizero run's losses come first
    assert s["losses"][:2] == _summary(runs, src)["losses"]


def test_minizero_resumes_deepspeed_beside_its_folder(runs):
    text = _ok(runs, "mz-from-ds1")
    _, w = runs
    assert f"minizero's go into {w}/ds1-minizero" in text
    _resumed(runs, "mz-from-ds1", "ds1-minizero", "ds1", "minizero")
    line = _error_line(runs, "mz-into-ds1")
    assert "--save-dir" in line and "DeepSpeed" in line


def test_a_folder_both_libraries_wrote(runs):
    line = _error_line(runs, "ds-on-mixed")
    assert "global_step3 is a minizero checkpoint" in line
    assert "python -m minizero.export_deepspeed" in line and "--tag global_step3" in line
    # the command the line names, then DeepSpeed resumes what it wrote
    _ok(runs, "mixed-export")
    assert "at step 3" in _ok(runs, "ds-on-mixed-export")
