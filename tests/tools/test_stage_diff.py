"""docs/lesson/stage_diff.py: the code-only diff between two stage files, for the projector.

Generic on purpose (the stage files change as the core is refactored): it strips docstrings
and comments from any Python file, diffs what is left, and on the real stage files prints
fewer lines than a plain diff, with the code the later stage adds still in it.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "docs", "lesson", "stage_diff.py")


def _module():
    return load_script(SCRIPT)


OLD = '''"""A module docstring,
over two lines."""
import torch  # a comment after code


class Stage:
    """A class docstring."""

    def reduce(self, x):
        # a comment alone on its line
        """still the docstring: a comment is no statement"""
        return x.sum()  # why: because


def helper():
    s = "# not a comment"
    return s
'''

NEW = OLD.replace("return x.sum()", "return x.sum() / 2").replace("class Stage:", "class Stage2:")


def test_docstrings_and_comments_go_code_and_strings_stay():
    code = _module().code_only(OLD)
    assert code == ["import torch", "", "class Stage:", "", "    def reduce(self, x):", "        return x.sum()", "",
                    "def helper():", '    s = "# not a comment"', "    return s"]


def test_the_diff_of_two_small_files_shows_only_the_changed_code(tmp_path):
    (tmp_path / "a.py").write_text(OLD)
    (tmp_path / "b.py").write_text(NEW)
    lines = _module().stage_diff(str(tmp_path / "a.py"), str(tmp_path / "b.py"))
    changed = [ln for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["-class Stage:", "+class Stage2:", "-        return x.sum()", "+        return x.sum() / 2"]
    assert not any("docstring" in ln or "comment" in ln.replace("# not a comment", "") for ln in lines)


def test_on_the_stage_files_it_is_shorter_than_diff_and_keeps_the_code():
    """Every pair of consecutive stages: the command runs, prints less than a plain diff
    (the prose is gone), and every line it prints as added is a line of the later file."""
    m = _module()
    for old, new in [("zero0", "zero1"), ("zero1", "zero2"), ("zero2", "zero3")]:
        a, b = m.resolve(old), m.resolve(new)
        plain = subprocess.run(["diff", a, b], capture_output=True, text=True).stdout
        plain_changed = sum(1 for ln in plain.splitlines() if ln[:1] in "<>")
        lines = m.stage_diff(a, b)
        changed = [ln for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        assert 0 < len(changed) < plain_changed, (old, new, len(changed), plain_changed)
        later = open(b).read()
        assert all(ln[1:] in later for ln in changed if ln.startswith("+")), (old, new)


def test_the_command_and_a_name_that_is_no_file():
    done = subprocess.run([sys.executable, SCRIPT, "zero0", "zero1"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("--- minizero/zero0.py\n+++ minizero/zero1.py")
    assert done.stdout.rstrip().endswith("lines differ; docstrings and comments left out)")
    bad = subprocess.run([sys.executable, SCRIPT, "zero9", "zero1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "zero9: no such file" in bad.stderr
