"""The GPU check's memory runs (launch/gpu_check.py): peak CUDA memory per ZeRO stage on iGPT-S
against the ZeRO paper's formula and the engine's own count, the peak falling from stage 0 to
1 to 3, and overlap_comm's gradient memory bounded (docs/gpu.md says why each bound holds).
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_run import MIB, ROOT, Check, Ctx, Proc, Result, mib, read_json  # noqa: E402
from gpu_check_training import CONFIGS, STAGES, TRAIN, Size, data_flags, launcher  # noqa: E402


CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


def checks(n_gpus: int, size: Size) -> list:
    """The memory checks, in the order they run."""
    all_gpus = max(n_gpus, 2)
    checks = []
    # Peak CUDA memory per stage, iGPT-S, against the ZeRO paper's formula.
    # ZeRO-3's prefetch and reuse at 0 (gpu_check_configs/memory.json, otherwise the default config):
    # at DeepSpeed's default reuse distance every unit stays gathered from forward to backward,
    # and ZeRO-3's peak would exceed ZeRO-1's for a config reason, not a memory one.
    mem_flags = [*data_flags(size, model="igpt-s", image=32, n_train=2048), "--dtype", "bf16",
                 "--max-steps", str(size.mem_steps)]
    for stage in STAGES:
        checks.append(Check(
            f"memory-z{stage}", f"ZeRO-{stage} bf16, iGPT-S on all GPUs: peak >= model states >= the paper's "
                                "formula; at rest >= the states a step keeps",
            min_gpus=2, steps=[[Proc([*launcher(all_gpus), *TRAIN, *mem_flags, "--config", f"{CONFIGS}/memory.json",
                                      "--stage", str(stage), "--save-dir", "{dir}/run"], f"memory-z{stage}.log",
                                     timeout=900)]],
            judge=judge_memory("{dir}/run", stage)))
    checks.append(Check(
        "memory-falls", "peak memory falls from ZeRO-0 to ZeRO-1 to ZeRO-3 (the states ZeRO removes outweigh "
                        "its transients)", min_gpus=2, after=tuple(f"memory-z{s}" for s in STAGES),
        judge=judge_memory_falls([f"{{out}}/memory-z{s}/run" for s in STAGES])))
    # overlap_comm's gradient memory: the reductions in flight must be bounded, not the whole
    # low-precision gradient (2Ψ bytes) alive at the end of backward.
    for stage in (2, 3):
        runs = [Proc([*launcher(1), *TRAIN, *mem_flags, "--config", f"{CONFIGS}/memory_overlap_{knobs}.json",
                      "--stage", str(stage), "--save-dir", f"{{dir}}/{knobs}"], f"memory-overlap-z{stage}-{knobs}.log",
                     timeout=900) for knobs in ("on", "off")]
        checks.append(Check(
            f"memory-overlap-z{stage}", f"ZeRO-{stage} bf16, iGPT-S on 1 GPU, overlap_comm on vs off "
                                        f"({CONFIGS}/memory_overlap_*.json): the peak with overlap on exceeds the "
                                        "peak with it off by less than Ψ bytes (half the bf16 gradient)",
            steps=[[runs[0]], [runs[1]]], judge=judge_memory_overlap("{dir}/on", "{dir}/off")))

    return checks


# ----------------------------------------------------------------------------- verdicts (pure)

def state_bytes(summary: dict) -> list:
    """Per-rank model-state bytes the engine reports (params + grads + master + optimizer)."""
    return [sum(int(r.get(k) or 0) for k in CATEGORIES) for r in summary["model_state_bytes"]]


def formula_bytes(summary: dict, stage: int) -> float:
    """The ZeRO paper's per-rank bytes for this run's Ψ, world size and precision."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from minizero.memory import paper_bytes, total
    return total(paper_bytes(summary["params"], summary["world_size"], stage, mixed=summary["dtype"] != "fp32"))


def memory_verdict(summary: dict, stage: int, at_rest_mb: float | None) -> Result:
    """peak >= model states >= formula on every rank; rank 0 at rest >= the states kept between steps.

    Why these hold: at the end of backward (from step 2 on, when Adam's moments exist) a rank
    holds its parameters, gradients, fp32 masters and moments at once, so the peak is at least
    their sum; the engine's sum is the formula plus the padding of each flat buffer to a
    multiple of N. After a step the gradients are freed, the rest stays (metrics.csv's mem_mb
    is read then). Lower bounds only: the peak also holds activations and ZeRO's transients."""
    if summary.get("status") != "completed":
        return Result("FAIL", f"the run ended {summary.get('status')!r}")
    formula = formula_bytes(summary, stage)
    states, peaks = state_bytes(summary), [p * MIB for p in summary["peak_mem_mb"]]
    kept = sum(int(summary["model_state_bytes"][0].get(k) or 0) for k in ("params", "master_params", "optimizer_states"))
    numbers = (f"peak {mib(max(peaks))} MiB; formula {mib(formula)} MiB; engine states {mib(max(states))} MiB; "
               f"peak - formula {mib(max(peaks) - formula)} MiB")
    if at_rest_mb is not None:
        numbers += f"; rank 0 at rest {mib(at_rest_mb * MIB)} MiB (states kept {mib(kept)})"
    bad = [f"rank {r}: engine states {s:,} B < formula {formula:,.0f} B" for r, s in enumerate(states) if s < formula]
    bad += [f"rank {r}: peak {p / MIB:,.1f} MiB < its model states {s / MIB:,.1f} MiB"
            for r, (p, s) in enumerate(zip(peaks, states)) if p < s]
    if at_rest_mb is not None and at_rest_mb * MIB < kept:
        bad.append(f"rank 0 at rest {at_rest_mb:,.1f} MiB < the states it keeps {kept / MIB:,.1f} MiB")
    return Result("FAIL", "; ".join(bad), numbers) if bad else Result("PASS", "", numbers)


def memory_falls_verdict(peaks: dict) -> Result:
    """peak(0) > peak(1) > peak(3), max over ranks, MiB. ZeRO-1 frees 12Ψ(1-1/N) bytes of
    master+moments that live all the time; ZeRO-3 frees another >= 2Ψ(1-1/N) of parameters and
    gradients. Its transients are small only with prefetch and reuse at 0 (the memory runs'
    config): then a unit is gathered for its forward or backward and freed after it, one or
    two gathered blocks of about Ψ/24 each for iGPT-S. At DeepSpeed's default reuse distance
    every unit stays gathered from its forward to its backward, the whole model at the peak,
    and ZeRO-3's peak exceeds ZeRO-1's. ZeRO-2's place is not asserted: it saves only
    gradients, which need not be allocated at the activation peak, and adds reduce buckets."""
    numbers = "peak MiB by stage 0/1/2/3: " + " / ".join(f"{peaks[s]:,.0f}" for s in STAGES)
    if peaks[0] > peaks[1] > peaks[3]:
        return Result("PASS", "", numbers)
    return Result("FAIL", "peak does not fall ZeRO-0 > ZeRO-1 > ZeRO-3", numbers)


def memory_overlap_verdict(on: dict, off: dict) -> Result:
    """overlap_comm on vs off, one GPU, iGPT-S bf16: the peak with overlap on may exceed the peak
    with it off by the reductions in flight (a few reduce buckets), never by the whole bf16
    gradient: less than Ψ bytes, half of 2Ψ. (When every bucket's gradient stays alive until
    backward ends, the excess is about 2Ψ: 146 MiB for iGPT-S.)"""
    for what, s in (("overlap on", on), ("overlap off", off)):
        if s.get("status") != "completed":
            return Result("FAIL", f"the {what} run ended {s.get('status')!r}")
    psi = on["params"]
    extra = (max(on["peak_mem_mb"]) - max(off["peak_mem_mb"])) * MIB
    numbers = (f"peak on {max(on['peak_mem_mb']):,.0f} MiB, off {max(off['peak_mem_mb']):,.0f} MiB: on - off "
               f"{mib(extra)} MiB; 2Ψ = {mib(2 * psi)} MiB")
    if extra >= psi:
        return Result("FAIL", f"overlap_comm on holds {mib(extra)} MiB more than off (>= Ψ bytes): the gradient's "
                              "reductions in flight are not bounded", numbers)
    return Result("PASS", "", numbers)


# ----------------------------------------------------------------------------- judges (read the files)

def at_rest_mb(run_dir: Path) -> float | None:
    """metrics.csv's mem_mb of the last logged step (rank 0, read right after that step)."""
    try:
        with open(run_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        return float(rows[-1]["mem_mb"]) if rows else None
    except (OSError, KeyError, ValueError):
        return None


def judge_memory(run: str, stage: int):
    def judge(ctx: Ctx) -> Result:
        d = ctx.path(run)
        return memory_verdict(read_json(d / "summary.json"), stage, at_rest_mb(d))
    return judge


def judge_memory_falls(runs: list):
    def judge(ctx: Ctx) -> Result:
        return memory_falls_verdict({s: max(read_json(ctx.path(r) / "summary.json")["peak_mem_mb"])
                                     for s, r in zip(STAGES, runs)})
    return judge


def judge_memory_overlap(on: str, off: str):
    return lambda ctx: memory_overlap_verdict(read_json(ctx.path(on) / "summary.json"),
                                              read_json(ctx.path(off) / "summary.json"))
