"""The preflight's command line: every flag of `python -m minizero.train` (so the job's line
works with only the program's name changed), and the preflight's own; and what they imply
for the checks: the dataset, the save folder, the node-group sizes, a checkpoint's bytes.

Torch-free at import, as train_args is: a mistyped flag is answered at once.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from minizero.train import train_args

PROG = "python -m minizero.preflight"
DEFAULT_TIMEOUT_S = 60
# Where a shared file system may still hide a file another node just wrote: a rank re-reads
# the folder for this long (NFS's attribute cache lasts up to a minute: checkpoint_files/shared_folder.py).
DEFAULT_FS_WAIT_S = 30
CIFAR_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
               "batches.meta")
CIFAR_TRAIN_IMAGES = 50_000
FILE_BYTES = 16 * 1024   # a checkpoint file's bytes beyond its tensors' (checkpoint_bytes)


def build_parser():
    p = train_args.build_parser(prog=PROG, description="Check a cluster job's launch before the job: its ranks, "
                                "hosts, collectives, bandwidth, save folder, data and disk, one line each "
                                "(docs/operations.md). Takes every flag of python -m minizero.train.")
    g = p.add_argument_group("preflight")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="how long any one wait may take (the other ranks joining, a backend connecting, a "
                        "collective) before the preflight ends in one line naming it (default %(default)s)")
    g.add_argument("--hpz", type=int, metavar="K", help="check hpZ's zero_hpz_partition_size K against the hosts "
                                                        "(default: the config's)")
    g.add_argument("--hsdp", type=int, metavar="S", help="check HSDP's hsdp_shard_size S against the hosts "
                                                         "(default: the config's)")
    g.add_argument("--fs-wait", type=float, default=DEFAULT_FS_WAIT_S, metavar="S",
                   help="how long a node re-reads a shared folder for a file another node wrote there "
                        "(default %(default)s)")
    g.add_argument("--message-mib", type=float, metavar="MIB",
                   help="the bandwidth test's message (default: 64 on GPUs, 4 on CPUs)")
    return p


def parse(argv=None):
    """The arguments, checked as minizero.train checks them (precheck: before torch)."""
    parser = build_parser()
    train_args.precheck(parser, argv)
    args = parser.parse_args(argv)
    for name in ("timeout", "fs_wait"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("hpz", "hsdp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.hpz and args.hsdp:
        parser.error("--hpz and --hsdp are two answers to one question (what a node group shards); give one")
    return parser, args


@dataclass
class Plan:
    """What the job will do, as far as the checks need it."""
    world: int
    stage: int
    dtype: str
    node_group: tuple | None    # (key, size): hpZ's or HSDP's node groups; None: plain
    config_error: str | None    # the config's one line, when minizero would refuse it
    dataset: str
    data_dir: str
    save_dir: str
    resume: str | None
    model: str
    params: int
    checkpoint_bytes: int       # one checkpoint folder, every rank's files
    checkpoints: int            # how many the run writes (--save-every, and the last step)


def plan(parser, args, world: int) -> Plan:
    """The job's plan from its command line (torch imported: the device's defaults)."""
    from minizero.config import ConfigError, load_config
    train_args.fill_defaults(parser, args)
    config_error = None
    try:
        cfg = train_args.build_config(args, world)
    except train_args.UserError as e:
        cfg, config_error = dict(train_args.DEFAULT_CONFIG), str(e)
    stage, dtype = train_args.stage_of(cfg), train_args.dtype_of(cfg)
    zero = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    parsed = None
    if config_error is None:
        try:
            parsed = load_config(cfg, world)
        except ConfigError as e:
            config_error = str(e)
    node_group = None
    if args.hpz or args.hsdp:
        node_group = ("zero_hpz_partition_size", args.hpz) if args.hpz else ("hsdp_shard_size", args.hsdp)
    elif stage == 3:
        hsdp = int(zero.get("hsdp_shard_size") or zero.get("mics_shard_size") or 0)
        hpz = int(zero.get("zero_hpz_partition_size") or 1)
        node_group = ("hsdp_shard_size", hsdp) if hsdp else ("zero_hpz_partition_size", hpz) if hpz > 1 else None
    save_dir = args.save_dir or args.resume or os.path.join("runs", f"minizero-{stage}-{dtype}")
    params, ckpt = checkpoint_bytes(args, parsed, world, stage, dtype, node_group)
    return Plan(world, stage, dtype, node_group, config_error, args.dataset, args.data_dir, save_dir, args.resume,
                args.model, params, ckpt, checkpoint_count(args, cfg, world))


def checkpoint_bytes(args, parsed, world: int, stage: int, dtype: str, node_group) -> tuple[int, int]:
    """(Ψ, the bytes of one checkpoint folder) for this model, world and config, from the
    stages' own layout plans (observe/memory_table's `layout`, the code that builds the real
    FlatParams) on a model with no storage (the meta device): the fp32 masters and Adam's two
    moments (12 bytes per element) and the low-precision shards (2, or 4 in fp32) of every
    partition, each FlatParam padded to the partition count; partitions are the ranks (stage
    0: one; HSDP: its S). Each file adds some kilobytes (the model file, each rank's RNG state,
    torch.save's framing): FILE_BYTES per file, an upper bound (tests/tools/test_preflight.py
    holds the sum to a checkpoint the trainer writes)."""
    import torch

    from minizero.engine import param_groups_of
    from minizero.gpt.model import GPT
    from minizero.observe.memory_table import layout
    from minizero.partition import padded_numel
    with torch.device("meta"):
        model = GPT(train_args.model_config(args))
    groups = param_groups_of(model, model.configure_param_groups(0.1))
    zero = parsed.zero if parsed is not None else None
    bucket = int(zero.reduce_bucket_size) if zero is not None else 500_000_000
    threshold = int(zero.stage3_param_persistence_threshold) if zero is not None else 0
    plans = layout(model, groups, stage, bucket, threshold)
    parts = 1 if stage == 0 else node_group[1] if node_group and node_group[0] == "hsdp_shard_size" else world
    low = 4 if dtype == "fp32" else 2
    padded = sum(padded_numel(p.numel, parts) for p in plans)
    files = 1 + world + parts   # the model file, every rank's RNG, every partition's optimizer file
    return sum(p.numel for p in plans), padded * (12 + low) + files * FILE_BYTES


def checkpoint_count(args, cfg: dict, world: int) -> int:
    """How many checkpoints the run writes: one every --save-every steps and one at the end
    (train.py's bookkeeping), every one kept."""
    steps = args.max_steps
    if steps is None:
        images = args.synthetic_train if args.dataset == "synthetic" else CIFAR_TRAIN_IMAGES
        micro = cfg.get("train_micro_batch_size_per_gpu") or 1
        accum = cfg.get("gradient_accumulation_steps") or 1
        steps = (args.epochs or 1) * max(images // (micro * world) // accum, 1)
    if not args.save_every:
        return 1
    return steps // args.save_every + (1 if steps % args.save_every else 0)


def human(nbytes: float) -> str:
    """Decimal units, as disks are sold and `df -H` prints them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def rate(nbytes: float, seconds: float) -> str:
    if seconds <= 0 or not math.isfinite(seconds):
        return "-"
    return human(nbytes / seconds) + "/s"
