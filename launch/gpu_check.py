"""The one-command GPU check: every claim the CPU suite makes that a GPU can show otherwise,
run again on this machine's GPUs, each check as subprocesses, one PASS / FAIL / SKIP table at
the end. How to run it, its flags and what each check asserts: docs/gpu.md (the one place).

This process stays on the standard library (and launch/kit.py's tables): it never starts
CUDA, so no check runs beside a context of its own. torch is imported by the subprocesses,
among them this file's drivers (`--driver NAME ...`), which run a check's ranks through
minizero.runtime.spawn and minizero's public API.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import fnmatch
import importlib.util
import json
import math
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

# Deterministic kernels (docs/gpu.md, "What bit-exact means on a GPU"). cuBLAS needs the
# workspace setting in the environment before CUDA starts; the trainer reads the other.
DETERMINISTIC_ENV = {"MINIZERO_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_MARK = "deterministic algorithms on"   # the line train.py prints when it honours it
# torch.distributed checks that every rank calls the same collective with the same shapes.
DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
PLAN_GPUS = 8            # --plan on a machine without GPUs: the plan for 2 nodes x 4 GPUs (README's cluster)
CONFIGS = "launch/gpu_check_configs"   # the configs of the checks below that need one
GRACE_S = 60             # when one command of a step fails, how long the others get to stop by themselves


# ----------------------------------------------------------------------------- the plan

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


@dataclass(frozen=True)
class Size:
    model: str
    image: int
    steps: int          # optimizer steps of a straight run
    save_every: int     # the resumed run starts from global_step<save_every>
    n_train: int        # synthetic training images
    mem_steps: int      # steps of a memory run (iGPT-S whatever the size: see docs/gpu.md)
    compare_steps: int
    step5_micro: int    # micro-batch of the step-5 offload runs (the tutorial's is 128)


FULL = Size("tutorial", 32, 20, 10, 10000, 4, 30, 32)
QUICK = Size("tiny", 8, 6, 3, 1024, 2, 20, 8)
STAGES, DTYPES = (0, 1, 2, 3), ("fp16", "bf16")


def data_flags(size: Size, model: str | None = None, image: int | None = None, n_train: int | None = None) -> list:
    """Synthetic data (a GPU box may have no network), the codebook cached once per report."""
    return ["--model", model or size.model, "--dataset", "synthetic", "--image-size", str(image or size.image),
            "--synthetic-train", str(n_train or size.n_train), "--synthetic-test", "64",
            "--data-dir", "{out}/data", "--eval-every", "0", "--num-samples", "0", "--seed", "0"]   # no grid: no check looks at it


def launcher(nproc: int) -> list:
    """One process: plain python (no process group). Several: torchrun on this machine."""
    return [PY] if nproc == 1 else [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc)]


def node_launcher(nproc: int, node_rank: int) -> list:
    """One of two torchruns that together make a 2-node job on this box (static rendezvous)."""
    return [*TORCHRUN, "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", "{port}"]


TRAIN = ["-m", "minizero.train"]


def resume_steps(launch: list, flags: list, size: Size, env: dict, log: str, timeout: int) -> list:
    """A straight run saving every `save_every` steps, then one resumed from its first checkpoint."""
    straight = [*launch, *TRAIN, *flags, "--save-every", str(size.save_every), "--save-dir", "{dir}/straight"]
    resumed = [*launch, *TRAIN, *flags, "--resume", "{dir}/straight", "--tag", f"global_step{size.save_every}",
               "--save-dir", "{dir}/resumed"]
    return [[Proc(straight, f"{log}.straight.log", env, timeout)], [Proc(resumed, f"{log}.resumed.log", env, timeout)]]


def driver(name: str, world: int, *args) -> list:
    """A check run by one of this file's drivers (`--driver`), its ranks' results in {dir}/ranks.json."""
    return [PY, "launch/gpu_check.py", "--driver", name, str(world), *map(str, args), "{dir}/ranks.json"]


def plan(n_gpus: int, quick: bool = False) -> list:
    """Every check, in the order they run; those this machine cannot run carry `skip`. A
    check is here only if a GPU can show what the CPU suite cannot: CUDA kernels and their
    determinism, NCCL and its streams, pinned memory, CUDA memory, host syncs."""
    size = QUICK if quick else FULL
    t_train = 300 if quick else 900
    all_gpus = max(n_gpus, 2)
    env_all = {**DETERMINISTIC_ENV, **DEBUG_ENV}
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

    # The tutorial's step 5 as written (ZeRO-3 fp16, offload_optimizer + offload_param), its
    # 24-layer GPT: resumed == straight, bit for bit, on one GPU and on all of them.
    for where, nproc, env, min_gpus in (("1gpu", 1, DETERMINISTIC_ENV, 1), ("allgpu", all_gpus, env_all, 2)):
        name = f"offload-step5-{where}"
        flags = [*data_flags(size, model="tutorial-24" if not quick else size.model), "--config",
                 "launch/ds_config_step5.json", "--micro-batch", str(size.step5_micro), "--max-steps", str(size.steps)]
        checks.append(Check(
            name, f"launch/ds_config_step5.json (ZeRO-3 fp16, optimizer and parameters offloaded) on "
                  f"{'1 GPU' if nproc == 1 else f'{nproc} GPUs'}: straight == resumed, bit for bit",
            min_gpus=min_gpus, steps=resume_steps(launcher(nproc), flags, size, env, name, t_train),
            judge=judge_resume("{dir}/straight", "{dir}/resumed", size.save_every)))

    # Train + resume == straight, bit for bit: one GPU, then all of them under torchrun.
    for where, nproc, env, min_gpus in (("1gpu", 1, DETERMINISTIC_ENV, 1), ("allgpu", all_gpus, env_all, 2)):
        for stage in STAGES:
            for dtype in DTYPES + (("fp32",) if nproc > 1 else ()):
                name = f"resume-{where}-z{stage}-{dtype}"
                flags = [*data_flags(size), "--stage", str(stage), "--dtype", dtype, "--max-steps", str(size.steps)]
                ranks = "1 GPU" if nproc == 1 else f"{nproc} GPUs (torchrun, TORCH_DISTRIBUTED_DEBUG=DETAIL)"
                checks.append(Check(
                    name, f"ZeRO-{stage} {dtype} on {ranks}: {size.steps} steps straight == stopped at "
                          f"{size.save_every} and resumed, bit for bit (deterministic kernels)",
                    min_gpus=min_gpus, steps=resume_steps(launcher(nproc), flags, size, env, name, t_train),
                    judge=judge_resume("{dir}/straight", "{dir}/resumed", size.save_every)))

    # Overlap and prefetch change when data moves, never the numbers: the same run with
    # overlap_comm + ZeRO-3 prefetch/reuse on (DeepSpeed's defaults) and all off, bit for bit.
    # On NCCL the asynchronous collectives run on NCCL's own stream: a buffer freed, resized or
    # reused too early would show here as different losses (CPU tests cannot see it).
    for stage in STAGES:
        for dtype in ("bf16", "fp32"):
            name = f"overlap-z{stage}-{dtype}"
            runs = {knobs: Proc([*launcher(all_gpus), *TRAIN, *data_flags(size), "--config",
                                 f"docs/lesson/overlap_{knobs}.json", "--stage", str(stage), "--dtype", dtype,
                                 "--max-steps", str(size.steps), "--save-dir", f"{{dir}}/{knobs}"],
                                f"{name}-{knobs}.log", env_all, timeout=t_train) for knobs in ("on", "off")}
            checks.append(Check(
                name, f"ZeRO-{stage} {dtype} on all GPUs, docs/lesson/overlap_on.json vs overlap_off.json (same "
                      "buckets): losses bit for bit", min_gpus=2, steps=[[runs["on"]], [runs["off"]]],
                judge=judge_same_losses("{dir}/on", "{dir}/off")))

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

    # Two "nodes" on one box: two torchruns, half the GPUs each, ZeRO-3 bf16.
    half = max(n_gpus // 2, 1)
    gpus = [",".join(str(i) for i in range(r * half, (r + 1) * half)) for r in (0, 1)]
    flags2 = [*data_flags(size), "--stage", "3", "--dtype", "bf16", "--max-steps", str(size.steps)]

    def two_nodes(extra, log):
        return [Proc([*node_launcher(half, r), *TRAIN, *flags2, *extra], f"{log}.node{r}.log",
                     {**env_all, "CUDA_VISIBLE_DEVICES": gpus[r]}, t_train) for r in (0, 1)]

    straight2 = "{out}/2node-straight/run"
    checks.append(Check(
        "2node-straight", f"2 nodes x {half} GPU(s) (two torchruns, --nnodes 2 --node-rank 0/1): one world of "
                          f"{2 * half} ranks, whose ranks do not all see the same devices, trains and saves",
        min_gpus=2, steps=[two_nodes(["--save-every", str(size.save_every), "--save-dir", "{dir}/run"],
                                     "2node-straight")],
        judge=judge_two_node_straight("{dir}/run", 2 * half)))
    checks.append(Check(
        "2node-resume", "both nodes resume from that folder: == the straight 2-node run, bit for bit",
        min_gpus=2, after=("2node-straight",),
        steps=[two_nodes(["--resume", straight2, "--tag", f"global_step{size.save_every}", "--save-dir",
                          "{dir}/resumed"], "2node-resume")],
        judge=judge_resume(straight2, "{dir}/resumed", size.save_every)))
    # The node-aware ZeRO-3s on the same two nodes, k = S = the GPUs of one node (4 on the
    # README's 2 x 4 cluster; docs/two_nodes.md): hpZ changes no number, so its losses are the straight run's bit for
    # bit; HSDP reduces in another order (within the node, then across), so it trains and saves.
    k = 4 if half >= 4 else 2   # the configs carry k = 2 or 4 (launch/gpu_check_configs/two_nodes_*)
    checks.append(Check(
        "2node-hpz", f"the same 2 nodes with hpZ (zero_hpz_partition_size {k}: backward's all-gathers stay in "
                     "the node): losses == the straight 2-node run's, bit for bit",
        min_gpus=4, after=("2node-straight",),
        steps=[two_nodes(["--config", f"{CONFIGS}/two_nodes_hpz{k}.json", "--save-dir", "{dir}/run"],
                         "2node-hpz")],
        judge=judge_same_losses(straight2, "{dir}/run")))
    checks.append(Check(
        "2node-hsdp", f"the same 2 nodes with HSDP (hsdp_shard_size {k}: sharded in the node, replicated "
                      "across): one world trains and saves",
        min_gpus=4, steps=[two_nodes(["--config", f"{CONFIGS}/two_nodes_hsdp{k}.json", "--save-dir",
                                      "{dir}/run"], "2node-hsdp")],
        judge=judge_two_node_straight("{dir}/run", 2 * half)))

    # Offload without the tutorial's step 5 around it, on NCCL: offload_optimizer alone at ZeRO-1/2,
    # offload_param alone at ZeRO-3; resumed == straight, bit for bit.
    for name, cfg, stage in (("offload-opt-z1", "offload_optimizer", 1), ("offload-opt-z2", "offload_optimizer", 2),
                             ("offload-param-z3", "offload_param", 3)):
        flags = [*data_flags(size), "--config", f"{CONFIGS}/{cfg}.json", "--stage", str(stage), "--dtype", "bf16",
                 "--max-steps", str(size.steps)]
        checks.append(Check(
            name, f"ZeRO-{stage} bf16 with {cfg} alone on all GPUs: straight == resumed, bit for bit",
            min_gpus=2, steps=resume_steps(launcher(all_gpus), flags, size, env_all, name, t_train),
            judge=judge_resume("{dir}/straight", "{dir}/resumed", size.save_every)))

    # engine.full_fp32_state_dict() with offload_optimizer: the gather takes each master from host memory.
    for stage in (1, 2):
        checks.append(Check(
            f"consolidate-offload-z{stage}", f"ZeRO-{stage} bf16 + offload_optimizer on all GPUs: "
                                             "full_fp32_state_dict() == the saved checkpoint consolidated, bit for bit",
            min_gpus=2, steps=[[Proc(driver("consolidate", all_gpus, stage), f"consolidate-offload-z{stage}.log",
                                     DEBUG_ENV, 300)]],
            judge=judge_ranks("{dir}/ranks.json", consolidate_verdict)))

    # One step with every host sync counted: only the engine's documented one may happen.
    for stage, dtype, knobs in [(s, d, "off") for s in STAGES for d in ("bf16", "fp16")] + [(3, "bf16", "default")]:
        name = f"sync-debug-z{stage}-{dtype}" + ("-default" if knobs == "default" else "")
        checks.append(Check(
            name, f"ZeRO-{stage} {dtype}{' with the default prefetch and reuse' if knobs == 'default' else ''} on "
                  f"{'all GPUs' if n_gpus > 1 else '1 GPU'}: one step under torch.cuda.set_sync_debug_mode('warn'): "
                  "exactly one host sync (the engine's read of the norm" + (" and the overflow vote" if dtype == "fp16"
                                                                           else "") + ")",
            steps=[[Proc(driver("sync-debug", max(n_gpus, 1), stage, dtype, knobs), f"{name}.log", timeout=300)]],
            judge=judge_ranks("{dir}/ranks.json", sync_debug_verdict)))

    # The timeline, the comms logger and the desync check on CUDA: the same losses as a plain run.
    flags = [*data_flags(size), "--stage", "3", "--dtype", "bf16", "--max-steps", str(size.steps)]
    allgpu = launcher(all_gpus)
    checks.append(Check(
        "observe-allgpu", "ZeRO-3 bf16 on all GPUs with --trace, --comms-logger and MINIZERO_DEBUG_COLLECTIVES=1: "
                          "the trace and the comms table are written, the losses equal a plain run's bit for bit",
        min_gpus=2,
        steps=[[Proc([*allgpu, *TRAIN, *flags, "--save-dir", "{dir}/plain"], "observe-allgpu.plain.log", env_all,
                     t_train)],
               [Proc([*allgpu, *TRAIN, *flags, "--save-dir", "{dir}/observed", "--trace", "{dir}/trace",
                      "--comms-logger"], "observe-allgpu.observed.log",
                     {**env_all, "MINIZERO_DEBUG_COLLECTIVES": "1"}, t_train)]],
        judge=judge_observed("{dir}/plain", "{dir}/observed", "{dir}/trace")))

    # Activation checkpointing with cpu_checkpointing (saved inputs in pinned host memory) on NCCL.
    checks.append(Check(
        "cpu-checkpointing-allgpu", f"ZeRO-3 bf16 on all GPUs, {CONFIGS}/cpu_checkpointing.json (every block "
                                    "checkpointed, saved inputs in host memory) vs no checkpointing: losses bit for bit",
        min_gpus=2,
        steps=[[Proc([*allgpu, *TRAIN, *flags, "--save-dir", "{dir}/plain"], "cpu-checkpointing-allgpu.plain.log",
                     env_all, t_train)],
               [Proc([*allgpu, *TRAIN, *flags, "--config", f"{CONFIGS}/cpu_checkpointing.json",
                      "--save-dir", "{dir}/checkpointed"], "cpu-checkpointing-allgpu.checkpointed.log", env_all,
                     t_train)]],
        judge=judge_same_losses("{dir}/plain", "{dir}/checkpointed")))

    # The user's first command, as the README gives it: the default config and dataset (CIFAR-10 on
    # a GPU); where CIFAR-10 cannot be fetched (no network), the same command on synthetic data.
    user = [*launcher(max(n_gpus, 1)), *TRAIN, "--stage", "3", "--data-dir", "{out}/cifar"]
    checks.append(Check(
        "user-command", f"the README's first command on {max(n_gpus, 1)} GPU(s), `-m minizero.train --stage 3` with "
                        "the default config (one epoch, CIFAR-10; synthetic where CIFAR-10 cannot be fetched), "
                        "completes",
        steps=[[Proc([*user, "--save-dir", "{dir}/cifar10"], "user-command.cifar10.log", timeout=3600, may_fail=True)],
               [Proc([*user, "--dataset", "synthetic", "--save-dir", "{dir}/synthetic"], "user-command.synthetic.log",
                     timeout=3600, fallback_for="user-command.cifar10.log")]],
        judge=judge_user_command("{dir}/cifar10", "{dir}/synthetic")))

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


# ----------------------------------------------------------------------------- comparisons (pure)

def max_abs_diff(a, b):
    """max |a_i - b_i| over two loss lists; None if they cannot be compared (lengths differ,
    empty, or a value that is missing or not finite: inf - inf is no agreement)."""
    if len(a) != len(b) or not a:
        return None
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in [*a, *b]):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def resume_verdict(straight: dict, resumed: dict, k: int, deterministic: bool) -> Result:
    """The resumed run's losses (the first k come from the checkpoint) == the straight run's."""
    for what, s in (("straight", straight), ("resumed", resumed)):
        if s.get("status") != "completed":
            return Result("FAIL", f"the {what} run ended {s.get('status')!r}")
    la, lb = straight["losses"], resumed["losses"]
    d = max_abs_diff(la, lb)
    det = "deterministic kernels on" if deterministic else "deterministic kernels NOT on (trainer ignored " \
                                                           "MINIZERO_DETERMINISTIC)"
    sps = straight.get("samples_per_s")
    numbers = (f"max |dloss| {fmt(d)} over steps {k + 1}-{len(la)}" if d is not None else "losses not comparable") \
        + (f"; {sps:.0f} samples/s" if sps else "") + f"; {det}"
    if d is None:
        return Result("FAIL", f"losses not comparable: {len(la)} vs {len(lb)} steps, or non-finite", numbers)
    if la != lb:
        return Result("FAIL", f"resumed losses differ from the straight run's (max |dloss| {fmt(d)})"
                      + ("" if deterministic else "; the trainer did not turn deterministic kernels on"), numbers)
    return Result("PASS", "", numbers)


MIB = 2 ** 20
CATEGORIES = ("params", "grads", "master_params", "optimizer_states")


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


def worker_tracebacks(text: str) -> int:
    """Tracebacks of the training processes: torchrun adds one of its own (ending in
    ChildFailedError) each time a worker exits non-zero, so those are not counted."""
    return text.count("Traceback (most recent call last)") - len(re.findall(r"ChildFailedError:", text))


def consolidate_verdict(ranks: list) -> Result:
    """engine.full_fp32_state_dict() with offload_optimizer, every rank: its masters were in
    host memory, and the gathered state equals, bit for bit, the same step's checkpoint
    consolidated from the files (minizero.consolidate), all finite."""
    bad = [f"rank {r['rank']}: " + ", ".join(what for key, what in (
        ("master_on_host", "master not in host memory"), ("equals_checkpoint", "gathered state != the checkpoint's"),
        ("finite", "non-finite values")) if not r[key]) for r in ranks
        if not (r["master_on_host"] and r["equals_checkpoint"] and r["finite"])]
    return Result("FAIL", "; ".join(bad[:4])) if bad else Result("PASS", "", f"{len(ranks)} ranks")


def sync_debug_verdict(ranks: list) -> Result:
    """Every rank stepped under set_sync_debug_mode('warn'), each host sync a warning: exactly
    one per rank (the engine's read of the norm, with fp16's vote in the same copy)."""
    counts = [len(r["syncs"]) for r in ranks]
    if any(c != 1 for c in counts):
        where = sorted({w for r in ranks for w in r["syncs"]})
        return Result("FAIL", f"host syncs per rank {counts} (want 1 each), at {'; '.join(where[:3])}")
    return Result("PASS", "", f"{len(ranks)} rank(s); 1 host sync per step ({ranks[0]['syncs'][0]}); "
                              f"loss {ranks[0]['loss']:.4f}")


def nccl_ws1_verdict(res: dict) -> Result:
    """launch/nccl_ws1.py's result: every case identical to its run with no process group,
    and every backend run issued collectives through the backend."""
    bad = [f"{c}: {r['reason']}" for c, r in res["cases"].items() if not r["identical"]]
    calls = sum(sum(r["calls"].values()) for r in res["cases"].values())
    numbers = f"{len(res['cases'])} cases, {calls} collectives through {res['backend']}, each issued late"
    return Result("FAIL", "; ".join(bad[:3]), numbers) if bad else Result("PASS", "", numbers)


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


USER_DATA_ERROR = "CIFAR-10 not found in"   # cifar10.DatasetNotFoundError's first words


def user_command_verdict(cifar: dict | None, cifar_log: str, synthetic: dict | None) -> Result:
    """The README's command completed on CIFAR-10; or CIFAR-10 could not be fetched (that one
    line, no traceback) and the same command completed on synthetic data."""
    def numbers(s, what):
        sps = f"; {s['samples_per_s']:.0f} samples/s" if s.get("samples_per_s") else ""
        return f"{what}: world {s['world_size']}, {s['steps']} steps, final loss {s['final_loss']:.4f}{sps}"
    if cifar is not None and cifar.get("status") == "completed":
        return Result("PASS", "", numbers(cifar, "CIFAR-10"))
    line = last_error(cifar_log)
    if USER_DATA_ERROR not in cifar_log or worker_tracebacks(cifar_log) > 0:
        return Result("FAIL", f"on CIFAR-10: {line}")
    if synthetic is None or synthetic.get("status") != "completed":
        return Result("FAIL", "CIFAR-10 could not be fetched, and the synthetic run did not complete")
    return Result("PASS", "", numbers(synthetic, "CIFAR-10 unreachable here, synthetic"))


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


def fmt(x) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.3g}"


def mib(nbytes: float) -> str:
    x = nbytes / MIB
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"


# ----------------------------------------------------------------------------- judges (read the files)

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


def judge_same_losses(a: str, b: str):
    """Two runs of the same training that differ only in when data moves: equal losses."""
    def judge(ctx: Ctx) -> Result:
        return resume_verdict(read_json(ctx.path(a) / "summary.json"), read_json(ctx.path(b) / "summary.json"), 0,
                              any(DETERMINISTIC_MARK in t for t in ctx.logs()))
    return judge


def judge_resume(straight: str, resumed: str, k: int):
    def judge(ctx: Ctx) -> Result:
        resumed_logs = [t for (p, _, _), t in zip(ctx.procs, ctx.logs()) if "--resume" in p.argv]
        det = any(DETERMINISTIC_MARK in t for t in resumed_logs)
        return resume_verdict(read_json(ctx.path(straight) / "summary.json"),
                              read_json(ctx.path(resumed) / "summary.json"), k, det)
    return judge


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


def judge_two_node_straight(run: str, world: int):
    def judge(ctx: Ctx) -> Result:
        s = read_json(ctx.path(run) / "summary.json")
        numbers = f"world {s['world_size']}; {s['steps']} steps; final loss {s['final_loss']:.4f}" + \
            (f"; {s['samples_per_s']:.0f} samples/s" if s.get("samples_per_s") else "")
        if s["status"] != "completed" or s["world_size"] != world:
            return Result("FAIL", f"status {s['status']!r}, world size {s['world_size']} (want {world})", numbers)
        return Result("PASS", "", numbers)
    return judge


def judge_ranks(path: str, verdict):
    """A --rank-driver's per-rank results (rank 0 wrote them as JSON), judged by `verdict`."""
    return lambda ctx: verdict(read_json(ctx.path(path)))


def judge_observed(plain: str, observed: str, trace: str):
    """The observed run wrote its trace and comms table, and its losses equal the plain run's."""
    def judge(ctx: Ctx) -> Result:
        missing = [str(p.relative_to(ctx.dir)) for p in (ctx.path(trace) / "trace.json", ctx.path(trace) / "rank0.json",
                                                          ctx.path(observed) / "comms_summary.txt") if not p.is_file()]
        same = judge_same_losses(plain, observed)(ctx)
        if missing:
            return Result("FAIL", f"not written: {', '.join(missing)}", same.numbers)
        return same
    return judge


def judge_user_command(cifar: str, synthetic: str):
    def judge(ctx: Ctx) -> Result:
        summary = lambda d: read_json(ctx.path(d) / "summary.json") if (ctx.path(d) / "summary.json").is_file() else None
        cifar_log = next((t for (p, _, _), t in zip(ctx.procs, ctx.logs()) if p.fallback_for is None), "")
        return user_command_verdict(summary(cifar), cifar_log, summary(synthetic))
    return judge


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


def judge_memory_overlap(on: str, off: str):
    return lambda ctx: memory_overlap_verdict(read_json(ctx.path(on) / "summary.json"),
                                              read_json(ctx.path(off) / "summary.json"))


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


def run_step(procs: list, d: Path, out: Path, logs: Path) -> list:
    """Start the step's commands together; wait for all. When one fails the others get a
    minute (GRACE_S) to fail too: a lone node would wait for its peer until NCCL's timeout."""
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
    try:
        while any(proc.poll() is None for _, proc, *_ in running):
            now = time.monotonic()
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


# ----------------------------------------------------------------------------- the table

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


# ----------------------------------------------------------------------------- the drivers
# Checks that need a view inside a step run as `--driver NAME WORLD ARGS... JSON`: WORLD ranks
# (minizero.runtime.spawn; one rank: this process, no process group), each training a small
# GPT through minizero's public API; every rank's result goes to JSON.

# ZeRO-3 as the paper describes it: every parameter partitioned, each unit gathered before
# each use and freed after (prefetch and reuse off)
Z3_OFF = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def small_engine(stage: int, dtype: str, zero: dict):
    """minizero's engine over the `micro` GPT (seed 0) and its synthetic batches, 8 rows a step."""
    import torch

    import minizero
    from minizero import comm
    from minizero.gpt.model import GPT, get_preset
    world = comm.get_world_size() if comm.is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": stage, **zero}}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    preset = get_preset("micro", block_size=16, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    engine = minizero.initialize(model=GPT(preset), config=cfg)[0]
    g = torch.Generator().manual_seed(1 + comm.get_rank())
    data = [torch.randint(0, preset.vocab_size, (8 // world, 17), generator=g) for _ in range(4)]
    return engine, [(d[:, :-1].to(engine.device), d[:, 1:].to(engine.device)) for d in data]


def consolidate_rank(stage: int, save_dir: str) -> dict:
    """offload_optimizer at `stage`: one step, then engine.full_fp32_state_dict() (its gather
    takes each master from host memory) against the checkpoint of that step consolidated from
    the files by minizero.consolidate. On every rank: masters on the host, equal, finite?"""
    import torch

    import minizero
    from minizero import comm
    engine, batches = small_engine(stage, "bf16", {"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    x, y = batches[0]
    engine.backward(engine(x, y)[1])
    engine.step()
    gathered = engine.full_fp32_state_dict()
    engine.save_checkpoint(save_dir, tag="step1")
    comm.barrier()
    saved = minizero.consolidate(save_dir, tag="step1")
    same = set(gathered) == set(saved) and all(torch.equal(gathered[k].cpu(), saved[k].cpu()) for k in saved)
    return {"rank": comm.get_rank(), "master_on_host": engine.memory_breakdown()["host"]["master_params"] > 0,
            "equals_checkpoint": same, "finite": all(bool(torch.isfinite(t).all()) for t in gathered.values())}


SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_debug_rank(stage: int, dtype: str, knobs: str) -> dict:
    """One optimizer step (after a warm-up step) under torch.cuda.set_sync_debug_mode("warn"):
    every host sync in forward, backward and step is a warning, recorded with the line that
    made it. The engine's step has exactly one by design (the norm, with fp16's vote)."""
    import warnings

    import torch

    from minizero import comm
    engine, batches = small_engine(stage, dtype, Z3_OFF if stage == 3 and knobs == "off" else {})
    x, y = batches[0]
    engine.backward(engine(x, y)[1])   # the warm-up step: first allocations, ZeRO-3's recorded order
    engine.step()
    torch.cuda.synchronize()
    x, y = batches[1]
    # (a sync in autograd's device thread is replayed as a warning here when backward returns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = engine(x, y)[1]
            engine.backward(loss)
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in seen if SYNC_WARNING in str(w.message)]
    return {"rank": comm.get_rank(), "syncs": syncs, "loss": float(loss)}


DRIVERS = {"consolidate": (consolidate_rank, (int,)), "sync-debug": (sync_debug_rank, (int, str, str))}


def run_driver(argv: list) -> int:
    """`--driver NAME WORLD ARGS... JSON`: the driver on WORLD ranks; their results to JSON."""
    name, world, *args, path = argv
    fn, types = DRIVERS[name]
    args = [t(a) for t, a in zip(types, args)]
    if name == "consolidate":
        args.append(str(Path(path).parent / "checkpoint"))
    kit.bootstrap()
    if int(world) == 1:
        ranks = [fn(*args)]
    else:
        import torch

        from minizero.runtime.spawn import run_ranks
        kit.preload(["minizero"])   # on a CPU (a rehearsal, the tests) the ranks fork: they need this file
        ranks = run_ranks(fn, int(world), tuple(args), cuda=torch.cuda.is_available(), timeout=600)
    Path(path).write_text(json.dumps(ranks, default=float))
    return 0


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


def say(*a, err: bool = False) -> None:
    print("gpu_check:", *a, file=sys.stderr if err else sys.stdout, flush=True)


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
        if not c.steps:
            print("     (reads the results of: " + ", ".join(c.after) + ")")
        print()


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.driver:
        return run_driver(args.driver)
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
