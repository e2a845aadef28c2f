""".ci/run prints where its time went (issue 22): the slowest tests and the total, so a slow
test is seen the day it lands; and it runs the README's test command, nothing less."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / ".ci" / "run"


def test_ci_prints_the_slowest_tests_and_the_total():
    text = CI.read_text()
    pytest_lines = [x for x in text.splitlines() if "-m pytest" in x and not x.lstrip().startswith("#")]
    assert len(pytest_lines) == 1, pytest_lines
    m = re.search(r"--durations[= ](\d+)", pytest_lines[0])
    assert m and int(m.group(1)) >= 25, pytest_lines[0]
    assert " -k " not in pytest_lines[0] and " -m " not in pytest_lines[0].split("-m pytest", 1)[1]   # nothing deselected
    assert re.search(r'echo "ci: .*tests \$\(\(.*\)\) s, total \$\(\(.*\)\) s', text), "no total printed"
    assert subprocess.run(["bash", "-n", str(CI)], capture_output=True).returncode == 0


def test_ci_runs_the_readmes_test_command():
    """The README's one full-suite command (its install block) and .ci/run's pytest line run
    the same pytest arguments; CI adds only --durations."""
    readme = [x.split("#")[0].split() for x in (ROOT / "README.md").read_text().splitlines()
              if x.startswith("python -m pytest") and "tests/" not in x]
    assert len(readme) == 1, readme
    ci = next(x for x in CI.read_text().splitlines() if "-m pytest" in x and not x.lstrip().startswith("#"))
    ci_args = ci.split("-m pytest", 1)[1].split("||")[0].split()
    assert [a for a in ci_args if not a.startswith("--durations")] == readme[0][3:], (ci_args, readme[0])



def test_the_readme_and_ci_build_deepspeeds_ops_before_the_tests():
    """reference/build_ops.py runs before the test command in the README's quick start and in
    .ci/run: skipped, a fresh clone's first run compiled the ops inside the suite (484 s).
    It builds into reference.build_ops.EXTENSIONS_DIR, the folder tests/conftest.py gives
    the tests."""
    lines = (ROOT / "README.md").read_text().splitlines()
    build = next(i for i, x in enumerate(lines) if x.startswith("python reference/build_ops.py"))
    assert build < next(i for i, x in enumerate(lines) if x.startswith("python -m pytest -q -n 2"))
    ci = [x for x in CI.read_text().splitlines() if not x.lstrip().startswith("#")]
    build = next(i for i, x in enumerate(ci) if "reference/build_ops.py" in x)
    assert build < next(i for i, x in enumerate(ci) if "-m pytest" in x)


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
