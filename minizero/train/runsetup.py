"""Everything a training run needs before its first step, built once: config, save folder,
data, model, engine, LR schedule, and the trainer's state, restored from a checkpoint when
resuming. train.py's loop reads it all from one Run.
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
from dataclasses import dataclass, field

import torch

from minizero import comm
from minizero.train import rundir, runlog
from minizero.gpt.data import build_datasets, make_loader
from minizero.train.schedule import MinGPTSchedule
from minizero.gpt.model import GPT
from minizero.train.train_args import UserError, build_config, dtype_of, find_checkpoint, model_config, stage_of

# minGPT play_image warms up for 1 epoch out of 20: 5% of the run's tokens.
WARMUP_FRACTION = 0.05


@dataclass
class Run:
    """Everything the loop and the finish need; built by setup()."""
    args: argparse.Namespace
    lib: object                     # train.Library: what differs between minizero and DeepSpeed
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
    moments: object = None          # runlog.MemoryMoments: model states at the last step's two moments


def setup(args, lib) -> Run:
    """Config, save folder, data, model, engine, LR schedule; resume if asked."""
    log = runlog.log0
    world = comm.get_world_size()
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
    # Resuming continues in the folder it resumes from, unless told otherwise, or unless
    # that folder is the other library's (foreign_resume).
    save_dir = args.save_dir or args.resume or os.path.join("runs", f"{lib.name}-{stage}-{dtype}")
    resume_tag = None
    if args.resume:
        resume_tag, save_dir = on_rank0(lambda: resume_plan(args, lib.name, save_dir))
    lock = rundir.claim_for_all_ranks(save_dir, args.resume, resume_tag,   # rank 0 holds the lock
                                      overwrite=getattr(args, "overwrite", False))
    log(f"{lib.name}: world size {world} on {device}; config {args.config or '(built-in default)'} "
        f"-> stage {stage}, {dtype}; writing to {save_dir}")
    if args.chosen:
        log(f"{lib.name}: defaults chosen: {' '.join(args.chosen)}")

    # data (collective: the codebook is computed on rank 0 and broadcast)
    train_ds, test_ds, codebook = build_datasets(
        args.dataset, root=args.data_dir, image_size=args.image_size, ncluster=args.ncluster,
        seed=args.seed, n_synthetic_train=args.synthetic_train, n_synthetic_test=args.synthetic_test)
    model_cfg = model_config(args)   # the --model preset, sized by --image-size, --ncluster, --n-embd, --n-head
    block_size = model_cfg.block_size
    if args.model_note:
        log(f"{lib.name}: {args.model_note}")

    torch.manual_seed(args.seed)   # the same initial weights on every rank (and in both libraries)
    model = GPT(model_cfg)
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


def on_rank0(fn):
    """fn() on rank 0 alone, its result (or the exception it raised) on every rank. For the
    decisions a resume makes from the checkpoint folder: on a shared file system another
    node's view may lag (checkpoint_files/shared_folder.py), and ranks that decided apart
    could load different tags, or some none; engine.load_checkpoint then waits until every
    rank sees the folder rank 0 chose."""
    outcome = None
    if comm.get_rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as e:   # a UserError, a refused file: every rank raises it alike
            try:
                pickle.dumps(e)
                outcome = (False, e)
            except Exception:    # an exception that cannot travel: its words do
                outcome = (False, RuntimeError(f"{type(e).__name__}: {e}"))
    ok, value = comm.broadcast_object(outcome)
    if not ok:
        raise value
    return value


def resume_plan(args, library: str, save_dir: str) -> tuple[str, str]:
    """(the tag --resume loads, the folder the run saves into). find_checkpoint reads every
    tag's model-states file, through the allow-list: a planted file is refused here, before
    the save folder is made."""
    tag = find_checkpoint(args.resume, args.tag)
    return tag, foreign_resume(args, library, tag, save_dir)


# The format each library's trainer writes, the formats it reads, and the command that
# converts any checkpoint into a format (minizero/checkpoint_files/: every command reads all three).
WRITES = {"minizero": "minizero", "deepspeed": "deepspeed", "torch": "dcp"}
READS = {"minizero": ("minizero", "deepspeed", "dcp"), "deepspeed": ("deepspeed",), "torch": ("dcp",)}
CONVERT = {"deepspeed": ("python -m minizero.export_deepspeed", "-deepspeed"),
           "dcp": ("python -m minizero.export_dcp", "-dcp")}
SAID = {"minizero": "minizero", "deepspeed": "DeepSpeed", "dcp": "DCP", "torch": "PyTorch"}


def foreign_resume(args, library: str, tag: str, save_dir: str) -> str:
    """Where a run resuming another library's checkpoint saves, or one line that says what
    to run instead.

    Each library writes its own format (minizero's, DeepSpeed's, PyTorch's DCP), and a
    folder must hold one format only: once minizero had written its tag into a DeepSpeed
    folder and moved `latest`, DeepSpeed could no longer resume that folder. So:
    - a library that reads the tag's format but writes another (minizero reads all three)
      saves into `<folder>-<library>` (said at start), never into the folder it resumes;
      --save-dir picks another folder, and naming the resumed folder itself is refused;
    - a library that cannot read it (DeepSpeed reads only its own, the PyTorch reference only
      DCP): the line names the command that converts it."""
    from minizero.checkpoint_files.checkpoint_io import tag_library
    written_by = tag_library(args.resume, tag)
    own = WRITES.get(library, library)
    if written_by == own:
        return save_dir
    if written_by not in READS.get(library, (own,)):
        command, suffix = CONVERT[own]
        converted = args.resume.rstrip("/") + suffix
        raise UserError(f"--resume {args.resume}: {tag} is a {SAID[written_by]} checkpoint, which {SAID[library]} "
                        f"cannot read; convert it first: {command} {args.resume} {converted} --tag {tag}, then "
                        f"--resume {converted}")
    kept = SAID[written_by] + ("'s" if written_by != "dcp" else "")
    if args.save_dir is None:
        save_dir = args.resume.rstrip("/") + f"-{library}"
        runlog.log0(f"{library}: {args.resume} holds {kept} checkpoints; {library}'s go into {save_dir} "
                    f"(--save-dir picks another folder), so {args.resume} can still be resumed as it is")
    elif os.path.realpath(save_dir) == os.path.realpath(args.resume):
        raise UserError(f"--save-dir {save_dir}: it holds {kept} checkpoints, and {library}'s there would stop "
                        f"resuming it as it is; pass another --save-dir ({library} reads {kept}, writes its own)")
    return save_dir


def resume(run: Run, tag: str | None) -> None:
    """Load the checkpoint and the trainer's own state: data position, losses, RNG, schedule.

    The data position is (epoch, micro-batches consumed in it): the DistributedSampler's
    order is a function of (seed, epoch), so skipping that many batches continues exactly;
    at another world size or micro-batch, carry_data_position converts it."""
    args, state, sched, log = run.args, run.state, run.sched, runlog.log0
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
    moved = carry_data_position(run, path)
    log(f"{run.lib.name}: resumed from {path} at step {state['step']} (epoch {state['epoch']}, "
        f"micro-batch {state['batch_in_epoch']}){moved}")
    saved = state.get("lr_schedule")
    if sched is not None and saved:
        planned = sched.final_tokens
        sched.load_state_dict(saved)   # the schedule the run was started with, not one for the new length
        if sched.final_tokens != planned:
            tokens_per_step = run.batch * run.block_size
            end = sched.final_tokens // tokens_per_step
            log(f"{run.lib.name}: keeping the saved lr schedule (minGPT cosine ending at step {end}); --max-steps "
                f"{run.max_steps} " + (f"goes on past it at the floor lr {0.1 * sched.learning_rate:.1e}"
                                       if run.max_steps > end else "stops before its end"))


def carry_data_position(run: Run, path: str) -> str:
    """A checkpoint saved by another number of ranks (or micro-batch size): convert the data
    position and return what the resumed line should add ("" when nothing changed).

    The sampler's permutation of the dataset depends on (seed, epoch) only; N ranks that
    each took b micro-batches of m samples have used exactly its first b * m * N entries
    (rank r takes entries r, r + N, ...). So M ranks with micro-batch m' go on at micro-batch
    floor(b * m * N / (m' * M)) of the same epoch: no sample skipped, and the few beyond
    the last whole batch are seen again. Which rank sees which sample, and so the dropout
    masks, differ from a run that never stopped (engine.load_checkpoint says so). The
    number of epochs or steps asked for still holds: --epochs E ends after epoch E."""
    from minizero.checkpoint_files.checkpoint_io import saved_batch
    state, args, engine = run.state, run.args, run.engine
    # minizero's load_checkpoint returns the tag folder, DeepSpeed's the model-states file in it.
    old_world, old_micro = saved_batch(path if os.path.isdir(path) else os.path.dirname(path))
    world, micro = comm.get_world_size(), engine.train_micro_batch_size_per_gpu()
    old_micro = old_micro or micro
    if (old_world, old_micro) == (world, micro):
        return ""
    per_epoch = run.steps_per_epoch * run.gas
    used = state["batch_in_epoch"] * old_micro * old_world
    first, again = divmod(used, micro * world)
    if first + run.gas > per_epoch:      # no whole step left in this epoch
        state["epoch"], first, again = state["epoch"] + 1, 0, 0
    state["batch_in_epoch"] = first
    steps_left_in_epoch = (per_epoch - first) // run.gas
    if args.epochs:                      # the epochs asked for, at this run's steps per epoch
        run.n_epochs = args.epochs
        run.max_steps = state["step"] + steps_left_in_epoch + (args.epochs - state["epoch"] - 1) * run.steps_per_epoch
        if args.max_steps is not None:
            run.max_steps = min(run.max_steps, args.max_steps)
    more = max(0, run.max_steps - state["step"] - steps_left_in_epoch)
    run.n_epochs = max(run.n_epochs, state["epoch"] + 1 + math.ceil(more / run.steps_per_epoch))
    return (f"; saved by {old_world} rank{'s' if old_world != 1 else ''} x micro-batch {old_micro}, now {world} x "
            f"{micro}: the epoch's first {used} samples were used, going on at micro-batch {first}" +
            (f" ({again} samples seen again)" if again else "") + f", {run.max_steps} steps in all")
