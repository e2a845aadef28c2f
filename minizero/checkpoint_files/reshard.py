"""`python -m minizero.reshard SRC DST --world-size M [--stage T] [--tag TAG]`

Rewrite a checkpoint for M ranks at ZeRO stage T (default: the stage it was saved at),
offline: one process, no process group, no model. DST gets a complete minizero checkpoint
folder (the tag and `latest`) that M ranks resume as if they had saved it.

`engine.load_checkpoint` does the same at load time (each rank builds its own shards), so
this is only needed to convert once, or to look at the result; both run the same code,
checkpoint_state.rank_state. A bad folder or argument is one line on stderr, exit code 2.

The new layout is the one the stage builds (the stage's own `plan`, Zero0.plan or Zero3.plan
functions), laid out on a stand-in of the model rebuilt from the parameter names on the
meta device: each dotted name a module path, a numbered child a ModuleList entry (a
ZeRO-3 unit). For a model built that way (the GPT here) the folder resumes by the plain
path, file for file; for any other model the load reshards it once more, still exactly.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

from . import durable
from .checkpoint_folder import (MODEL_FILE, CheckpointError, CommandParser, command_error, offline_tmp, optim_file,
                                publish, rng_file, tag_folder)
from .checkpoint_io import open_checkpoint, rank_span, read_every_file
from .checkpoint_state import adam_state_dict, fill_missing_hparams, rank_state
from ..config import ZeroConfig
from ..partition import padded_numel
from ..version import __version__

PROG = "python -m minizero.reshard"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def stand_in_model(names, shapes) -> nn.Module:
    """A module tree on the meta device with these parameters, registered in this order, so
    its named_parameters() is `names`: what the stages' plan functions need, without memory."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        m = root
        for i, part in enumerate(path):
            if part not in m._modules:
                following = path[i + 1] if i + 1 < len(path) else leaf
                m.add_module(part, nn.ModuleList() if following.isdigit() else nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(torch.empty(shapes[name], device="meta")))
    return root


def target_layout(source, stage: int) -> list[dict]:
    """The FlatParams stage `stage` builds for the source's model and param groups (with the
    saved config's reduce_bucket_size and stage3_param_persistence_threshold): per FlatParam
    {"label", "names", "shapes", "group", "persistent"}, in buffer order."""
    from ..engine import STAGES
    model = stand_in_model(source.names, source.shapes)
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in g["names"]]} for g in source.groups]
    zero_keys = ("reduce_bucket_size", "stage3_param_persistence_threshold", "param_persistence_threshold")
    saved_zero = ((source.config or {}).get("zero_optimization") or {})
    zero = ZeroConfig.parse({k: v for k, v in saved_zero.items() if k in zero_keys}
                            if isinstance(saved_zero, dict) else {}, "zero_optimization")
    plans = STAGES[stage].plan(model, groups, zero)
    return [{"label": p.label, "names": list(p.names), "shapes": [tuple(source.shapes[n]) for n in p.names],
             "group": p.group, "persistent": p.persistent} for p in plans]


def reshard(src_dir: str, dst_dir: str, world_size: int, stage: int | None = None, tag: str | None = None):
    """Write the checkpoint `tag` of src_dir (default: `latest`) into dst_dir for
    `world_size` ranks at `stage`; returns (the source read, the tag folder written)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"--world-size must be a whole number >= 1, got {world_size}")
    if stage is not None and stage not in (0, 1, 2, 3):
        raise CheckpointError(f"--stage must be 0, 1, 2 or 3, got {stage}")
    tag, folder = tag_folder(src_dir, tag)
    if os.path.realpath(dst_dir) == os.path.realpath(src_dir):
        raise CheckpointError(f"{dst_dir} is the folder being read: write the resharded checkpoint to another one")
    if os.path.exists(os.path.join(dst_dir, tag)):
        raise CheckpointError(f"{os.path.join(dst_dir, tag)} already exists: pick another DST, or remove it")
    source = open_checkpoint(folder)
    read_every_file(source)   # a refused or damaged file is said before DST exists
    if hasattr(source, "require_optimizer_state"):   # a model-only DCP folder cannot continue training
        source.require_optimizer_state()
    stage = source.zero_stage if stage is None else stage
    layout = target_layout(source, stage)
    shards = world_size if stage > 0 else 1          # stage 0: one optimizer file, the whole buffers
    for f in layout:
        numel = sum(int(torch.Size(s).numel()) for s in f["shapes"])
        f.update(numel=numel, padded_numel=padded_numel(numel, shards))

    with offline_tmp(dst_dir, tag) as tmp:
        _write(source, layout, tmp, world_size, stage, shards)
    publish(dst_dir, tag, save_latest=True)
    return source, os.path.join(dst_dir, tag)


def _write(source, layout: list[dict], tmp: str, world_size: int, stage: int, shards: int) -> None:
    """Every rank's files into the tag's .tmp folder, rank by rank (one rank's shards in memory)."""
    lp = TORCH_DTYPES[source.dtype]
    defaults = [_adam_defaults(source.config, source.world_size)] * len(source.groups)
    for r in range(shards):
        st = rank_state(source, layout, shards, r)
        if st["optimizer"] is None:   # no Adam state saved: Adam's as at init (zeros, step 0)
            st["optimizer"] = adam_state_dict(source, layout, [{k: torch.zeros_like(m) for k in ("exp_avg", "exp_avg_sq")}
                                                               for m in st["masters"]])
        fill_missing_hparams(st["optimizer"], defaults)
        durable.save({"rank": r, "masters": st["masters"], "shards": [m.to(lp) for m in st["masters"]],
                      "optimizer": st["optimizer"], "partition_count": shards}, os.path.join(tmp, optim_file(r)))
    for r in range(world_size):   # a rank the saving run did not have gets no RNG state ({}): it keeps its own
        durable.save(source.rng_state(r) or {}, os.path.join(tmp, rng_file(r)))
    config = dict(source.config or {})
    config["zero_optimization"] = dict(config.get("zero_optimization") or {}, stage=stage)
    durable.save({
        "minizero_version": __version__, "stage": stage, "world_size": world_size,
        "dtype": str(lp), "layout": [{k: f[k] for k in ("label", "names", "shapes", "numel", "padded_numel",
                                                         "persistent", "group")} for f in layout],
        "param_names": list(source.names), **source.counters,
        "lr_scheduler": source.lr_scheduler, "loss_scaler": source.loss_scaler,
        "client_state": source.client_state, "config": config,
        "resharded_from": {"library": source.library, "world_size": source.world_size, "stage": source.zero_stage},
    }, os.path.join(tmp, MODEL_FILE))


def _adam_defaults(config: dict | None, world_size: int) -> dict:
    """The param-group keys of the Adam the saved config builds (adam.build_optimizer),
    for a source that does not carry them all; AdamW's when the config cannot say."""
    from ..config import load_config
    from ..adam import build_optimizer
    dummy = [{"params": [nn.Parameter(torch.zeros(1))]}]
    try:
        opt_cfg = load_config(dict(config or {}), world_size=world_size).optimizer
    except Exception:   # another library's config: keys minizero does not know
        opt_cfg = None
    opt = build_optimizer(dummy, opt_cfg) if opt_cfg is not None else torch.optim.AdamW(dummy)
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def describe_move(source, world_size: int, stage: int | None) -> str:
    """What the conversion did, and what it could not carry (said once, here)."""
    n, m = source.world_size, world_size
    stage = source.zero_stage if stage is None else stage
    said = (f"{n} rank{'s' if n != 1 else ''} at ZeRO stage {source.zero_stage} -> {m} rank{'s' if m != 1 else ''} at "
            f"stage {stage}; fp32 masters, Adam's moments and step, lr schedule, loss scale and counters carried over")
    if source.rng_state(0) is None:
        said += "; no RNG state was saved"
    elif m > n:
        said += f"; {rank_span(n, m - 1)} get no RNG state (dropout) and keep their own when resumed"
    elif m < n:
        said += f"; the RNG states of {rank_span(m, n - 1)} are dropped"
    return said


def main(argv=None) -> int:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[1])
    ap.add_argument("src", help="checkpoint folder (with 'latest' and <tag>/ sub-folders)")
    ap.add_argument("dst", help="folder to write the resharded checkpoint into")
    ap.add_argument("--world-size", type=int, required=True, help="ranks that will resume it")
    ap.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default: the saved one)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = ap.parse_args(argv)
    try:
        source, out = reshard(args.src, args.dst, args.world_size, args.stage, args.tag)
    except Exception as e:
        return command_error(PROG, e, args.src, args.dst)
    print(f"wrote {out}: {describe_move(source, args.world_size, args.stage)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
