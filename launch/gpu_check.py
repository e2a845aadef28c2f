"""The one-command GPU check: every claim the CPU suite makes that a GPU can show otherwise,
run again on this machine's GPUs, each check as subprocesses, one PASS / FAIL / SKIP table at
the end. How to run it, its flags and what each check asserts: docs/gpu.md (the one place).

The checks live by what they check, each file short enough to read at once:

    gpu_check_two_nodes.py   two torchruns as two nodes: the preflight, ZeRO-3, resume, hpZ, HSDP (first)
    gpu_check_suites.py      the CPU suite with CUDA hidden, the CUDA-only tests, NCCL on one GPU
    gpu_check_training.py    the trainer: resume == straight, overlap, offload, observers, the README's command
    gpu_check_memory.py      peak CUDA memory per stage against the paper's formula
    gpu_check_drivers.py     looks inside a step (`--driver NAME`): host syncs, consolidation with offload
    gpu_check_run.py         running them: commands, timeouts, hangs, logs, the table

This process stays on the standard library (and launch/kit.py's tables): it never starts
CUDA, so no check runs beside a context of its own. torch is imported by the subprocesses,
among them this file's drivers (`--driver NAME ...`), which run a check's ranks through
minizero.runtime.spawn and minizero's public API.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_drivers as drivers  # noqa: E402  (each standard library only at import)
import gpu_check_memory as memory  # noqa: E402
import gpu_check_run as runner  # noqa: E402
import gpu_check_suites as suites  # noqa: E402
import gpu_check_training as training  # noqa: E402
import gpu_check_two_nodes as two_nodes  # noqa: E402
# The names the tests and the drivers' subprocesses read off this module.
from gpu_check_drivers import *  # noqa: E402,F401,F403
from gpu_check_memory import *  # noqa: E402,F401,F403
from gpu_check_run import *  # noqa: E402,F401,F403
from gpu_check_run import ROOT, Ctx, Stopped, render, say, show  # noqa: E402
from gpu_check_suites import *  # noqa: E402,F401,F403
from gpu_check_training import *  # noqa: E402,F401,F403
from gpu_check_training import CONFIGS, FULL, QUICK  # noqa: E402
from gpu_check_two_nodes import *  # noqa: E402,F401,F403

PLAN_GPUS = 8            # --plan on a machine without GPUs: the plan for 2 nodes x 4 GPUs (README's cluster)


def plan(n_gpus: int, quick: bool = False) -> list:
    """Every check, in the order they run; those this machine cannot run carry `skip`. A
    check is here only if a GPU can show what the CPU suite cannot: CUDA kernels and their
    determinism, NCCL and its streams, pinned memory, CUDA memory, host syncs. The two-node
    checks come first: they are what a cluster job needs, and the longest untested path."""
    size = QUICK if quick else FULL
    t_train = 300 if quick else 900
    checks = [*two_nodes.checks(n_gpus, size, t_train),
              *suites.checks(n_gpus),
              *training.training_checks(n_gpus, size, t_train, quick),
              *memory.checks(n_gpus, size),
              *training.late_training_checks(n_gpus, size, t_train)[:3],   # offload alone
              *drivers.checks(n_gpus),
              *training.late_training_checks(n_gpus, size, t_train)[3:],   # observers, checkpointing, the README's
              *suites.compare_checks(n_gpus, size, quick)]
    for c in checks:
        if n_gpus < c.min_gpus:
            c.skip = "no GPU found" if n_gpus == 0 else f"needs {c.min_gpus} GPUs (found {n_gpus})"
    return checks


def select(checks: list, only=(), skip=()) -> list:
    """The checks left after --only (with the checks they read) and --skip (with the checks
    that read them); both take shell patterns."""
    match = lambda c, pats: any(fnmatch.fnmatch(c.name, p) for p in pats)
    by_name = {c.name: c for c in checks}
    keep = {c.name for c in checks if not only or match(c, only)}
    todo = list(keep)
    while todo:
        for dep in by_name[todo.pop()].after:
            if dep not in keep:
                keep.add(dep)
                todo.append(dep)
    keep -= {c.name for c in checks if match(c, skip)}
    while any(set(by_name[n].after) - keep for n in keep):
        keep = {n for n in keep if not set(by_name[n].after) - keep}
    return [c for c in checks if c.name in keep]


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(prog="launch/gpu_check.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="What each check asserts and why: docs/gpu.md.")
    p.add_argument("--plan", "--dry-run", dest="dry_run", action="store_true",
                   help=f"print the plan (every check and command), run nothing; on a machine without GPUs, the "
                        f"plan for {PLAN_GPUS} (or --gpus N)")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (memory checks keep iGPT-S)")
    p.add_argument("--out", help="report folder (default reports/gpu-check-<date>); must not hold a report")
    p.add_argument("--gpus", type=int, help="use this many GPUs (default: all that torch sees); with --dry-run, "
                                            "plan for any number")
    p.add_argument("--only", nargs="+", default=[], metavar="PATTERN", help="run only these checks (shell patterns)")
    p.add_argument("--skip", nargs="+", default=[], metavar="PATTERN", help="leave these checks out")
    p.add_argument("--rehearse", action="store_true",
                   help="with --gpus N on a machine without them: run anyway (CPU, gloo) to test this script")
    p.add_argument("--driver", nargs="+", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def print_plan(checks: list, out: Path, n: int, quick: bool) -> None:
    say(f"the plan for {n} GPU(s){' (--quick)' if quick else ''}, commands run from the repository root; "
        f"report folder {out}; PORT = a free port picked when the step starts")
    for i, c in enumerate(checks, 1):
        if c.skip:
            print(f"[{i:2d}] {c.name}: SKIP: {c.skip}")
            continue
        print(f"[{i:2d}] {c.name}: {c.what}")
        if c.after and c.steps:
            print(f"     after: {', '.join(c.after)}")
        if c.requires:
            print(f"     needs the {c.requires} package (else SKIP)")
        at = Ctx(out / c.name, out, [])
        for step in c.steps:
            for p in step:
                print(f"     $ {show(*render(p, str(at.dir), str(out), 'PORT'))}"
                      + (" &" if len(step) > 1 else "") + ("   # its exit status goes to the judge" if p.may_fail else "")
                      + (f"   # only if {p.fallback_for} did not exit 0" if p.fallback_for else ""))
            if step and step[0].stall:
                print(f"     # hung (all stopped, FAIL) after {step[0].stall} s without output from any of them")
        for path in sorted({p.argv[p.argv.index("--config") + 1] for step in c.steps for p in step
                            if "--config" in p.argv and CONFIGS in p.argv[p.argv.index("--config") + 1]}):
            print(f"     {path}: zero_optimization {json.dumps(config_zero(path), separators=(', ', ': '))}")
        if not c.steps:
            print("     (reads the results of: " + ", ".join(c.after) + ")")
        print()


def config_zero(path: str) -> dict:
    """A check config's zero_optimization section, as the plan shows it."""
    with open(ROOT / path) as f:
        return json.load(f).get("zero_optimization", {})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.driver:
        return drivers.run_driver(args.driver)
    # Mistakes a user can make: one line each, before anything slow.
    names = [c.name for c in plan(0)]
    unknown = [pat for pat in args.only + args.skip if not any(fnmatch.fnmatch(nm, pat) for nm in names)]
    if unknown:
        say(f"error: no check matches {' or '.join(unknown)}; the checks: {' '.join(names)}", err=True)
        return 2
    if args.gpus is not None and args.gpus < 0:
        say(f"error: --gpus must be >= 0, got {args.gpus}", err=True)
        return 2
    out = Path(args.out or ROOT / "reports" / f"gpu-check-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    if not args.dry_run and out.exists() and any(out.iterdir()):
        say(f"error: {out} is not empty; pass a new --out (a report is never overwritten)", err=True)
        return 2

    info = probe()
    found = info["count"]
    say(f"found {found} GPU(s): {machine_line(info)}" if found else "no GPU found (torch.cuda.device_count() == 0"
        + (f"; {info['error']}" if info.get("error") else "") + ")")
    n = found if args.gpus is None else args.gpus
    if args.dry_run and args.gpus is None and not found:
        n = PLAN_GPUS
        say(f"no GPU here: the plan for {n} GPUs (2 nodes x 4); --gpus N plans for another count")
    if n > found and not (args.dry_run or args.rehearse):
        say(f"error: --gpus {n}, but torch sees {found} GPU(s) here; add --dry-run to see that plan, or "
            "--rehearse to run it on CPU (a test of this script, not of GPUs)", err=True)
        return 2
    checks = select(plan(n, args.quick), args.only, args.skip)
    if args.dry_run:
        print_plan(checks, out, n, args.quick)
        return 0

    say(f"writing to {out}")
    command = shlex.join(["bash", "launch/gpu_check.sh", *argv])

    def write(rows):
        (out / "gpu_check.md").write_text(report_md(command, info, rows, rehearsal=n > found))
        (out / "results.json").write_text(json.dumps(
            {"command": command, "machine": info, "gpus_used": n, "quick": args.quick,
             "checks": [{"name": nm, "status": r.status, "reason": r.reason, "numbers": r.numbers, "seconds": secs}
                        for nm, r, secs in rows]}, indent=1))
    stop_on_sigterm()
    rows = run_all(checks, out, write)
    print()
    print(format_table(rows))
    failed = [nm for nm, r, _ in rows if r.status == "FAIL"]
    say(f"{len(failed)} FAILED: {', '.join(failed)}" if failed else "nothing failed",
        f"(table: {out / 'gpu_check.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
