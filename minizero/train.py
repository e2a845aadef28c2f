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
import itertools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from minizero import comm, runlog
from minizero.checkpoint import CheckpointError
from minizero.config import ConfigError, load_config
from minizero.data import DataConfigError, DatasetNotFoundError, UnknownDatasetError, build_datasets, make_loader
from minizero.lr_schedules import MinGPTSchedule
from minizero.model import GPT, ModelConfigError, UnknownPresetError, get_preset
# The command line (flags, checks, CPU/GPU defaults) and the config dict: train_args.py.
from minizero.train_args import (UserError, build_config, build_parser, check_args, dtype_of,
                                 find_checkpoint, stage_of)
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

def train(args, lib: Library) -> None:
    log = print if comm.get_rank() == 0 else (lambda *a, **k: None)
    rank, world = comm.get_rank(), comm.get_world_size()
    device = comm.get_device()

    # -------------------------------------------------------------- config
    cfg = build_config(args, world)
    if args.lr_schedule is None:
        args.lr_schedule = "config" if "scheduler" in cfg else "mingpt"
        args.chosen.append(f"--lr-schedule {args.lr_schedule}")
    cfg = lib.check_config(cfg, world)
    stage, dtype = stage_of(cfg), dtype_of(cfg)
    save_dir = args.save_dir or os.path.join("runs", f"{lib.name}-{stage}-{dtype}")
    if args.resume:
        find_checkpoint(args.resume)
    log(f"{lib.name}: world size {world} on {device}; config {args.config or '(built-in CPU default)'} "
        f"-> stage {stage}, {dtype}")
    if args.chosen:
        log(f"{lib.name}: defaults chosen: {' '.join(args.chosen)}")

    # -------------------------------------------------------------- data (collective: codebook on rank 0)
    train_ds, test_ds, codebook = build_datasets(
        args.dataset, root=args.data_dir, image_size=args.image_size, ncluster=args.ncluster,
        seed=args.seed, n_synthetic_train=args.synthetic_train, n_synthetic_test=args.synthetic_test)
    block_size = args.image_size ** 2 - 1

    # -------------------------------------------------------------- model + engine
    torch.manual_seed(args.seed)   # the same initial weights on every rank (and in both libraries)
    model = GPT(get_preset(args.model, block_size=block_size, vocab_size=args.ncluster))
    n_params = model.num_params()
    opt_params = (cfg.get("optimizer") or {}).get("params") or {}
    # minGPT's split: decay only the Linear weights. The groups carry their weight_decay,
    # which overrides the optimizer's default in both libraries.
    param_groups = model.configure_param_groups(opt_params.get("weight_decay", 0.01))
    engine = lib.initialize(model, param_groups, cfg, args)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    batch = engine.train_batch_size()            # samples per optimizer step, all ranks
    log(f"{lib.name}: model {args.model}: {n_params:,} params, block_size {block_size}, vocab {args.ncluster}; "
        f"{len(train_ds)} train / {len(test_ds)} test images of {args.image_size}x{args.image_size}; "
        f"batch {batch} = micro {micro} x accum {gas} x {world} ranks")

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
    n_epochs = math.ceil(max_steps / steps_per_epoch)

    # minGPT's schedule counts tokens, so it does not depend on the batch size; we step it
    # ourselves (after every optimizer step that was not skipped), so it is not handed to the engine.
    sched = None
    if args.lr_schedule == "mingpt":
        final_tokens = max_steps * batch * block_size
        sched = MinGPTSchedule(engine.optimizer, learning_rate=opt_params.get("lr", 1e-3),
                               warmup_tokens=int(WARMUP_FRACTION * final_tokens), final_tokens=final_tokens)

    # -------------------------------------------------------------- resume
    # The data position is (epoch, micro-batches consumed in it): the DistributedSampler's
    # order is a function of (seed, epoch), so skipping that many batches continues exactly.
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "losses": [], "rows": [], "test_loss": None,
             "elapsed_s": 0.0}
    if args.resume:
        path, client = engine.load_checkpoint(args.resume)
        if path is None or not client or "train_state" not in client:
            raise UserError(f"--resume {args.resume}: the checkpoint has no training state (was it written by this script?)")
        state.update(client["train_state"])
        # Dropout draws from the global RNG: restore it, or the resumed run sees other masks.
        # (Every rank seeds alike and draws alike, so rank 0's state serves all ranks.)
        if state.get("rng") is not None:
            torch.set_rng_state(torch.as_tensor(state["rng"], dtype=torch.uint8).cpu())
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.as_tensor(state["cuda_rng"], dtype=torch.uint8).cpu())
        if sched is not None and state.get("lr_schedule"):
            sched.load_state_dict(state["lr_schedule"])
        log(f"{lib.name}: resumed from {path} at step {state['step']} (epoch {state['epoch']}, "
            f"micro-batch {state['batch_in_epoch']})")

    probs = runlog.first_token_probs(train_ds, args.ncluster, seed=args.seed)
    log_every = cfg.get("steps_per_print") or 10
    window = runlog.StepCommWindow(lambda: lib.comm_snapshot(engine))
    os.makedirs(save_dir, exist_ok=True)

    # -------------------------------------------------------------- the loop
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    step, losses, rows = state["step"], state["losses"], state["rows"]
    test_loss = state["test_loss"]
    last_eval_step = step if test_loss is not None else -1
    interval_time, interval_steps = 0.0, 0
    t_run = time.perf_counter() - state["elapsed_s"]
    pbar = tqdm(total=max_steps, initial=step, disable=rank != 0, dynamic_ncols=True, desc=lib.name)
    engine.train()
    with logging_redirect_tqdm(loggers=[logging.getLogger("minizero"), logging.getLogger("DeepSpeed")]):
        for epoch in range(state["epoch"], n_epochs):
            if step >= max_steps:
                break
            loader.sampler.set_epoch(epoch)
            first = state["batch_in_epoch"] if epoch == state["epoch"] else 0
            batches = itertools.islice(loader, first, steps_per_epoch * gas)
            for i, (x, y) in enumerate(batches, start=first):
                if i % gas == 0:                        # a new optimizer step begins
                    window.open()
                    t0, acc = time.perf_counter(), 0.0
                x, y = x.to(device), y.to(device)
                _, loss = engine(x, y)
                engine.backward(loss)
                skipped_before = engine.skipped_steps
                engine.step()                           # the optimizer steps at the accumulation boundary
                acc += float(loss.detach().float().item())
                if (i + 1) % gas:
                    continue

                # ---- one optimizer step done
                window.close()
                step += 1
                lr, scale = engine.get_lr()[0], lib.loss_scale(engine)   # the lr this step used
                if sched is not None and engine.skipped_steps == skipped_before:
                    sched.step(tokens=batch * block_size)                 # minGPT: the lr of the next step
                loss_avg = runlog.mean_across_ranks(acc / gas, device)
                losses.append(loss_avg)
                dt = time.perf_counter() - t0
                interval_time, interval_steps = interval_time + dt, interval_steps + 1
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_avg:.4f}", lr=f"{lr:.1e}", scale=f"{scale:g}", refresh=False)

                if step % log_every == 0 or step == max_steps:
                    mem, peak = runlog.memory_mb(device)
                    sps = interval_steps * batch / interval_time
                    row = dict(step=step, epoch=epoch, loss=loss_avg, lr=lr, loss_scale=scale,
                               samples_per_s=sps, tokens_per_s=sps * block_size, mem_mb=mem,
                               peak_mem_mb=peak, elapsed_s=time.perf_counter() - t_run)
                    rows.append(row)
                    if rank == 0:
                        pbar.write(runlog.metrics_line(row))
                    interval_time, interval_steps = 0.0, 0

                end_of_epoch = i + 1 == steps_per_epoch * gas
                if (args.eval_every and step % args.eval_every == 0) or end_of_epoch or step == max_steps:
                    test_loss, last_eval_step = runlog.evaluate(engine, test_loader, device), step
                    if rank == 0:
                        pbar.write(f"step={step:>4d} test_loss={test_loss:.4f} (epoch {epoch}"
                                   f"{', end' if end_of_epoch else ''})")
                if args.sample_every and step % args.sample_every == 0:
                    runlog.write_samples(engine, probs, args, codebook, device,
                                         os.path.join(save_dir, f"samples-step{step}.png"))
                if (args.save_every and step % args.save_every == 0) or step == max_steps:
                    pos = (epoch + 1, 0) if end_of_epoch else (epoch, i + 1)
                    state.update(step=step, epoch=pos[0], batch_in_epoch=pos[1], losses=losses, rows=rows,
                                 test_loss=test_loss, elapsed_s=time.perf_counter() - t_run,
                                 lr_schedule=sched.state_dict() if sched is not None else None,
                                 rng=torch.get_rng_state(),
                                 cuda_rng=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
                    # Collective: every rank writes its shard (ZeRO) or rank 0 the whole (stage 0).
                    engine.save_checkpoint(save_dir, client_state={"train_state": state})
                if step >= max_steps:
                    break
    pbar.close()

    # -------------------------------------------------------------- the end: samples, memory, summary
    # Model-state bytes first: evaluation and sampling call the module outside a training
    # step, after which DeepSpeed's ZeRO-3 leaves parameters gathered and would over-report.
    model_state = runlog.gather_objects(lib.model_state_bytes(engine))
    if test_loss is None or last_eval_step != step:   # e.g. resumed at the very end
        test_loss = runlog.evaluate(engine, test_loader, device)
    runlog.write_samples(engine, probs, args, codebook, device, os.path.join(save_dir, "samples.png"))
    peaks = runlog.gather_objects(runlog.memory_mb(device)[1])
    if rank == 0:
        runlog.write_metrics_csv(os.path.join(save_dir, "metrics.csv"), rows)
        summary = {
            "library": lib.name, "stage": stage, "dtype": dtype, "world_size": world, "model": args.model,
            "params": n_params, "steps": step, "losses": losses,
            "final_loss": losses[-1] if losses else None, "test_loss": test_loss,
            "model_state_bytes": model_state, "peak_mem_mb": peaks,
            "samples_per_s": runlog.median_throughput(rows),
            "comm_wire_bytes_per_step": window.per_step(),
            "skipped_steps": int(engine.skipped_steps), "config": cfg,
        }
        runlog.write_summary(os.path.join(save_dir, "summary.json"), summary)
        log(f"{lib.name}: {step} steps, final loss {summary['final_loss']:.4f}, test loss {test_loss:.4f}, "
            f"{summary['samples_per_s'] or 0:.1f} samples/s; wrote metrics.csv, summary.json, samples.png to {save_dir}")


def main(argv=None, lib: Library = MINIZERO, parser: argparse.ArgumentParser | None = None) -> None:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        comm.init_distributed()
        train(args, lib)
    except USER_ERRORS + lib.user_errors as e:
        # Bad input is one line, not a traceback. Config/data errors happen on every rank
        # alike, so rank 0 speaks for all of them.
        if comm.get_rank() == 0:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        comm.destroy()


if __name__ == "__main__":
    main()
