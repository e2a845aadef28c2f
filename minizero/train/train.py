"""Train minGPT's image GPT with minizero: the whole run in one readable loop.

    python -m minizero.train                                  # CPU, offline: synthetic 8x8 images, "tiny" GPT
    python -m minizero.train --max-steps 30
    torchrun --nproc-per-node 2 -m minizero.train --stage 3   # ZeRO-3 on 2 ranks
    python -m minizero.train --config launch/ds_config_basic.json --dtype bf16 --stage 2

The same script, with the same flags and output files, runs under real DeepSpeed as
reference/train.py (it imports this module's parser and loop, and swaps the engine).
Read train_loop first: one optimizer step in a dozen lines, like nanoGPT's; the rest is
named helpers. What comes before the first step is in minizero/train/runsetup.py, the command
line and the config dict in minizero/train/train_args.py, the non-finite-loss guard in
minizero/train/divergence.py, the progress bar and the run's clock in minizero/train/progress.py,
and what both scripts share (test loss, sampling, metrics and summary files) in
minizero/train/runlog.py.

A run writes into --save-dir (default runs/minizero-<stage>-<dtype>), on rank 0:

    metrics.csv   one row per logged step (every `steps_per_print` steps):
                  step, epoch, loss, lr, loss_scale, samples_per_s, tokens_per_s,
                  mem_mb, peak_mem_mb, elapsed_s
    summary.json  library, stage, dtype, world_size, model, params, steps, losses (rank-
                  averaged loss of every optimizer step), final_loss, test_loss,
                  model_state_bytes (per rank), peak_mem_mb (per rank), samples_per_s
                  (median over logged intervals after the first), comm_wire_bytes_per_step
                  (per op, steady-state training steps only), comm_inter_node_bytes_per_step
                  (per rank, per op: the part of those bytes the rank sent to another node),
                  ranks_per_node, skipped_steps,
                  memory_moments (per rank: the model states held at the end of the last
                  step's backward and after that step, runlog.MemoryMoments), config
    comms_summary.json / .txt   with a comms_logger section (--comms-logger): DeepSpeed's
                  log_summary numbers and table (library.py: Library.comms_summary)
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
import os
import sys
import time

import torch

from minizero import comm
from minizero.observe import desync, trace
from minizero.train import rundir, runlog, train_args
from minizero.train.divergence import NonFiniteGuard, TrainingDiverged, diverged_message, what_diverged
# What differs between minizero and DeepSpeed in this script: library.py.
from minizero.train.library import MINIZERO, USER_ERRORS, Library
from minizero.train.progress import Progress
# Before the first step (config, save folder, data, model, engine, schedule, resume): runsetup.py.
from minizero.train.runsetup import Run, setup
# The command line (flags, checks, CPU/GPU defaults) and the config dict: train_args.py.
from minizero.train.train_args import UserError, build_parser, check_args


# ----------------------------------------------------------------------------- the run

def train(args, lib: Library) -> None:
    """Set up, run the loop, and write the results however it ends (runlog.finish)."""
    if args.trace is not None and lib.name != "minizero":
        raise UserError("--trace records minizero's own timeline; DeepSpeed has none (--comms-logger gives "
                        "its per-op latency table)")
    run = setup(args, lib)
    run.moments = runlog.MemoryMoments(lib.held_bytes, step=run.max_steps, peaks=lib.peaks)   # the last step's
    aim_trace(run)
    guard = NonFiniteGuard(args.max_nonfinite_steps, enabled=run.dtype != "fp16")
    status = "failed"
    try:
        train_loop(run, guard)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        what = what_diverged(e, guard, step=run.state["step"] + 1)
        if what is None:
            raise
        status = "diverged"
        raise TrainingDiverged(diverged_message(what, run.cfg, run.dtype, run.save_dir)) from None
    finally:
        try:
            finish_observers(run, status)
            runlog.finish(run, status)
        finally:
            if run.lock is not None:
                run.lock.release()


def aim_trace(run: Run) -> None:
    """--trace without --trace-steps means the second step *of this run* (the first after
    warm-up), also after --resume; say where the timeline will go."""
    tracer = trace.tracer_of(run.engine)
    if tracer is None or run.args.trace is None:
        return
    first = run.state["step"] + 1
    if run.args.trace_default:
        tracer.steps = [first + 1 if run.max_steps > first else first]
    if max(tracer.steps) < first:
        raise UserError(f"--trace-steps {' '.join(map(str, tracer.steps))}: this run resumes at step {first}; "
                        f"choose steps from {first} to {run.max_steps}")
    from ..observe.timeline import has_matplotlib
    files = ("timeline.png, " if has_matplotlib() else "") + "replay.html, trace.json, rank<r>.json"
    runlog.log0(f"minizero: tracing step{'s' * (len(tracer.steps) > 1)} {' '.join(map(str, tracer.steps))} "
                f"into {run.args.trace} ({files})")


def finish_observers(run: Run, status: str) -> None:
    """However the run ended: close the trace (a run that stopped before its traced steps
    writes what it has and says so); a completed traced run prints its collectives table.
    (The comms logger's table: Library.comms_summary.)"""
    tracer = trace.tracer_of(run.engine)
    if tracer is not None and not tracer.closed:
        missed = [s for s in tracer.steps if s not in tracer.traced_steps]
        tracer.close(failed=status != "completed")
        if missed:
            runlog.log0(f"minizero: trace: step{'s' * (len(missed) > 1)} {' '.join(map(str, missed))} never ran")
    if tracer is not None and run.args.trace is not None and comm.get_rank() == 0 and status == "completed":
        print_ledger_table(run.args.trace)


def print_ledger_table(folder: str) -> None:
    """Rank 0, once the trace is written: each traced step's collectives, by op and label,
    with payload and wire bytes (observe/ledger_table.py), where the lesson's numbers come from."""
    from minizero.observe import ledger_table
    try:
        ledger_table.print_table(folder)
    except (OSError, ValueError, KeyError) as e:   # the trace's files are its own; a table is only a view of them
        runlog.log0(f"minizero: trace: no collectives table ({e})")


def train_loop(run: Run, guard: NonFiniteGuard) -> None:
    """nanoGPT's loop: each optimizer step is a forward and backward per micro-batch (the
    engine steps the optimizer after the last), then what the step is due for (bookkeeping)."""
    engine, device = run.engine, comm.get_device()
    engine.train()
    with Progress(run) as progress:
        for step, epoch, i, micro_batches in optimizer_steps(run):
            run.window.open()                                    # count this step's collectives
            progress.step_begins()
            loss_sum = 0.0
            for micro, (x, y) in enumerate(micro_batches):       # gradient accumulation
                _, loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                engine.backward(loss)
                if micro == run.gas - 1:
                    run.moments.take("after_backward", engine, step)   # the step's gradients are all here
                skipped_before = engine.skipped_steps
                engine.step()                                    # the optimizer steps at the accumulation boundary
                loss_sum = loss_sum + loss.detach().double()     # stays on the device: no host sync per micro-batch
            run.window.close()
            run.moments.take("after_step", engine, step)
            bookkeeping(run, guard, progress, step, epoch, i, loss_sum / run.gas,
                        stepped=engine.skipped_steps == skipped_before)


def optimizer_steps(run: Run):
    """(step, epoch, i, micro_batches) for each optimizer step left: the step's number, its
    gradient_accumulation_steps (x, y) micro-batches, and i, the index of its last one in the
    epoch. Starts where run.state says (resume).

    An epoch is a whole number of optimizer steps (the last < gas micro-batches are dropped)."""
    step, start_epoch, start_batch = run.state["step"], run.state["epoch"], run.state["batch_in_epoch"]
    per_epoch = run.steps_per_epoch * run.gas
    for epoch in range(start_epoch, run.n_epochs):
        if step >= run.max_steps:
            return
        run.loader.sampler.set_epoch(epoch)        # the DistributedSampler's order is a function of (seed, epoch)
        first = start_batch if epoch == start_epoch else 0
        batches = itertools.islice(run.loader, first, per_epoch)
        for i in range(first + run.gas - 1, per_epoch, run.gas):
            step += 1
            yield step, epoch, i, itertools.islice(batches, run.gas)
            if step >= run.max_steps:
                return


def bookkeeping(run: Run, guard: NonFiniteGuard, progress: Progress, step: int, epoch: int, i: int,
                local_loss: torch.Tensor, stepped: bool) -> None:
    """A finished optimizer step: LR schedule, then what this step is due for: metrics, the
    non-finite guard, test loss, samples, checkpoint.

    The step's loss stays on the device in `run.pending` until a step that needs it on the
    host (a logged, evaluated, sampled or saved step, or the last): then the losses of all
    pending steps cross ranks and reach the host together, one sync instead of one per step.
    """
    engine, args = run.engine, run.args
    run.state["step"] = step
    lr, scale = engine.get_lr()[0], run.lib.loss_scale(engine)   # the lr this step used
    if run.sched is not None and stepped:
        run.sched.step(tokens=run.batch * run.block_size)          # minGPT: the lr of the next step
    run.pending.append((step, local_loss, engine.get_global_grad_norm()))
    progress.bar.update(1)
    end_of_epoch = i + 1 == run.steps_per_epoch * run.gas
    log = step % run.log_every == 0 or step == run.max_steps
    evaluate = (args.eval_every and step % args.eval_every == 0) or end_of_epoch or step == run.max_steps
    sample = args.sample_every and step % args.sample_every == 0
    save = (args.save_every and step % args.save_every == 0) or step == run.max_steps
    if not (log or evaluate or sample or save):
        progress.step_ends()
        return
    bad = flush_losses(run, guard)   # raises TrainingDiverged at the guard's patience
    progress.step_ends()             # after the sync: the device's work is counted too
    progress.bar.set_postfix(loss=f"{run.state['losses'][-1]:.4f}", lr=f"{lr:.1e}", scale=f"{scale:g}",
                             refresh=False)
    if log:
        log_metrics(run, progress, step, epoch, lr, scale)
    if bad:   # no evaluation, samples or checkpoint of a step whose numbers are inf/NaN
        progress.say(guard.bad_step_line(step))
        return
    if evaluate:
        log_test_loss(run, progress, step, epoch, end_of_epoch)
    if sample:
        runlog.write_samples(engine, run.probs, args, run.codebook, comm.get_device(),
                             os.path.join(run.save_dir, f"samples-step{step}.png"))
    if save:
        save_checkpoint(run, progress, step, position=(epoch + 1, 0) if end_of_epoch else (epoch, i + 1))


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


def log_metrics(run: Run, progress: Progress, step: int, epoch: int, lr: float, scale: float) -> None:
    """One metrics row: printed, and metrics.csv rewritten (on disk at every logged step, so
    a crash loses at most the last interval)."""
    mem, peak = runlog.memory_mb(comm.get_device())
    sps = progress.interval_steps * run.batch / progress.interval_s
    row = dict(step=step, epoch=epoch, loss=run.state["losses"][-1], lr=lr, loss_scale=scale, samples_per_s=sps,
               tokens_per_s=sps * run.block_size, mem_mb=mem, peak_mem_mb=peak, elapsed_s=progress.elapsed_s())
    run.state["rows"].append(row)
    progress.say(runlog.metrics_line(row))
    if comm.get_rank() == 0:
        runlog.write_metrics_csv(os.path.join(run.save_dir, "metrics.csv"), run.state["rows"])
    progress.new_interval()


def log_test_loss(run: Run, progress: Progress, step: int, epoch: int, end_of_epoch: bool) -> None:
    """The test loss (collective), kept for summary.json, and its line."""
    run.state["test_loss"], run.state["eval_step"] = runlog.evaluate(run.engine, run.test_loader,
                                                                     comm.get_device()), step
    progress.say(f"step={step:>4d} test_loss={run.state['test_loss']:.4f} (epoch {epoch}"
                 f"{', end' if end_of_epoch else ''})")


def save_checkpoint(run: Run, progress: Progress, step: int, position: tuple[int, int]) -> None:
    """Collective: every rank writes its shard (ZeRO) or rank 0 the whole (stage 0). The
    trainer's state rides along for resume: data position (epoch, micro-batches consumed in
    it), losses, the clock, the lr schedule and the RNG (dropout)."""
    run.state.update(step=step, epoch=position[0], batch_in_epoch=position[1], elapsed_s=progress.elapsed_s(),
                     lr_schedule=run.sched.state_dict() if run.sched is not None else None,
                     rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
    run.engine.save_checkpoint(run.save_dir, client_state={"train_state": run.state})


# ----------------------------------------------------------------------------- main

def _let_rank0_speak() -> None:
    """A silent rank failing with rank 0: wait a moment before exiting. torchrun (and
    DeepSpeed's launcher) kill every rank as soon as one exits non-zero, which could stop
    rank 0 before it has printed the one line that says what went wrong
    (train_args.SILENT_RANK_PAUSE_S)."""
    if comm.get_rank() != 0:
        time.sleep(train_args.SILENT_RANK_PAUSE_S)


def deterministic_from_env() -> None:
    """MINIZERO_DETERMINISTIC=1 (launch/gpu_check.py sets it): deterministic CUDA kernels, so a
    resumed run is bit-exact on a GPU too (embedding and SDPA backward are not, by default).
    cuBLAS is deterministic only with a fixed workspace, and torch's deterministic mode raises
    at the first matrix multiply without one: set it here unless the user chose one (cuBLAS
    reads it when its first handle is made, at that first multiply, after this)."""
    if os.environ.get("MINIZERO_DETERMINISTIC") != "1":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)   # an op with no deterministic kernel raises
    torch.backends.cudnn.benchmark = False                      # no algorithm chosen by timing
    runlog.log0("minizero: deterministic algorithms on (MINIZERO_DETERMINISTIC=1, "
                f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']})")


def report_error(prog: str, message: str) -> None:
    """Rank 0's one line for a run that stops on bad input, on stderr; under torchrun also in
    the error file torchrun reads. torchrun answers any rank's non-zero exit with ~35 lines
    of its own (a ChildFailedError traceback and a table), and no exit status avoids them;
    with the file, the table's "Root Cause" repeats this line instead of a link, so the end
    of the output says what went wrong too (README, "When a run stops")."""
    line = f"{prog}: error: {message}"
    print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json
        with contextlib.suppress(OSError), open(error_file, "w") as f:
            # torch.distributed.elastic's own format (ErrorHandler.record_exception)
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


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
        deterministic_from_env()
        train(args, lib)
    except USER_ERRORS + lib.user_errors + (TrainingDiverged, rundir.RunDirError, comm.LaunchError) as e:
        # Bad input is one line, not a traceback. Config/data errors happen on every rank
        # alike, and the trainer's own checks agree across ranks, so rank 0 speaks for all.
        if comm.get_rank() == 0:
            report_error(parser.prog, str(e))
        else:
            _let_rank0_speak()
        raise SystemExit(1) from None
    except desync.CollectiveError as e:
        # Ranks out of step (docs/debugging.md). A CollectiveMismatch is the same line on every
        # rank, so rank 0 speaks for all; a timeout is this rank's own (it names the rank).
        if comm.get_rank() == 0 or not isinstance(e, desync.CollectiveMismatch):
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        else:
            _let_rank0_speak()
        raise SystemExit(1) from None
    finally:
        rundir.release_all()   # a run refused during setup: its lock, and the folder if it made it
        comm.destroy()


if __name__ == "__main__":
    main()
