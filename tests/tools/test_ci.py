""".ci/run prints where its time went (issue 22): the slowest tests and the total, so a slow
test is seen the day it lands; and it runs the README's test command, ./test.sh, nothing less
(issue 41: two commands, the first installs and passes the tests). ./test.sh installs once,
builds DeepSpeed's ops once before pytest starts, and hands its arguments to pytest."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / ".ci" / "run"
TEST_SH = ROOT / "test.sh"


def code_lines(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.strip() and not x.lstrip().startswith("#")]


def test_ci_runs_the_readmes_test_command_and_prints_the_slowest_tests_and_the_total():
    """The README's first command is `./test.sh`; .ci/run runs exactly that, adding only
    pytest's --durations (at least 25), and prints its total."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines()[0].split("#")[0].split() == ["./test.sh"], block
    runs = [x for x in code_lines(CI) if "test.sh" in x]
    assert len(runs) == 1, runs
    args = runs[0].split("||")[0].split()
    assert args[0] == "./test.sh", runs[0]
    assert all(a.startswith("--durations") for a in args[1:]), f"CI adds only --durations: {args}"
    m = re.search(r"--durations[= ](\d+)", runs[0])
    assert m and int(m.group(1)) >= 25, runs[0]
    assert not [x for x in code_lines(CI) if "-m pytest" in x], "CI runs pytest only through ./test.sh"
    assert re.search(r'echo "ci: total \$\(\(.*\)\) s', CI.read_text()), "no total printed"
    for script in (CI, TEST_SH):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
        assert os.access(script, os.X_OK), f"{script.name} is not executable"


def test_test_sh_builds_deepspeeds_ops_before_the_tests_and_runs_them_on_two_workers():
    """test.sh's lines: reference/build_ops.py before pytest (skipped, a fresh clone's first run
    compiled the ops inside the suite: 484 s against 220-250 s), pytest on 2 workers with the
    caller's arguments. build_ops builds into reference.build_ops.EXTENSIONS_DIR, the folder
    tests/conftest.py gives the tests, which is test.sh's default too."""
    lines = code_lines(TEST_SH)
    build = next(i for i, x in enumerate(lines) if "reference/build_ops.py" in x)
    test = next(i for i, x in enumerate(lines) if "-m pytest" in x)
    assert build < test
    assert lines[test].split("-m pytest", 1)[1].split() == ["-q", "-n", "2", '"$@"'], lines[test]
    from reference.build_ops import EXTENSIONS_DIR
    assert Path(EXTENSIONS_DIR) == ROOT / ".torch_extensions"
    assert "${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}" in TEST_SH.read_text()


FAKE = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$LOG"
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && cp "$0" "$3/bin/pip"
fi
"""


def test_test_sh_installs_once_builds_the_ops_once_and_hands_its_arguments_to_pytest(tmp_path):
    """test.sh run on a copy of the checkout whose python3, pip and python only log their
    arguments: the first run makes the venv, installs and builds the ops; the next one only
    tests; a changed pyproject.toml installs again; --selftest installs and self-checks."""
    shutil.copy(TEST_SH, tmp_path / "test.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    fake = tmp_path / "fake-python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log, ops = tmp_path / "log", tmp_path / "ops"
    env = {**os.environ, "LOG": str(log), "PYTHON": str(fake), "TORCH_EXTENSIONS_DIR": str(ops)}

    def run(*args):
        log.write_text("")
        r = subprocess.run(["bash", str(tmp_path / "test.sh"), *args], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return log.read_text().splitlines()

    assert run("-k", "agreement") == [
        "fake-python3 -m venv .venv", "pip install -q -e .[dev]",
        "python reference/build_ops.py", "python -m pytest -q -n 2 -k agreement"]
    assert run() == ["python reference/build_ops.py", "python -m pytest -q -n 2"]   # ops still missing
    for op in ("deepspeed_shm_comm", "async_io"):
        (ops / op).mkdir(parents=True)
        (ops / op / f"{op}.so").write_text("")
    assert run("-x") == ["python -m pytest -q -n 2 -x"]
    stamp = tmp_path / ".venv" / ".minizero-dev-installed"
    older = (tmp_path / "pyproject.toml").stat().st_mtime - 10
    os.utime(stamp, (older, older))                 # pyproject.toml changed since the install
    assert run() == ["pip install -q -e .[dev]", "python -m pytest -q -n 2"]
    assert run("--selftest") == ["python -m minizero.selftest"]


class _Builder:
    def __init__(self, fail=None):
        self.fail, self.loaded = fail, False

    def load(self):
        print("compiler chatter")          # to the op's log, not the terminal
        if self.fail:
            raise RuntimeError(f"ninja build stopped\n{self.fail}")
        self.loaded = True


def test_build_ops_says_one_line_per_op(tmp_path, capfd):
    from reference.build_ops import build
    good = _Builder()
    assert build("op_a", lambda: good, str(tmp_path)) == (True, "op_a: ready in 0 s") and good.loaded
    ok, line = build("op_b", lambda: None, str(tmp_path))
    assert ok and line.startswith("op_b: cannot be built on this machine") and "the tests that need it skip" in line
    ok, line = build("op_c", lambda: _Builder(fail="error: aio.h: No such file"), str(tmp_path))
    assert not ok and line.startswith("op_c: FAILED after 0 s: error: aio.h: No such file (compiler output: ")
    assert capfd.readouterr().out == ""
    assert (tmp_path / "op_a.build.log").read_text() == "compiler chatter\n"


# ----------------------------------------------------------------------------- one CPU per xdist worker

def test_worker_cpus_splits_the_cpus_into_equal_disjoint_shares():
    from tests.support.worker_cpus import worker_cpus
    assert [worker_cpus(i, 2, [1, 0]) for i in range(2)] == [{0}, {1}]
    assert [worker_cpus(i, 2, range(16)) for i in range(2)] == [set(range(8)), set(range(8, 16))]
    assert [worker_cpus(i, 3, range(7)) for i in range(3)] == [{0, 1}, {2, 3}, {4, 5}]   # CPU 6 pinned by none
    assert worker_cpus(0, 4, [0, 1]) is None          # more workers than CPUs: nothing to split
    assert worker_cpus(0, 1, [0, 1]) is None          # one worker keeps every CPU
    assert worker_cpus(2, 2, [0, 1]) is None


def test_pin_this_worker_pins_only_an_xdist_worker_and_can_be_switched_off(monkeypatch):
    import os

    from tests.support import worker_cpus as W
    pinned = []
    monkeypatch.setattr(W, "PINNED", W.PINNED)                          # what the conftest did, kept
    monkeypatch.setattr(W.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(W.os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)), raising=False)
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "MINIZERO_TEST_PIN"):
        monkeypatch.delenv(var, raising=False)
    assert W.pin_this_worker() is None and pinned == []                 # not a worker
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert W.pin_this_worker() == {2, 3} and pinned == [{2, 3}]
    monkeypatch.setenv("MINIZERO_TEST_PIN", "0")
    assert W.pin_this_worker() is None and pinned == [{2, 3}]
    assert os.sched_getaffinity is W.os.sched_getaffinity               # the module's os is os


def test_this_process_keeps_to_its_share_under_xdist():
    """The conftest pinned this very process when it is an xdist worker (the README's
    command: gw0 on the first CPU, gw1 on the second); outside xdist it left it alone."""
    import os

    from tests.support import worker_cpus as W
    if not hasattr(os, "sched_getaffinity"):
        assert W.PINNED is None
        return
    started, mine = W.PINNED
    name, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if name and os.environ.get("MINIZERO_TEST_PIN") != "0":
        assert mine == W.worker_cpus(int(name[2:]), int(count), started)
    else:
        assert mine is None
    assert os.sched_getaffinity(0) == (mine or started)


# ----------------------------------------------------------------------------- whole files, heaviest first

def test_heavy_first_moves_the_listed_files_to_the_front_and_keeps_every_other_order():
    from tests.support.schedule import HEAVY_FIRST, heavy_first
    ids = ["tests/a.py::t1", f"{HEAVY_FIRST[1]}::x", "tests/b.py::t2", f"{HEAVY_FIRST[0]}::y",
           f"{HEAVY_FIRST[1]}::w", "tests/a.py::t0"]
    assert sorted(ids, key=heavy_first) == [f"{HEAVY_FIRST[0]}::y", f"{HEAVY_FIRST[1]}::x", f"{HEAVY_FIRST[1]}::w",
                                "tests/a.py::t1", "tests/b.py::t2", "tests/a.py::t0"]


def test_every_heavy_file_exists_once():
    from tests.support.schedule import HEAVY_FIRST
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
    assert [p for p in HEAVY_FIRST if not (ROOT / p).is_file()] == []


def test_the_default_dist_deals_whole_files_in_collection_order():
    import types

    from xdist.scheduler import LoadFileScheduling

    from tests import conftest

    def config(dist, args=("-q", "-n", "2")):
        option = types.SimpleNamespace(dist=dist, loadscopereorder=True, maxschedchunk=None,
                                       numprocesses=2, tx=["2*popen"], px=None)
        return types.SimpleNamespace(option=option, getoption=lambda name: getattr(option, name),
                                     getvalue=lambda name: getattr(option, name),
                                     invocation_params=types.SimpleNamespace(args=tuple(args)))
    c = config("load")
    sched = conftest.pytest_xdist_make_scheduler(c, None)
    assert isinstance(sched, LoadFileScheduling) and c.option.loadscopereorder is False
    for other in ("loadscope", "loadgroup", "worksteal", "each"):
        assert conftest.pytest_xdist_make_scheduler(config(other), None) is None
    # a --dist the user names is theirs, even the default's own name
    for args in (("-n", "2", "--dist", "load"), ("-n", "2", "--dist=load")):
        assert conftest.pytest_xdist_make_scheduler(config("load", args), None) is None


def test_a_process_the_tests_start_keeps_its_temporary_files_in_pytests_folder(tmp_path_factory):
    """tests/conftest.py: a child's temp folder is under this run's pytest folder, which pytest
    prunes (torchrun left a torchelastic_* folder in /tmp on every launch before); this
    process keeps the usual one, where the workers' shared agreement runs are found."""
    import tempfile
    r = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                       capture_output=True, text=True, timeout=60, check=True)
    base = tmp_path_factory.getbasetemp()
    assert Path(r.stdout.strip()).is_relative_to(base), (r.stdout, base)
    assert not Path(tempfile.gettempdir()).is_relative_to(base)


def test_the_suite_runs_without_xdist(tmp_path):
    """`-p no:xdist` (xdist not loaded, or not installed): tests/conftest.py's xdist hook is
    optional, so pytest starts instead of stopping on "unknown hook"."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "tools" / "test_ci.py"), "-k", "heavy_first"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
