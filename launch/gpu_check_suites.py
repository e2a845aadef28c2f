"""The GPU check's runs of other programs (launch/gpu_check.py): the CPU test suite with CUDA
hidden, the CUDA-only pytest tests, launch/nccl_ws1.py (every collective through NCCL on one
GPU), and `python -m minizero.compare` against DeepSpeed (a measurement).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_run import PY, TORCHRUN, Check, Ctx, Proc, Result, fmt, read_json  # noqa: E402
from gpu_check_training import STAGES, Size  # noqa: E402


def checks(n_gpus: int) -> list:
    """The pytest runs and the one-GPU NCCL check, in the order they run."""
    checks = []
    checks.append(Check(
        "cpu-suite", "the CPU test suite (gloo) with CUDA hidden: nothing in it may depend on a GPU being there",
        steps=[[Proc([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"], "cpu-suite.log",
                     {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}, timeout=3600, may_fail=True)]],
        judge=judge_pytest(allow_skips=True)))
    for name, test, what in (("cuda-checkpointing", "tests/core/test_checkpointing.py",
                              "the CUDA-only activation-checkpointing tests (pinned host copies, side stream)"),
                             ("cuda-offload", "tests/core/test_offload.py",
                              "the CUDA-only ZeRO-Offload tests (pinned host masters and shards, copies counted each "
                              "way, one step within Adam's rounding of the GPU step)")):
        checks.append(Check(
            name, what, steps=[[Proc([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test, "-k", "cuda"],
                                     f"{name}.log", {"MINIZERO_TEST_CUDA": "1"},   # else conftest hides CUDA
                                     timeout=600, may_fail=True)]],
            judge=judge_pytest(allow_skips=False)))

    # NCCL at world size 1: every collective through the backend, issued late (launch/nccl_ws1.py).
    checks.append(Check(
        "nccl-ws1", "torchrun --nproc-per-node 1: every collective of ZeRO 0-3 (bf16 with overlap, ZeRO-3 defaults, "
                    "fp16, parameter offload) through NCCL from a side stream that sleeps first; each bit for bit the "
                    "run with no process group",
        steps=[[Proc([*TORCHRUN, "--standalone", "--nproc-per-node", "1", "launch/nccl_ws1.py", "--out",
                      "{dir}/nccl_ws1.json"], "nccl-ws1.log", timeout=600, may_fail=True)]],
        judge=judge_nccl_ws1("{dir}/nccl_ws1.json")))

    return checks


def compare_checks(n_gpus: int, size: Size, quick: bool) -> list:
    """minizero against DeepSpeed, the last check."""
    checks = []
    # minizero vs DeepSpeed, all GPUs: samples/s and peak memory per stage (a measurement).
    nproc = max(n_gpus, 1)
    checks.append(Check(
        "compare", f"python -m minizero.compare: minizero and DeepSpeed, bf16, ZeRO 0-3 on {nproc} GPU(s): samples/s "
                   "and peak memory per stage (reported, not asserted)",
        requires="deepspeed",
        steps=[[Proc([PY, "-m", "minizero.compare", "--stages", *map(str, STAGES), "--dtype", "bf16",
                      "--nproc", str(nproc), "--model", size.model, "--dataset", "synthetic", "--image-size",
                      str(size.image), "--max-steps", str(size.compare_steps), "--out", "{dir}/report",
                      "--synthetic-train", str(size.n_train), "--synthetic-test", "64",
                      "--data-dir", "{out}/data"], "compare.log", timeout=1200 if quick else 3000)]],
        judge=judge_compare("{dir}/report/results.json")))

    return checks


# ----------------------------------------------------------------------------- verdicts

PYTEST_KINDS = {"passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed", "warnings"}


def pytest_counts(text: str) -> dict:
    """The counts in pytest's last summary line, e.g. {'passed': 312, 'skipped': 3}."""
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)\b", line)
        if found:
            return {k if k in PYTEST_KINDS else k + "s": int(n) for n, k in found}
    return {}


def pytest_verdict(rc: int, text: str, allow_skips: bool) -> Result:
    n = pytest_counts(text)
    numbers = ", ".join(f"{v} {k}" for k, v in n.items() if k != "warnings") or "no summary line"
    if rc != 0 or n.get("failed") or n.get("errors"):
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
        return Result("FAIL", f"pytest exit {rc}" + (f": {', '.join(failed[:3])}" if failed else "")
                      + (f" and {len(failed) - 3} more" if len(failed) > 3 else ""), numbers)
    if n.get("skipped") and not allow_skips:
        return Result("FAIL", "tests were skipped: does torch see CUDA?", numbers)
    if not n.get("passed"):
        return Result("FAIL", "no test passed", numbers)
    return Result("PASS", "", numbers)


def nccl_ws1_verdict(res: dict) -> Result:
    """launch/nccl_ws1.py's result: every case identical to its run with no process group,
    and every backend run issued collectives through the backend."""
    bad = [f"{c}: {r['reason']}" for c, r in res["cases"].items() if not r["identical"]]
    calls = sum(sum(r["calls"].values()) for r in res["cases"].values())
    numbers = f"{len(res['cases'])} cases, {calls} collectives through {res['backend']}, each issued late"
    return Result("FAIL", "; ".join(bad[:3]), numbers) if bad else Result("PASS", "", numbers)


def judge_pytest(allow_skips: bool):
    return lambda ctx: pytest_verdict(ctx.procs[0][1], ctx.logs()[0], allow_skips)


def judge_compare(results: str):
    def judge(ctx: Ctx) -> Result:
        parts = []
        for row in read_json(ctx.path(results))["rows"]:
            mz, ds = row["minizero"], row["deepspeed"]
            parts.append(f"z{row['stage']}: {fmt(mz['samples_per_s'])} / {fmt(ds['samples_per_s'])} samples/s, "
                         f"{mz['peak_mem_mb']:,.0f} / {ds['peak_mem_mb']:,.0f} MiB, |dloss| {fmt(row['max_abs_dloss'])}")
        return Result("PASS", "", "minizero / DeepSpeed " + "; ".join(parts))
    return judge


def judge_nccl_ws1(path: str):
    return lambda ctx: nccl_ws1_verdict(read_json(ctx.path(path)))
