"""The autograder's verdicts: what the student's code did (run.py) against minizero's own and
DeepSpeed's, part by part: losses and weights bit for bit, bytes per collective, when each
runs, memory per rank, and the part's own checks (the partition arithmetic, the loss scaler
against minizero's and DeepSpeed's), each failure with a message in the lesson's terms
(parts.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

from .parts import CORE, PARTS, Facts, Scenario, partition_unit_checks, scaler_trajectory, SCALER_CASES
from .run import WORLD, run_variants, student_files


def deepspeed_available() -> bool:
    from minizero.runtime import selftest
    return selftest.deepspeed_available()


def deepspeed_losses(stages: list) -> dict:
    """{stage: mean loss per step} of DeepSpeed under the selftest's config, or {} when DeepSpeed
    (or the repository's reference/ runner) is not there."""
    from minizero.runtime import selftest, spawn
    if not stages or not selftest.deepspeed_available():
        return {}
    spawn.preload("deepspeed")
    per_rank = spawn.run_ranks(selftest.deepspeed_rank, WORLD, (sorted(stages),), backend="gloo",
                               env={"DS_ACCELERATOR": "cpu"})
    return {s: r["losses"] for s, r in per_rank[0].items()}


def compare(sc: Scenario, got: list, want: list, ds: list | None) -> Facts:
    """The student's run (per rank) against minizero's: the facts the part's diagnosis reads."""
    f = Facts(sc)
    errors = [g.get("error") for g in got]
    if any(errors):
        f.error = next(e for e in errors if e)
        f.error_ops = next(g.get("error_ops") or {} for g in got if g.get("error"))
        return f
    g0, w0 = got[0], want[0]
    steps = [i + 1 for i in range(len(w0["losses"])) if any(g["losses"][i] != w["losses"][i]
                                                              for g, w in zip(got, want))]
    f.losses_equal, f.first_loss_diff = not steps, (steps[0] if steps else None)
    f.weights_differ = sorted(k for k in w0["weights"] if g0["weights"].get(k) != w0["weights"][k])
    f.weights_equal = not f.weights_differ
    f.ops = {op: (tuple(g0["steps"][-1][op]), tuple(w0["steps"][-1][op])) for op in w0["steps"][-1]}
    f.calls_per_step = {op: (tuple(s[op][0] for s in g0["steps"]), tuple(s[op][0] for s in w0["steps"]))
                        for op in w0["steps"][-1]}
    micro = max(e[3] for e in w0["events"]) + 1 if w0["events"] else 1
    for op in ("reduce_scatter", "all_gather"):
        count = lambda events: tuple(sum(1 for e in events if e[0] == op and e[2] == "backward" and e[3] == m)
                                     for m in range(micro))
        f.in_backward[op] = (count(g0["events"]), count(w0["events"]))
    gl = [(e[0], e[1]) for e in g0["events"] if e[0] == "all_gather"]
    wl = [(e[0], e[1]) for e in w0["events"] if e[0] == "all_gather"]
    f.labels_equal = gl == wl
    if not f.labels_equal:
        i = next((i for i, (a, b) in enumerate(zip(gl, wl)) if a != b), min(len(gl), len(wl)))
        f.label_diff = (f"all-gather {i + 1} of the step is {gl[i][1] if i < len(gl) else 'missing'}, "
                        f"minizero's {wl[i][1] if i < len(wl) else 'none'}")
    f.memory = {"end of backward": (g0["memory_end_of_backward"], w0["memory_end_of_backward"]),
                "after the step": (g0["memory_after_step"], w0["memory_after_step"])}
    f.peak_gathered = (g0["peak_gathered"], w0["peak_gathered"])
    f.loss_scales = (tuple(g0["loss_scales"]), tuple(w0["loss_scales"]))
    if ds is not None:
        diff = [i + 1 for i, (a, b) in enumerate(zip(g0["mean_losses"], ds)) if a != b]
        f.deepspeed = "equal" if not diff else f"differ from step {diff[0]}"
    return f


def check_lines(f: Facts) -> list[tuple[str, bool, str]]:
    """The report's lines for one scenario: (what, passed, detail)."""
    if f.error:
        return [("runs", False, f.error)]
    lines = [("losses and weights", f.losses_equal and f.weights_equal,
              "bit for bit equal to minizero's" if f.losses_equal and f.weights_equal else
              (f"losses part from step {f.first_loss_diff}" if not f.losses_equal else
               f"final weights differ: {', '.join(f.weights_differ[:3])}"))]
    bad = [op for op in f.ops if f.op_differs(op)]
    detail = "; ".join(f"{op}: {f.ops[op][0][0]} calls, {f.ops[op][0][1]:,} bytes (minizero: {f.ops[op][1][0]}, "
                       f"{f.ops[op][1][1]:,})" for op in bad)
    lines.append(("bytes per collective", not bad, detail or "every op's calls, payload and wire bytes in a step "
                                                            "equal to minizero's"))
    when_bad = [op for op, (a, b) in f.in_backward.items() if a != b] + ([] if f.labels_equal else ["labels"])
    lines.append(("when each runs", not when_bad,
                  "collectives issued inside autograd's backward, and their labels, as minizero's" if not when_bad else
                  "; ".join(f"{op} inside backward per micro-step: {f.in_backward[op][0]} (minizero "
                            f"{f.in_backward[op][1]})" for op in when_bad if op != "labels")
                  + ("" if f.labels_equal else f.label_diff)))
    mem_bad = [m for m, (a, b) in f.memory.items() if a != b]
    lines.append(("memory per rank", not mem_bad and f.peak_gathered[0] == f.peak_gathered[1],
                  "model states at the end of backward and after the step, and the gathered peak, as minizero's"
                  if not mem_bad and f.peak_gathered[0] == f.peak_gathered[1] else
                  "; ".join([f"{m}: {f.memory[m][0]} (minizero {f.memory[m][1]})" for m in mem_bad]
                            + ([f"gathered at the peak {f.peak_gathered[0]:,} (minizero {f.peak_gathered[1]:,})"]
                               if f.peak_gathered[0] != f.peak_gathered[1] else []))))
    if f.loss_scales[1] and any(s != 1.0 for s in f.loss_scales[1]):
        lines.append(("loss scale", f.loss_scales[0] == f.loss_scales[1],
                      "after each step as minizero's" if f.loss_scales[0] == f.loss_scales[1] else
                      f"{list(f.loss_scales[0])} (minizero {list(f.loss_scales[1])})"))
    if f.deepspeed is not None:
        lines.append(("DeepSpeed", f.deepspeed == "equal", "losses bit for bit equal to DeepSpeed's"
                      if f.deepspeed == "equal" else f"losses {f.deepspeed} against DeepSpeed's"))
    return lines


def unit_checks(part: str, files: dict, with_deepspeed: bool) -> tuple[list, list[str]]:
    """The part's checks that need no ranks (the partition arithmetic, the loss scaler against
    minizero's and DeepSpeed's), in this process: (lines, messages)."""
    from . import parts
    if part == "partition":
        from minizero import partition as real
        student = _load(files["minizero.partition"], "lab_partition_student")
        checks = partition_unit_checks(student, real)
        return ([(f"partition arithmetic: {n}", ok, d or "equal to minizero's on 36 sizes") for n, ok, d in checks],
                parts.partition_messages(checks))
    if part == "fp16":
        from minizero import fp16 as real
        student = _load(files["minizero.fp16"], "lab_fp16_student")
        lines, msgs = [], []
        quiet_deepspeed_scaler = None     # DeepSpeed's class, through the repository's reference/
        if with_deepspeed and deepspeed_available():
            from reference.ds_run import quiet_loss_scaler as quiet_deepspeed_scaler
        for case, (kwargs, pattern) in SCALER_CASES.items():
            want = scaler_trajectory(real.DynamicLossScaler, real.MinLossScaleError, kwargs, pattern)
            got = scaler_trajectory(student.DynamicLossScaler, student.MinLossScaleError, kwargs, pattern)
            ok = got == want
            lines.append((f"scaler: {case}", ok, "every update as minizero's" if ok else
                          f"after each update {got}, minizero {want}"))
            if not ok:
                msgs += parts.fp16_messages(case, kwargs, pattern, got, want)
            if quiet_deepspeed_scaler is not None:
                with quiet_deepspeed_scaler() as ds:
                    theirs = scaler_trajectory(ds.DynamicLossScaler, Exception,
                                               dict(kwargs, consecutive_hysteresis=False, raise_error_at_min_scale=True),
                                               pattern)
                theirs = [t if not isinstance(t, str) else "raised MinLossScaleError" for t in theirs]
                lines.append((f"scaler against DeepSpeed's: {case}", got == theirs,
                              "every update as DeepSpeed's DynamicLossScaler" if got == theirs else
                              f"DeepSpeed's {theirs}"))
        return lines, msgs
    return [], []


def _load(path: str, name: str):
    """The student's file as a module of its own name (registered: a dataclass looks its module up)."""
    name = f"{name}_{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def grade_jobs(jobs: list, with_deepspeed: bool = True) -> dict:
    """{(name, part): Graded} for each job (name, part, the student's folder or None for
    minizero's own files, the names of the scenarios to run or None for all of them). minizero's
    own code runs every scenario asked for once, in the same launch, as the reference; minizero's
    own files graded as a student's are a second, separate run through the same import hook (the
    answer key must reproduce the reference bit for bit)."""
    wanted: dict = {}
    for _, part, _, names in jobs:
        have = wanted.setdefault(part, set())
        have.update(sc.name for sc in PARTS[part].scenarios if names is None or sc.name in names)
    runs_of = [("minizero", part, {}, tuple(sorted(names))) for part, names in wanted.items()]
    runs_of += [(name, part, student_files(part, folder or CORE), names) for name, part, folder, names in jobs]
    chosen = [sc for part, names in wanted.items() for sc in PARTS[part].scenarios if sc.name in names]
    ds_stages = sorted({sc.stage for sc in chosen if sc.deepspeed and not sc.fp16})
    if with_deepspeed and ds_stages and deepspeed_available():
        from minizero.runtime import spawn
        spawn.preload("deepspeed")   # before the first launch starts the forkserver: imported once
    runs = run_variants(runs_of)
    ds = deepspeed_losses(ds_stages) if with_deepspeed else {}
    out = {}
    for name, part, folder, names in jobs:
        got, want = runs[(name, part)], runs[("minizero", part)]
        facts = [compare(sc, got[sc.name], want[sc.name], ds.get(sc.stage) if sc.deepspeed else None)
                 for sc in PARTS[part].scenarios if names is None or sc.name in names]
        lines, msgs = unit_checks(part, student_files(part, folder or CORE), with_deepspeed)
        out[(name, part)] = Graded(part, folder, facts, lines, msgs)
    return out


def grade(parts: list, variants: dict, with_deepspeed: bool = True) -> dict:
    """{variant: {part: Graded}}: every part, every scenario, for each variant ({name: the
    student's folder, or None for minizero's own files})."""
    graded = grade_jobs([(name, p, folder, None) for name, folder in variants.items() for p in parts], with_deepspeed)
    return {name: {p: graded[(name, p)] for p in parts} for name in variants}


class Graded:
    """One part's grade: the unit checks, each scenario's facts, and the messages."""

    def __init__(self, part: str, folder, facts: list, unit_lines: list, unit_messages: list):
        self.part, self.folder, self.facts = part, folder, facts
        self.unit_lines, self.unit_messages = unit_lines, unit_messages

    @property
    def messages(self) -> list[str]:
        msgs = list(self.unit_messages)
        for f in self.facts:
            for m in PARTS[self.part].diagnose(f):
                if m not in msgs:
                    msgs.append(m)
        return msgs

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.unit_lines) and all(f.passed for f in self.facts)

    def report(self) -> str:
        part = PARTS[self.part]
        who = f"your files in {self.folder}" if self.folder else "minizero's own code (the answer key)"
        out = [f"lab part {self.part}: {part.title}", f"  graded: {who}, on {WORLD} ranks"]
        for what, ok, detail in self.unit_lines:
            out.append(f"  {'PASS' if ok else 'FAIL'}  {what}: {detail}")
        for f in self.facts:
            out.append(f"  scenario: {f.scenario.name} ({f.scenario.describe()})")
            for what, ok, detail in check_lines(f):
                out.append(f"    {'PASS' if ok else 'FAIL'}  {what}: {detail}")
        msgs = self.messages
        if not self.passed and not msgs:
            msgs = ["the run differs from minizero's in the checks above"]
        for m in msgs:
            out.append(f"  => {m}")
        out.append(f"part {self.part}: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(out)


def to_json(graded: dict) -> str:
    return json.dumps({v: {p: {"passed": g.passed, "messages": g.messages} for p, g in ps.items()}
                       for v, ps in graded.items()}, indent=1)
