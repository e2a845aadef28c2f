"""The teaching pages quote only numbers their command prints (issue 24).

docs/lesson.md, docs/reading.md and the README's teaching section ("See each collective",
"Memory at any world size") name `python docs/lesson/lesson_numbers.py`, which runs
the lesson's training commands (tiny model, 3 steps each) and the layout code and prints
every number they quote. This test runs it once (its launches on forked ranks: the `lesson`
fixture) and checks each page against its output:

- every number with a thousands comma, a decimal point, or three digits or more;
- every count of collectives or copies ("7 all-reduces", "200 host-to-device", "6 of the 7").

Code blocks are commands (run as printed) and are not checked.

So changing a quoted number by one digit fails here (test_a_changed_digit_is_caught shows
it on the real page). Not checked: one- and two-digit numbers in other prose (stage
numbers, N = 2, minutes), which are names rather than measurements.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (page, the part of it that teaches: from this heading up to the next "## " heading, or all of it)
PAGES = [("docs/lesson.md", None), ("docs/reading.md", None), ("README.md", "### See each collective")]
SCRIPT = "docs/lesson/lesson_numbers.py"

NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+\.\d+|\d{3,})(?![\w])")
COUNT = re.compile(r"(?<![\w-])(\d+) (?:all-reduces|reduce-scatters|all-gathers|device-to-host|host-to-device)\b"
                   r"|(?<![\w-])(\d+) of (?:the )?(\d+)\b")
PRINTED_COUNT = re.compile(r"(?:calls|reduce-scatters|backward|ended) (\d+)")
ANY_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def not_printed(page_text: str, output: str) -> list[str]:
    """The numbers a page quotes (see the module docstring) that the script did not print."""
    text = re.sub(r"```.*?```", "", page_text, flags=re.S)   # commands, run as printed, quote nothing
    text = re.sub(r"https?://\S+", "", text)                 # addresses are not numbers
    values = {m.group(1) for m in NUMBER.finditer(text)}
    counts = {g for m in COUNT.finditer(text) for g in m.groups() if g}
    # the overlap part's step and wait times (" ms") vary from run to run and no page quotes
    # them: left in, a time that happened to print as 31.5 let "31.4 GB -> 31.5 GB" through
    output = re.sub(r"\d[\d,]*(?:\.\d+)? ms\b", "", output)
    printed_values = {m.group(0).rstrip(",") for m in ANY_NUMBER.finditer(output)}
    printed_counts = {m.group(1) for m in PRINTED_COUNT.finditer(output)}
    return sorted(values - printed_values) + sorted(f"{c} (a count)" for c in counts - printed_counts)


def load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("lesson_numbers", os.path.join(ROOT, SCRIPT))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    """(the runs folder, what `python docs/lesson/lesson_numbers.py --runs RUNS` prints):
    its main(argv) in this process, its seven torchrun runs as minizero.train's main(argv)
    on processes forked from the tests' preloaded forkserver (tests/support/command_runs.py),
    not seven launches of fresh interpreters that each import torch (and DeepSpeed) again
    (its two `python -m minizero.memory_table` commands compute and start nothing: the
    script runs their main(argv) itself). Each run is still its own processes, started from
    its command line; test_the_script_as_a_command_prints_the_same runs the script itself."""
    from tests.support.command_runs import torchrun_on_forked_ranks
    runs = tmp_path_factory.mktemp("lesson-runs")
    out = io.StringIO()
    with torchrun_on_forked_ranks(), contextlib.redirect_stdout(out):
        load_script().main(["--runs", str(runs)])
    return runs, out.getvalue()


@pytest.fixture(scope="module")
def output(lesson):
    return lesson[1]


def test_the_script_as_a_command_prints_the_same(lesson):
    """The page's command itself, in a fresh interpreter, on the runs the fixture made (its
    second form, `--runs runs/`, reads the traces the lesson's commands wrote, so it
    launches no training): it prints exactly what the in-process run printed (the times
    too: they are read from the same traces)."""
    runs, printed = lesson
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, SCRIPT, "--runs", str(runs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == printed


def teaching_text(page: str, start: str | None) -> str:
    text = open(os.path.join(ROOT, page)).read()
    if start is None:
        return text
    assert start in text, f"{page} has no section {start!r}"
    return "## " + text.split(start, 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("page,start", PAGES)
def test_every_quoted_number_is_printed_by_the_pages_command(page, start, output):
    text = teaching_text(page, start)
    assert SCRIPT in text, f"{page} must name {SCRIPT}, the command that prints its numbers"
    assert NUMBER.search(text), f"{page}: no numbers found: is the pattern broken?"
    assert not_printed(text, output) == [], f"{page} quotes numbers {SCRIPT} does not print"


def test_the_script_runs_the_lessons_commands_as_printed():
    """Each command the script runs is on the page, word for word (line continuations joined)."""
    script = load_script()
    page = " ".join(open(os.path.join(ROOT, "docs/lesson.md")).read().replace("\\\n", " ").split())
    for name, command in script.COMMANDS.items():
        assert " ".join(command.split()) in page, f"docs/lesson.md does not print the script's {name} command"
    reading = " ".join(open(os.path.join(ROOT, "docs/reading.md")).read().replace("\\\n", " ").split())
    assert script.COMMANDS["stages"].replace("$s", "2") in reading, "docs/reading.md's stage-2 run is not the lesson's"


def test_a_changed_digit_is_caught(output):
    text = open(os.path.join(ROOT, "docs/lesson.md")).read()
    for was, now in [("41,881,968", "41,881,969"), ("31.4 GB", "31.5 GB"), ("870,432", "870,433"),
                     ("6 reduce-scatters", "5 reduce-scatters"), ("1,358,976", "1,358,977")]:
        assert was in text
        assert not_printed(text.replace(was, now), output) != [], f"{was} -> {now} went unnoticed"


def test_a_printed_time_does_not_stand_for_a_quoted_number(output):
    """The overlap part prints times that vary by run: one that comes out as 31.5 ms must not
    let a page's "31.5 GB" pass (it once did, in CI)."""
    text = open(os.path.join(ROOT, "docs/lesson.md")).read().replace("31.4 GB", "31.5 GB")
    assert "31.5 GB" in text and not_printed(text, output + "\noverlap on: step 31.5 ms, waiting 31.5 ms\n") != []


def test_timeline_is_legible_on_a_projector(tmp_path, monkeypatch):
    """The timeline PNG is 1600 px wide and no text in it is under 11 px (it was 1680 px with
    6-point unit labels, 10 px), and collective bars name the unit they moved."""
    import matplotlib.figure
    import matplotlib.image
    import matplotlib.text
    from minizero.observe import timeline

    def ev(cat, name, ts, dur, **args):
        return {"ph": "X", "pid": 0, "tid": 0, "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"step": 2, **args}}
    doc = {"traceEvents": [ev("step", "forward", 0, 400), ev("units", "blocks.0.forward", 0, 400, unit="blocks.0", phase="forward"),
                           ev("collectives", "all_gather blocks.0.g0.fwd", 0, 200, op="all_gather", label="blocks.0.g0.fwd"),
                           ev("step", "backward", 400, 600)],
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
