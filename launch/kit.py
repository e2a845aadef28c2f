"""What the scripts in launch/ share: one-line errors, flags, the machine line, tables, JSON,
timing statistics, and the engines and timed steps the benchmarks measure.

    from kit import BenchError, OneLineParser, md_table, machine, step_ms   # launch/ on sys.path

Each script puts the repository root and launch/ on sys.path itself (`bootstrap()`), so it
runs as `python3 launch/<script>.py` from any folder. Nothing here imports torch at module
level: a script checks its flags and answers a mistake in one line before torch loads.

The engines: minizero (`minizero.initialize`), DeepSpeed (`deepspeed.initialize`) and PyTorch
(`reference/torch_engine.py`: DDP at stage 0, FSDP2 at stages 2 and 3), all driven through
DeepSpeed's engine API (`engine(x, y)`, `engine.backward(loss)`, `engine.step()`), the same
model (minizero/gpt/model.py) and the same random tokens (reference/ds_run.py). Only names
every minizero checkout has are used (its public API, minizero.gpt.model,
minizero.runtime.spawn), so `launch/bench_host.py --minizero-checkout DIR` can time an older
minizero with this file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = ("minizero", "deepspeed", "torch")
# What PyTorch runs at each ZeRO stage (reference/torch_engine.py): DDP is data parallelism with
# everything whole (stage 0); FSDP2 keeping the gathered parameters from forward to backward
# (reshard_after_forward=False) gathers once per step and reduce-scatters gradients, ZeRO-2's
# traffic; FSDP2 resharding after forward is ZeRO-3. FSDP2 has no ZeRO-1 (sharded optimizer
# state with whole parameters and gradients): stage 1 has no PyTorch cell.
TORCH_NAMES = {0: "DDP", 2: "FSDP2 (reshard_after_forward=False)", 3: "FSDP2"}


def bootstrap(root: Path | None = None) -> None:
    """The repository (or `root`, another checkout's) and launch/ first on sys.path."""
    for p in (str(Path(__file__).resolve().parent), str(root or ROOT)):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)


class BenchError(Exception):
    """Reported as one line, no traceback."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes raise BenchError (the script prints one line and exits 2)."""

    def error(self, message):
        raise BenchError(f"{message} (see --help)")


def comma_list(text: str, choices, flag: str, cast=str) -> list:
    """'a,b' -> [a, b] in the order of `choices`, each one of them; else one line."""
    try:
        items = [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        items = None
    if not items or any(x not in choices for x in items):
        raise BenchError(f"--{flag} {text!r}: give comma-separated values of {', '.join(map(str, choices))}")
    return sorted(set(items), key=list(choices).index)


def at_least(args, least: int, names) -> None:
    for name in names:
        if getattr(args, name) < least:
            raise BenchError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")


def add_model_flags(p: argparse.ArgumentParser, model: str | None, n_embd: int, seq: int) -> None:
    p.add_argument("--model", default=model, help=f"GPT preset (minizero/gpt/model.py; default {model})")
    p.add_argument("--n-layer", type=int, help="override the preset's depth")
    p.add_argument("--n-embd", type=int, default=n_embd, help=f"width (default {n_embd})")
    p.add_argument("--n-head", type=int, help="heads (default: the preset's, or 4 when it does not divide --n-embd)")
    p.add_argument("--seq", type=int, default=seq, help=f"tokens per row (default {seq})")


def add_output_flags(p: argparse.ArgumentParser, report: str = "the report",
                     logs: str = "the libraries'") -> None:
    """--out and --json (what write_outputs writes), --seed, --verbose (what quiet_rank reads)."""
    p.add_argument("--out", help=f"also write {report} to this file")
    p.add_argument("--json", help="also write every number to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help=f"keep {logs} info logs (stderr)")


def check_launch(args, libs, cuda: bool | None = None, gpus: int | None = None) -> None:
    """What every benchmark checks before launching ranks: sets args.cuda, args.world_size
    (default 2, or min(2, GPUs)) and args.model_kw; one line for a library that is not
    installed, more ranks than GPUs, or a model the size flags cannot build."""
    import importlib.util
    if cuda is None:
        import torch
        cuda, gpus = torch.cuda.is_available(), torch.cuda.device_count()
    args.cuda = cuda
    for lib in libs:
        if lib in ("deepspeed",) and importlib.util.find_spec(lib) is None:
            raise BenchError(f"--libs {lib}: {lib} is not installed (pip install -e .[dev]), or leave it out")
    if args.world_size is None:
        args.world_size = min(2, gpus) if cuda else 2
    if cuda and args.world_size > gpus:
        raise BenchError(f"--world-size {args.world_size} but {gpus} GPU(s) visible: one rank per GPU")
    args.model_kw = model_kw(args)


def model_kw(args) -> dict:
    """The size flags as GPTConfig overrides; dropout off (timing, not regularisation), as the
    tutorial's GPTConfig has it. One line for a preset or size the model refuses."""
    from minizero.gpt.model import ModelConfigError, UnknownPresetError, get_preset
    try:
        preset = get_preset(args.model)
        kw = {"n_embd": args.n_embd, "block_size": getattr(args, "block_size", None) or args.seq,
              "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}
        if args.n_layer is not None:
            kw["n_layer"] = args.n_layer
        if args.n_head is not None:
            kw["n_head"] = args.n_head
        elif args.n_embd % preset.n_head:
            kw["n_head"] = 4 if args.n_embd % 4 == 0 else 1
        get_preset(args.model, **kw)
    except (UnknownPresetError, ModelConfigError) as e:
        raise BenchError(str(e)) from None
    return kw


def build_gpt(preset: str, overrides: dict):
    from minizero.gpt.model import GPT, get_preset
    return GPT(get_preset(preset, **overrides))


def model_numbers(args) -> dict:
    from minizero.gpt.model import get_preset
    cfg = get_preset(args.model, **args.model_kw)
    psi = sum(p.numel() for p in build_gpt(args.model, args.model_kw).parameters())
    return {"psi": psi, "psi_per_rank": math.ceil(psi / args.world_size),
            "config": {k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}}


# ----------------------------------------------------------------------------- the machine

def machine() -> str:
    """The GPUs, or the CPU's model, cores and the vector flags that decide bf16's speed."""
    from minizero.runtime import about
    return about.machine()


def versions() -> str:
    from minizero.runtime import about
    return ", ".join(f"{name} {v}" for name, v in about.versions().items() if v != "not installed")


# ----------------------------------------------------------------------------- tables and files

def fmt(x, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def mib(nbytes) -> str:
    return fmt(None if nbytes is None else nbytes / 2 ** 20, ".2f")


def ms(x) -> str:
    """Milliseconds to three significant digits or whole ms, whichever is longer."""
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def md_table(head: list, rows: list) -> str:
    """A markdown table; every row must have one cell per column. `|` in a cell is escaped."""
    for r in rows:
        if len(r) != len(head):
            raise ValueError(f"row {r} has {len(r)} cells, the header {len(head)}")
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(map(cell, head)) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def write_outputs(text: str, data: dict, out: str | None, js: str | None) -> None:
    """The report on stdout, and in --out / --json when given (JSON: every number)."""
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    if js:
        Path(js).write_text(json.dumps(data, indent=1, default=str) + "\n")


def logger(prog: str):
    def log(msg: str) -> None:
        print(f"[{prog} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


# ----------------------------------------------------------------------------- timing statistics

def step_ms(per_rank_step_s: list) -> tuple:
    """Median and minimum over steps of the slowest rank's time (a step ends when its last
    rank does), in ms. On a shared machine the minimum is the run least disturbed."""
    slowest = [max(ts) for ts in zip(*per_rank_step_s)]
    return statistics.median(slowest) * 1000.0, min(slowest) * 1000.0


def samples_per_s(step_ms_: float, global_batch: int) -> float:
    return global_batch / (step_ms_ / 1000.0) if step_ms_ > 0 else float("nan")


def spread(values: list) -> dict | None:
    """Median, min, max and count of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else None


class RegionTimer:
    """The time of a region: on a GPU by CUDA events on the current stream (read seconds()
    after a device sync: the device's time from the region's first queued kernel to its last;
    the engines end every step on the current stream, side-stream work waited for before the
    optimizer reads it), on a CPU by the wall clock."""

    def __init__(self, cuda: bool):
        import torch
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self.t = [0.0, 0.0]

    def start(self) -> None:
        self._mark(0)

    def stop(self) -> None:
        self._mark(1)

    def _mark(self, i: int) -> None:
        if self.events:
            self.events[i].record()
        else:
            self.t[i] = time.perf_counter()

    def seconds(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) / 1e3 if self.events else self.t[1] - self.t[0]


# ----------------------------------------------------------------------------- engines and steps

def make_engine(lib: str, cfg: dict, args_d: dict):
    """One library's engine over the benchmark's GPT, on this rank (inside its process
    group). cfg: a DeepSpeed config dict, adjusted as reference/ds_run.py's comparisons
    adjust it (torch_adam inside optimizer.params, ZeRO-3's F.linear patch off)."""
    import functools

    import torch

    from reference.ds_run import build_model, prepare_ds_config
    cfg = prepare_ds_config(cfg)
    model, params = build_model(functools.partial(build_gpt, args_d["model"], args_d["model_kw"]), cfg,
                                args_d["seed"])
    if torch.cuda.is_available():
        # reset_peak_memory_stats does not start CUDA itself: in a rank with no process group
        # yet (one rank, no NCCL) it failed "Invalid device argument" on an H200 until this init
        torch.cuda.init()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if lib == "deepspeed":
        import deepspeed

        from reference.ds_run import patch_cpu_fp16, skip_inference_shm_op
        skip_inference_shm_op()    # an inference-only op DeepSpeed compiles on first use (a minute)
        if (cfg.get("fp16") or {}).get("enabled") and not torch.cuda.is_available():
            patch_cpu_fp16()
        return deepspeed.initialize(model=model, model_parameters=params, config=cfg)[0]
    if lib == "torch":
        from minizero import comm

        from reference.torch_engine import TorchEngine
        return TorchEngine(model.to(comm.get_device()), list(params), cfg)
    import minizero
    return minizero.initialize(model=model, model_parameters=params, config=cfg)[0]


def make_batches(args_d: dict, steps: int, gas: int, rank: int, device) -> list:
    """Random tokens (reference.ds_run.SyntheticBatches), made before the clock starts."""
    from minizero.gpt.model import get_preset

    from reference.ds_run import SyntheticBatches
    vocab = get_preset(args_d["model"], **args_d["model_kw"]).vocab_size
    gen = SyntheticBatches(vocab, args_d["seq"], args_d["micro_batch"], seed=args_d["seed"] + 1)
    world = args_d["world_size"]
    return [tuple(t.to(device) for t in gen(s, m, rank, world)) for s in range(steps) for m in range(gas)]


def engine_device(engine):
    return getattr(engine, "device", None) or next(engine.module.parameters()).device


def one_step(engine, batches, step: int, gas: int) -> tuple:
    """One optimizer step of `gas` micro-steps; the loss and the host seconds of each call
    (on a GPU: when Python got through each phase, not when the GPU ran it)."""
    took = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    for micro in range(gas):
        x, y = batches[step * gas + micro]
        t0 = time.perf_counter()
        loss = engine(x, y)[1]
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        took["forward"] += t1 - t0
        took["backward"] += t2 - t1
        took["step"] += t3 - t2
    return loss, took


def timed_steps(engine, batches, first: int, count: int, gas: int, cuda: bool) -> dict:
    """Steps first .. first+count-1, each between device syncs: its time (CUDA events on a
    GPU, RegionTimer), the host's wall clock around the same syncs, and each phase's host
    seconds; the last loss."""
    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = RegionTimer(cuda)
    out = {"step_s": [], "step_wall_s": [], "phase_s": {"forward": [], "backward": [], "step": []}}
    loss = None
    for step in range(first, first + count):
        sync()
        t0 = time.perf_counter()
        timer.start()
        loss, took = one_step(engine, batches, step, gas)
        timer.stop()
        sync()
        out["step_wall_s"].append(time.perf_counter() - t0)
        out["step_s"].append(timer.seconds())
        for k, v in took.items():
            out["phase_s"][k].append(v)
    out["final_loss"] = None if loss is None else float(loss.detach().float())
    return out


def peak_cuda_bytes() -> int | None:
    import torch
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def quiet_rank(verbose: bool) -> None:
    """In a rank: library chatter to stderr (stdout carries the report), info logs off."""
    import logging
    os.dup2(2, 1)
    if not verbose:
        for name in ("DeepSpeed", "minizero"):
            logging.getLogger(name).setLevel(logging.WARNING)


def preload(libs) -> None:
    """On a CPU the ranks fork from a forkserver that imports torch (and DeepSpeed) once;
    "__main__": the ranks run the script's functions, so the server imports it too. (On a
    GPU machine they are spawned: a forked CUDA runtime is not safe.) Not reference.torch_engine:
    importing it wraps torch.distributed's collectives to count them (reference/comm_counter.py),
    and every rank forked after that would run its collectives through the wrappers, the other
    libraries' too."""
    from minizero.runtime import spawn
    spawn.preload("__main__", "kit", "reference.ds_run", *(["deepspeed"] if "deepspeed" in libs else []))


def run_on_ranks(fn, world_size: int, args: tuple, what: str, cuda: bool, threads: int = 1,
                 timeout: float = 3600.0, group: bool = True) -> list:
    """fn(*args) on world_size fresh ranks (minizero.runtime.spawn), each in its process group
    (one rank too: DDP, FSDP2 and the floor's barriers need one); a failure is one line."""
    from minizero.runtime.spawn import RankError, run_ranks
    try:
        return run_ranks(fn, world_size, args, threads=threads, cuda=cuda, timeout=timeout, group=group)
    except RankError as e:
        raise BenchError(f"{what} failed: {e}") from None
