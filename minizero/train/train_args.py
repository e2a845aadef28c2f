"""The command line of minizero/train/train.py (and reference/train.py, which reuses it): the
flags, their checks and CPU/GPU defaults, the DeepSpeed config dict a run uses
(--config or DEFAULT_CONFIG, plus the flags that override it), and the model's GPTConfig
(the --model preset, sized by --image-size, --ncluster, --n-embd and --n-head).

train.py reads it as: parser = build_parser(); check_args(parser, args); then, inside
the run, cfg = build_config(args, world_size) and model = GPT(model_config(args)).

Importing this module imports no torch (about 3 s): `precheck` parses and checks the command
line first, so a mistyped flag is answered at once; what needs torch (the config parser,
the checkpoint folder, CUDA's presence) is imported where it is used.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import time

from minizero.launcher_env import launcher_rank
from minizero.train import output_dir
from minizero.gpt.presets import DATASETS, PRESETS, GPTConfig, ModelConfigError, get_preset

# A first run, on a CPU or a GPU: plain data parallelism (stage 0), fp32 (DeepSpeed's own
# rule: no fp16/bf16 section means fp32; --dtype picks another), minGPT play_image's
# optimizer (lr 3e-3, betas (0.9, 0.95)) with weight decay 0.1 on the Linear weights.
# torch_adam inside optimizer.params: DeepSpeed would otherwise build its JIT FusedAdam.
DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                             "torch_adam": True}},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 0},
}

# The --help description: the first line of minizero/train.py's docstring.
DESCRIPTION = "Train minGPT's image GPT with minizero: the whole run in one readable loop."


class UserError(Exception):
    """Bad input: reported as one line, no traceback."""


# ----------------------------------------------------------------------------- command line

def build_parser(prog: str = "python -m minizero.train", description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description or DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("engine (DeepSpeed config and overrides)")
    g.add_argument("--config", metavar="JSON", default=None,
                   help="a DeepSpeed JSON config; default: a built-in one (stage 0, fp32, micro-batch 8, "
                        "AdamW lr 3e-3), on a GPU too: add --dtype bf16 or fp16 there")
    g.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="override zero_optimization.stage")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="override the fp16/bf16 sections")
    g.add_argument("--micro-batch", type=int, metavar="N", help="override train_micro_batch_size_per_gpu")
    g.add_argument("--grad-accum", type=int, metavar="N", help="override gradient_accumulation_steps")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="add an activation_checkpointing section (recompute each block in backward)")
    g.add_argument("--lr-schedule", choices=["mingpt", "config"], default=None,
                   help="mingpt: minGPT's token schedule (5%% linear warmup, cosine to 10%% of the "
                        "config's lr); config: the config's scheduler section (constant lr if none). "
                        "Default: config if the config has a scheduler, else mingpt")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=list(PRESETS), help="GPT preset (default: tiny on CPU, tutorial on GPU)")
    g.add_argument("--n-embd", type=int, metavar="N",
                   help="the preset's width, overridden (to run a large preset such as tutorial-24 on a CPU; "
                        "its n_layer is kept); must be divisible by n_head")
    g.add_argument("--n-head", type=int, metavar="N", help="the preset's number of attention heads, overridden")
    g.add_argument("--dataset", choices=list(DATASETS),
                   help="default: synthetic on CPU (works offline), cifar10 on GPU")
    g.add_argument("--data-dir", default="./data", help="where CIFAR-10 and the codebook cache live")
    g.add_argument("--image-size", type=int, choices=[8, 16, 32], help="default: 8 on CPU, 32 on GPU")
    g.add_argument("--ncluster", type=int, metavar="K",
                   help="colour codebook size = vocab (default: 512 for cifar10, the preset's vocab for synthetic)")
    g.add_argument("--synthetic-train", type=int, default=10000, metavar="N", help="synthetic training images")
    g.add_argument("--synthetic-test", type=int, default=1000, metavar="N", help="synthetic test images")
    g = p.add_argument_group("run")
    g.add_argument("--epochs", type=int, help="epochs to train (default 1 when --max-steps is not given)")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps in total")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-dir", help="default: runs/<library>-<stage>-<dtype>")
    g.add_argument("--overwrite", action="store_true",
                   help="replace --save-dir if it holds a finished run of this script and nothing else (a folder "
                        "with other files, or a run still going or killed, is refused); without it such a folder "
                        "is refused")
    g.add_argument("--save-every", type=int, default=0, metavar="STEPS", help="checkpoint every N steps; 0 = only at the end")
    g.add_argument("--resume", metavar="DIR", help="a checkpoint dir (a previous --save-dir): continue from it "
                                                  "(and save into it, unless --save-dir is given)")
    g.add_argument("--tag", metavar="TAG", help="with --resume: the checkpoint to load (e.g. global_step40) instead "
                                              "of the one 'latest' names")
    g.add_argument("--max-nonfinite-steps", type=int, default=3, metavar="N",
                   help="bf16/fp32: stop the run after N optimizer steps in a row with an inf/NaN loss or "
                        "gradient norm (fp16: the loss scaler decides)")
    g.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="test loss every N steps (it is always computed at the end of each epoch)")
    g.add_argument("--sample-every", type=int, default=0, metavar="STEPS",
                   help="also write samples-step<N>.png every N steps (samples.png is always written at the end)")
    g.add_argument("--num-samples", type=int, default=32, metavar="N",
                   help="images in a sample grid (0: draw none, no samples.png)")
    g.add_argument("--top-k", type=int, default=100, help="sample from the k most likely colours (play_image: 100)")
    g = p.add_argument_group("see the collectives")
    g.add_argument("--trace", metavar="DIR",
                   help="minizero only: write a timeline of the --trace-steps optimizer steps to DIR: rank<r>.json "
                        "per rank (Chrome trace: ui.perfetto.dev or chrome://tracing), the merged trace.json, "
                        "timeline.png and replay.html, the step replayed in a browser, memory included "
                        "(docs/replay.md)")
    g.add_argument("--trace-steps", type=int, nargs="+", metavar="N",
                   help="with --trace: the optimizer steps to record (default: step 2, the first after warm-up; "
                        "step 1 when the run has one step)")
    g.add_argument("--comms-logger", action="store_true",
                   help="add DeepSpeed's comms_logger section: time every collective and write DeepSpeed's "
                        "summary table to comms_summary.txt (numbers in comms_summary.json)")
    return p


# How long a rank that fails in silence (rank 0 prints the one line for all) waits before it
# exits: torchrun and DeepSpeed's launcher kill every rank as soon as one exits non-zero,
# which could stop rank 0 before its line is out. (The tests' forked ranks set it to 0: there
# no launcher kills anyone, every rank runs to its end: tests/support/command_runs.py.)
SILENT_RANK_PAUSE_S = 3.0


def precheck(parser: argparse.ArgumentParser, argv=None) -> None:
    """Parse and check the command line before torch is imported: a usage error or --help
    costs a fraction of a second instead of ~3 s. As in train.main: rank 0 prints, the
    other ranks exit with the same status in silence, a moment later (torchrun stops every
    rank when one exits non-zero, which could cut rank 0's line)."""
    quiet = launcher_rank() != 0
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext(), \
                contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            check_values(parser, parser.parse_args(argv))
    except SystemExit as e:
        if e.code not in (0, None) and quiet:
            time.sleep(SILENT_RANK_PAUSE_S)
        raise


def launched_ranks() -> int:
    """How many ranks the launcher started, read before torch exists: torchrun's (and
    DeepSpeed's launcher's) WORLD_SIZE, a bare srun's tasks (process_group._from_slurm), 1
    for a plain `python` run.

    On more than one rank --save-dir is not looked up on the command line: a rank that looks
    for a folder rank 0 has not created yet leaves its node's NFS client remembering "no
    such folder" (nfs(5), lookupcache=all) for up to a minute, and then misses the probe
    file rank 0 writes there (rundir.claim_for_all_ranks). Nor can rank 0 refuse it alone
    here: the other ranks would go on to wait for it in the process group's rendezvous (a
    bare srun stops no task for another's exit). So rank 0 checks it once the group is up
    (rundir.refuse_unusable), and every rank stops with its line."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    return 1


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Argument values argparse cannot check by itself; fill in the device-dependent defaults."""
    check_values(parser, args)
    fill_defaults(parser, args)


def check_values(parser: argparse.ArgumentParser, args) -> None:
    """The checks that need neither torch nor the device (precheck runs them first)."""
    for name in ("micro_batch", "grad_accum", "epochs", "max_steps", "ncluster", "synthetic_train",
                 "synthetic_test", "top_k", "max_nonfinite_steps", "n_embd", "n_head"):
        v = getattr(args, name)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("save_every", "eval_every", "sample_every", "num_samples"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0 (0 = off)")
    if args.sample_every and not args.num_samples:
        parser.error(f"--sample-every {args.sample_every} draws grids of --num-samples images: give --num-samples "
                     f">= 1, or drop --sample-every")
    if args.tag is not None and args.resume is None:
        parser.error("--tag needs --resume DIR (the folder holding that checkpoint)")
    for flag, path in (("--save-dir", args.save_dir), ("--trace", args.trace)):   # before anything is created
        if flag == "--save-dir" and launched_ranks() > 1:
            continue   # rank 0 alone looks, once the group is up (launched_ranks says why)
        if path is not None and (why := output_dir.problem(path, flag)):
            parser.error(why)
    args.trace_default = args.trace is not None and args.trace_steps is None
    if args.trace_steps is not None:
        if args.trace is None:
            parser.error("--trace-steps needs --trace DIR (where to write the timeline)")
        if min(args.trace_steps) < 1:
            parser.error(f"--trace-steps are optimizer steps, counted from 1; got {min(args.trace_steps)}")
        if args.max_steps is not None and max(args.trace_steps) > args.max_steps:
            parser.error(f"--trace-steps {max(args.trace_steps)} is after the last step (--max-steps {args.max_steps})")
    elif args.trace is not None:
        args.trace_steps = [1 if args.max_steps == 1 else 2]


def fill_defaults(parser: argparse.ArgumentParser, args) -> None:
    """The defaults that depend on the device (CPU: synthetic 8x8 images and the tiny model),
    then the model they make."""
    import torch
    cuda = torch.cuda.is_available()
    args.chosen = []   # defaults we picked, printed at start
    if args.dataset is None:
        args.dataset = "cifar10" if cuda else "synthetic"
        args.chosen.append(f"--dataset {args.dataset}")
    if args.model is None:
        args.model = "tutorial" if cuda else "tiny"
        args.chosen.append(f"--model {args.model}")
    if args.image_size is None:
        args.image_size = 32 if cuda else 8
        args.chosen.append(f"--image-size {args.image_size}")
    if args.ncluster is None:
        args.ncluster = 512 if args.dataset == "cifar10" else PRESETS[args.model].vocab_size
        args.chosen.append(f"--ncluster {args.ncluster}")
    if args.epochs is None and args.max_steps is None:
        args.epochs = 1
        args.chosen.append("--epochs 1")
    try:
        model_config(args)
    except ModelConfigError as e:
        parser.error(str(e))
    args.model_note = model_note(args)   # printed at start when the preset's size was changed


# ----------------------------------------------------------------------------- config

def read_config_file(path: str) -> dict:
    """--config's JSON object (config.read_json), its errors as UserError naming the flag."""
    from minizero.config import ConfigError, read_json
    try:
        return read_json(path, f"--config {path}")
    except ConfigError as e:
        raise UserError(str(e)) from None


def dtype_of(cfg: dict) -> str:
    if (cfg.get("fp16") or {}).get("enabled"):
        return "fp16"
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return "bf16"
    return "fp32"


def stage_of(cfg: dict) -> int:
    z = cfg.get("zero_optimization")
    if isinstance(z, bool):        # DeepSpeed's deprecated form: true = stage 1
        return int(z)
    return int((z or {}).get("stage", 0))


def build_config(args, world_size: int) -> dict:
    """The DeepSpeed config dict this run uses: --config (or DEFAULT_CONFIG) + the overrides."""
    from minizero.config import ActivationCheckpointingConfig, resolve_batch_size
    cfg = read_config_file(args.config) if args.config else copy.deepcopy(DEFAULT_CONFIG)
    if args.stage is not None:
        z = cfg.get("zero_optimization")
        z = dict(z) if isinstance(z, dict) else {}
        z["stage"] = args.stage
        cfg["zero_optimization"] = z
    if args.dtype is not None:
        cfg.pop("bfloat16", None)
        cfg["fp16"] = dict(cfg.get("fp16") or {}, enabled=args.dtype == "fp16")
        cfg["bf16"] = dict(cfg.get("bf16") or {}, enabled=args.dtype == "bf16")
    if args.micro_batch is not None or args.grad_accum is not None:
        # Resolve the three batch numbers first (as DeepSpeed would), then override and
        # write all three, so both libraries read the same, consistent triple. With both
        # flags given the file's numbers are not consulted: a config written for another
        # world size (train_batch_size 64 = 16 x 2 x 2 ranks) still runs on 8 ranks.
        if args.micro_batch is not None and args.grad_accum is not None:
            m, g = args.micro_batch, args.grad_accum
        else:
            _, m, g = resolve_batch_size(cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                                         cfg.get("gradient_accumulation_steps"), world_size)
        m = args.micro_batch or m
        g = args.grad_accum or g
        cfg.update(train_batch_size=m * g * world_size, train_micro_batch_size_per_gpu=m,
                   gradient_accumulation_steps=g)
    if args.checkpoint_activations and "activation_checkpointing" not in cfg:
        cfg["activation_checkpointing"] = ActivationCheckpointingConfig().to_dict()   # DeepSpeed's defaults
    if args.lr_schedule == "mingpt" and "scheduler" in cfg:
        cfg.pop("scheduler")   # the token schedule replaces it
    if args.trace is not None:
        cfg["minizero_trace"] = {"enabled": True, "output_path": args.trace, "steps": list(args.trace_steps)}
    if args.comms_logger:
        cfg["comms_logger"] = dict(cfg.get("comms_logger") or {}, enabled=True)
    return cfg


def find_checkpoint(path: str, tag: str | None = None) -> str:
    """The tag --resume loads: `tag`, or the one `latest` names. Refused early, with one
    line that lists the complete checkpoints there, unless it is a complete checkpoint."""
    from minizero.checkpoint_files.checkpoint_folder import complete_tags, describe_tags, read_latest
    if not os.path.isdir(path):
        raise UserError(f"--resume {path}: no such directory")
    tags = complete_tags(path)
    if tag is None:
        tag = read_latest(path)
        if tag is None:
            raise UserError(f"--resume {path}: no checkpoint found ('latest' is missing); {describe_tags(path)}")
        if tag not in tags:
            raise UserError(f"--resume {path}: 'latest' names {tag!r}, which is not a complete checkpoint; "
                            f"{describe_tags(path)}")
    elif tag not in tags:
        raise UserError(f"--resume {path} --tag {tag}: no complete checkpoint {tag!r}; {describe_tags(path)}")
    return tag


# ----------------------------------------------------------------------------- model

def _sizes(args) -> dict:
    """The GPTConfig fields the command line sets: block_size (one token per pixel, the
    last one only a target) and vocab_size (the codebook) always, n_embd / n_head when given."""
    sizes = {"block_size": args.image_size ** 2 - 1, "vocab_size": args.ncluster}
    for name in ("n_embd", "n_head"):
        if getattr(args, name, None) is not None:
            sizes[name] = getattr(args, name)
    return sizes


def model_config(args) -> GPTConfig:
    """The GPTConfig the run builds: the --model preset with _sizes(args). A width that
    the heads do not divide raises ModelConfigError naming the flags."""
    sizes = _sizes(args)
    preset = PRESETS[args.model]
    n_embd, n_head = sizes.get("n_embd", preset.n_embd), sizes.get("n_head", preset.n_head)
    if n_embd % n_head:
        given = " ".join(f"--{k.replace('_', '-')} {sizes[k]}" for k in ("n_embd", "n_head") if k in sizes)
        raise ModelConfigError(f"{given}: n_embd {n_embd} must be divisible by n_head {n_head} (--model "
                               f"{args.model} has n_embd {preset.n_embd}, n_head {preset.n_head}); pick "
                               f"--n-embd as a multiple of n_head, or pass --n-head")
    return get_preset(args.model, **sizes)


def model_note(args) -> str | None:
    """One line naming the preset and every size the command line changed in it, e.g.
    "model tutorial-24 with n_embd=32 (--n-embd), block_size=63 (--image-size 8) instead of
    the preset's n_embd=256, block_size=1023"; None when the model is the preset as it is."""
    preset, cfg = PRESETS[args.model], model_config(args)
    changed = [name for name in ("n_embd", "n_head", "block_size", "vocab_size")
               if getattr(cfg, name) != getattr(preset, name)]
    if not changed:
        return None
    how = {"n_embd": "--n-embd", "n_head": "--n-head", "block_size": f"--image-size {args.image_size}",
           "vocab_size": f"--ncluster {args.ncluster}"}
    return (f"model {args.model} with {', '.join(f'{n}={getattr(cfg, n)} ({how[n]})' for n in changed)} "
            f"instead of the preset's {', '.join(f'{n}={getattr(preset, n)}' for n in changed)}")
