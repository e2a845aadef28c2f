"""Train minGPT's image GPT with minizero: the whole run in one readable loop.

    python -m minizero.train                                  # CPU, offline: synthetic 8x8 images, "tiny" GPT
    python -m minizero.train --max-steps 30
    torchrun --nproc-per-node 2 -m minizero.train --stage 3   # ZeRO-3 on 2 ranks
    python -m minizero.train --config launch/ds_config_basic.json --dtype bf16 --stage 2

The same script, with the same flags and output files, runs under real DeepSpeed as
reference/train.py (it imports this module's parser and loop, and swaps the engine).
The command line and the config dict are in minizero/train_args.py; the helpers both
scripts share (test loss, sampling, metrics files) in minizero/runlog.py.

A run writes into --save-dir (default runs/minizero-<stage>-<dtype>), on rank 0:

    metrics.csv   one row per logged step (every `steps_per_print` steps):
                  step, epoch, loss, lr, loss_scale, samples_per_s, tokens_per_s,
                  mem_mb, peak_mem_mb, elapsed_s
    summary.json  library, stage, dtype, world_size, model, params, steps, losses (rank-
                  averaged loss of every optimizer step), final_loss, test_loss,
                  model_state_bytes (per rank), peak_mem_mb (per rank), samples_per_s
                  (median over logged intervals after the first), comm_wire_bytes_per_step
                  (per op, steady-state training steps only), skipped_steps, config
    samples.png   images sampled from the model, minGPT play_image style
    latest, global_step<N>/   the checkpoint (engine.save_checkpoint), for --resume

Honest notes:
- "loss" is the training loss averaged over the gradient-accumulation micro-batches of
  one optimizer step and then over ranks. With dropout on (minGPT's 0.1) it is noisier
  and higher than the test loss, which is computed in eval mode.
- On CPU, mem/peak are the process RSS (interpreter + libraries + data included), not
  the model states: summary.json's model_state_bytes is the number to compare stages by.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from minizero import comm, rundir, runlog
from minizero.checkpoint_io import CheckpointError
from minizero.config import ConfigError, load_config
from minizero.data import DataConfigError, DatasetNotFoundError, UnknownDatasetError, build_datasets, make_loader
from minizero.lr_schedules import MinGPTSchedule
from minizero.model import GPT, ModelConfigError, UnknownPresetError, get_preset
# The command line (flags, checks, CPU/GPU defaults) and the config dict: train_args.py.
from minizero.train_args import (UserError, build_config, build_parser, check_args, dtype_of,
                                 find_checkpoint, later_tags, stage_of)
from minizero.train_args import ACTIVATION_CHECKPOINTING, DEFAULT_CONFIG, read_config_file  # noqa: F401

# minGPT play_image warms up for 1 epoch out of 20: 5% of the run's tokens.
WARMUP_FRACTION = 0.05


# ----------------------------------------------------------------------------- the library

@dataclass
class Library:
    """What differs between minizero and DeepSpeed in this script (everything else is shared)."""
    name: str
    initialize: Callable            # (model, param_groups, cfg, args) -> engine
    loss_scale: Callable            # engine -> float
    model_state_bytes: Callable     # engine -> dict (this rank)
    comm_snapshot: Callable         # engine -> {op: {"wire_bytes": int, ...}} since start
    check_config: Callable          # (cfg, world_size) -> cfg as the engine will use it
    user_errors: tuple = field(default_factory=tuple)   # exception types that mean bad input


def _minizero_initialize(model, param_groups, cfg, args):
    import minizero
    # minizero applies an activation_checkpointing section itself (GPT.checkpoint_fn).
    engine, _, _, _ = minizero.initialize(model=model, model_parameters=param_groups, config=cfg)
    return engine


def _minizero_check_config(cfg, world_size):
    load_config(cfg, world_size)   # unknown keys / bad values -> ConfigError naming the key
    return cfg


MINIZERO = Library(
    name="minizero",
    initialize=_minizero_initialize,
    loss_scale=lambda engine: float(engine.loss_scale),
    model_state_bytes=lambda engine: engine.memory_breakdown(),
    comm_snapshot=lambda engine: engine.comm_stats(),
    check_config=_minizero_check_config,
)

USER_ERRORS = (UserError, ConfigError, DataConfigError, DatasetNotFoundError, UnknownDatasetError,
               ModelConfigError, UnknownPresetError, CheckpointError)


# ----------------------------------------------------------------------------- the run

class TrainingDiverged(Exception):
    """The loss or gradient norm stayed inf/NaN: the run stops, its results stay on disk."""


class NonFiniteGuard:
    """Stop a run after `patience` consecutive optimizer steps with an inf/NaN loss or
    gradient norm (bf16 and fp32; under fp16 the loss scaler owns overflow and gives up
    at its minimum scale, see fp16.MinLossScaleError).

    A lone bad step is not the end: both libraries skip an optimizer step whose gradient
    norm is inf/NaN (weights unchanged), so training can go on after one bad batch. A
    streak of them means the run diverged; going on would only burn time and, with a
    library that applies the step, fill every later checkpoint with NaN.
    """

    def __init__(self, patience: int, enabled: bool):
        self.patience, self.enabled = patience, enabled
        self.streak, self.first_bad = 0, None

    def bad(self, step: int, loss: float, grad_norm) -> bool:
        """Record this step; True if it was bad. Raises TrainingDiverged at the patience."""
        if not self.enabled:
            return False
        norm_bad = grad_norm is not None and not math.isfinite(float(grad_norm))
        if math.isfinite(loss) and not norm_bad:
            self.streak, self.first_bad = 0, None
            return False
        self.streak += 1
        self.first_bad = self.first_bad or step
        self.last_what = f"loss {loss:g}" + (f", gradient norm {float(grad_norm):g}" if grad_norm is not None else "")
        if self.streak >= self.patience:
            raise TrainingDiverged(f"steps {self.first_bad}-{step}")
        return True


@dataclass
class Run:
    """Everything the loop and the finish need; built by setup()."""
    args: argparse.Namespace
    lib: Library
    cfg: dict
    stage: int
    dtype: str
    save_dir: str
    lock: object
    engine: object
    train_ds: object
    loader: object
    test_loader: object
    codebook: torch.Tensor
    block_size: int
    n_params: int
    batch: int
    gas: int
    steps_per_epoch: int
    max_steps: int
    n_epochs: int
    sched: object
    log_every: int
    state: dict
    window: object = None
    probs: torch.Tensor | None = None
    pending: list = field(default_factory=list)   # (step, loss on the device, grad norm) not yet read


def setup(args, lib: Library) -> Run:
    """Config, save folder, data, model, engine, LR schedule; resume if asked."""
    log = _log0
    rank, world = comm.get_rank(), comm.get_world_size()
    device = comm.get_device()

    cfg = build_config(args, world)
    if args.lr_schedule is None:
        args.lr_schedule = "config" if "scheduler" in cfg else "mingpt"
        args.chosen.append(f"--lr-schedule {args.lr_schedule}")
    cfg = lib.check_config(cfg, world)
    stage, dtype = stage_of(cfg), dtype_of(cfg)
    # The trainer prints one metrics line every steps_per_print steps; the engine's own
    # step line (both libraries print one) would say the same again, so it is turned off.
    log_every = cfg.get("steps_per_print") or 10
    engine_cfg = dict(cfg, steps_per_print=10 ** 9)
    resume_tag = find_checkpoint(args.resume, args.tag) if args.resume else None
    # Resuming continues in the folder it resumes from, unless told otherwise.
    save_dir = args.save_dir or args.resume or os.path.join("runs", f"{lib.name}-{stage}-{dtype}")
    lock = claim_save_dir(save_dir, args.resume, resume_tag)
    log(f"{lib.name}: world size {world} on {device}; config {args.config or '(built-in CPU default)'} "
        f"-> stage {stage}, {dtype}; writing to {save_dir}")
    if args.chosen:
        log(f"{lib.name}: defaults chosen: {' '.join(args.chosen)}")

    # data (collective: the codebook is computed on rank 0 and broadcast)
    train_ds, test_ds, codebook = build_datasets(
        args.dataset, root=args.data_dir, image_size=args.image_size, ncluster=args.ncluster,
        seed=args.seed, n_synthetic_train=args.synthetic_train, n_synthetic_test=args.synthetic_test)
    block_size = args.image_size ** 2 - 1

    torch.manual_seed(args.seed)   # the same initial weights on every rank (and in both libraries)
    model = GPT(get_preset(args.model, block_size=block_size, vocab_size=args.ncluster))
    n_params = model.num_params()   # before the engine: ZeRO-3 leaves empty parameters on the module
    opt_params = (cfg.get("optimizer") or {}).get("params") or {}
    # minGPT's split: decay only the Linear weights. The groups carry their weight_decay,
    # which overrides the optimizer's default in both libraries.
    param_groups = model.configure_param_groups(opt_params.get("weight_decay", 0.01))
    engine = lib.initialize(model, param_groups, engine_cfg, args)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    batch = engine.train_batch_size()            # samples per optimizer step, all ranks
    log(f"{lib.name}: model {args.model}: {n_params:,} params, block_size {block_size}, vocab "
        f"{args.ncluster}; {len(train_ds)} train / {len(test_ds)} test images of {args.image_size}x"
        f"{args.image_size}; batch {batch} = micro {micro} x accum {gas} x {world} ranks")

    loader = make_loader(train_ds, micro, shuffle=True, seed=args.seed)
    test_loader = make_loader(test_ds, micro, shuffle=False)
    # Each new DataLoader iterator draws a base seed from the global RNG unless the loader
    # has its own generator; give them one, so the global RNG (dropout) sees only the model,
    # and a resumed run continues with exactly the masks the uninterrupted run would draw.
    loader.generator = torch.Generator().manual_seed(args.seed)
    test_loader.generator = torch.Generator().manual_seed(args.seed)
    # An epoch is a whole number of optimizer steps; the last < gas micro-batches are dropped.
    steps_per_epoch = len(loader) // gas
    if steps_per_epoch == 0:
        raise UserError(f"an epoch has {len(loader)} micro-batches per rank, fewer than gradient_accumulation_steps "
                        f"{gas}: use more data or a smaller --grad-accum")
    max_steps = steps_per_epoch * (args.epochs or 10**9)
    if args.max_steps is not None:
        max_steps = min(max_steps, args.max_steps)

    # minGPT's schedule counts tokens, so it does not depend on the batch size; we step it
    # ourselves (after every optimizer step that was not skipped), so it is not handed to the engine.
    sched = None
    if args.lr_schedule == "mingpt":
        final_tokens = max_steps * batch * block_size
        sched = MinGPTSchedule(engine.optimizer, learning_rate=opt_params.get("lr", 1e-3),
                               warmup_tokens=int(WARMUP_FRACTION * final_tokens), final_tokens=final_tokens)

    run = Run(args=args, lib=lib, cfg=cfg, stage=stage, dtype=dtype, save_dir=save_dir, lock=lock,
              engine=engine, train_ds=train_ds, loader=loader, test_loader=test_loader, codebook=codebook,
              block_size=block_size, n_params=n_params, batch=batch, gas=gas,
              steps_per_epoch=steps_per_epoch, max_steps=max_steps, n_epochs=math.ceil(max_steps / steps_per_epoch),
              sched=sched, log_every=log_every,
              state={"step": 0, "epoch": 0, "batch_in_epoch": 0, "losses": [], "rows": [], "test_loss": None,
                     "elapsed_s": 0.0})
    if args.resume:
        resume(run, resume_tag)
    run.probs = runlog.first_token_probs(train_ds, args.ncluster, seed=args.seed)
    run.window = runlog.StepCommWindow(lambda: lib.comm_snapshot(engine))
    return run


def claim_save_dir(save_dir: str, resume_dir: str | None, resume_tag: str | None):
    """Rank 0 locks the save folder and refuses one holding another run (rundir.py); every
    rank gets the verdict, so all of them stop with the same one line."""
    lock, err = None, None
    if comm.get_rank() == 0:
        try:
            lock = rundir.claim(save_dir, resume_dir)
            if resume_tag is not None and lock is not None:
                later = later_tags(save_dir, resume_tag) if os.path.realpath(save_dir) == \
                    os.path.realpath(resume_dir) else []
                if later:
                    lock.release()
                    raise rundir.RunDirError(
                        f"resuming {resume_tag} into {save_dir} would overwrite its later checkpoints "
                        f"({', '.join(later)}); pass a new --save-dir for the resumed run")
        except rundir.RunDirError as e:
            err = str(e)
    err = comm.broadcast_object(err)
    if err is not None:
        raise rundir.RunDirError(err)
    return lock


def resume(run: Run, tag: str | None) -> None:
    """Load the checkpoint and the trainer's own state: data position, losses, RNG, schedule.

    The data position is (epoch, micro-batches consumed in it): the DistributedSampler's
    order is a function of (seed, epoch), so skipping that many batches continues exactly."""
    args, state, sched = run.args, run.state, run.sched
    path, client = run.engine.load_checkpoint(args.resume, tag=tag)
    if path is None or not client or "train_state" not in client:
        raise UserError(f"--resume {args.resume}: the checkpoint has no training state (was it written by this script?)")
    state.update(client["train_state"])
    # Dropout draws from the global RNG: restore it, or the resumed run sees other masks.
    # (Every rank seeds alike and draws alike, so rank 0's state serves all ranks.)
    if state.get("rng") is not None:
        torch.set_rng_state(torch.as_tensor(state["rng"], dtype=torch.uint8).cpu())
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.as_tensor(state["cuda_rng"], dtype=torch.uint8).cpu())
    _log0(f"{run.lib.name}: resumed from {path} at step {state['step']} (epoch {state['epoch']}, "
          f"micro-batch {state['batch_in_epoch']})")
    saved = state.get("lr_schedule")
    if sched is not None and saved:
        planned = sched.final_tokens
        sched.load_state_dict(saved)   # the schedule the run was started with, not one for the new length
        if sched.final_tokens != planned:
            tokens_per_step = run.batch * run.block_size
            end = sched.final_tokens // tokens_per_step
            _log0(f"{run.lib.name}: keeping the saved lr schedule (minGPT cosine ending at step {end}); --max-steps "
                  f"{run.max_steps} " + (f"goes on past it at the floor lr {0.1 * sched.learning_rate:.1e}"
                                         if run.max_steps > end else "stops before its end"))


def train_loop(run: Run, guard: NonFiniteGuard) -> None:
    """The loop: forward, backward, step; then the bookkeeping of a finished optimizer step."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    engine, args, state, device = run.engine, run.args, run.state, comm.get_device()
    step = state["step"]
    t_run = time.perf_counter() - state["elapsed_s"]
    timer = {"time": 0.0, "steps": 0}
    pbar = tqdm(total=run.max_steps, initial=step, disable=comm.get_rank() != 0, dynamic_ncols=True,
                desc=run.lib.name)
    engine.train()
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger("minizero"), logging.getLogger("DeepSpeed")]):
            for epoch in range(state["epoch"], run.n_epochs):
                if step >= run.max_steps:
                    break
                run.loader.sampler.set_epoch(epoch)
                first = state["batch_in_epoch"] if epoch == state["epoch"] else 0
                for i, (x, y) in enumerate(itertools.islice(run.loader, first, run.steps_per_epoch * run.gas),
                                           start=first):
                    if i % run.gas == 0:                        # a new optimizer step begins
                        run.window.open()
                        t0, acc = time.perf_counter(), 0.0
                    _, loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    engine.backward(loss)
                    skipped_before = engine.skipped_steps
                    engine.step()                           # the optimizer steps at the accumulation boundary
                    acc = acc + loss.detach().double()      # stays on the device: no host sync per micro-batch
                    if (i + 1) % run.gas:
                        continue
                    run.window.close()
                    step += 1
                    after_step(run, guard, pbar, timer, step, epoch, i, acc / run.gas, t0,
                               stepped=engine.skipped_steps == skipped_before, t_run=t_run)
                    if step >= run.max_steps:
                        break
    finally:
        state["step"] = step
        state["elapsed_s"] = time.perf_counter() - t_run
        pbar.close()


def after_step(run: Run, guard: NonFiniteGuard, pbar, timer: dict, step: int, epoch: int, i: int,
               local_loss: torch.Tensor, t0: float, stepped: bool, t_run: float) -> None:
    """A finished optimizer step: LR schedule, metrics, non-finite guard, eval, samples, checkpoint.

    The step's loss stays on the device in `run.pending` until a step that needs it on the
    host (a logged, evaluated, sampled or saved step, or the last): then the losses of all
    pending steps cross ranks and reach the host together, one sync instead of one per step.
    """
    engine, args, state, device = run.engine, run.args, run.state, comm.get_device()
    lr, scale = engine.get_lr()[0], run.lib.loss_scale(engine)   # the lr this step used
    if run.sched is not None and stepped:
        run.sched.step(tokens=run.batch * run.block_size)          # minGPT: the lr of the next step
    run.pending.append((step, local_loss, engine.get_global_grad_norm()))
    pbar.update(1)
    end_of_epoch = i + 1 == run.steps_per_epoch * run.gas
    log = step % run.log_every == 0 or step == run.max_steps
    evaluate = (args.eval_every and step % args.eval_every == 0) or end_of_epoch or step == run.max_steps
    sample = args.sample_every and step % args.sample_every == 0
    save = (args.save_every and step % args.save_every == 0) or step == run.max_steps
    if not (log or evaluate or sample or save):
        timer["time"] += time.perf_counter() - t0
        timer["steps"] += 1
        return
    bad = flush_losses(run, guard)                 # raises TrainingDiverged at the guard's patience
    timer["time"] += time.perf_counter() - t0      # after the sync: the device's work is counted too
    timer["steps"] += 1
    loss = state["losses"][-1]
    pbar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.1e}", scale=f"{scale:g}", refresh=False)

    if log:
        mem, peak = runlog.memory_mb(device)
        sps = timer["steps"] * run.batch / timer["time"]
        row = dict(step=step, epoch=epoch, loss=loss, lr=lr, loss_scale=scale, samples_per_s=sps,
                   tokens_per_s=sps * run.block_size, mem_mb=mem, peak_mem_mb=peak,
                   elapsed_s=time.perf_counter() - t_run)
        state["rows"].append(row)
        if comm.get_rank() == 0:
            pbar.write(runlog.metrics_line(row))
            # On disk at every logged step, so a crash loses at most the last interval.
            runlog.write_metrics_csv(os.path.join(run.save_dir, "metrics.csv"), state["rows"])
        timer["time"], timer["steps"] = 0.0, 0

    if bad:   # no evaluation, samples or checkpoint of a step whose numbers are inf/NaN
        if comm.get_rank() == 0:
            pbar.write(f"step={step:>4d} {guard.last_what}: not finite ({guard.streak} in a row, "
                       f"--max-nonfinite-steps {guard.patience})")
        return
    if evaluate:
        state["test_loss"], state["eval_step"] = runlog.evaluate(engine, run.test_loader, device), step
        if comm.get_rank() == 0:
            pbar.write(f"step={step:>4d} test_loss={state['test_loss']:.4f} (epoch {epoch}"
                       f"{', end' if end_of_epoch else ''})")
    if sample:
        runlog.write_samples(engine, run.probs, args, run.codebook, device,
                             os.path.join(run.save_dir, f"samples-step{step}.png"))
    if save:
        pos = (epoch + 1, 0) if end_of_epoch else (epoch, i + 1)
        state.update(step=step, epoch=pos[0], batch_in_epoch=pos[1],
                     elapsed_s=time.perf_counter() - t_run,
                     lr_schedule=run.sched.state_dict() if run.sched is not None else None,
                     rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        # Collective: every rank writes its shard (ZeRO) or rank 0 the whole (stage 0).
        engine.save_checkpoint(run.save_dir, client_state={"train_state": state})


def flush_losses(run: Run, guard: NonFiniteGuard) -> bool:
    """Pending steps' losses -> rank-averaged floats in state["losses"], through the guard.
    Returns whether the newest step was bad (non-finite loss or gradient norm)."""
    steps, losses, norms = zip(*run.pending)
    run.pending.clear()
    bad = False
    for step, loss, norm in zip(steps, runlog.mean_across_ranks_many(losses, comm.get_device()), norms):
        run.state["losses"].append(loss)
        bad = guard.bad(step, loss, norm)
    return bad


def finish(run: Run, status: str) -> None:
    """Write metrics.csv and summary.json whatever happened; samples and the test loss only
    after a completed run. `status` is "completed", "diverged" (every rank stops at the same
    step, so collectives are safe) or anything else (an error: rank 0 writes what it has,
    without collectives, which could hang if another rank is gone)."""
    engine, state, rank, device = run.engine, run.state, comm.get_rank(), comm.get_device()
    together = status in ("completed", "diverged")
    # Model-state bytes first: evaluation and sampling call the module outside a training
    # step, after which DeepSpeed's ZeRO-3 leaves parameters gathered and would over-report.
    mine = run.lib.model_state_bytes(engine)
    model_state = comm.all_gather_object(mine) if together else [mine]
    test_loss = state["test_loss"]
    if status == "completed":
        if test_loss is None or state.get("eval_step") != state["step"]:   # e.g. resumed at the very end
            test_loss = runlog.evaluate(engine, run.test_loader, device)
        runlog.write_samples(engine, run.probs, run.args, run.codebook, device,
                             os.path.join(run.save_dir, "samples.png"))
    peak = runlog.memory_mb(device)[1]
    peaks = comm.all_gather_object(peak) if together else [peak]
    if rank == 0:
        write_results(run, status, test_loss, model_state, peaks)
    if together and status != "completed":
        # The run stops with an error on every rank; the first rank to exit makes torchrun
        # kill the others, so nobody leaves before rank 0 has written the files.
        comm.barrier()


def write_results(run: Run, status: str, test_loss, model_state: list, peaks: list) -> None:
    """Rank 0: metrics.csv and summary.json, and the run's last line."""
    engine, state = run.engine, run.state
    losses = state["losses"]
    runlog.write_metrics_csv(os.path.join(run.save_dir, "metrics.csv"), state["rows"])
    summary = {
        "library": run.lib.name, "status": status, "stage": run.stage, "dtype": run.dtype,
        "world_size": comm.get_world_size(), "model": run.args.model, "params": run.n_params,
        "steps": state["step"], "losses": losses, "final_loss": losses[-1] if losses else None,
        "test_loss": test_loss, "model_state_bytes": model_state, "peak_mem_mb": peaks,
        "samples_per_s": runlog.median_throughput(state["rows"]),
        "comm_wire_bytes_per_step": run.window.per_step(), "skipped_steps": int(engine.skipped_steps),
        "config": run.cfg,
    }
    runlog.write_summary(os.path.join(run.save_dir, "summary.json"), summary)
    wrote = "metrics.csv, summary.json" + (", samples.png" if status == "completed" else "")
    if status == "completed":
        _log0(f"{run.lib.name}: {state['step']} steps, final loss {summary['final_loss']:.4f}, test loss "
              f"{test_loss:.4f}, {summary['samples_per_s'] or 0:.1f} samples/s; wrote {wrote} to {run.save_dir}")
    else:
        print(f"{run.lib.name}: stopped at step {state['step']} ({status}); wrote {wrote} to {run.save_dir}",
              file=sys.stderr)


def diverged_message(run: Run, what: str) -> str:
    """One line: what went non-finite, what is safe on disk, and what to try."""
    lr = ((run.cfg.get("optimizer") or {}).get("params") or {}).get("lr")
    latest = os.path.join(run.save_dir, "latest")
    ckpt = "no checkpoint was saved"
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = f"the newest checkpoint, with finite weights, is {f.read().strip()} (--resume {run.save_dir})"
    other = "bf16" if run.dtype == "fp16" else "fp32"
    return (f"training diverged: {what}; {ckpt}; try a lower learning rate (lr {lr}), gradient_clipping"
            + (f", or {other}" if run.dtype != "fp32" else ""))


def train(args, lib: Library) -> None:
    run = setup(args, lib)
    guard = NonFiniteGuard(args.max_nonfinite_steps, enabled=run.dtype != "fp16")
    status = "failed"
    try:
        train_loop(run, guard)
        status = "completed"
    except TrainingDiverged as e:
        status = "diverged"
        raise TrainingDiverged(diverged_message(
            run, f"{guard.last_what} at {e} ({guard.streak} steps in a row; --max-nonfinite-steps "
                 f"{guard.patience})")) from None
    except Exception as e:
        if "Current loss scale already at minimum" not in str(e):   # fp16 gave up (either library)
            raise
        status = "diverged"
        raise TrainingDiverged(diverged_message(
            run, f"at step {run.state['step'] + 1} the fp16 gradients overflowed even at the minimum loss "
                 f"scale, so they are inf/NaN unscaled (a smaller min_loss_scale cannot help)")) from None
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        try:
            finish(run, status)
        finally:
            if run.lock is not None:
                run.lock.release()


def _let_rank0_speak() -> None:
    """A silent rank failing with rank 0: wait a moment before exiting. torchrun (and
    DeepSpeed's launcher) kill every rank as soon as one exits non-zero, which could stop
    rank 0 before it has printed the one line that says what went wrong."""
    if comm.get_rank() != 0:
        time.sleep(3.0)


def _log0(*a, **k) -> None:
    if comm.get_rank() == 0:
        print(*a, **k)


def main(argv=None, lib: Library = MINIZERO, parser: argparse.ArgumentParser | None = None) -> None:
    parser = parser or build_parser()
    # Under torchrun every rank parses the same command line: only rank 0 may print a
    # usage error (or --help), the others exit with the same code in silence.
    quiet = comm.get_rank() != 0     # before the group starts: the launcher's rank (torchrun or srun)
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext(), \
                contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            args = parser.parse_args(argv)
            check_args(parser, args)
    except SystemExit as e:
        if e.code not in (0, None):
            _let_rank0_speak()
        raise
    try:
        comm.init_distributed()
        # MINIZERO_DETERMINISTIC=1 (launch/gpu_check.py sets it): deterministic CUDA kernels,
        # so a resumed run is bit-exact on a GPU too (embedding and SDPA backward are not, by default).
        if os.environ.get("MINIZERO_DETERMINISTIC") == "1":
            torch.use_deterministic_algorithms(True, warn_only=False)   # an op with no deterministic kernel raises
            torch.backends.cudnn.benchmark = False                      # no algorithm chosen by timing
            _log0("minizero: deterministic algorithms on (MINIZERO_DETERMINISTIC=1)")
        train(args, lib)
    except USER_ERRORS + lib.user_errors + (TrainingDiverged, rundir.RunDirError, comm.LaunchError) as e:
        # Bad input is one line, not a traceback. Config/data errors happen on every rank
        # alike, and the trainer's own checks agree across ranks, so rank 0 speaks for all.
        if comm.get_rank() == 0:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        else:
            _let_rank0_speak()
        raise SystemExit(1) from None
    finally:
        comm.destroy()


if __name__ == "__main__":
    main()
