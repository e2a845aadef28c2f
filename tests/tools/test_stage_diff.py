"""docs/lesson/stage_diff.py: what each stage adds to the one before, for the projector.

Generic on purpose (the stage files change as the core is refactored): it reads the classes
and their parents from the files, strips docstrings and comments, and projects the later
class's own members beside what they replace; two unrelated files get a code-only diff.
Cost: well under a second (no torch, no process but the command's own).
"""
from __future__ import annotations

import ast
import os
import re
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


PAIRS = [("zero0", "zero1"), ("zero1", "zero2"), ("zero2", "zero3")]


def _own_methods(path: str, cls: str) -> list[str]:
    tree = ast.parse(open(path).read())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return [n.name for n in node.body if isinstance(n, ast.FunctionDef)]


def test_each_stage_projects_its_own_code_beside_what_it_replaces():
    """Every pair of consecutive stages: the later class's own members only, each override
    beside the ancestor's member it replaces; nothing it inherits shows as removed (the old
    file diff showed `- def after_step` at zero1 -> zero2: "ZeRO-2 drops the all-gather");
    each side is valid Python (a docstring-only method keeps its docstring as its body);
    every `+` line is code of the later file and every `-` line code of an ancestor."""
    m = _module()
    for old, new in PAIRS:
        a, b = m.resolve(old), m.resolve(new)
        lines = m.stage_diff(a, b)
        before, after = m.sides(lines)
        ast.parse(before), ast.parse(after)
        cls = f"Zero{new[-1]}"
        own = _own_methods(b, cls)
        defs = [re.match(r"[ +]    def (\w+)", ln).group(1) for ln in lines if re.match(r"[ +]    def \w+", ln)]
        assert defs == own, (old, new, defs, own)
        removed_defs = [ln for ln in lines if re.match(r"-    def ", ln)]
        assert all(re.match(r"-    def (\w+)", ln).group(1) in own for ln in removed_defs), (old, new, removed_defs)
        later = "\n".join(m.code_only(open(b).read()))
        parents = "\n".join("\n".join(m.code_only(open(m.resolve(f"zero{i}")).read())) for i in range(int(new[-1])))
        for ln in lines:
            if ln.startswith("+") and not ln.startswith("+++"):
                assert ln[1:].strip() in later, (old, new, ln)
            if ln.startswith("-") and not ln.startswith("---") and not ln[1:].strip().startswith("#"):
                assert ln[1:].strip() in parents, (old, new, ln)
        inherited = [ln for ln in lines if "# inherited unchanged:" in ln]
        assert len(inherited) == 1 and not any(n in inherited[0].split(":", 1)[1].split(", ") for n in own)
    z12 = m.stage_diff(m.resolve("zero1"), m.resolve("zero2"))
    assert "after_step" in [ln for ln in z12 if "inherited unchanged" in ln][0]
    assert not any("after_step" in ln or "all_gather" in ln for ln in z12 if ln[:1] in "+-")


def test_part_2_sees_no_hpz_and_short_projections():
    """The class's three projections (docs/lesson.md, part 2) fit a projector and carry
    nothing of hpZ or HSDP (part 11); the module's layout helpers are named, not shown."""
    m = _module()
    for old, new in PAIRS:
        lines = m.stage_diff(m.resolve(old), m.resolve(new))
        assert len(lines) <= 50, (old, new, len(lines))
        text = "\n".join(ln for ln in lines if ln[:1] in "+- ")
        for word in ("hpz", "secondary", "hierarchy", "hsdp", "replicas"):
            assert word not in text.lower(), (old, new, word)
    z23 = m.stage_diff(m.resolve("zero2"), m.resolve("zero3"))
    assert any("also defines: module_units, unit_plan" in ln for ln in z23)
    assert not any("def unit_plan" in ln for ln in z23)


def test_the_command_and_a_name_that_is_no_file():
    done = subprocess.run([sys.executable, SCRIPT, "zero0", "zero1"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("--- minizero/zero0.py: class Zero0, what Zero1 replaces\n"
                                                          "+++ minizero/zero1.py: class Zero1, what it adds"), done.stdout
    assert re.search(r"\((\d+) lines added, (\d+) removed; docstrings and comments left out\)\n$", done.stdout)
    whole = subprocess.run([sys.executable, SCRIPT, "--whole", "zero0", "zero1"], capture_output=True, text=True,
                           cwd=ROOT)
    assert whole.returncode == 0 and whole.stdout.startswith("--- minizero/zero0.py\n+++ minizero/zero1.py")
    bad = subprocess.run([sys.executable, SCRIPT, "zero9", "zero1"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "zero9: no such file" in bad.stderr


def test_show_prints_chosen_members_of_one_class():
    """Part 2's fourth command: Unit's four hooks, code only and valid Python, the rest named;
    a member the class lacks is one line and exit status 2."""
    m = _module()
    lines = m.show(m.resolve("unit"), "Unit", ["pre_forward", "post_forward", "pre_backward", "post_backward"])
    ast.parse("\n".join(lines[1:]) + "\n")
    assert [re.match(r"    def (\w+)", ln).group(1) for ln in lines if re.match(r"    def \w+", ln)] == \
        ["pre_forward", "post_forward", "pre_backward", "post_backward"]
    assert "on_backward(output, self.pre_backward)" in "\n".join(lines)
    assert lines[-1].startswith("    # Unit also has: ") and "unshard" in lines[-1] and '"""' not in "\n".join(lines)
    bad = subprocess.run([sys.executable, SCRIPT, "--show", "unit.Unit", "nope"], capture_output=True, text=True,
                         cwd=ROOT)
    assert bad.returncode == 2 and bad.stdout == "" and "has no member nope" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
