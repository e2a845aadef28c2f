"""minizero/lab: the student's copy, and the autograder that runs it beside minizero.

- `make` writes each part's files with exactly the pieces to write removed (their bodies,
  comments included: the docstring stays as the specification) and every other line as
  minizero has it, and never overwrites a folder holding a student's work;
- graded in one launch of 2 ranks (grade.grade_jobs; more only when the ranks had to stop):
  minizero's own files pass every part, bit for bit against minizero's own run; the copy as
  `make` writes it fails every part with "not written yet"; and each part's seeded typical
  mistakes (minizero/lab/mistakes.py, at least three per part) fail, each with its teaching
  message;
- the loss scaler's check against DeepSpeed's own class, where DeepSpeed is installed.

Cost: the launch grades 5 parts x (the answer key on every scenario, the unwritten copy and
each of the 20 mistakes on one scenario) beside minizero's reference runs: about 30 s on a
loaded 2-core machine; the rest is file work (well under a second) and, for the DeepSpeed
scaler, importing DeepSpeed in this process.
"""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest

from minizero.lab import grade as lab_grade
from minizero.lab.make import make
from minizero.lab.mistakes import MISTAKES, scenario_of, write
from minizero.lab.parts import CORE, PARTS


def _functions(tree: ast.AST) -> dict:
    """qualname -> FunctionDef, for module functions and methods."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({f"{node.name}.{n.name}": n for n in node.body if isinstance(n, ast.FunctionDef)})
    return out


def _without_holes(source: str, file: str, holes: dict) -> str:
    """The module's AST dump with every hole's body emptied (its docstring kept)."""
    tree = ast.parse(source)
    for name, node in _functions(tree).items():
        if (file, name) in holes:
            node.body = node.body[:1] if ast.get_docstring(node) is not None else []
    return ast.dump(tree)


def test_make_removes_each_piece_and_nothing_else(tmp_path):
    """Every hole's body is its task's comment and a NotImplementedError naming the part; its
    docstring stays; every other function, class and statement is minizero's, unchanged; no
    comment of a removed body survives; the README names every piece."""
    written = make(str(tmp_path / "lab"))
    files = {h.file for p in PARTS.values() for h in p.holes}
    assert sorted(os.path.basename(w) for w in written) == sorted(files | {"README.md"})
    holes = {(h.file, h.qualname): part for part, p in PARTS.items() for h in p.holes}
    for file in files:
        real_src = open(os.path.join(CORE, file)).read()
        student_src = open(tmp_path / "lab" / file).read()
        real, student = _functions(ast.parse(real_src)), _functions(ast.parse(student_src))
        assert real.keys() == student.keys(), file
        for name, node in student.items():
            if (file, name) not in holes:
                assert ast.dump(node) == ast.dump(real[name]), (file, name)
                continue
            body = node.body
            if ast.get_docstring(real[name]) is not None:
                assert ast.get_docstring(node) == ast.get_docstring(real[name]), (file, name)
                body = body[1:]
            assert len(body) == 1 and isinstance(body[0], ast.Raise), (file, name)
            assert f"{name}: lab part {holes[(file, name)]}" in ast.unparse(body[0])
            text = "\n".join(student_src.splitlines()[node.lineno - 1:node.end_lineno])
            comments = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("#")]
            assert comments and all(c.startswith("#") for c in comments)
            assert comments[0].startswith(f"# lab part {holes[(file, name)]}:"), comments
            removed = [ln.strip() for ln in real_src.splitlines()[real[name].lineno - 1:real[name].end_lineno]
                       if ln.strip().startswith("#")]
            assert not set(removed) & set(comments), (file, name)   # the body's own comments went with it
        # the whole module, the holes' bodies left out, as minizero has it (imports, constants, attributes)
        assert _without_holes(real_src, file, holes) == _without_holes(student_src, file, holes), file
    readme = open(tmp_path / "lab" / "README.md").read()
    assert all(f"`{h.file}`: `{h.qualname}`" in readme for p in PARTS.values() for h in p.holes)


def test_make_never_overwrites_and_the_command_says_so_in_one_line(tmp_path, capsys):
    from minizero.lab.__main__ import main
    folder = str(tmp_path / "lab")
    assert main(["make", folder]) == 0
    capsys.readouterr()
    (tmp_path / "lab" / "zero1.py").write_text("# the student's work\n")
    assert main(["make", folder]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "never overwritten" in err
    assert open(tmp_path / "lab" / "zero1.py").read() == "# the student's work\n"
    assert main(["check", "zero1", "--student", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such folder" in err and "minizero.lab make" in err
    (tmp_path / "half").mkdir()
    assert main(["check", "zero3", "--student", str(tmp_path / "half")]) == 2
    assert "unit.py: no such file" in capsys.readouterr().err


def test_every_part_has_three_mistakes_or_more_each_editing_the_core_once(tmp_path):
    for part in PARTS:
        assert len(MISTAKES[part]) >= 3, part
        for k in range(1, len(MISTAKES[part]) + 1):
            folder = write(part, k, str(tmp_path / f"{part}-{k}"))
            m = MISTAKES[part][k - 1]
            assert open(os.path.join(folder, m.file)).read() != open(os.path.join(CORE, m.file)).read()
            assert scenario_of(part, k) in [sc.name for sc in PARTS[part].scenarios]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grading run: minizero's own files on every scenario of every part, the unwritten
    copy and every seeded mistake on the scenario that shows it; DeepSpeed left out."""
    tmp = tmp_path_factory.mktemp("lab")
    unwritten = str(tmp / "unwritten")
    make(unwritten)
    jobs = [("answer key", p, None, None) for p in PARTS]
    jobs += [("unwritten", p, unwritten, (PARTS[p].scenarios[0].name,)) for p in PARTS]
    jobs += [(f"{p}:{k}", p, write(p, k, str(tmp / f"{p}-{k}")), (scenario_of(p, k),))
             for p in PARTS for k in range(1, len(MISTAKES[p]) + 1)]
    return lab_grade.grade_jobs(jobs, with_deepspeed=False)


def test_the_answer_key_passes_every_part(graded):
    for part in PARTS:
        g = graded[("answer key", part)]
        assert g.passed, g.report()
        assert g.messages == [] and g.report().endswith(f"part {part}: PASS")
        assert len(g.facts) == len(PARTS[part].scenarios)


def test_the_unwritten_copy_fails_every_part_saying_what_to_write(graded):
    for part in PARTS:
        g = graded[("unwritten", part)]
        assert not g.passed, part
        assert any(m.startswith("not written yet: ") and "NotImplementedError" in m for m in g.messages), \
            (part, g.messages)


@pytest.mark.parametrize("part,k", [(p, k) for p in MISTAKES for k in range(1, len(MISTAKES[p]) + 1)],
                         ids=lambda x: str(x))
def test_each_seeded_mistake_fails_with_its_teaching_message(graded, part, k):
    g = graded[(f"{part}:{k}", part)]
    m = MISTAKES[part][k - 1]
    assert not g.passed, f"{part} mistake {k} ({m.what}) passed:\n{g.report()}"
    assert any(m.says in msg for msg in g.messages), f"{part} mistake {k} ({m.what}):\n{g.report()}"
    report = g.report()
    assert report.endswith(f"part {part}: FAIL") and f"=> " in report


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_the_scaler_is_graded_against_deepspeeds_own_class(tmp_path):
    """fp16's unit checks compare each update with DeepSpeed's DynamicLossScaler too: minizero's
    own file agrees with it; the seeded mistake without hysteresis does not."""
    files = lab_grade.student_files("fp16", CORE)
    lines, msgs = lab_grade.unit_checks("fp16", files, with_deepspeed=True)
    against = [(what, ok) for what, ok, _ in lines if "DeepSpeed" in what]
    assert len(against) == 4 and all(ok for _, ok in against) and msgs == []
    wrong = lab_grade.student_files("fp16", write("fp16", 1, str(tmp_path / "m")))
    lines, msgs = lab_grade.unit_checks("fp16", wrong, with_deepspeed=True)
    assert not all(ok for what, ok, _ in lines if "DeepSpeed" in what) and msgs


def test_grading_the_scaler_prints_no_overflow_line(caplog):
    """The scaler checks provoke overflows on purpose; the grade shows its verdicts, not the
    scaler's "OVERFLOW! ... Skipping step" line for each of them."""
    import logging

    from minizero.fp16 import DynamicLossScaler, MinLossScaleError
    from minizero.lab.parts import SCALER_CASES, scaler_trajectory
    with caplog.at_level(logging.INFO):
        for kwargs, pattern in SCALER_CASES.values():
            assert scaler_trajectory(DynamicLossScaler, MinLossScaleError, kwargs, pattern)
    assert not [r for r in caplog.records if "OVERFLOW" in r.getMessage()]
    assert not logging.getLogger("minizero").disabled      # and the engine's own lines still log
