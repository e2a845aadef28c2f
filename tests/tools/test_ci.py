""".ci/run prints where its time went (issue 22): the slowest tests and the total, so a slow
test is seen the day it lands; and it runs the README's test command, nothing less."""
from __future__ import annotations

import re
import subprocess
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
