"""Docs teach; results live apart (issue 41).

A teaching or reference page (README.md, docs/*.md) says what is true and the command that
shows it. It carries no log: no commit hash, no time stamp or date, no story of the machine
it was measured on ("load average", "lease") or of how the code got here ("we tried", "this
stop", "until issue 25"). A measurement with its date, machine and command is a file of its
own in docs/results/, linked from the page that needs it; only there do dates and commits belong.

The README is the product's front page, held to a length a visitor reads whole (below).
Cheap: text only.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
TEACHING = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# What a log says and a teaching page does not. Each pattern is matched outside URLs.
LOG = {
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a UTC time": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s*-\s*\d{1,2}:\d{2})?\s*UTC\b"),
    "a date": re.compile(r"\b(?:19|20)\d{2}-\d{2}-\d{2}\b"),
    "a machine-load story": re.compile(r"\bload average\b|\bloaded machine\b|\blease[sd]?\b", re.I),
    "history": re.compile(r"\bthis stop\b|\bwe tried\b|\bwas done about it\b|\bnot done here\b"
                          r"|\bit once did\b|\bonce died\b|\buntil issue \d+|\bissue \d+'s\b", re.I),
}
URL = re.compile(r"https?://\S+")


def log_lines(text: str) -> list[str]:
    """'line N: what, "the words"' for every log-like phrase in a page."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        line = URL.sub("", line)
        for what, pattern in LOG.items():
            for m in pattern.finditer(line):
                hits.append(f"line {n}: {what}, {m.group(0)!r}")
    return hits


def test_the_log_patterns_catch_what_they_name_and_spare_teaching_text():
    log = ("in CI at commit 50a24d0 (20:56-21:04 UTC); 2026-11-26, at a load average of 4; the lease was "
           "15 minutes; which is the next step and not done here; (it once did); until issue 25 it did")
    assert [h.split(",")[0].split(": ")[1] for h in log_lines(log)] == [
        "a commit hash", "a UTC time", "a date", "a machine-load story", "a machine-load story",
        "history", "history", "history"]
    teaching = ("1,740,816 bytes; fp16 is 2 bytes; 0x7f; step 1000; 3Ψ(N-1)/N; 1e-5; 2.4e-7; "
                "https://github.com/a/b/commit/0123abcd4567; ZeRO-3 gathers each unit once per step; "
                "Chen et al. 2016; the accelerator; `launch/gpu_lease.sh`; deadbeef faced; 12:30 of the clock")
    assert log_lines(teaching) == []


@pytest.mark.parametrize("page", TEACHING, ids=lambda p: str(p.relative_to(ROOT)))
def test_teaching_pages_carry_no_log(page):
    hits = log_lines(page.read_text())
    assert not hits, (f"{page.relative_to(ROOT)} reads as a log: a measurement with its date, machine and "
                      "command goes to docs/results/<what>.md, linked from here; history is cut:\n"
                      + "\n".join(hits))


# ----------------------------------------------------------------------------- the README

# The README is read top to bottom, whole, by someone deciding whether to clone: at the pace
# technical prose with commands is read (about 200 words a minute) ten minutes is 2,000 words;
# 1,800 leaves the tour its pictures. 200 lines of at most about 100 characters is four
# screens, and what a visitor needs first, the two commands, is on the first one (40 lines).
# What does not fit is a page of docs/ that the README links.
README_MAX_LINES = 200
README_MAX_WORDS = 1800
TWO_COMMANDS_WITHIN = 40


def test_readme_is_a_front_page_a_visitor_reads_whole():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, over {README_MAX_LINES}"
    words = len(text.split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words, over {README_MAX_WORDS}"
    first = "\n".join(lines[:TWO_COMMANDS_WITHIN])
    assert "./test.sh" in first and "-m minizero.train --stage 3" in first, \
        f"the two commands are not in the README's first {TWO_COMMANDS_WITHIN} lines"
    for heading in ("## Two commands", "## A short tour", "## Tests and CI"):
        assert heading in text, f"README.md lacks {heading!r}"
    tests_section = text.split("## Tests and CI", 1)[1].split("\n## ", 1)[0]
    assert len([x for x in tests_section.splitlines() if x.strip()]) <= 10, \
        "the README's Tests and CI says how to run the tests and how long they take, in a few lines"


# ----------------------------------------------------------------------------- docs/results

def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")


def test_each_result_says_when_where_and_how():
    files = results_files()
    assert files, "docs/results/ holds no measurement"
    bad = []
    for f in files:
        text = f.read_text()
        head = "\n".join(text.splitlines()[:12])
        for field in ("Date:", "Machine:", "Command:"):
            if f"**{field}**" not in head:
                bad.append(f"{f.name}: no **{field}** line in its first 12 lines")
        if not re.search(r"\*\*Date:\*\*[^\n]*\b20\d{2}-\d{2}-\d{2}\b", head):
            bad.append(f"{f.name}: its Date is not YYYY-MM-DD")
    assert not bad, "a result says its date, machine and command at its top:\n" + "\n".join(bad)


def test_each_result_is_linked_from_a_page_that_needs_it():
    """Reachable from a teaching page, directly or through results that are (a run that
    explains another is linked from it), and listed in docs/results/README.md."""
    link = re.compile(r"\(((?:docs/)?results/)?([\w.-]+\.md)\)")
    reached, frontier = set(), []
    for page in TEACHING:
        frontier += [m.group(2) for m in link.finditer(page.read_text()) if m.group(1)]
    while frontier:
        name = frontier.pop()
        if name in reached or not (RESULTS / name).is_file():
            continue
        reached.add(name)
        frontier += [m.group(2) for m in link.finditer((RESULTS / name).read_text())]
    orphans = [f.name for f in results_files() if f.name not in reached]
    assert not orphans, f"results no teaching page leads to (link them where the number is needed): {orphans}"
    index = (RESULTS / "README.md").read_text()
    unlisted = [f.name for f in results_files() if f"({f.name})" not in index]
    assert not unlisted, f"docs/results/README.md does not list {unlisted}"


# ----------------------------------------------------------------------------- names a page gives

PATH = re.compile(r"`((?:minizero|tests|reference|launch|docs)/[\w./-]+\.(?:py|json|sh|md|sbatch))`")


def test_the_files_a_teaching_page_names_exist():
    """A page that names `minizero/x.py` or `launch/y.sh` in code quotes sends a reader there:
    the file must exist (after a file is renamed, this lists the pages to update)."""
    bad = []
    for page in TEACHING:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                if not (ROOT / m.group(1)).exists():
                    bad.append(f"{page.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not bad, "teaching pages name files that do not exist:\n" + "\n".join(bad)
