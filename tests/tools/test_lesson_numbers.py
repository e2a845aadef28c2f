"""The class's pages are their sources filled in by the lesson's own runs, and the class runs twice as printed.

`python docs/lesson/lesson_numbers.py` runs the commands of docs/lesson.md (read from its
source, docs/lesson/src/lesson.md.in, loops expanded), reads their traces, logs and summaries,
and fills in every `{{name}}` of the sources in docs/lesson/src/: the lesson, the worksheet,
the answer key, the question bank, the slides' notes, the slide deck and docs/reading.md. Here:

- every page (and the deck) equals its source filled in, character for character, so one
  changed digit anywhere fails (a count, a "2 passed", a stage number:
  test_a_changed_digit_anywhere_is_caught mutates every digit of every page);
- no source types a number by hand: outside its `{{name}}`s it holds only question numbers
  and constants (years, N = 1024, DeepSpeed's default window), so every count an answer
  states is the run's (and the script asserts the arithmetic the answers spell out);
- the timing table is docs/results/lesson-timings.md's measurement of exactly the sessions'
  in-class commands, and each session fits its 50 minutes;
- every reference to a lesson part from another page links the part's own heading, and every
  `Class.member` / `module.name` the class's pages name exists in minizero;
- the README's teaching section and docs/timeline.md, which have no source, quote only
  numbers the script prints (every number of three digits or more, or with a comma or a
  decimal point), and timeline.md's comms-logger table is the run's, row for row;
- each traced run prints its collectives table with the trace's own totals;
- session 1 runs a second time as printed, into the folder of the first, with no refusal and
  no traceback (session 2 and the homework: MINIZERO_LESSON_HOMEWORK=1, a few minutes more,
  most of it DeepSpeed's side-by-side comparison);
- the slides are 1600 px wide, in the order their notes give; the worksheet holds no answer;
  part 8's recording says on its first line that it is one;
- the deck opens in headless Chromium with the network off (test_lesson_deck.py).

Cost: the lesson's 21 training runs (part 11's three and part 4's three on 4 ranks) on ranks
forked from the tests' preloaded forkserver (tests/support/command_runs.py), and part 10's
--collect-only count in a process forked from it too, its three memory tables, the activation
measurement and the projections in this process, once per session (the `lesson` fixture);
then session 1's 14 commands again (6 of them training runs).
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


@contextlib.contextmanager
def pytest_on_a_forked_process():
    """While open, subprocess.run of `python -m pytest ARGS` (the script's --collect-only count
    of part 10's command) runs pytest.main(ARGS) in a process forked from the tests' preloaded
    forkserver: the same pytest on the same files, without a fresh interpreter importing torch
    again for the test file it collects (about 4 s of CPU)."""
    from tests.support.command_runs import run_command
    real = subprocess.run

    def run(cmd, *args, capture_output=False, text=None, **kw):
        if not (isinstance(cmd, list) and cmd[:3] == [sys.executable, "-m", "pytest"] and capture_output and text):
            return real(cmd, *args, capture_output=capture_output, text=text, **kw)
        p = run_command("pytest", cmd[3:], 1, launcher=False)
        return subprocess.CompletedProcess(cmd, p.returncode, p.stdout, p.stderr)
    subprocess.run = run
    try:
        yield
    finally:
        subprocess.run = real


@pytest.fixture(scope="module")
def lesson(tmp_path_factory, script):
    """(the runs folder, the numbers, what `python docs/lesson/lesson_numbers.py --runs RUNS`
    prints): the script's main(argv) in this process, its torchrun commands (and its
    `python -m pytest --collect-only`) on processes forked from the tests' preloaded
    forkserver, not fresh interpreters that each import torch again. Each run is still its
    own processes, started from its command line."""
    from tests.support.command_runs import torchrun_on_forked_ranks
    runs = str(tmp_path_factory.mktemp("lesson-runs"))
    out = io.StringIO()
    with torchrun_on_forked_ranks(), pytest_on_a_forked_process(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(io.StringIO()):
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


def test_the_deck_is_its_source_filled_in(lesson, script):
    _, numbers, _, _ = lesson
    have = open(os.path.join(ROOT, script.DECK)).read()
    if have != script.render_deck(numbers):
        pytest.fail(f"{script.DECK} differs from docs/lesson/src/deck.md.in filled in: run `python {SCRIPT} --write`")


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
    """Session 1, the first 50 minutes: every in-class command a second time, into the folders
    the first time (the fixture) wrote, as an instructor repeats the class (the projections,
    the memory tables and the replay pages included)."""
    runs, _, _, _ = lesson
    with open(script.SESSIONS) as f:
        first = [slot["heading"] for slot in __import__("json").load(f)["sessions"][0]["slots"]]
    commands = [c for heading, cs in script.session_commands() if heading in first for c in cs]
    assert len([c for c in commands if "stage_diff.py" in c]) == 4 and len(commands) == 2 + 9 + 3
    _run_again(script, commands, runs)


@pytest.mark.skipif(os.environ.get("MINIZERO_LESSON_HOMEWORK") != "1",
                    reason="the homework's second run takes minutes (DeepSpeed's comparison); MINIZERO_LESSON_HOMEWORK=1")
def test_the_homework_runs_twice_as_printed(lesson, script):
    runs, _, _, _ = lesson
    page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    commands = [c for c in script.page_commands(page[page.index("## Session 2"):]) if "minizero.lab" not in c]
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
    refs = re.findall(r"(?:worksheet|ask) (\d+\.\d+)(?:(?:-| and )(\d+\.\d+))?", lesson_page, flags=re.I)
    assert len(refs) >= 15
    for ref in refs:
        assert all(q in asked for q in ref if q), ref
    # each part's in-class questions come before its after-class ones, and the part exists
    for part in sorted({q.split(".")[0] for q in asked}, key=int):
        assert re.search(rf"^## Part {part}\. ", worksheet, flags=re.M), part
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


# ----------------------------------------------------------------------------- no number typed by hand

SOURCES = ["lesson.md.in", "worksheet.md.in", "answers.md.in", "question_bank.md.in", "slides.md.in",
           "reading.md.in", "deck.md.in"]
# the constants the class's prose may write out: years of the papers it cites, the world sizes
# it names, DeepSpeed's default loss-scale window and version, the ratio 1.5 of the paper's
# section 7, the slides' width
CONSTANTS = {"2016", "2018", "2020", "1024", "511", "512", "1000", "1.5", "0.19", "1600"}
NUMBER_IN_PROSE = re.compile(r"(?<![\w.{^-])(\d{1,3}(?:,\d{3})+|\d+\.\d+|\d{3,})(?![\w}])")


def hand_typed(source_text: str, questions: set) -> list[str]:
    """The numbers of a source outside its {{name}}s, code and links that are neither a
    question's number nor one of the CONSTANTS."""
    text = re.sub(r"```.*?```", "", source_text, flags=re.S)
    text = re.sub(r"\{\{[^}]*\}\}", "", text)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return sorted({m.group(1) for m in NUMBER_IN_PROSE.finditer(text)} - CONSTANTS - questions)


def test_no_source_types_a_number_by_hand(script, lesson):
    """Every count, byte and ratio the pages state is a {{name}} the runs or the layout fill in;
    an answer that typed "2 x 217,608 x 1/2 = 435,216" itself would fail here."""
    _, numbers, _, _ = lesson
    questions = set(re.findall(r"^\*\*(\d+\.\d+)\*\*", script.render("worksheet.md.in", numbers), flags=re.M))
    for source in SOURCES:
        text = open(os.path.join(ROOT, "docs", "lesson", "src", source)).read()
        assert hand_typed(text, questions) == [], source
    assert hand_typed("each rank sends 2 x {{nodes.z2.half}} x 1/2 = 435,216 bytes", questions) == ["435,216"]


# ----------------------------------------------------------------------------- the timing

def test_the_timing_table_is_the_measured_sessions(script, lesson):
    """docs/results/lesson-timings.md times exactly the in-class commands of the two sessions,
    each session's minutes are talk plus measured seconds rounded up and fit 50, and a command
    added to a session without a time stops the pages from being made."""
    _, numbers, _, _ = lesson
    times = script.read_timings()
    in_class = [c for _, cs in script.session_commands() for c in cs]
    assert sorted(times) == sorted(set(in_class)) and len(in_class) >= 20
    with open(script.SESSIONS) as f:
        spec = __import__("json").load(f)
    text = script.lesson_source()
    for i, session in enumerate(spec["sessions"], start=1):
        used = sum(slot["talk"] + __import__("math").ceil(sum(times[c] for c in script.page_commands(
            script.part_text(text, slot["heading"]))) / 60) for slot in session["slots"])
        assert numbers[f"timing.session{i}.used"] == str(used) and used <= spec["minutes"]
        assert numbers[f"timing.session{i}"].count("\n") == len(session["slots"]) + 2
    measured = open(script.TIMINGS).read()
    assert "**Machine:** " in measured and "**Date:** " in measured and "load average" in measured

    real = script.read_timings
    try:
        script.read_timings = lambda: {c: t for c, t in times.items() if "--stage 3" not in c}
        with pytest.raises(KeyError, match="no time measured"):
            script.timing_numbers(script.Numbers())
    finally:
        script.read_timings = real


# ----------------------------------------------------------------------------- references

def _part_anchors() -> dict:
    """part number -> the anchor of its heading in docs/lesson.md."""
    from tests.tools.test_repo_hygiene import _slug
    page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    return {int(m.group(1)): _slug(m.group(0)[3:]) for m in re.finditer(r"^## (\d+)\. .*$", page, flags=re.M)}


def stale_part_references(text: str, anchors: dict) -> list[str]:
    """Mentions of the lesson's part N (outside code) not inside a link to part N's heading."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    covered, bad = [], []
    for m in re.finditer(r"\[([^\]]*)\]\(([^)]*)\)", text):
        for n in re.findall(r"part (\d+)", m.group(1)):
            if "lesson.md#" in m.group(2):
                if m.group(2).split("#", 1)[1] != anchors.get(int(n)):
                    bad.append(f"{m.group(0)}: part {n} is #{anchors.get(int(n))}")
                covered.append((m.start(), m.end()))
    for m in re.finditer(r"part (\d+)", text):
        before = text[max(0, m.start() - 40):m.start()]
        if "lesson" in before and not any(a <= m.start() < b for a, b in covered):
            bad.append(f"...{before[-30:]}{m.group(0)}: link it to the part's heading (lesson.md#...)")
    return bad


def test_pages_name_the_lessons_parts_by_their_headings():
    """A page outside the lesson that names one of its parts links that part's heading, so a
    renumbered part breaks a link the hygiene test sees (offload.md once sent readers to part 5
    for what part 9 runs); the lesson's own mentions name parts that exist."""
    anchors = _part_anchors()
    assert sorted(anchors) == list(range(1, 12))
    docs = [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
    docs.append(os.path.join(ROOT, "README.md"))
    bad = {os.path.relpath(d, ROOT): stale_part_references(open(d).read(), anchors)
           for d in docs if not d.endswith("lesson.md")}
    assert {k: v for k, v in bad.items() if v} == {}
    assert stale_part_references("This is the lesson's part 5 and the table", anchors)
    assert stale_part_references("[the lesson's part 5](lesson.md#9-homework-what-offload-copies)", anchors)
    lesson_page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    assert {int(n) for n in re.findall(r"\bparts? (\d+)", lesson_page)} <= set(anchors)


def _minizero_names() -> tuple[dict, dict]:
    """({class: its members and its bases' members}, {module: its top-level names}) of minizero/."""
    import ast
    classes, modules = {}, {}
    for folder, _, files in os.walk(os.path.join(ROOT, "minizero")):
        for f in files:
            if not f.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(folder, f)).read())
            names = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                if isinstance(node, ast.ClassDef):
                    members = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                    members |= {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                if isinstance(t, ast.Name)}
                    members |= {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                if isinstance(t, ast.Attribute)}
                    classes.setdefault(node.name, [set(), [b.id for b in node.bases if isinstance(b, ast.Name)]])
                    classes[node.name][0] |= members
            modules[f[:-3]] = names | modules.get(f[:-3], set())
    def all_members(c, seen=()):
        members, bases = classes[c]
        out = set(members)
        for b in bases:
            if b in classes and b not in seen:
                out |= all_members(b, seen + (c,))
        return out
    return {c: all_members(c) for c in classes}, modules


def test_the_code_the_class_pages_name_exists(lesson, script):
    """Every `Class.member` and `module.name` the lesson's pages and the deck name is in minizero
    today (the lesson once named FlatParam.free_full, renamed release_full)."""
    _, numbers, _, _ = lesson
    classes, modules = _minizero_names()
    pages = [script.render(src, numbers) for src in SOURCES if src != "deck.md.in"]
    pages.append(script.render("deck.md.in", numbers))
    missing = set()
    any_member = set().union(*classes.values())
    for page in pages:
        for code in re.findall(r"`([^`\n]+)`", page):
            if code.startswith(("python", "torchrun")) or "/" in code or "<" in code:
                continue   # a command or a path, not a name
            for owner, name in re.findall(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", code):
                if name in ("py", "md", "json", "png", "html", "csv", "passed"):
                    continue   # a file's name
                if owner in classes and name not in classes[owner]:
                    missing.add(f"{owner}.{name}")
                elif owner in modules and owner not in classes and owner != "minizero" \
                        and name not in modules[owner] and name not in any_member:
                    missing.add(f"{owner}.{name}")   # a module's name (an instance's attribute is some class's)
    assert missing == set()
    assert "free_full" not in classes["FlatParam"] and "release_full" in classes["FlatParam"]


# ----------------------------------------------------------------------------- part 8 without DeepSpeed

def test_part_8_shows_its_recording_and_says_so():
    """`python docs/lesson/recorded.py` (no torch, no DeepSpeed) prints part 8's comparison as
    recorded, its first line saying it is a recording of another machine, with the command the
    lesson prints; the recording's report links nothing outside the repository."""
    done = subprocess.run([sys.executable, "docs/lesson/recorded.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("RECORDED, NOT RUN ON THIS MACHINE: `python -m minizero.compare --stages 1 3")
    assert "| stage | max abs dloss/step |" in done.stdout and done.stdout.rstrip().endswith(
        "RECORDED, NOT RUN ON THIS MACHINE.")
    lesson_page = open(os.path.join(ROOT, "docs/lesson.md")).read()
    printed = first.split("`")[1].replace("runs/compare-<time>", "runs/compare-$(date +%s)")
    assert printed in " ".join(lesson_page.replace("\\\n", " ").split())
    report = open(os.path.join(ROOT, "docs/results/lesson-compare.md")).read()
    assert ROOT not in report and "](/" not in report


def test_the_fp16_story_follows_any_run(script):
    """On another CPU the fp16 run may overflow a step earlier or later, or not again after the
    first clean step: the pages' reading of it (lesson, worksheet 6.1-6.2, answers, Q17) is told
    from whatever pattern the run had, never an assertion that stops the pages from being made."""
    from minizero.fp16 import DynamicLossScaler

    def pattern(overflows):
        s = DynamicLossScaler(init_scale=2 ** 20, scale_window=4, min_scale=1, delayed_shift=2)
        out = []
        for o in overflows:
            before = s.cur_scale
            s.update_scale(o)
            out.append((o, before, s.cur_scale, []))
        return out
    T, F = True, False
    cases = {"the lesson's": [T, T, T, T, F, F, T, F, F, F, F, F],
             "shifted a step": [T, T, T, F, F, F, T, F, F, F, F, F],
             "no late overflow": [T, T, T, F, F, F, F, F, F, F, F, F],
             "no doubling yet": [T, T, F, F, T, F, F],
             "every step overflows": [T, T, T, T],
             "no overflow at all": [F] * 6}
    for name, overflows in cases.items():
        story = script.fp16_story(pattern(overflows), 20, 4, 2)
        assert set(story) == {"reading", "q61", "a61", "q62", "a62", "q17", "a17"}, name
        assert all(text and "None" not in text for text in story.values()), (name, story)
        assert all(len(line) <= 92 for text in story.values() for line in text.splitlines()), name
    told = script.fp16_story(pattern(cases["shifted a step"]), 20, 4, 2)
    assert "step 4 is the first clean step" in told["reading"].replace("\n", " ")
    assert "The doubling comes at step 12" in told["reading"].replace("\n", " ")
    told = script.fp16_story(pattern(cases["no late overflow"]), 20, 4, 2)
    assert "halves at once" not in told["reading"] and "at which step does the scale double" in told["q62"].replace(
        "\n", " ")
