"""Every number of the lesson's pages, made by the commands that make them; the pages, made from their sources.

    python docs/lesson/lesson_numbers.py                # runs the lesson's commands, prints every number, checks the pages
    python docs/lesson/lesson_numbers.py --runs runs/   # the same, in runs/ (what a run already left there is read, not run again)
    python docs/lesson/lesson_numbers.py --write        # and writes the pages from their sources (docs/lesson/src/)
    python docs/lesson/lesson_numbers.py --img          # and redraws the slides (docs/lesson/slides/) and docs/img/'s two

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
# from them (the tests run them twice, as the class does: tests/tools/test_lesson_numbers.py).
NOT_RUN = ("docs/lesson/stage_diff.py", "minizero.compare", "minizero.observe.ledger_table")


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
    for k in ("off", "on"):
        ledger, events, _ = runs.trace(f"overlap-{k}")
        put_ledger(v, f"overlap-{k}", ledger)
        step = [e for e in events if e["name"].startswith("step ")][0]
        coll = [e for e in events if e.get("cat") == "collectives"]
        times[k] = (step["dur"] / 1e3, sum(e["args"].get("wait_us", 0) for e in coll) / 1e3)
    with open(os.path.join(HERE, "overlap_on.json")) as f:
        zero = json.load(f)["zero_optimization"]
    v.put("overlap.reuse", f"{zero['stage3_max_reuse_distance']:.0e}".replace("e+0", "e"))
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
    halved = [i for i, (o, b, n, _) in enumerate(pattern, 1) if o and n < b]
    kept = [i for i, (o, b, n, _) in enumerate(pattern, 1) if o and n == b]
    doubled = [i for i, (o, b, n, _) in enumerate(pattern, 1) if n > b]
    v.put("fp16.halvings", len(halved))
    v.put("fp16.hysteresis_step", kept[0])
    v.put("fp16.first_clean", next(i for i, (o, *_) in enumerate(pattern, 1) if not o))
    v.put("fp16.first_clean.scale", int(pattern[v_int(v, "fp16.first_clean") - 1][1]))
    v.put("fp16.doubled_step", doubled[0])
    late = [i for i in halved if i > v_int(v, "fp16.first_clean")]
    # what the page's prose says of this run (rewrite it if a change of the code changes these)
    first_clean, window = v_int(v, "fp16.first_clean"), fp16["loss_scale_window"]
    assert kept == [1] and halved[:first_clean - 2] == list(range(2, first_clean)), pattern
    assert late and not [i for i in doubled if i < late[0]], pattern
    assert doubled[0] == late[0] + window + 1 and not any(o for o, *_ in pattern[late[0]:doubled[0]]), pattern
    v.put("fp16.late_overflow", late[0])
    v.put("fp16.before_late", late[0] - 1)
    v.put("fp16.after_late", late[0] + 1)
    v.put("fp16.before_doubled", doubled[0] - 1)
    v.put("fp16.last_descent", first_clean - 1)
    v.put("fp16.late_overflow.scale", int(pattern[late[0] - 1][1]))
    v.put("fp16.line.hysteresis", logged[0])
    v.put("fp16.line.halve", logged[1])


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
    assert all(".fwd" in label for label in labels) and len(labels) == gas * len(flats), labels
    assert ledger["h2d"]["calls"] == gas * len(flats) and ledger["d2h"]["calls"] == len(flats)
    v.put("step5.flatparams", len(flats))
    v.put("step5.units", len(units))
    with open(os.path.join(HERE, "offload_step5.json")) as f:
        zero = json.load(f)["zero_optimization"]
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
        v.put(f"q.mem.s{s}", gb(b), ".3f")
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


def stale_pages(v: Numbers) -> list[str]:
    """The pages that differ from their source filled in."""
    stale = []
    for source, page in PAGES.items():
        path = os.path.join(ROOT, page)
        if not os.path.exists(path) or open(path).read() != render(source, v):
            stale.append(page)
    return stale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/lesson/lesson_numbers.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", help="folder of the lesson's runs (default: a new temporary one)")
    ap.add_argument("--write", action="store_true", help="write the pages from their sources (docs/lesson/src/)")
    ap.add_argument("--img", action="store_true", help="also redraw the slides (pictures.py; needs matplotlib)")
    args = ap.parse_args(argv)
    runs = Runs(args.runs or tempfile.mkdtemp(prefix="minizero-lesson-"))
    v, times = compute(runs)
    for name, text in v.items():
        print(f"{name}: {text}" if "\n" not in text else f"{name}:\n{text}")
    for k, (step_ms, wait_ms) in times.items():
        print(f"overlap {k}: step {step_ms:.1f} ms, waiting {wait_ms:.1f} ms (times: yours will differ)")
    if args.write:
        for source, page in PAGES.items():
            os.makedirs(os.path.dirname(os.path.join(ROOT, page)), exist_ok=True)
            with open(os.path.join(ROOT, page), "w") as f:
                f.write(render(source, v))
    if args.img:
        sys.path.insert(0, HERE)
        from pictures import draw_all
        for path in draw_all(runs.folder, os.path.join(HERE, "slides"), os.path.join(ROOT, "docs", "img")):
            print(f"wrote {os.path.relpath(path, ROOT)}")
    stale = stale_pages(v)
    for page in stale:
        print(f"{page} differs from its source filled in: run with --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
