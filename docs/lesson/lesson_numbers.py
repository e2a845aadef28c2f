"""Every number of the lesson's pages, made by the commands that make them; the pages, made from their sources.

    python docs/lesson/lesson_numbers.py                # runs the lesson's commands, prints every number, checks the pages
    python docs/lesson/lesson_numbers.py --runs runs/   # the same, in runs/ (what a run already left there is read, not run again)
    python docs/lesson/lesson_numbers.py --write        # and writes the pages from their sources (docs/lesson/src/)
    python docs/lesson/lesson_numbers.py --img          # and redraws the pictures (docs/lesson/slides/, docs/img/'s two), then --write
    python docs/lesson/lesson_numbers.py --timings      # and times the two sessions' commands (docs/results/lesson-timings.md)
    python docs/lesson/lesson_numbers.py --record       # and records part 8's comparison (docs/results/lesson-compare.*)

Why: a number typed into a page drifts the day the code changes. Each page of the class
(docs/lesson.md, the worksheet, the answer key, the question bank, the slides' notes,
docs/reading.md) has a source in docs/lesson/src/ where every number is a `{{name}}`, and
this script fills them in: it runs the lesson's own commands, read from the lesson's
source word for word (its ```bash blocks, loops expanded, `runs/` put under --runs), reads
their traces, logs and summaries and the layout code, and computes the question bank's
arithmetic from the same formulas. tests/tools/test_lesson_numbers.py holds every page to
its source filled in, character for character: one changed digit anywhere on a page (a
count, a "2 passed", a stage number) fails it. To change a page, edit its source, then
`--write`. Times (ms) are printed for you to compare with yours, and quoted nowhere: they
change from run to run, bytes and counts do not.

Two kinds of numbers depend on the machine and are measured apart, each into a file of
docs/results/ with its date and machine, which the pages then read like any other number:
the wall time of every command of the two 50-minute sessions (`--timings`: each run once more
as printed, a fresh process, timed; the timing table's minutes are the lesson's talking
minutes, docs/lesson/sessions.json, plus those seconds rounded up to whole minutes, and this
script refuses a session over 50), and part 8's comparison with DeepSpeed (`--record`: its
command as printed; the lesson shows the recording where DeepSpeed does not install).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import importlib.util
import io
import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "docs", "lesson")
sys.path.insert(0, ROOT)

# source (docs/lesson/src/) -> the page made from it
# (.md.in, not .md: a source's relative links are its page's, which would be broken where it lies)
PAGES = {"lesson.md.in": "docs/lesson.md", "worksheet.md.in": "docs/lesson/worksheet.md",
         "answers.md.in": "docs/lesson/answers.md", "question_bank.md.in": "docs/lesson/question_bank.md",
         "slides.md.in": "docs/lesson/slides/README.md", "reading.md.in": "docs/reading.md"}
HEADER = "<!-- Made by `python docs/lesson/lesson_numbers.py --write` from docs/lesson/src/{src}: edit that file. -->\n"
PLACEHOLDER = re.compile(r"\{\{([\w.\-]+)\}\}")

# The commands on the lesson's page this script does not run: no number on the pages comes
# from them (the tests run them twice, as the class does: tests/tools/test_lesson_numbers.py;
# part 8's comparison runs with --record, its recording gives part 8's numbers).
NOT_RUN = ("docs/lesson/stage_diff.py", "minizero.compare", "minizero.observe.ledger_table", "minizero.replay",
           "docs/lesson/recorded.py", "minizero.lab")
SESSIONS = os.path.join(HERE, "sessions.json")
TIMINGS = os.path.join(ROOT, "docs", "results", "lesson-timings.md")
RECORDED = os.path.join(ROOT, "docs", "results", "lesson-compare")   # .md (the report) and .json (its rows)
OFFLOAD_PAGE = os.path.join(ROOT, "docs", "offload.md")
AFTER_CLASS = "### After class"   # a part's commands below this heading are homework: not timed


# ----------------------------------------------------------------------------- the commands

def _strip_comment(line: str) -> str:
    """A shell line without its comment (a # outside quotes, at the start or after a space)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def page_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks, one string each, as a shell would run them:
    continuation lines joined, comments dropped, `for v in a b; do ...; done` expanded."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = [" ".join(_strip_comment(ln).split()) for ln in block.replace("\\\n", " ").splitlines()]
        lines = [ln for ln in lines if ln]
        i = 0
        while i < len(lines):
            loop = re.fullmatch(r"for (\w+) in ([^;]+); do\s*(.*)", lines[i])
            if not loop:
                out.append(lines[i])
                i += 1
                continue
            var, values, body = loop.group(1), loop.group(2).split(), [loop.group(3)] if loop.group(3) else []
            i += 1
            while lines[i] != "done":
                body.append(lines[i].rstrip(";").strip())
                i += 1
            i += 1
            out += [b.replace(f"${var}", v) for v in values for b in body]
    return out


def lesson_commands() -> list[str]:
    with open(os.path.join(HERE, "src", "lesson.md.in")) as f:
        return page_commands(f.read())


def lesson_source() -> str:
    with open(os.path.join(HERE, "src", "lesson.md.in")) as f:
        return f.read()


def part_text(text: str, heading: str, in_class: bool = True) -> str:
    """The lesson's text from the line `heading` to the next "## " heading; in_class: up to
    its "### After class" (what a part leaves to homework)."""
    start = text.index("\n" + heading) + 1
    end = text.find("\n## ", start + len(heading))
    part = text[start:end if end >= 0 else len(text)]
    return part.split("\n" + AFTER_CLASS, 1)[0] if in_class else part


def session_commands() -> list[tuple[str, list[str]]]:
    """(slot heading, its in-class commands) for every slot of docs/lesson/sessions.json."""
    with open(SESSIONS) as f:
        sessions = json.load(f)["sessions"]
    text = lesson_source()
    return [(slot["heading"], page_commands(part_text(text, slot["heading"]))) for s in sessions for slot in s["slots"]]


def subprocess_of(command: str, runs: str) -> tuple[list[str], dict]:
    """The process a shell would start for one command of the page, and its environment:
    `torchrun` is `python -m torch.distributed.run`; `NAME=value` words set the environment."""
    words = words_of(command, runs)
    env = {"PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run"] + words[1:], env
    if words[0] == "python":
        return [sys.executable] + words[1:], env
    return words, env


def measure_timings(runs: str) -> list[tuple[str, float]]:
    """Every in-class command of the two sessions, run once more exactly as printed (a fresh
    process each, in the order of the page), and its wall time in seconds."""
    times = []
    for _, commands in session_commands():
        for command in commands:
            cmd, env = subprocess_of(command, runs)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"{command}: exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            times.append((command, wall))
            print(f"{wall:7.1f} s  {command}")
    return times


def write_timings(times: list[tuple[str, float]], load: tuple) -> None:
    from minizero.runtime.about import machine, versions
    v = versions()
    lines = ["# The lesson's commands, timed", "",
             f"**Date:** {time.strftime('%Y-%m-%d')}",
             f"**Machine:** {machine()}; load average (1 min) before and after: {load[0]:.1f}, {load[1]:.1f} (on 2 "
             f"cores, a load above 2 means other work shared them: the seconds below are then longer than on an "
             f"idle laptop)",
             "**Command:** `python docs/lesson/lesson_numbers.py --timings --runs DIR`",
             f"**Software:** python {v['python']}, torch {v['torch']}", "",
             "Every command the two 50-minute sessions of [docs/lesson.md](../lesson.md) run in class, run once "
             "more exactly as printed (a fresh process each, in the page's order, after the lesson's runs had "
             "filled the folder) and timed by the wall clock. The lesson's timing table adds these seconds, "
             "rounded up to whole minutes per part, to each part's talking minutes "
             "(docs/lesson/sessions.json).", "",
             "| seconds | command |", "|---|---|"]
    lines += [f"| {wall:.1f} | `{command}` |" for command, wall in times]
    with open(TIMINGS, "w") as f:
        f.write("\n".join(lines) + "\n")


def read_timings() -> dict[str, float]:
    """command -> seconds, from docs/results/lesson-timings.md (empty when there is none)."""
    if not os.path.exists(TIMINGS):
        return {}
    with open(TIMINGS) as f:
        return {m.group(2): float(m.group(1)) for m in re.finditer(r"^\| ([\d.]+) \| `(.*)` \|$", f.read(), flags=re.M)}


def timing_numbers(v: "Numbers") -> None:
    """The two sessions' timing tables: per slot its talking minutes (sessions.json) plus its
    in-class commands' measured seconds (docs/results/lesson-timings.md), rounded up to whole
    minutes; a session must fit its minutes."""
    with open(SESSIONS) as f:
        spec = json.load(f)
    times, text = read_timings(), lesson_source()
    for si, session in enumerate(spec["sessions"], start=1):
        rows = ["| minutes | part | talk and predictions | its commands, measured | what happens |",
                "|---|---|---|---|---|"]
        at, run_total = 0, 0.0
        for slot in session["slots"]:
            commands = page_commands(part_text(text, slot["heading"]))
            missing = [c for c in commands if c not in times]
            if missing:
                raise KeyError(f"{slot['heading']}: no time measured for {missing[0]!r}: run "
                               f"`python {os.path.relpath(__file__, ROOT)} --timings`")
            seconds = sum(times[c] for c in commands)
            run_total += seconds
            minutes = slot["talk"] + math.ceil(seconds / 60)
            measured = f"{len(commands)}: {seconds:.0f} s" if commands else "none"
            rows.append(f"| {at}-{at + minutes} | {slot['heading'][3:]} | {slot['talk']} min | {measured} | "
                        f"{slot['what']} |")
            at += minutes
        if at > spec["minutes"]:
            raise ValueError(f"{session['title']} takes {at} minutes, more than {spec['minutes']}: cut its talk "
                             f"(docs/lesson/sessions.json) or move a command under {AFTER_CLASS!r}")
        rows.append(f"| {at}-{spec['minutes']} | slack | | | questions, or a command slow to start |")
        v.put(f"timing.session{si}", "\n".join(rows))
        v.put(f"timing.session{si}.title", session["title"])
        v.put(f"timing.session{si}.used", at)
        v.put(f"timing.session{si}.run_s", run_total, ".0f")


def diff_numbers(v: "Numbers") -> None:
    """The line counts of part 2's three projections (stage_diff.py, as the commands print them)."""
    spec = importlib.util.spec_from_file_location("stage_diff", os.path.join(HERE, "stage_diff.py"))
    stage_diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage_diff)
    for a, b in ((0, 1), (1, 2), (2, 3)):
        lines = stage_diff.stage_diff(stage_diff.resolve(f"zero{a}"), stage_diff.resolve(f"zero{b}"))
        added, removed = stage_diff.counts(lines)
        v.put(f"diff.z{a}{b}.added", added)
        v.put(f"diff.z{a}{b}.removed", removed)
        v.put(f"diff.z{a}{b}.lines", len(lines))
        v.put(f"diff.z{a}{b}.text", "\n".join(lines))
        # the deck shows a long projection on two slides, cut between two members near its middle
        cuts = [i for i, ln in enumerate(lines) if ln == " "]
        cut = min(cuts, key=lambda i: abs(i - len(lines) / 2)) if cuts else len(lines)
        v.put(f"diff.z{a}{b}.first", "\n".join(lines[:cut]))
        v.put(f"diff.z{a}{b}.second", "\n".join(lines[:2] + lines[cut + 1:]))
    (command,) = [c for c in lesson_commands() if "stage_diff.py --show" in c]
    words = shlex.split(command)[3:]
    module, _, cls = words[0].rpartition(".")
    v.put("diff.unit.text", "\n".join(stage_diff.show(stage_diff.resolve(module), cls, words[1:])))
    # the deck's objectives slide: the lesson's own list, as its source words it
    text = lesson_source()
    objectives = text.split("**After these two classes a student can**\n", 1)[1].split("\n\n", 1)[0]
    v.put("lesson.objectives", objectives)


def record_comparison(runs: str) -> None:
    """Part 8's comparison, run as printed (it needs DeepSpeed); its report kept as
    docs/results/lesson-compare.md (links made relative), the rows of its results.json as
    lesson-compare.json, so the lesson can show it where DeepSpeed will not install."""
    (command,) = [c for c in lesson_commands() if "minizero.compare" in c and "--libs" not in c]
    out = run_command(command, runs)
    folder = re.search(r"report: (\S+)/report\.md", out).group(1)
    with open(os.path.join(folder, "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(folder, "report.md")) as f:
        report = f.read()
    report = report.replace(os.path.join(ROOT, "docs") + "/", "../").replace(folder + "/", "")
    report = report.replace(os.path.abspath(runs), "runs")   # the command as printed, not this machine's folder
    report = re.sub(r"!\[[^]]*\]\([^)]*\.png\)\n\n", "", report)   # its pictures stay in the run's folder
    report = re.sub(r"\[([^\]]+)\]\((?!\.\./|https?:)[^)]+\)", r"\1", report)   # and its other files
    printed = command.replace("runs/compare-$(date +%s)", "runs/compare-<time>")
    header = (f"<!-- Recorded by `python docs/lesson/lesson_numbers.py --record`: the lesson's part 8 command, "
              f"`{printed}`, on the machine below; `python docs/lesson/recorded.py` shows it. -->\n"
              f"# Part 8 of the lesson, recorded: minizero beside DeepSpeed\n\n"
              f"**Date:** {results['date'][:10]}\n**Machine:** {results['machine']}\n"
              f"**Command:** `python docs/lesson/lesson_numbers.py --record` (the lesson's `{printed}`)\n"
              f"**Software:** " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + "\n\n")
    with open(RECORDED + ".md", "w") as f:
        f.write(header + report)
    keep = {k: results[k] for k in ("command", "machine", "date", "versions", "nproc", "dtype", "rows")}
    keep["command"] = printed
    with open(RECORDED + ".json", "w") as f:
        json.dump(keep, f, indent=1)
        f.write("\n")


def recorded_numbers(v: "Numbers") -> None:
    """Part 8's numbers, from the recorded comparison (record_comparison)."""
    with open(RECORDED + ".json") as f:
        rec = json.load(f)
    v.put("rec.date", rec["date"][:10])
    v.put("rec.deepspeed", rec["versions"]["deepspeed"])
    for row in rec["rows"]:
        s = row["stage"]
        for lib, short in (("minizero", "mz"), ("deepspeed", "ds")):
            v.put(f"rec.s{s}.{short}.state", row[lib]["state_bytes_rank0"])
            v.put(f"rec.s{s}.{short}.wire", round(row[lib]["wire_bytes_per_step"]))   # the report's rounding
            v.put(f"rec.s{s}.{short}.loss", row[lib]["final_loss"], ".6f")
        v.put(f"rec.s{s}.dloss", row["max_abs_dloss"], ".1e")
        v.put(f"rec.s{s}.steps", row["steps"])
    v.put("rec.s1.wire.ratio", v_int(v, "rec.s1.ds.wire") / v_int(v, "rec.s1.mz.wire"), ".2f")


def offload_table_numbers(v: "Numbers") -> None:
    """docs/offload.md's "What crosses, both libraries" (the tiny GPT, N = 2, rank 0, bytes per
    optimizer step, measured by its command, tests/agreement/test_offload_traffic.py):
    `offload.z<stage>[op].A<A>.<mz|ds>.<d2h|h2d>`."""
    with open(OFFLOAD_PAGE) as f:
        page = f.read()
    rows = re.findall(r"^\| (\d) \| (oo(?: \+ op)?) \| (\d) \| (minizero|DeepSpeed) \|.*\| ([\d,]+) \| ([\d,]+) \|$",
                      page, flags=re.M)
    assert len(rows) == 16, f"docs/offload.md's table of both libraries' copies: {len(rows)} rows, not 16"
    for stage, offload, a, lib, d2h, h2d in rows:
        key = f"offload.z{stage}{'op' if 'op' in offload else ''}.A{a}.{'mz' if lib == 'minizero' else 'ds'}"
        v.put(f"{key}.d2h", int(d2h.replace(",", "")))
        v.put(f"{key}.h2d", int(h2d.replace(",", "")))
    for a in (1, 4):   # DeepSpeed's ZeRO-3 over minizero's, bytes down per step
        v.put(f"offload.z3.A{a}.down_ratio", v_int(v, f"offload.z3.A{a}.ds.d2h") / v_int(v, f"offload.z3.A{a}.mz.d2h"),
              ".1f")


def words_of(command: str, runs: str) -> list[str]:
    """The command's words, `runs/...` moved under `runs`, `$(date +%s)` made unique."""
    command = command.replace("$(date +%s)", str(time.time_ns()))
    return [os.path.join(runs, w[len("runs/"):]) if w.startswith("runs/") else w for w in shlex.split(command)]


def name_of(command: str) -> str:
    """A run's name: its --trace folder's without "trace-", else its --save-dir's without
    "lesson-", else the words that make it up."""
    words = shlex.split(command)
    for flag, prefix in (("--trace", "trace-"), ("--save-dir", "lesson-")):
        if flag in words:
            return os.path.basename(words[words.index(flag) + 1]).removeprefix(prefix)
    words = [w for w in words if w not in ("python", "-m") and not w.startswith("runs/") and "=" not in w]
    program = os.path.basename(words[0]).removesuffix(".py").rsplit(".", 1)[-1]
    return "_".join([program] + [w.lstrip("-") for w in words[1:]])[:80]


def run_command(command: str, runs: str) -> str:
    """Run one command of the page as printed (from the repository root); its output
    (stdout, then stderr). `torchrun ARGS` is `python -m torch.distributed.run ARGS`;
    `python -m minizero.memory_table ARGS` and `python docs/lesson/X.py ARGS` run their
    main(ARGS) in this process (they compute and start no process: no second import of
    torch); `NAME=value` words in front set the command's environment, as a shell does. A
    command that fails raises with its output's end."""
    words = words_of(command, runs)
    env = {"PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "python" and (words[1:3] == ["-m", "minizero.memory_table"] or words[1].startswith("docs/lesson/")):
        if words[1] == "-m":
            from minizero.observe import memory_table
            main, argv = memory_table.main, words[3:]
        else:
            spec = importlib.util.spec_from_file_location(os.path.basename(words[1])[:-3], os.path.join(ROOT, words[1]))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            main, argv = module.main, words[2:]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(argv) or 0
        if rc:
            raise RuntimeError(f"{command}: exit status {rc}\n{out.getvalue()[-2000:]}")
        return out.getvalue()
    if words[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"] + words[1:]
    elif words[0] == "python":
        cmd = [sys.executable] + words[1:]
    else:
        cmd = words
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(f"{command}: exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def collected(command: str) -> int:
    """How many tests a `python -m pytest ... ARGS` command runs: its --collect-only count."""
    words = shlex.split(command)
    i = words.index("pytest")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
                          + [w for w in words[i + 1:] if w != "-q"], cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)   # "2/15 tests collected (13 deselected)"
    if found is None:
        raise RuntimeError(f"{command}: collected no tests\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return int(found.group(1))


class Runs:
    """The lesson's commands, run (or read, where an earlier run left its log) in one folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.commands = {name_of(c): c for c in lesson_commands()
                         if not any(s in c for s in NOT_RUN) and "pytest" not in c}
        self.tests = [c for c in lesson_commands() if "pytest" in c]

    def output(self, name: str) -> str:
        """The output of the run `name` (name_of), running it unless a log of this very
        command is here (its first line is the command)."""
        log, head = os.path.join(self.folder, "logs", f"{name}.log"), f"$ {self.commands[name]}\n"
        if os.path.exists(log):
            with open(log) as f:
                text = f.read()
            if text.startswith(head):
                return text[len(head):]
        out = run_command(self.commands[name], self.folder)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            f.write(head + out)
        return out

    def trace(self, name: str) -> tuple[dict, list[dict], dict]:
        """(the traced step's ledger, its events on rank 0, otherData)."""
        self.output(name)
        with open(os.path.join(self.folder, f"trace-{name}", "rank0.json")) as f:
            d = json.load(f)
        (ledger,) = d["otherData"]["ledger"].values()
        return ledger, [e for e in d["traceEvents"] if e.get("ph") == "X"], d["otherData"]

    def summary(self, name: str) -> dict:
        self.output(name)
        with open(os.path.join(self.folder, f"lesson-{name}", "summary.json")) as f:
            return json.load(f)

    def metrics(self, name: str) -> list[dict]:
        self.output(name)
        with open(os.path.join(self.folder, f"lesson-{name}", "metrics.csv")) as f:
            return list(csv.DictReader(f))


# ----------------------------------------------------------------------------- the numbers

class Numbers(dict):
    """name -> the text a page shows for it; `put` formats (ints with thousands commas)."""

    def put(self, name: str, value, fmt: str | None = None) -> None:
        assert name not in self, f"{name} computed twice"
        if fmt is not None:
            text = format(value, fmt)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            text = str(value)
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            raise TypeError(f"{name}: give a float a format")
        self[name] = text


OPS = {"ar": "all_reduce", "rs": "reduce_scatter", "ag": "all_gather"}


def put_ledger(v: Numbers, prefix: str, ledger: dict) -> None:
    for short, op in OPS.items():
        counts = ledger.get(op) or {"calls": 0, "bytes": 0, "wire_bytes": 0}
        v.put(f"{prefix}.{short}.calls", counts["calls"])
        v.put(f"{prefix}.{short}.bytes", counts["bytes"])
        v.put(f"{prefix}.{short}.wire", counts["wire_bytes"])


def memory_numbers(v: Numbers, runs: Runs) -> None:
    """Part 1: the paper's Figure 1 and the tutorial model's bytes per rank (the two
    memory_table commands, whose output the page shows), and the threshold's effect."""
    from minizero.observe.memory_table import compute, figure1, meta_model
    from minizero.config.zero import ZeroConfig
    for name in runs.commands:
        if "memory_table" in runs.commands[name]:
            runs.output(name)   # the page's two commands, run as printed
    for row in figure1():
        v.put(f"fig1.s{row['stage']}", row["total"] / 1e9, ".1f")
    table = compute("tutorial", [2, 4, 8, 64, 1024], "bf16")
    for n, by_stage in table.items():
        for s, (b, psi) in by_stage.items():
            total = sum(b[k] for k in ("params", "grads", "master_params", "optimizer_states"))
            for k, short in (("params", "p"), ("grads", "g"), ("master_params", "m"), ("optimizer_states", "o")):
                v.put(f"tut.n{n}.s{s}.{short}", b[k])
            v.put(f"tut.n{n}.s{s}.total", total)
            v.put(f"tut.n{n}.s{s}.mb", total / 1e6, ".1f")
            v.put(f"tut.n{n}.s{s}.pg_mb", (b["params"] + b["grads"]) / 1e6, ".1f")
    v.put("tut.psi", psi)
    v.put("tut.16psi", 16 * psi)
    v.put("tut.12psi", 12 * psi)
    model, groups = meta_model("tutorial")
    params = dict(model.named_parameters())
    w = params["blocks.0.mlp.0.weight"]
    v.put("tut.mlp0.rows", w.shape[0])
    v.put("tut.mlp0.cols", w.shape[1])
    v.put("tut.mlp0.numel", w.numel())
    attn = [n for n in params if n.startswith("blocks.0.attn.") and n.endswith("weight")]
    v.put("tut.attn_weight.numel", params[attn[0]].numel())
    threshold = ZeroConfig().stage3_param_persistence_threshold
    v.put("threshold.default", threshold)
    kept = sum(p.numel() for p in params.values() if p.numel() <= threshold)
    v.put("tut.persistent", kept)
    v.put("tut.persistent.pct", 100 * kept / psi, ".0f")
    with_threshold = compute("tutorial", [64], "bf16", stages=(3,), persistence_threshold=threshold)[64][3][0]
    v.put("tut.n64.s3.threshold.total", sum(with_threshold[k] for k in ("params", "grads", "master_params",
                                                                        "optimizer_states")))
    v.put("tut.n64.s3.threshold.p", with_threshold["params"])
    tiny, _ = meta_model("tiny")
    v.put("tiny.largest", max(p.numel() for p in tiny.parameters()))


def volume_numbers(v: Numbers) -> None:
    """The tiny GPT's bytes per rank per step at N = 2, 4 and 64, from the layout the stages
    build with the lesson's buckets (stages.json) and comm.py's ring formulas."""
    from minizero.observe.memory_table import layout, meta_model
    from minizero.partition import padded_numel
    with open(os.path.join(HERE, "stages.json")) as f:
        bucket = json.load(f)["zero_optimization"]["reduce_bucket_size"]
    model, groups = meta_model("tiny")
    v.put("tiny.psi", sum(p.numel() for g in groups for p in g["params"]))
    v.put("bucket_size", bucket)
    v.put("tiny.buckets", len(layout(model, groups, 1, bucket)))
    v.put("tiny.flatparams", len(layout(model, groups, 3)))
    for n in (2, 4, 64):
        z0 = sum(padded_numel(p.numel, 1) for p in layout(model, groups, 0, bucket)) * 4
        z1 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 1, bucket)) * 4
        z3 = sum(padded_numel(p.numel, n) for p in layout(model, groups, 3)) * 4
        v.put(f"vol.n{n}.s0.payload", z0)
        v.put(f"vol.n{n}.s0.wire", 2 * z0 * (n - 1) // n)
        v.put(f"vol.n{n}.s1.payload", z1)
        v.put(f"vol.n{n}.s1.wire", z1 * (n - 1) // n)
        v.put(f"vol.n{n}.s1.wire2", 2 * (z1 * (n - 1) // n))
        v.put(f"vol.n{n}.s3.payload", z3)
        v.put(f"vol.n{n}.s3.elements", z3 // 4)
        v.put(f"vol.n{n}.s3.payload2", 2 * z3)
        v.put(f"vol.n{n}.s3.wire", z3 * (n - 1) // n)
        v.put(f"vol.n{n}.s3.wire2", 2 * z3 * (n - 1) // n)
        v.put(f"vol.n{n}.s3.wire3", 3 * z3 * (n - 1) // n)
        v.put(f"vol.n{n}.norm.wire", 2 * 8 * (n - 1) // n)
    v.put("vol.n2.ratio.wire", v_int(v, "vol.n2.s3.wire3") / v_int(v, "vol.n2.s0.wire"), ".1f")
    v.put("vol.n2.ratio.payload", 3 * v_int(v, "vol.n2.s3.payload") / v_int(v, "vol.n2.s0.payload"), ".0f")


def stage_numbers(v: Numbers, runs: Runs) -> None:
    """Part 2: the four stages' traced step (rank 0), and where the reduce-scatters start."""
    for s in range(4):
        ledger, events, other = runs.trace(f"z{s}")
        put_ledger(v, f"z{s}", ledger)
        backward = [e for e in events if e["name"] == "backward"][0]
        blocks = [e for e in events if e.get("cat") == "units" and e["args"]["phase"] == "backward"
                  and e["args"]["unit"] != "root"]
        last_block_end = max(e["ts"] + e["dur"] for e in blocks)
        rs = [e for e in events if e.get("cat") == "collectives" and e["args"]["op"] == "reduce_scatter"]
        v.put(f"z{s}.rs.before_last_block", sum(e["ts"] < last_block_end for e in rs))
        v.put(f"z{s}.rs.in_backward", sum(backward["ts"] <= e["ts"] < backward["ts"] + backward["dur"] for e in rs))
        if s == 3:
            units = sorted({e["args"]["unit"] for e in events if e.get("cat") == "units"})
            v.put("z3.units", len(units))
    # ZeRO-2 with gradient accumulation: A micro-steps reduce-scatter A times, gather once
    ledger, _, _ = runs.trace("accum")
    put_ledger(v, "accum", ledger)
    wire = ledger["reduce_scatter"]["wire_bytes"] + ledger["all_gather"]["wire_bytes"]
    v.put("accum.wire.total", wire)
    v.put("accum.A", runs.summary("accum")["config"]["gradient_accumulation_steps"])


def overlap_numbers(v: Numbers, runs: Runs) -> dict:
    """Part 3: the overlap knobs; the times are returned for printing, not quoted."""
    times = {}
    for k in ("off", "on", "prefetch", "reuse"):
        ledger, events, _ = runs.trace(f"overlap-{k}")
        put_ledger(v, f"overlap-{k}", ledger)
        step = [e for e in events if e["name"].startswith("step ")][0]
        coll = [e for e in events if e.get("cat") == "collectives"]
        if k in ("off", "on"):
            times[k] = (step["dur"] / 1e3, sum(e["args"].get("wait_us", 0) for e in coll) / 1e3)
        labels = [e["args"]["label"] for e in coll if e["args"]["op"] == "all_gather"]
        v.put(f"overlap-{k}.ag.prefetched", sum(label.endswith(".prefetch") for label in labels))
    for k in ("on", "prefetch", "reuse"):
        with open(os.path.join(HERE, f"overlap_{k}.json")) as f:
            zero = json.load(f)["zero_optimization"]
        for knob, short in (("stage3_max_reuse_distance", "reuse"), ("stage3_prefetch_bucket_size", "prefetch")):
            v.put(f"overlap-{k}.{short}", f"{zero[knob]:.0e}".replace("e+0", "e") if zero[knob] else "0")
    v.put("overlap.reuse", v["overlap-on.reuse"])
    # what the page says (part 3 and the answers to 3.1, 3.3 and Q14): "off" gathers every unit
    # twice; each knob alone, and both, gather it once (prefetch alone too: a unit whose next use
    # a prefetch walk has passed stays gathered, prefetch.py's _used_again_soon); the losses do
    # not move. Bytes and counts are the same on every machine: a change of the code that moves
    # them must rewrite the prose.
    calls = {k: v_int(v, f"overlap-{k}.ag.calls") for k in ("off", "on", "prefetch", "reuse")}
    assert calls["on"] == calls["prefetch"] == calls["reuse"] == calls["off"] // 2, calls
    assert v_int(v, "overlap-reuse.ag.prefetched") == 0 < v_int(v, "overlap-prefetch.ag.prefetched"), v
    losses = {k: tuple(runs.summary(f"overlap-{k}")["losses"]) for k in calls}
    assert len(set(losses.values())) == 1, losses
    return times


def n4_numbers(v: Numbers, runs: Runs) -> None:
    """Homework: the N = 4 runs, against the computed table."""
    for s in (0, 1, 3):
        ledger, _, other = runs.trace(f"n4-z{s}")
        assert other["world_size"] == 4, other
        put_ledger(v, f"n4-z{s}", ledger)


def threshold_numbers(v: Numbers, runs: Runs) -> None:
    ledger, events, _ = runs.trace("threshold")
    put_ledger(v, "threshold", ledger)
    labels = [e["args"]["label"] for e in events if e.get("cat") == "collectives" and e["args"]["op"] == "all_gather"]
    # none in forward or backward; after the step every unit's persistent FlatParams in one call
    assert labels == ["all.persist.params"] * len(labels) and len(labels) == ledger["all_gather"]["calls"] == 1, labels
    v.put("threshold.ag.after_step", len(labels))


def fp16_numbers(v: Numbers, runs: Runs) -> None:
    """The loss scaler's steps in the fp16 run, from its metrics (the scale after each step),
    its summary (how many steps were skipped) and its OVERFLOW lines, replayed through
    minizero.fp16.DynamicLossScaler (DeepSpeed's rules) to find which steps overflowed."""
    from minizero.fp16 import DynamicLossScaler
    with open(os.path.join(HERE, "fp16.json")) as f:
        fp16 = json.load(f)["fp16"]
    for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        v.put(f"fp16.{k}", fp16[k])
    v.put("fp16.initial_scale", 2 ** fp16["initial_scale_power"])
    after = [float(r["loss_scale"]) for r in runs.metrics("fp16")]
    logged = [ln.split("OVERFLOW! ", 1)[1] for ln in runs.output("fp16").splitlines() if "OVERFLOW! " in ln]
    skipped = runs.summary("fp16")["skipped_steps"]
    scaler = DynamicLossScaler(init_scale=2 ** fp16["initial_scale_power"], scale_window=fp16["loss_scale_window"],
                               min_scale=fp16["min_loss_scale"], delayed_shift=fp16["hysteresis"])
    messages: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage().split("OVERFLOW! ", 1)[1])
    handler, logger = Catch(), logging.getLogger("minizero")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False   # the replay's tries are not the run's lines
    try:
        def replay(state, step, pattern):
            """Every overflow pattern from `step` on that gives the logged scales and lines."""
            if step == len(after):
                return [pattern] if len(messages_of(pattern)) == len(logged) else []
            found = []
            for overflow in (False, True):
                s = copy.deepcopy(state)
                messages.clear()
                s.update_scale(overflow)
                new = list(messages)
                so_far = messages_of(pattern) + new
                if s.cur_scale == after[step] and so_far == logged[:len(so_far)]:
                    found += replay(s, step + 1, pattern + [(overflow, state.cur_scale, s.cur_scale, new)])
            return found

        def messages_of(pattern):
            return [m for *_, ms in pattern for m in ms]
        solutions = replay(scaler, 0, [])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    assert len(solutions) == 1, f"the fp16 run's scales and OVERFLOW lines fit {len(solutions)} patterns"
    (pattern,) = solutions
    assert sum(o for o, *_ in pattern) == skipped, (pattern, skipped)
    rows = []
    for step, (overflow, before, now, msgs) in enumerate(pattern, start=1):
        what = ("overflow: skipped, " + ("scale halved" if now < before else "hysteresis used, scale kept")
                if overflow else ("clean: scale doubled" if now > before else "clean"))
        rows.append(f"| {step} | {int(before):,} | {what} | {int(now):,} |")
    v.put("fp16.table", "\n".join(rows))
    v.put("fp16.steps", len(pattern))
    v.put("fp16.skipped", skipped)
    v.put("fp16.updates", len(pattern) - skipped)
    v.put("fp16.final_scale", int(after[-1]))
    for key, text in fp16_story(pattern, fp16["initial_scale_power"], fp16["loss_scale_window"],
                                fp16["hysteresis"]).items():
        v.put(f"fp16.{key}", text)
    v.put("fp16.line.hysteresis", logged[0])
    v.put("fp16.line.halve", logged[1] if len(logged) > 1 else logged[0])


def fp16_story(pattern: list, power: int, window: int, hysteresis: int) -> dict:
    """The fp16 run told with DeepSpeed's rules, whatever its overflows were: the lesson's
    reading of the table (`reading`), worksheet 6.1 and 6.2 (`q61`, `q62`) and their answers
    (`a61`, `a62`), and the question bank's Q17 (`q17`, `a17`). Which step overflows depends
    on the gradients, so on the CPU's kernels: these sentences follow the run's pattern
    (pattern: (overflowed, scale before, scale after, logged lines) per step) instead of
    stopping the regeneration when another machine shifts an overflow by a step."""
    steps = list(enumerate(pattern, start=1))
    over = [i for i, (o, *_) in steps if o]
    kept = [i for i, (o, b, n, _) in steps if o and n == b]
    halved = [i for i, (o, b, n, _) in steps if o and n < b]
    doubled = [i for i, (o, b, n, _) in steps if n > b]
    first_clean = next((i for i, (o, *_) in steps if not o), None)
    scale = lambda i: f"{int(pattern[i - 1][1]):,}"                   # the scale step i ran at
    span = lambda a, b: f"step {a}" if a == b else f"steps {a} to {b}"
    out, reading = {}, []
    if first_clean is None:
        reading.append(f"Every step overflows: step 1 at 2^{power}, and each halving still overflows.")
    elif first_clean == 1:
        reading.append(f"Step 1 is clean at 2^{power}: the gradients fit.")
    else:
        opening = first_clean - 1
        first = ("only uses the hysteresis" if 1 in kept else "halves it")
        text = f"step 1 overflows at 2^{power} and {first}"
        rest = [i for i in range(2, first_clean)]
        if rest:
            text += f"; {span(2, opening)} " + ("overflows and halves" if len(rest) == 1 else "each overflow and halve")
        reading.append(f"Read it with the rules: {text}; step {first_clean} is the first clean step, at "
                       f"{scale(first_clean)}.")
    late = [i for i in halved if first_clean is not None and i > first_clean]
    if late:
        refilled = any(d < late[0] for d in doubled)
        reading.append(f"The overflow at step {late[0]} halves at once: " +
                       ("a doubling had refilled the budget, and the budget was used up again."
                        if refilled else "the budget is refilled only when the scale doubles, and it has not "
                                         "doubled yet."))
    if doubled:
        d = doubled[0]
        last = max([i for i in over if i < d], default=0)
        since = f"the overflow at step {last}" if last else "the start"
        reading.append(f"The doubling comes at step {d}: the clean step after {window} clean steps since {since}.")
    reading.append("Which step overflows depends on the gradients (another CPU may shift one by a step); the "
                   "rules do not.")
    out["reading"] = wrap(" ".join(reading), 0)
    updates = lambda upto: sum(1 for i, (o, *_) in steps if i < upto and not o)
    if first_clean and first_clean > 1:
        out["q61"] = (f"`initial_scale_power` {power}, `hysteresis` {hysteresis}. {span(1, first_clean - 1).capitalize()} "
                      f"all overflow. At what scale does step {first_clean} run, and how many optimizer updates have "
                      f"happened by then?")
        budget = ("uses the hysteresis (the budget goes from 2 to 1, the scale stays)" if 1 in kept
                  else "halves the scale")
        halvings = len([i for i in halved if i < first_clean])
        out["a61"] = (f"Step 1 overflows at 2^{power} = {scale(1)} and {budget}; " +
                      (f"{span(2, first_clean - 1)} each halve it" if first_clean > 2 else "no step halves it") +
                      f" ({halvings} halving{'s' if halvings != 1 else ''}), so step {first_clean} runs at "
                      f"{scale(first_clean)}. No update yet: every overflowed step is skipped "
                      f"({first_clean - 1} skipped steps).")
    else:
        out["q61"] = (f"`initial_scale_power` {power}, `hysteresis` {hysteresis}. What decides whether step 1 "
                      f"overflows, and what does the scale do if it does?")
        out["a61"] = (f"Whether any gradient times 2^{power} exceeds fp16's largest number, 65,504; an overflow "
                      f"at step 1 would only use the hysteresis (the budget goes from 2 to 1).")
    skipped = len(over)
    if late:
        L = late[0]
        d = next((x for x in doubled if x > L), None)
        out["q62"] = (f"Steps {first_clean} to {L - 1} are clean; step {L} overflows. Does step {L} halve the scale "
                      f"or use the hysteresis? With `loss_scale_window` {window}"
                      + (f" and no overflow after step {L}, at which step does the scale double?" if d else
                         ", when could the scale double next?"))
        out["a62"] = (f"It halves ({scale(L)} -> half): the hysteresis budget was used at step "
                      f"{kept[0] if kept else 1} and is refilled only when the scale doubles, which has not "
                      f"happened. " +
                      (f"After it, steps {L + 1} to {d - 1} are {window} clean steps; the next clean one, step "
                       f"{d}, doubles the scale (DeepSpeed doubles when the clean steps since the last overflow, "
                       f"not counting this one, are a positive multiple of the window). "
                       if d else f"It doubles at the clean step after {window} clean steps since step {L}. ") +
                      f"The run skips {skipped} of {len(pattern)} steps.")
        out["q17"] = (f"In the lesson's fp16 run (`initial_scale_power` {power}, window {window}, hysteresis "
                      f"{hysteresis}), step {L} overflows after clean steps. Why does it halve the scale at once "
                      f"instead of using the hysteresis?")
        out["a17"] = (f"The budget of hysteresis - 1 overflows is refilled only when the scale doubles (or, with "
                      f"`consecutive_hysteresis`, after any clean step); step {kept[0] if kept else 1} used it and "
                      f"no doubling came before step {L}. So {scale(L)} is halved.")
    else:
        d = doubled[0] if doubled else None
        last = max(over, default=0)
        out["q62"] = (f"With `loss_scale_window` {window}, and no overflow after step {last}, at which step does "
                      f"the scale double?")
        out["a62"] = ((f"Step {d}: the clean step after {window} clean steps since the overflow at step {last} "
                       f"(DeepSpeed doubles when the clean steps since the last overflow, not counting this one, "
                       f"are a positive multiple of the window). " if d else
                       f"At step {last + window + 1}, the clean step after {window} clean steps since step {last}. ")
                      + f"The run skips {skipped} of {len(pattern)} steps.")
        out["q17"] = (f"A run with `hysteresis` {hysteresis} overflows at step 1, runs clean for a while (no "
                      f"doubling yet), then overflows again. Does the second overflow halve the scale?")
        out["a17"] = ("Yes, at once: the budget of hysteresis - 1 overflows is refilled only when the scale doubles "
                      "(or, with `consecutive_hysteresis`, after any clean step); step 1 used it.")
    for key, prefix in (("q61", 8), ("a61", 8), ("q62", 8), ("a62", 8), ("q17", 9), ("a17", 10)):
        out[key] = wrap(out[key], prefix)
    return out


def wrap(text: str, prefix: int) -> str:
    """A generated paragraph in the pages' lines of 92, its first line after a `prefix`-wide start
    ("**6.1** " is 8)."""
    return textwrap.fill(text, width=92, initial_indent=" " * prefix, break_on_hyphens=False,
                         break_long_words=False)[prefix:]


def exact(x: float) -> str:
    """A decimal with every digit it has (up to 6 places), no trailing zeros: 24, 7.125, 4.3125."""
    return f"{x:.6f}".rstrip("0").rstrip(".")


def v_int(v: Numbers, name: str) -> int:
    return int(v[name].replace(",", ""))


def checkpointing_numbers(v: Numbers, runs: Runs) -> None:
    """Activation checkpointing: the measuring script's numbers, and what ZeRO-3 gathers
    with it (the traced run)."""
    (name,) = [n for n, c in runs.commands.items() if "activations.py" in c]
    out = runs.output(name)
    kept, ck = (re.search(rf"{what}\s+([\d,]+) bytes\s+([\d,]+)", out).groups()
                for what in ("every activation kept", "each block checkpointed"))
    v.put("act.kept.bytes", kept[0])
    v.put("act.kept.flops", kept[1])
    v.put("act.ck.bytes", ck[0])
    v.put("act.ck.flops", ck[1])
    saved = re.search(r"saved: ([\d,]+) bytes \(([\d.]+)x less\); repeated: ([\d,]+) FLOPs \(\+([\d.]+)% of the step; "
                      r"the forward alone is ([\d,]+)\)", out).groups()
    for key, value in zip(("saved", "less", "repeated", "pct", "forward"), saved):
        v.put(f"act.{key}", value)
    n_embd, tokens, micro = re.search(r"n_embd (\d+), (\d+) tokens; micro-batch (\d+)", out).groups()
    v.put("act.n_embd", n_embd)
    v.put("act.micro", micro)
    v.put("act.tokens", tokens)
    per_block = re.search(r"= ([\d,]+) per block, ([\d,]+) for (\d+) blocks; the other ([\d,]+)", out).groups()
    for key, value in zip(("block_input", "inputs", "blocks", "outside"), per_block):
        v.put(f"act.{key}", value)
    ledger, events, _ = runs.trace("ckpt-z3")
    put_ledger(v, "ckpt-z3", ledger)
    labels = [e["args"]["label"] for e in events if e.get("cat") == "collectives" and e["args"]["op"] == "all_gather"]
    whys = {}
    for label in labels:
        flat, why = re.match(r"(.*\.g\d+)\.(\w+)", label).groups()
        whys.setdefault(flat, []).append(why)
    # the page: each block gathered for forward, recompute and backward; the root twice
    assert all(sorted(w) == (["bwd", "fwd"] if f.startswith("root") else ["bwd", "fwd", "recompute"])
               for f, w in whys.items()), whys
    v.put("ckpt-z3.ag.recompute", sum(label.endswith(".recompute") for label in labels))


def offload_numbers(v: Numbers, runs: Runs) -> None:
    ledger, events, _ = runs.trace("step5")
    for op in ("d2h", "h2d", "all_gather", "reduce_scatter"):
        v.put(f"step5.{op}.calls", ledger[op]["calls"])
        v.put(f"step5.{op}.bytes", ledger[op]["bytes"])
    s = runs.summary("step5")
    psi, n, gas = s["params"], s["world_size"], s["config"]["gradient_accumulation_steps"]
    v.put("step5.psi", psi)
    v.put("step5.A", gas)
    v.put("step5.2psi_n", 2 * psi // n)
    labels = [e["args"]["label"] for e in events if e.get("cat") == "collectives" and e["args"]["op"] == "all_gather"]
    flats = {re.match(r"(.*\.g\d+)\.", label).group(1) for label in labels}
    units = {flat.rsplit(".", 1)[0] for flat in flats}
    # what the page says: each FlatParam gathered once per micro-step, for its forward only
    # (with A > 1, so that once per micro-step and once per step differ)
    assert gas > 1 and all(".fwd" in label for label in labels) and len(labels) == gas * len(flats), labels
    assert ledger["h2d"]["calls"] == gas * len(flats) and ledger["d2h"]["calls"] == len(flats)
    v.put("step5.flatparams", len(flats))
    v.put("step5.units", len(units))
    with open(os.path.join(HERE, "offload_step5.json")) as f:
        config = json.load(f)
    zero = config["zero_optimization"]
    # the tutorial's accumulation; the homework's command cuts it (--grad-accum) for a laptop
    v.put("step5.config.A", config["gradient_accumulation_steps"])
    v.put("step5.reuse", f"{zero['stage3_max_reuse_distance']:.0e}".replace("e+0", "e"))
    v.put("step5.12psi_n", 12 * psi // n)


def nodes_numbers(v: Numbers, runs: Runs) -> None:
    """Part 11: ZeRO-3, hpZ and HSDP on 2 pretended nodes of 2 ranks (MINIZERO_RANKS_PER_NODE=2).
    The prediction: the tiny GPT's FlatParams padded to 4 (or to 2: HSDP's shards) through
    node_costs.step_traffic; the runs: every rank's ledger of the traced step (rank<r>.json),
    summed per node as the printed table sums it (ledger_table.link_bytes). They must agree."""
    from minizero.observe.node_costs import step_traffic
    from minizero.observe import ledger_table
    from minizero.observe.memory_table import layout, meta_model
    from minizero.observe.node_table import layout_costs
    from minizero.partition import padded_numel
    model, groups = meta_model("tiny")
    numels = [p.numel for p in layout(model, groups, 3)]
    world, per_node, b = 4, 2, 4
    padded = {n: sum(padded_numel(x, n) for x in numels) for n in (world, per_node)}
    v.put("nodes.P4", padded[world])
    v.put("nodes.P2", padded[per_node])
    v.put("nodes.z4", padded[world] * b)
    v.put("nodes.z2", padded[per_node] * b)
    v.put("nodes.z4.wire", padded[world] * b * (world - 1) // world)
    v.put("nodes.z2.half", padded[per_node] * b // 2)
    v.put("nodes.norm", 2 * 8 * (world - 1) // world)
    costs = layout_costs(numels, world // per_node, per_node, "fp32")
    for scheme in ("zero3", "hpz", "hsdp"):
        name = f"nodes-{scheme}"
        ledger, _, other = runs.trace(name)
        assert other["world_size"] == world and other["ranks_per_node"] == per_node, other
        (step,) = [int(s) for s in other["ledger"]]
        docs = [ledger_table.read(os.path.join(runs.folder, f"trace-{name}"), r) for r in range(world)]
        sent = ledger_table.link_bytes(docs, step)
        want = {}
        for rank in range(per_node):
            for op, (_, x) in step_traffic([padded[per_node if scheme == "hsdp" else world]], b, world, per_node,
                                           scheme, rank).items():
                want[op] = want.get(op, 0) + x
        got = {op: sum(d["otherData"]["ledger"][str(step)][op]["inter_node_bytes"] for d in docs[:per_node])
               for op in want}
        # the page's claims: the link carries what the prediction says, op by op, both ways
        assert got == want and sent == [sum(want.values())] * 2 == [costs[scheme]["link"]] * 2, (scheme, got, want)
        v.put(f"nodes.{scheme}.link", sent[0])
        for short, op in OPS.items():
            v.put(f"nodes.{scheme}.link.{short}", got[op])
        v.put(f"nodes.{scheme}.r0.wire", sum(c["wire_bytes"] for c in ledger.values()))
        v.put(f"nodes.{scheme}.r0.inter", sum(c["inter_node_bytes"] for c in ledger.values()))
        v.put(f"nodes.{scheme}.states", costs[scheme]["states"])
    # the answer key's arithmetic (11.1), held to the runs: ZeRO-3's link carries three collectives
    # of z4 (3/4 each) and the norm; HSDP's, ranks 0 and 1 each sending their shard once
    assert v_int(v, "nodes.zero3.link") == 3 * v_int(v, "nodes.z4.wire") + v_int(v, "nodes.norm"), v
    assert v_int(v, "nodes.hsdp.link") == 2 * v_int(v, "nodes.z2.half") == v_int(v, "nodes.z2"), v
    v.put("nodes.hpz.ratio", v_int(v, "nodes.hpz.link") / v_int(v, "nodes.zero3.link"), ".2f")
    v.put("nodes.hsdp.ratio", v_int(v, "nodes.hsdp.link") / v_int(v, "nodes.zero3.link"), ".2f")


def comms_numbers(v: Numbers, runs: Runs) -> None:
    """The comms logger's table (DeepSpeed's log_summary) of the side-by-side part's run:
    op, message size and count (its latencies are this machine's and quoted nowhere)."""
    (name,) = [n for n, c in runs.commands.items() if "--comms-logger" in c]
    runs.output(name)
    with open(os.path.join(runs.folder, f"lesson-{name}", "comms_summary.json")) as f:
        summary = json.load(f)
    rows = [f"{op} {size['msg_size_str']} count {size['count']}" for op, sizes in summary.items() for size in sizes.values()]
    v.put("comms.rows", "; ".join(rows))
    v.put("comms.steps", runs.summary(name)["steps"])


def test_numbers(v: Numbers, runs: Runs) -> None:
    """How many tests part 10's command runs (its --collect-only count, kept in the runs'
    logs like a run's output)."""
    (command,) = runs.tests
    log, head = os.path.join(runs.folder, "logs", "pytest-collect.log"), f"$ {command}\n"
    text = open(log).read() if os.path.exists(log) else ""
    if not text.startswith(head):
        text = head + str(collected(command))
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            f.write(text)
    v.put("desync.passed", int(text[len(head):]))


# ----------------------------------------------------------------------------- the question bank

def bank_numbers(v: Numbers) -> None:
    """The question bank's arithmetic, from the formulas the lesson teaches; where a run or
    the layout code gives the same quantity, it is checked against it here."""
    from minizero.fp16 import DynamicLossScaler, MinLossScaleError
    from minizero.partition import padded_numel
    gb = lambda b: b / 1e9
    # Q1: model states per rank, mixed-precision Adam (2 + 2 + 12 bytes), Ψ = 1.5e9, N = 16
    psi, n, k = 1_500_000_000, 16, 12
    v.put("q.mem.psi", "1.5e9")
    v.put("q.mem.n", n)
    for s, b in enumerate([(2 + 2 + k) * psi, 2 * psi + 2 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n,
                           (2 + 2 + k) * psi / n]):
        v.put(f"q.mem.s{s}", exact(gb(b)))   # 4.3125 GB, not 4.312: every digit the arithmetic gives
    # Q2: the fewest ranks for 7.5B at ZeRO-3 within 16 GB of model states
    psi, mem = 7.5e9, 16e9
    v.put("q.fit.psi", f"{psi / 1e9:g}B")
    v.put("q.fit.gb", mem / 1e9, ".0f")
    v.put("q.fit.n", math.ceil(16 * psi / mem))
    v.put("q.fit.exact", 16 * psi / mem, ".1f")
    # Q3: the largest Ψ at ZeRO-2 on 64 ranks with 32 GB
    n, mem = 64, 32e9
    v.put("q.z2max.n", n)
    v.put("q.z2max.gb", mem / 1e9, ".0f")
    v.put("q.z2max.psi", mem / (2 + 14 / n) / 1e9, ".1f")
    v.put("q.z2max.bytes_per_param", 2 + 14 / n, ".4f")
    # Q4: padding
    numel, n = 1_000_003, 8
    v.put("q.pad.numel", numel)
    v.put("q.pad.n", n)
    v.put("q.pad.padded", padded_numel(numel, n))
    v.put("q.pad.shard", padded_numel(numel, n) // n)
    v.put("q.pad.extra", padded_numel(numel, n) - numel)
    # Q5: ZeRO-2's traffic with accumulation A = 4, N = 8, Ψ = 1e9 in fp16 (2 bytes)
    a, n, elems = 4, 8, 10 ** 9
    one = 2 * elems * (n - 1) / n
    v.put("q.acc.psi", f"{elems:.0e}".replace("e+0", "e"))
    v.put("q.acc.n", n)
    v.put("q.acc.a", a)
    v.put("q.acc.one", gb(one), ".2f")
    v.put("q.acc.z2", gb((a + 1) * one), ".2f")
    v.put("q.acc.z1", gb(2 * one), ".2f")
    v.put("q.acc.ratio", (a + 1) / 2, ".1f")
    # the formula against the lesson's run (A = accum.A, N = 2): (A+1) x one reduce-scatter's wire
    A = v_int(v, "accum.A")
    assert v_int(v, "accum.wire.total") == (A + 1) * v_int(v, "accum.ag.wire"), "ZeRO-2 accumulation formula"
    # Q6: the tutorial model at the default threshold (memory_numbers computed it)
    # Q7: ZeRO-3's gathers per step with and without reuse (the overlap runs): 3 -> 2 (x Ψ(N-1)/N)
    # Q8: activations against model states for step 5's shrunk model (one micro-batch of 8)
    v.put("q.act.states", 16 * v_int(v, "step5.psi"))
    v.put("q.act.states.n2.s3", 16 * v_int(v, "step5.psi") // 2)
    v.put("q.act.ratio", v_int(v, "act.kept.bytes") / (16 * v_int(v, "step5.psi")), ".1f")
    # Q9, Q10: loss-scale arithmetic, replayed through the scaler itself
    logging.getLogger("minizero").setLevel(logging.WARNING)
    s = DynamicLossScaler(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2)
    for _ in range(3):
        s.update_scale(True)
    v.put("q.ls.initial", 2 ** 16)
    v.put("q.ls.after3", int(s.cur_scale))
    clean = 0
    while s.cur_scale == 2 ** 14:
        s.update_scale(False)
        clean += 1
    v.put("q.ls.clean_to_double", clean, "d")
    s = DynamicLossScaler(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2)
    overflows = 0
    try:
        while True:
            s.update_scale(True)
            overflows += 1
    except MinLossScaleError:
        overflows += 1
    v.put("q.ls.to_stop", overflows)
    v.put("q.ls.halvings", overflows - 2)   # less the one that used the hysteresis and the one that stopped it
    # Q11: what offload moves over PCIe per step: Ψ = 1e9, N = 8, fp16, A = 4
    psi, n, a = 10 ** 9, 8, 4
    v.put("q.pcie.psi", f"{psi:.0e}".replace("e+0", "e"))
    v.put("q.pcie.n", n)
    v.put("q.pcie.a", a)
    v.put("q.pcie.opt", gb(2 * psi / n), ".2f")
    v.put("q.pcie.param.reuse0", gb(2 * a * 2 * psi / n), ".2f")
    v.put("q.pcie.param.reuse", gb(a * 2 * psi / n), ".2f")
    v.put("q.pcie.host", gb(12 * psi / n), ".1f")
    # DeepSpeed's ZeRO-3 (docs/offload.md's formula, S_r ~ Ψ/N): (A b + 4) S_r down per step, b = 2
    v.put("q.pcie.ds.down", gb((2 * a + 4) * psi / n), ".2f")
    v.put("q.pcie.ds.ratio", (2 * a + 4) / 2, ".0f")
    # Q12: all-reduce on 8 ranks: 2(N-1)/N
    v.put("q.ar8", 2 * 7 / 8, ".2f")
    # Q13: ZeRO-3 at N = 1024: 3(N-1)/N
    v.put("q.z3.1024", 3 * 1023 / 1024, ".3f")
    # Q14: the gradient norm's all-reduce on 4 ranks (the N = 4 run's)
    assert v_int(v, "n4-z1.ar.wire") == 2 * 8 * 3 // 4
    # Q15: stage-1 bytes per rank for the tutorial model at N = 8 (memory_numbers: tut.n8.s1.*)
    # Q19: a checkpointed block's input, B = 16, T = 1023, C = 256, bf16
    from minizero.gpt.presets import get_preset
    tutorial = get_preset("tutorial")
    b, t, c, layers = 16, tutorial.block_size, tutorial.n_embd, tutorial.n_layer
    for key, value in (("b", b), ("t", t), ("c", c), ("layers", layers)):
        v.put(f"q.ck.{key}", value)
    v.put("q.ck.input", b * t * c * 2)
    v.put("q.ck.inputs12", layers * b * t * c * 2)
    # Q23: ZeRO-3, hpZ and HSDP for Ψ = 7.5e9 on 64 nodes x 8 GPUs, bf16 (the papers' formulas)
    from minizero.observe.node_costs import paper_costs
    psi, nodes, per_node = 7_500_000_000, 64, 8
    v.put("q.nodes.psi", "7.5e9")
    v.put("q.nodes.m", nodes)
    v.put("q.nodes.l", per_node)
    v.put("q.nodes.n", nodes * per_node)
    for scheme, row in paper_costs(psi, nodes, per_node).items():
        v.put(f"q.nodes.{scheme}.states", gb(row["states"]), ".2f")
        v.put(f"q.nodes.{scheme}.link", gb(row["link"]), ".1f")


# ----------------------------------------------------------------------------- the pages

def compute(runs: Runs) -> tuple[Numbers, dict]:
    v = Numbers()
    memory_numbers(v, runs)
    volume_numbers(v)
    stage_numbers(v, runs)
    times = overlap_numbers(v, runs)
    n4_numbers(v, runs)
    threshold_numbers(v, runs)
    fp16_numbers(v, runs)
    checkpointing_numbers(v, runs)
    offload_numbers(v, runs)
    comms_numbers(v, runs)
    nodes_numbers(v, runs)
    test_numbers(v, runs)
    offload_table_numbers(v)
    recorded_numbers(v)
    diff_numbers(v)
    timing_numbers(v)
    bank_numbers(v)
    return v, times


def render(source: str, v: Numbers) -> str:
    """A page from its source: every {{name}} replaced by v[name]; an unknown name raises."""
    with open(os.path.join(HERE, "src", source)) as f:
        text = f.read()
    unknown = sorted({m.group(1) for m in PLACEHOLDER.finditer(text)} - v.keys())
    if unknown:
        raise KeyError(f"docs/lesson/src/{source} names numbers this script does not make: {', '.join(unknown)}")
    return HEADER.format(src=source) + PLACEHOLDER.sub(lambda m: v[m.group(1)], text)


DECK = "docs/lesson/slides/deck.html"


def render_deck(v: Numbers) -> str:
    """The slide deck (docs/lesson/deck.py) from docs/lesson/src/deck.md.in filled in, with the
    slides' notes page filled in for the pictures' speaker notes."""
    sys.path.insert(0, HERE)
    import deck
    body = render("deck.md.in", v).split("\n", 1)[1]   # without the page header
    return deck.build(body, render("slides.md.in", v))


def stale_pages(v: Numbers) -> list[str]:
    """The pages (and the deck) that differ from their source filled in."""
    stale = []
    for source, page in PAGES.items():
        path = os.path.join(ROOT, page)
        if not os.path.exists(path) or open(path).read() != render(source, v):
            stale.append(page)
    path = os.path.join(ROOT, DECK)
    if not os.path.exists(path) or open(path).read() != render_deck(v):
        stale.append(DECK)
    return stale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/lesson/lesson_numbers.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", help="folder of the lesson's runs (default: a new temporary one)")
    ap.add_argument("--write", action="store_true", help="write the pages from their sources (docs/lesson/src/)")
    ap.add_argument("--img", action="store_true", help="also redraw the slides (pictures.py; needs matplotlib)")
    ap.add_argument("--timings", action="store_true",
                    help=f"first time every command of the two sessions, as printed ({os.path.relpath(TIMINGS, ROOT)})")
    ap.add_argument("--record", action="store_true",
                    help=f"first record part 8's comparison with DeepSpeed ({os.path.relpath(RECORDED, ROOT)}.md)")
    args = ap.parse_args(argv)
    runs = Runs(args.runs or tempfile.mkdtemp(prefix="minizero-lesson-"))
    if args.record:
        record_comparison(runs.folder)
    if args.timings:
        load = os.getloadavg()[0]
        times = measure_timings(runs.folder)
        write_timings(times, (load, os.getloadavg()[0]))
    v, times = compute(runs)
    for name, text in v.items():
        print(f"{name}: {text}" if "\n" not in text else f"{name}:\n{text}")
    for k, (step_ms, wait_ms) in times.items():
        print(f"overlap {k}: step {step_ms:.1f} ms, waiting {wait_ms:.1f} ms (times: yours will differ)")
    if args.img:
        sys.path.insert(0, HERE)
        from pictures import draw_all
        for path in draw_all(runs.folder, os.path.join(HERE, "slides"), os.path.join(ROOT, "docs", "img")):
            print(f"wrote {os.path.relpath(path, ROOT)}")
    if args.write or args.img:   # the deck holds the pictures: redrawn, it is written again
        for source, page in PAGES.items():
            os.makedirs(os.path.dirname(os.path.join(ROOT, page)), exist_ok=True)
            with open(os.path.join(ROOT, page), "w") as f:
                f.write(render(source, v))
        with open(os.path.join(ROOT, DECK), "w") as f:
            f.write(render_deck(v))
    stale = stale_pages(v)
    for page in stale:
        print(f"{page} differs from its source filled in: run with --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
