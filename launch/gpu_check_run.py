"""How launch/gpu_check.py runs its checks: the check and command records, the runner (each
check's steps as subprocesses, each with a timeout, a failure never stopping the rest), the
logs, the one-line reasons, the table and the report. Standard library only: this process
never starts CUDA (gpu_check.py's docstring says why).
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # noqa: E402  (standard library only at import)

ROOT = kit.ROOT
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
GRACE_S = 60             # when one command of a step fails, how long the others get to stop by themselves
MIB = 2 ** 20


# ----------------------------------------------------------------------------- records


@dataclass
class Proc:
    """One command. Strings may hold {dir} (the check's folder), {out} (the report folder)
    and {port} (a free port, the same for every command of a step)."""
    argv: list
    log: str
    env: dict = field(default_factory=dict)
    timeout: int = 900
    may_fail: bool = False   # a run that must be refused: the judge reads its exit status
    fallback_for: str | None = None   # run only if the command with this log did not exit 0
    stall: int | None = None          # no new output from the step's commands for this long: hung, all stopped


@dataclass
class Result:
    status: str              # PASS | FAIL | SKIP
    reason: str = ""
    numbers: str = ""


@dataclass
class Check:
    name: str
    what: str
    min_gpus: int = 1
    steps: list = field(default_factory=list)      # each a list of Procs run together
    judge: Callable | None = None                  # (Ctx) -> Result; None: every command exited 0
    after: tuple = ()                              # checks that must PASS first (their results are read)
    requires: str | None = None                    # a module that must be importable
    skip: str | None = None                        # why it cannot run here (set by plan / select)


@dataclass
class Ctx:
    dir: Path
    out: Path
    procs: list          # (Proc, exit status, log path) of every command the check ran

    def path(self, template: str) -> Path:
        return Path(template.replace("{dir}", str(self.dir)).replace("{out}", str(self.out)))

    def logs(self) -> list:
        return [log.read_text(errors="replace") for _, _, log in self.procs]


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def fmt(x) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.3g}"


def mib(nbytes: float) -> str:
    x = nbytes / MIB
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"


# ----------------------------------------------------------------------------- running


def free_port() -> int:
    # minizero.comm.free_port's twin: this process stays standard-library only (module
    # docstring), and minizero.comm imports torch.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible(indices: str, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child: plan indices mapped through the parent's own list
    (the check may itself run with CUDA_VISIBLE_DEVICES=4,5,6,7). "" hides every GPU."""
    if not indices or not parent:
        return indices
    ids = [x.strip() for x in parent.split(",")]
    return ",".join(ids[int(i)] for i in indices.split(","))


def render(p: Proc, d: str, out: str, port: str) -> tuple:
    sub = lambda s: str(s).replace("{dir}", d).replace("{out}", out).replace("{port}", port)
    return [sub(a) for a in p.argv], {k: sub(v) for k, v in p.env.items()}


def show(argv: list, env: dict) -> str:
    """A command as a shell line; the interpreter as the repo-relative path it usually is."""
    py = os.path.relpath(PY, ROOT) if PY.startswith(str(ROOT) + os.sep) else PY
    words = [py if a == PY else a.replace(str(ROOT) + os.sep, "") for a in argv]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(words)])


def kill(proc: subprocess.Popen) -> None:
    """The command and everything it started (its own session), politely then not."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):   # inside a lease part's kill grace
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def child_env(p_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(p_env)
    if "CUDA_VISIBLE_DEVICES" in p_env:
        env["CUDA_VISIBLE_DEVICES"] = visible(p_env["CUDA_VISIBLE_DEVICES"], os.environ.get("CUDA_VISIBLE_DEVICES"))
    return env


hung: set = set()   # the logs of commands run_step stopped as hung (no output for their `stall`)


def run_step(procs: list, d: Path, out: Path, logs: Path) -> list:
    """Start the step's commands together; wait for all. When one fails the others get a
    minute (GRACE_S) to fail too: a lone node would wait for its peer until NCCL's timeout.
    A step whose commands have a `stall` is hung when none of their logs grew for that long:
    all of them are stopped at once (a hang ends every node's progress, so no grace)."""
    port = str(free_port())
    running = []
    for p in procs:
        argv, env = render(p, str(d), str(out), port)
        log = logs / p.log
        fh = open(log, "w")
        fh.write(f"$ {show(argv, env)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(env), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        running.append((p, proc, fh, log, time.monotonic() + p.timeout))
    timed_out, grace_until = set(), None
    stall = min((p.stall for p in procs if p.stall), default=None)
    sizes, grew = None, time.monotonic()
    try:
        while any(proc.poll() is None for _, proc, *_ in running):
            now = time.monotonic()
            if stall:
                now_sizes = [log.stat().st_size for *_, log, _ in running]
                if now_sizes != sizes:
                    sizes, grew = now_sizes, now
                elif now - grew > stall:
                    for p, proc, *_ in running:
                        if proc.poll() is None:
                            timed_out.add(p.log)
                            hung.add(p.log)
                            kill(proc)
                    continue
            if grace_until is None and any(proc.poll() not in (None, 0) for _, proc, *_ in running):
                grace_until = now + GRACE_S
            for p, proc, _, _, deadline in running:
                if proc.poll() is None and (now > deadline or (grace_until is not None and now > grace_until)):
                    timed_out.add(p.log)
                    kill(proc)
            time.sleep(0.2)
    finally:   # Ctrl-C: the commands run in their own sessions, so the terminal's signal missed them
        for _, proc, *_ in running:
            if proc.poll() is None:
                kill(proc)
    results = []
    for p, proc, fh, log, _ in running:
        fh.close()
        results.append((p, None if p.log in timed_out else proc.returncode, log))
    return results


EXCEPTION = re.compile(r"(^|\]:\s*)[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*:")


def exception_line(text: str) -> str | None:
    """The last exception line of a training process's traceback (torchrun prefixes them
    "[rankN]: "); torchrun's own ChildFailedError says nothing and is passed over."""
    hits = [ln.strip() for ln in text.splitlines() if EXCEPTION.search(ln.strip()) and "ChildFailedError" not in ln]
    return hits[-1][:200] if hits else None


def last_error(text: str) -> str:
    """The line that says what went wrong: the last one-line error (": error: "), else the
    last exception line, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ": error: " in ln]
    if errors:
        return errors[-1][:200]
    return exception_line(text) or (lines[-1][:200] if lines else "(empty log)")


def skip_reason(c: Check, done: dict) -> str | None:
    """Why a check cannot run now: too few GPUs, a check it reads did not pass, a missing package."""
    if c.skip:
        return c.skip
    for dep in c.after:
        if dep in done and done[dep].status != "PASS":
            return f"needs {dep} to pass (it is {done[dep].status})"
    if c.requires and importlib.util.find_spec(c.requires) is None:
        return f"{c.requires} is not installed (pip install -e .[dev])"
    return None


def failure(res: list):
    """The (Proc, exit status, log) that failed a step, if any. A command that exited non-zero
    says why; one we stopped (status None) had timed out, or waited for a partner that died."""
    bad = [r for r in res if r[1] is None or (r[1] != 0 and not r[0].may_fail)]
    return min(bad, key=lambda r: r[1] is None) if bad else None


def run_check(c: Check, out: Path, logs: Path) -> Result:
    """Run the check's steps in order (a failed step ends it: later steps need its files), then judge."""
    d = out / c.name
    d.mkdir(parents=True, exist_ok=True)
    ran = []
    for step in c.steps:
        exited = {p.log: rc for p, rc, _ in ran}
        step = [p for p in step if p.fallback_for is None or exited.get(p.fallback_for) != 0]
        if not step:
            continue
        res = run_step(step, d, out, logs)
        ran += res
        bad = failure(res)
        if bad:
            p, rc, log = bad
            if rc is None and p.log in hung:
                return Result("FAIL", f"hung: no output from any of the step's commands for {p.stall} s, so all "
                                      f"were stopped; log {log.relative_to(out)}")
            if rc is None:
                return Result("FAIL", f"timed out (limit {p.timeout} s), log {log.relative_to(out)}")
            return Result("FAIL", f"exit {rc}: {last_error(log.read_text(errors='replace'))} "
                                  f"(log {log.relative_to(out)})")
    if c.judge is None:
        return Result("PASS", "", "")
    try:
        return c.judge(Ctx(d, out, ran))
    except (OSError, KeyError, ValueError, StopIteration, TypeError) as e:
        return Result("FAIL", f"could not read the results: {type(e).__name__}: {e}")


def say(*a, err: bool = False) -> None:
    print("gpu_check:", *a, file=sys.stderr if err else sys.stdout, flush=True)


class Stopped(BaseException):
    """SIGTERM (`timeout` ran out, the lease ends): stop, keep what finished."""


def stop_on_sigterm() -> None:
    def stop(signum, frame):
        raise Stopped()
    signal.signal(signal.SIGTERM, stop)


def run_all(checks: list, out: Path, progress=lambda rows: None) -> list:
    """Run every check in order; a failure (even of this script) never stops the rest. After
    each check `progress(rows)` (the report so far is written: a SIGKILL keeps it). On SIGTERM
    the running check's commands are stopped and it FAILs, the rest SKIP."""
    logs = out / "logs"
    logs.mkdir(parents=True)
    done, rows, stopped = {}, [], False
    for c in checks:
        why, t0 = ("stopped (SIGTERM) before it ran" if stopped else skip_reason(c, done)), time.monotonic()
        if why:
            r = Result("SKIP", why)
        else:
            say(f"{c.name}: running ({c.what})")
            try:
                r = run_check(c, out, logs)
            except Stopped:   # run_step's `finally` has stopped the commands
                r, stopped = Result("FAIL", "stopped (SIGTERM) while running"), True
            except Exception as e:   # a bug here must not cost the other checks
                r = Result("FAIL", f"gpu_check itself failed: {type(e).__name__}: {e}")
        done[c.name] = r
        rows.append((c.name, r, None if why else time.monotonic() - t0))
        say(f"{c.name}: {r.status}" + (f": {r.reason}" if r.reason else "") + (f" [{r.numbers}]" if r.numbers else ""))
        progress(rows)
    return rows


# ----------------------------------------------------------------------------- the table and the report


def format_table(rows: list) -> str:
    """rows: (check name, Result, seconds or None) -> a markdown table."""
    return kit.md_table(["check", "result", "numbers", "s"],
                        [[name, r.status + (f": {r.reason}" if r.reason else ""), r.numbers,
                          "" if secs is None else f"{secs:.0f}"] for name, r, secs in rows])


PROBE = """
import json, torch
n = torch.cuda.device_count()
try:
    v = torch.cuda.nccl.version() if n else None
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else v
except Exception:
    nccl = None
print(json.dumps({"count": n, "names": [torch.cuda.get_device_name(i) for i in range(n)],
                  "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}))
"""


def probe() -> dict:
    """GPU count and names, from a subprocess: this process never starts CUDA (a context on
    GPU 0 would sit there through every check)."""
    try:
        r = subprocess.run([PY, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
        if r.returncode != 0:   # e.g. this python has no torch: say so, not what failed to parse
            lines = r.stderr.strip().splitlines()
            return {"count": 0, "names": [], "error": f"{PY}: {lines[-1] if lines else f'exit {r.returncode}'}"}
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"count": 0, "names": [], "error": f"{type(e).__name__}: {e}"}


def machine_line(info: dict) -> str:
    if not info["count"]:
        return "no GPU"
    names = sorted(set(info["names"]))
    return (f"{info['count']} x {', '.join(names)}; torch {info.get('torch')}, CUDA {info.get('cuda')}, "
            f"NCCL {info.get('nccl')}")


def commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return (rev or "unknown") + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def report_md(command: str, info: dict, rows: list, rehearsal: bool) -> str:
    counts = {s: sum(r.status == s for _, r, _ in rows) for s in ("PASS", "FAIL", "SKIP")}
    head = [f"# GPU check, {datetime.datetime.now().isoformat(timespec='seconds')}", "",
            f"- command: `{command}`", f"- machine: {machine_line(info)}", f"- commit: {commit()}",
            f"- result: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", ""]
    if rehearsal:
        head[1:1] = ["", "**REHEARSAL on a machine without these GPUs: the runs fell back to CPU and gloo. "
                         "This tests the script, not the GPUs.**"]
    return "\n".join([*head, format_table(rows), "", "Logs: `logs/`; what each check asserts: docs/gpu.md.", ""])
