"""The GPU check's training runs (launch/gpu_check.py): what the whole trainer, `python -m
minizero.train` under torchrun, must give on GPUs: a resumed run equal to the straight one bit
for bit (deterministic kernels), overlap and prefetch changing no number, the tutorial's step-5
offload config, the observers and CPU checkpointing changing no number, the README's first
command completing. Also the sizes, flags and launchers every training check builds from.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_run import PY, TORCHRUN, Check, Ctx, Proc, Result, fmt, last_error, read_json  # noqa: E402


# Deterministic kernels (docs/gpu.md, "What bit-exact means on a GPU"). cuBLAS needs the
# workspace setting in the environment before CUDA starts; the trainer reads the other.
DETERMINISTIC_ENV = {"MINIZERO_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
DETERMINISTIC_MARK = "deterministic algorithms on"   # the line train.py prints when it honours it
# torch.distributed checks that every rank calls the same collective with the same shapes.
DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
CONFIGS = "launch/gpu_check_configs"   # the configs of the checks that need one


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


TRAIN = ["-m", "minizero.train"]


def resume_steps(launch: list, flags: list, size: Size, env: dict, log: str, timeout: int) -> list:
    """A straight run saving every `save_every` steps, then one resumed from its first checkpoint."""
    straight = [*launch, *TRAIN, *flags, "--save-every", str(size.save_every), "--save-dir", "{dir}/straight"]
    resumed = [*launch, *TRAIN, *flags, "--resume", "{dir}/straight", "--tag", f"global_step{size.save_every}",
               "--save-dir", "{dir}/resumed"]
    return [[Proc(straight, f"{log}.straight.log", env, timeout)], [Proc(resumed, f"{log}.resumed.log", env, timeout)]]


def training_checks(n_gpus: int, size: Size, t_train: int, quick: bool) -> list:
    """The training checks, in the order they run."""
    all_gpus = max(n_gpus, 2)
    env_all = {**DETERMINISTIC_ENV, **DEBUG_ENV}
    checks = []

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

    return checks


def late_training_checks(n_gpus: int, size: Size, t_train: int) -> list:
    """The training checks that run after the drivers' (offload alone, the observers, CPU
    checkpointing, the README's command)."""
    all_gpus = max(n_gpus, 2)
    env_all = {**DETERMINISTIC_ENV, **DEBUG_ENV}
    checks = []
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

    return checks


# ----------------------------------------------------------------------------- verdicts (pure)

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


def worker_tracebacks(text: str) -> int:
    """Tracebacks of the training processes: torchrun adds one of its own (ending in
    ChildFailedError) each time a worker exits non-zero, so those are not counted."""
    return text.count("Traceback (most recent call last)") - len(re.findall(r"ChildFailedError:", text))


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


# ----------------------------------------------------------------------------- judges (read the files)

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
