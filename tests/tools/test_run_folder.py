"""What a run leaves on disk, and what it says, when it is refused or ends: through the
scripts' command lines.

- an output path that cannot be a folder (--trace or --save-dir naming a file, compare's
  --out) is one line before anything is created, not a FileExistsError traceback after the
  save folder was made;
- a refused run leaves no folder it created (a missing dataset once left one holding only
  `.minizero.lock`), and a finished run removes its lock file (one with a pid in it reads as
  a stale lock);
- under torchrun, rank 0's one line is also the "Root Cause" of torchrun's own report;
- a mistyped config key gets "did you mean", and no list of accepted keys to bury it (the list only where nothing is near);
- `python -m minizero.reshard` on a folder that holds no checkpoint says so once;
- a usage error is answered before torch is imported (a fraction of a second, not ~3 s).

The single-process command lines are forked from one preloaded process
(tests/support/script_runs.py); the torchrun case is its own launch, torchrun forked as
`python -m torch.distributed.run` (tests/support/python_m.py) and its ranks fresh
interpreters, and `python -m minizero.compare` is forked the same way.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support import python_m
from tests.support.command_runs import run_command
from tests.tools.test_train import PY, ROOT, _env, _torchrun

# --num-samples 0: no test here looks at samples.png (tests/tools/test_train.py does)
TINY = ["--model", "micro", "--image-size", "8", "--synthetic-train", "32", "--synthetic-test", "8",
        "--num-samples", "0"]


def _plan(w: str) -> list[dict]:
    data = ["--data-dir", f"{w}/data"]
    return [
        {"name": "finished", "cmd": ["minizero.train", *TINY, *data, "--max-steps", "1", "--save-dir", f"{w}/finished"]},
        {"name": "trace-file", "cmd": ["minizero.train", *TINY, *data, "--max-steps", "1", "--trace", f"{w}/a-file",
                                       "--save-dir", f"{w}/traced"]},
        {"name": "save-dir-file", "cmd": ["minizero.train", *TINY, *data, "--save-dir", f"{w}/a-file/run"]},
        {"name": "cifar-offline", "cmd": ["minizero.train", *TINY, "--dataset", "cifar10", "--data-dir", f"{w}/empty",
                                          "--save-dir", f"{w}/new/cifar"]},
        {"name": "typo", "cmd": ["minizero.train", *TINY, *data, "--config", f"{w}/typo.json",
                                 "--save-dir", f"{w}/typo"]},
        {"name": "reshard-empty", "cmd": ["minizero.reshard", f"{w}/empty", f"{w}/resharded", "--world-size", "2"]},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    w = str(tmp_path_factory.mktemp("runfolder"))
    os.makedirs(f"{w}/empty")
    with open(f"{w}/a-file", "w") as f:
        f.write("not a folder\n")
    with open(f"{w}/typo.json", "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 8, "gradient_cliping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}, f)
    plan = _plan(w)
    with open(f"{w}/plan.json", "w") as f:
        json.dump(plan, f)
    p = run_command("tests.support.script_runs", [f"{w}/plan.json"], timeout=300)   # one thread, as each rank
    assert p.returncode == 0, p.stdout + p.stderr
    results = {s["name"]: tuple(open(f"{w}/{s['name']}.{ext}").read() for ext in ("rc", "out", "err")) for s in plan}
    return {k: (int(rc), out, err) for k, (rc, out, err) in results.items()}, w


def _python_m(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (cmd, from PY on) on a process forked from the preloaded
    forkserver (tests/support/python_m.py): its exit status, stdout and stderr."""
    assert cmd[:2] == [PY, "-m"], cmd
    env = {k: v for k, v in _env().items() if os.environ.get(k) != v}
    return run_command("tests.support.python_m", [json.dumps([cmd[2:]])], 1, launcher=False,
                       rank_env=[{**env, python_m.INDEX_ENV: "0"}], timeout=timeout)


def _refused(runs, name) -> tuple[str, str]:
    """(its one error line, all of stderr) of a run that must stop on bad input."""
    rc, out, err = runs[0][name]
    assert rc != 0 and "Traceback" not in err, f"{name} ({rc}):\n{out[-1500:]}\n{err[-3000:]}"
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, f"{name}: expected one error line:\n{err}"
    return lines[0], err


def test_finished_run_removes_its_lock(runs):
    rc, out, err = runs[0]["finished"]
    assert rc == 0, err[-3000:]
    folder = os.path.join(runs[1], "finished")
    assert os.path.exists(os.path.join(folder, "summary.json"))
    assert not os.path.exists(os.path.join(folder, ".minizero.lock"))


@pytest.mark.parametrize("name, flag", [("trace-file", "--trace"), ("save-dir-file", "--save-dir")])
def test_an_output_path_that_is_a_file_is_one_line_and_nothing_is_created(runs, name, flag):
    line, _ = _refused(runs, name)
    assert flag in line and "a-file" in line and "is a file" in line, line
    assert not os.path.exists(os.path.join(runs[1], "traced"))


def test_refused_run_leaves_no_folder_it_created(runs):
    line, _ = _refused(runs, "cifar-offline")
    assert "--dataset synthetic" in line
    assert not os.path.exists(os.path.join(runs[1], "new"))   # neither the save folder nor its parent


def test_config_typo_suggests_the_key(runs):
    line, err = _refused(runs, "typo")
    assert "unknown config key 'gradient_cliping': did you mean 'gradient_clipping'?" in line
    assert "does not implement" not in line and "train_micro_batch_size_per_gpu" not in line, line
    assert "accepted keys" not in err, err   # one line: the suggestion alone, no list to bury it
    assert not os.path.exists(os.path.join(runs[1], "typo"))


def test_reshard_of_a_folder_without_checkpoint_says_it_once(runs):
    line, _ = _refused(runs, "reshard-empty")
    assert line.count("checkpoint") == 1 and "holds no checkpoint" in line, line
    assert not os.path.exists(os.path.join(runs[1], "resharded"))


def test_compare_refuses_an_out_path_that_is_a_file(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("matplotlib")
    a_file = tmp_path / "report"
    a_file.write_text("")
    p = _python_m([PY, "-m", "minizero.compare", "--out", str(a_file)], timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "--out" in lines[0] and "is a file" in lines[0], p.stderr


def test_torchrun_reports_the_one_line_as_root_cause(tmp_path):
    """torchrun follows a failed rank with its own report; its Root Cause is rank 0's line."""
    save = tmp_path / "cifar"
    p = _python_m([*_torchrun(2), "-m", "minizero.train", *TINY, "--dataset", "cifar10",
                   "--data-dir", str(tmp_path), "--save-dir", str(save)], timeout=180)
    assert p.returncode != 0
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("python -m minizero.train: error:")]
    assert len(ours) == 1 and "--dataset synthetic" in ours[0], p.stderr
    root = p.stderr.split("Root Cause")[-1]
    assert f"traceback : {ours[0]}" in root, p.stderr[-3000:]
    assert not save.exists()


@pytest.mark.parametrize("script, bad, needle", [
    (["-m", "minizero.train"], ["--stage", "7"], "invalid choice: 7"),
    (["reference/train.py"], ["--max-steps", "0"], "--max-steps must be >= 1"),
    (["-m", "minizero.train"], ["--trace", "README.md"], "--trace README.md is a file"),
])
def test_command_line_is_checked_before_torch_is_imported(tmp_path, script, bad, needle):
    """A usage error is answered without importing torch (~3 s): a `torch` that refuses to be
    imported stands first on the path, and the one line still comes."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), _env()["PYTHONPATH"]]))
    p = subprocess.run([PY, *script, *bad], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "torch was imported" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and needle in lines[0], p.stderr
