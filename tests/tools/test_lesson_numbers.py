"""The class's pages are their sources filled in by the lesson's own runs, and the class runs twice as printed.

`python docs/lesson/lesson_numbers.py` runs the commands of docs/lesson.md (read from its
source, docs/lesson/src/lesson.md.in, loops expanded), reads their traces, logs and summaries,
and fills in every `{{name}}` of the sources in docs/lesson/src/: the lesson, the worksheet,
the answer key, the question bank, the slides' notes and docs/reading.md. Here:

- every page equals its source filled in, character for character, so one changed digit
  anywhere fails (a count, a "2 passed", a stage number: test_a_changed_digit_anywhere_is_caught
  mutates every digit of every page);
- the README's teaching section and docs/timeline.md, which have no source, quote only
  numbers the script prints (every number of three digits or more, or with a comma or a
  decimal point), and timeline.md's comms-logger table is the run's, row for row;
- each traced run prints its collectives table with the trace's own totals;
- the class (parts 1-3) runs a second time as printed, into the folder of the first, with
  no refusal and no traceback (the homework's second run: MINIZERO_LESSON_HOMEWORK=1,
  about two more minutes, most of it DeepSpeed's side-by-side comparison);
- the slides are 1600 px wide, in the order their notes give; the worksheet holds no answer.

Cost: the lesson's 18 training runs (part 11's three on 4 ranks) on ranks forked from the
tests' preloaded forkserver (tests/support/command_runs.py), its three memory tables and the
activation measurement in this process, once per session (the `lesson` fixture); then the
class's 6 runs again.
"""
from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import subprocess
import sys

import pytest

from tests.support.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = "docs/lesson/lesson_numbers.py"
# pages with no source: (page, the part that teaches: from this heading to the next "## ", or all)
PRINTED_ONLY = [("README.md", "### See each collective"), ("docs/timeline.md", None)]

NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+|\d{3,})(?![\w])")
ANY_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def lesson_script():
    return load_script(os.path.join(ROOT, SCRIPT))


@pytest.fixture(scope="module")
def script():
    return lesson_script()


@pytest.fixture(scope="module")
def lesson(tmp_path_factory, script):
    """(the runs folder, the numbers, what `python docs/lesson/lesson_numbers.py --runs RUNS`
    prints): the script's main(argv) in this process, its torchrun commands on processes
    forked from the tests' preloaded forkserver, not fresh interpreters that each import
    torch again. Each run is still its own processes, started from its command line."""
    from tests.support.command_runs import torchrun_on_forked_ranks
    runs = str(tmp_path_factory.mktemp("lesson-runs"))
    out = io.StringIO()
    with torchrun_on_forked_ranks(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = script.main(["--runs", runs])
    numbers, _ = script.compute(script.Runs(runs))   # read back from the logs: runs nothing
    return runs, numbers, out.getvalue(), rc


# ----------------------------------------------------------------------------- the pages

@pytest.mark.parametrize("source", ["lesson.md.in", "worksheet.md.in", "answers.md.in", "question_bank.md.in",
                                    "slides.md.in", "reading.md.in"])
def test_every_page_is_its_source_filled_in(source, lesson, script):
    _, numbers, _, _ = lesson
    page = script.PAGES[source]
    want = script.render(source, numbers)
    have = open(os.path.join(ROOT, page)).read()
    if have != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), have.splitlines(True), "source filled in",
                                                 page, n=0))[:12])
        pytest.fail(f"{page} differs from docs/lesson/src/{source} filled in: edit the source, then run "
                    f"`python {SCRIPT} --write`\n{diff}")


def test_a_changed_digit_anywhere_is_caught(lesson, script):
    """Every digit of every page, changed by one: the page no longer matches (and one-digit
    counts are digits like any other). The check that once missed `1 passed` for a test
    that runs twice now holds the count to pytest's own."""
    _, numbers, _, _ = lesson
    for source, page in script.PAGES.items():
        want = script.render(source, numbers)
        digits = [i for i, c in enumerate(want) if c.isdigit()]
        assert len(digits) > 20, page
        for i in digits:
            changed = want[:i] + str((int(want[i]) + 1) % 10) + want[i + 1:]
            assert changed != want   # what test_every_page_is_its_source_filled_in compares
    lesson_page = script.render("lesson.md.in", numbers)
    assert f"`{numbers['desync.passed']} passed`" in lesson_page and numbers["desync.passed"] == "2"


def test_a_source_names_only_numbers_the_script_makes(script, lesson, tmp_path, monkeypatch):
    _, numbers, _, _ = lesson
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.md.in").write_text("{{z0.ar.calls}} and {{no.such.number}}")
    monkeypatch.setattr(script, "HERE", str(tmp_path))
    with pytest.raises(KeyError, match="no.such.number"):
        script.render("x.md.in", numbers)


def not_printed(page_text: str, output: str) -> list[str]:
    """The numbers a page without a source quotes (three digits or more, or with a comma or
    a decimal point; code blocks of commands left out) that the script did not print."""
    text = re.sub(r"```bash.*?```", "", page_text, flags=re.S)
    text = re.sub(r"https?://\S+", "", text)
    values = {m.group(1) for m in NUMBER.finditer(text)}
    # the overlap runs' times vary from run to run and no page quotes them: left in, a time
    # that happened to print as 31.5 would let "31.4 GB -> 31.5 GB" through
    output = re.sub(r"\d[\d,]*(?:\.\d+)? ms\b", "", output)
    printed = {m.group(0).rstrip(",") for m in ANY_NUMBER.finditer(output)}
    return sorted(values - printed)


def teaching_text(page: str, start: str | None) -> str | None:
    text = open(os.path.join(ROOT, page)).read()
    if start is None:
        return text
    if start not in text:
        return None
    return "## " + text.split(start, 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("page,start", PRINTED_ONLY)
def test_pages_without_a_source_quote_only_printed_numbers(page, start, lesson):
    text = teaching_text(page, start)
    if text is None:
        pytest.skip(f"{page} has no section {start!r} (it moved): nothing of the lesson's to check there")
    assert SCRIPT in text, f"{page} must name {SCRIPT}, the command that prints its numbers"
    assert NUMBER.search(text), f"{page}: no numbers found: is the pattern broken?"
    assert not_printed(text, lesson[2]) == [], f"{page} quotes numbers {SCRIPT} does not print"
    changed = text.replace("652,824", "652,825")
    assert changed == text or not_printed(changed, lesson[2]) != []


def test_timelines_comms_table_is_the_runs(lesson):
    """docs/timeline.md's comms-logger table (op, message size, count) is the lesson's
    `--comms-logger` run's, row for row: it once counted 3 steps of a 5-step command."""
    _, numbers, _, _ = lesson
    lines, last_op = ["Comm. Op            Message Size        Count"], None
    for row in numbers["comms.rows"].split("; "):
        op, size, unit, _, count = row.split()
        if op != last_op:
            lines.append(op)
            last_op = op
        lines.append(f"{'':20}{size + ' ' + unit:<20}{count}")
    text = open(os.path.join(ROOT, "docs/timeline.md")).read()
    assert "```\n" + "\n".join(lines) + "\n```" in text, "\n".join(lines)
    assert f"({numbers['comms.steps']} steps;" in text and "--max-steps 5" in text


def test_each_traced_run_prints_its_collectives_table(lesson, script):
    """A traced run prints, on rank 0, its step's collectives: each op's "(total)" row is the
    ledger of its rank0.json."""
    runs, _, _, _ = lesson
    r = script.Runs(runs)
    traced = [name for name, command in r.commands.items() if "--trace" in command]
    assert len(traced) >= 10
    for name in traced:
        ledger, _, _ = r.trace(name)
        out = r.output(name)
        for op, counts in ledger.items():
            if counts["calls"]:   # (the label column widens for HSDP's longer labels)
                row = rf"{op} +\(total\) +{counts['calls']} +{counts['bytes']:,} +{counts['wire_bytes']:,}\b"
                assert re.search(row, out), f"{name}: no row {row!r} in its output"


def test_the_two_node_runs_split_every_byte(lesson, script):
    """Part 11's runs on 2 pretended nodes: on every rank each collective event's inter-node
    bytes add up to the ledger's per op, a rank's bytes cross all or none (the ring rule), and
    the table's last line is what every rank's ledger says each node sent."""
    from minizero.observe import ledger_table
    runs, _, _, _ = lesson
    r = script.Runs(runs)
    names = [n for n in r.commands if n.startswith("nodes-")]
    assert sorted(names) == ["nodes-hpz", "nodes-hsdp", "nodes-zero3"]
    for name in names:
        folder = os.path.join(runs, f"trace-{name}")
        docs = [ledger_table.read(folder, rank) for rank in range(4)]
        (step,) = docs[0]["otherData"]["ledger"]
        for doc in docs:
            events = [e for e in doc["traceEvents"] if e.get("cat") == "collectives"]
            assert all(e["args"]["inter_node_bytes"] in (0, e["args"]["wire_bytes"]) for e in events)
            for op, counts in doc["otherData"]["ledger"][step].items():
                assert sum(e["args"]["inter_node_bytes"] for e in events if e["args"]["op"] == op) == \
                    counts["inter_node_bytes"], (name, op)
        sent = ledger_table.link_bytes(docs, int(step))
        assert f"node 0 -> 1: {sent[0]:,}, node 1 -> 0: {sent[1]:,}" in r.output(name)


def test_the_script_as_a_command(lesson):
    """The page's command itself: its help, in a fresh interpreter (the fixture ran its
    main(argv) in this process; a second full run would cost the numbers again); and the
    fixture's run of it printed every number and exited 0, every page matching its source."""
    done = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--runs" in done.stdout and "--write" in done.stdout, done.stderr
    _, numbers, printed, rc = lesson
    assert rc == 0, "a page differs from its source filled in"
    assert all(f"{name}: {text}" in printed or f"{name}:\n{text}" in printed for name, text in numbers.items())


# ----------------------------------------------------------------------------- the commands

def test_the_page_parser_expands_loops_and_joins_lines(script):
    text = ("```bash\nfor s in 0 1; do\n  torchrun x --stage $s \\\n      --save-dir runs/a-$s   # why\ndone\n"
            "python -m pytest -q t.py -k \"a # b\"\n```\n```text\nnot a command\n```\n")
    assert script.page_commands(text) == ["torchrun x --stage 0 --save-dir runs/a-0",
                                          "torchrun x --stage 1 --save-dir runs/a-1",
                                          'python -m pytest -q t.py -k "a # b"']


def test_every_command_on_the_page_is_accounted_for(script):
    """Each command of docs/lesson.md is run by the script (its numbers), or is one the
    script leaves to the second-run tests below; every training command can run again
    (--overwrite) and writes its own folders."""
    page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    commands = script.page_commands(page)
    assert commands == script.lesson_commands()
    runs = script.Runs("unused")
    for c in commands:
        assert c in runs.commands.values() or c in runs.tests or any(s in c for s in script.NOT_RUN), c
    train = [c for c in commands if "minizero.train" in c]
    assert train and all("--overwrite" in c for c in train)
    folders = [w for c in train for w in c.split() if w.startswith("runs/")]
    assert len(folders) == len(set(folders)), "two commands write into one folder"
    reading = " ".join(open(os.path.join(ROOT, "docs/reading.md")).read().replace("\\\n", " ").split())
    assert [c for c in commands if "lesson-z2 " in c + " "][0] in reading, "reading.md's stage-2 run is not the lesson's"


def _part_commands(script, first: str, last: str) -> list[str]:
    """The commands of docs/lesson.md from heading `first` up to heading `last`."""
    page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    return script.page_commands(page[page.index(first):page.index(last)])


def _run_again(script, commands, runs):
    from tests.support.command_runs import torchrun_on_forked_ranks
    assert commands
    with torchrun_on_forked_ranks():
        for c in commands:
            out = script.run_command(c, runs)   # raises on a nonzero exit, with the output's end
            assert "Traceback" not in out and "error:" not in out, f"{c}:\n{out[-3000:]}"


def test_the_class_runs_twice_as_printed(lesson, script):
    """Parts 1-3, the 50 minutes: every command a second time, into the folders the first
    time (the fixture) wrote, as an instructor repeats the class; the code-only diffs twice."""
    runs, _, _, _ = lesson
    commands = _part_commands(script, "## 1. Where the memory goes", "## Wrap-up")
    diffs = [c for c in commands if "stage_diff.py" in c]
    assert len(diffs) == 3 and len(commands) == 3 + 2 + 4 + 2
    _run_again(script, diffs + commands, runs)


@pytest.mark.skipif(os.environ.get("MINIZERO_LESSON_HOMEWORK") != "1",
                    reason="the homework's second run takes minutes (DeepSpeed's comparison); MINIZERO_LESSON_HOMEWORK=1")
def test_the_homework_runs_twice_as_printed(lesson, script):
    runs, _, _, _ = lesson
    page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    commands = script.page_commands(page[page.index("## 4. Homework"):])
    once = [c for c in commands if "minizero.compare" in c or "pytest" in c]   # the fixture ran neither
    _run_again(script, once + commands, runs)


# ----------------------------------------------------------------------------- the class's pages

def test_the_worksheet_asks_and_the_answer_key_answers(lesson, script):
    _, numbers, _, _ = lesson
    worksheet = script.render("worksheet.md.in", numbers)
    answers = script.render("answers.md.in", numbers)
    lesson_page = script.render("lesson.md.in", numbers)
    asked = re.findall(r"^\*\*(\d+\.\d+)\*\*", worksheet, flags=re.M)
    answered = re.findall(r"^\*\*(\d+\.\d+)\*\*", answers, flags=re.M)
    assert asked == answered and len(asked) >= 20
    assert "Answer" not in worksheet.split("\n", 3)[3] and worksheet.count("> prediction:") == len(asked)
    for ref in re.findall(r"worksheet (\d+\.\d+)(?:-(\d+\.\d+))?", lesson_page):
        assert all(q in asked for q in ref if q), ref
    bank = script.render("question_bank.md.in", numbers)
    questions = re.findall(r"^\*\*Q(\d+)\.\*\*", bank, flags=re.M)
    assert len(questions) >= 20 and questions == [str(i) for i in range(1, len(questions) + 1)]
    assert bank.count("*Answer.*") == len(questions)


def test_the_slides_are_1600_px_wide_in_the_order_of_their_notes(script):
    import matplotlib.image
    sys.path.insert(0, os.path.join(ROOT, "docs", "lesson"))
    import pictures
    notes = open(os.path.join(ROOT, "docs/lesson/slides/README.md")).read()
    linked = re.findall(r"\]\((\d\d-[\w-]+\.png)\)", notes)
    assert linked == list(pictures.SLIDES)
    for name in pictures.SLIDES:
        assert matplotlib.image.imread(os.path.join(ROOT, "docs/lesson/slides", name)).shape[1] == 1600, name
    for name in ("zero_figure1.png", "timeline_zero3.png"):   # docs/zero.md's and the README's copies
        assert matplotlib.image.imread(os.path.join(ROOT, "docs/img", name)).shape[1] == 1600, name


def test_stage_0_partitions_nothing_on_the_strips():
    """The partition strips' stage-0 title once said "rank r holds slice r of every one"."""
    sys.path.insert(0, os.path.join(ROOT, "docs", "lesson"))
    import pictures
    titles = [pictures.strip_title(s) for s in range(4)]
    assert "slice" not in titles[0] and "nothing cut" in titles[0]
    assert all("slice r" in t for t in titles[1:])


def test_timeline_is_legible_on_a_projector(tmp_path, monkeypatch):
    """The timeline PNG is 1600 px wide and no text in it is under 11 px; collective bars
    name the unit they moved, and a label wider than its bar (the short grad_norm
    all-reduce) is left off instead of spilling over its neighbours."""
    import matplotlib.figure
    import matplotlib.image
    import matplotlib.text
    from minizero.observe import timeline

    def ev(cat, name, ts, dur, **args):
        return {"ph": "X", "pid": 0, "tid": 0, "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"step": 2, **args}}
    doc = {"traceEvents": [ev("step", "forward", 0, 400), ev("units", "blocks.0.forward", 0, 400, unit="blocks.0", phase="forward"),
                           ev("collectives", "all_gather blocks.0.g0.fwd", 0, 200, op="all_gather", label="blocks.0.g0.fwd"),
                           ev("step", "backward", 400, 560),
                           ev("collectives", "all_reduce grad_norm", 960, 45, op="all_reduce", label="grad_norm")],
           "otherData": {"stage": 3, "dtype": "torch.float32"}}
    texts = []
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        texts.extend((t.get_text(), t.get_fontsize()) for t in fig.findobj(matplotlib.text.Text) if t.get_text())
        return savefig(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    path = timeline.plot(doc, str(tmp_path / "timeline.png"))
    assert matplotlib.image.imread(path).shape[1] == 1600
    small = [(t, round(pt * timeline.DPI / 72, 1)) for t, pt in texts if pt * timeline.DPI / 72 < 11]
    assert small == [], f"text under 11 px: {small}"
    assert [t for t, _ in texts].count("blocks.0") == 2, "the unit bar and its all-gather both name blocks.0"
    assert "grad_norm" not in [t for t, _ in texts], "a label wider than its bar is left off"
