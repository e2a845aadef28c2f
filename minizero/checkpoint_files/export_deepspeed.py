"""`python -m minizero.export_deepspeed SRC DST [--tag TAG] [--stage S] [--world-size N]`

Write a minizero checkpoint as a folder DeepSpeed's `engine.load_checkpoint(DST)` loads
(and its `zero_to_fp32.py` / `get_fp32_state_dict_from_zero_checkpoint` consolidates, to
the same fp32 tensors `minizero.consolidate` gives), at the saved ZeRO stage and world size
or at the ones given. SRC may be a DeepSpeed folder too: then this rewrites a DeepSpeed
checkpoint for another world size or stage, what DeepSpeed itself cannot load ("Automatic
adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported") and answers with its offline universal-checkpoint conversion. Or a PyTorch
Distributed Checkpoint (FSDP2's, torchtitan's, `python -m minizero.export_dcp`'s): then this is
FSDP2 -> DeepSpeed, optimizer state included (a DCP folder without it is refused in one line).

The training state is read parameter slice by parameter slice from the minizero checkpoint
(a CheckpointSource, checkpoint_state.py) and laid out DeepSpeed's way: the arithmetic is
deepspeed_checkpoint.py's (`zero12_partition_numel`, `zero12_tail_padding`, `zero3_partition_numel`) and
the files are those DeepSpeed writes (docs/checkpoints.md, "DeepSpeed's layout"). DeepSpeed
pickles its loss scaler class into its optimizer files and ZeRO-3 requires it on load: it is
written as that DeepSpeed class without importing deepspeed (deepspeed_checkpoint.Foreign).

Not carried: RNG states (DeepSpeed's checkpoints have none) and buffers (minizero saves
none; the GPT has none). A missing folder, a damaged file or a tag that exists already is one
line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import shutil
import sys
from collections import OrderedDict

import torch

from . import durable
from .checkpoint_folder import CheckpointError, command_error, load_file, offline_tmp, tag_folder
from .checkpoint_io import read_every_file
from .checkpoint_state import MinizeroSource, build_shard
from .dcp_source import open_source as open_dcp
from .dcp_files import is_dcp_folder
from .deepspeed_checkpoint import (DTYPES, MODEL_FILE, OPTIM_FILE, ZERO3_MODEL_FILE, foreign_object, open_source,
                                   torch_save, zero3_partition_numel, zero12_partition_numel, zero12_tail_padding)

PROG = "python -m minizero.export_deepspeed"
DS_VERSION = "0.19.8"   # the DeepSpeed whose layout this writes (docs/deepspeed.md's version)
LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"


def _ds_version() -> str:
    try:
        from importlib.metadata import version
        return version("deepspeed")
    except Exception:
        return DS_VERSION


def _step(group: dict) -> torch.Tensor:
    return torch.tensor(float(group["step"]), dtype=torch.float32)


def _loss_scaler(source):
    """DeepSpeed's LossScaler / DynamicLossScaler object (its attribute names are minizero's)."""
    ls = source.loss_scaler
    if source.dtype == "fp16" and ls is not None and "cur_iter" in ls:
        return foreign_object(LOSS_SCALER_MODULE, "DynamicLossScaler", {**ls, "dynamic": True, "dtype": torch.float16})
    cur = float(ls["cur_scale"]) if source.dtype == "fp16" and ls is not None else 1.0
    return foreign_object(LOSS_SCALER_MODULE, "LossScaler", {"cur_scale": cur, "dynamic": False})


def _groups(source) -> list[dict]:
    """The param groups DeepSpeed keeps: it drops empty ones (engine.py, _configure_optimizer)."""
    return [g for g in source.groups if g["names"]]


def _model_state(source, stage: int, world_size: int, config: dict, module, param_shapes, optimizer=None) -> dict:
    """A model-states file as DeepSpeed's _save_checkpoint writes it, client_state at the top level."""
    return {
        "module": module, "buffer_names": [], "optimizer": optimizer,
        "param_shapes": param_shapes, "frozen_param_shapes": OrderedDict() if stage >= 2 else None,
        "shared_params": {} if stage > 0 else None, "frozen_param_fragments": OrderedDict() if stage >= 2 else None,
        "lr_scheduler": source.lr_scheduler, "data_sampler": None, "random_ltd": None,
        "skipped_steps": source.counters["skipped_steps"], "global_steps": source.counters["global_steps"],
        "global_samples": source.counters["global_samples"], "dp_world_size": world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": config, "ds_version": _ds_version(), **(source.client_state or {}),
    }


def _hparams(group: dict) -> dict:
    return {k: v for k, v in group["hparams"].items() if k != "params"}


def _config(source, stage: int) -> dict:
    cfg = copy.deepcopy(source.config or {})
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    if source.dtype in ("bf16", "fp16"):
        cfg.setdefault(source.dtype, {})["enabled"] = True
    return cfg


# ----------------------------------------------------------------------------- per stage

def _stage0(source, world_size: int, config: dict) -> dict[str, dict]:
    """Stage 0: the whole optimizer in the model-states file. fp32: torch's Adam state_dict
    (the module's weights are the masters); bf16/fp16: FP16_UnfusedOptimizer's, one fp32
    master per parameter in fp32_groups."""
    lp = DTYPES[source.dtype]
    state, pgs, fp32_groups, sid = {}, [], [], 0
    for g in _groups(source):
        ids, masters = [], []
        for n in g["names"]:
            shape = source.shapes[n]
            masters.append(source.read("master", n).view(shape))
            if source.has_optimizer_state:
                state[sid] = {"step": _step(g), "exp_avg": source.read("exp_avg", n).view(shape),
                              "exp_avg_sq": source.read("exp_avg_sq", n).view(shape)}
            ids.append(sid)
            sid += 1
        pgs.append({**_hparams(g), "params": ids})
        fp32_groups.append(masters)
    torch_sd = {"state": state, "param_groups": pgs}
    by_name = {n: m for g, ms in zip(_groups(source), fp32_groups) for n, m in zip(g["names"], ms)}
    module = OrderedDict((n, by_name[n].to(lp)) for n in source.names)
    if source.dtype == "fp32":
        optimizer = torch_sd
    else:
        ls = source.loss_scaler or {"cur_scale": 1.0}
        dynamic = "cur_iter" in ls
        optimizer = {"dynamic_loss_scale": dynamic, "cur_scale": float(ls["cur_scale"]),
                     "cur_iter": int(ls.get("cur_iter", source.counters["global_steps"])),
                     "optimizer_state_dict": torch_sd, "fp32_groups": fp32_groups,
                     "clip_grad": float(config.get("gradient_clipping", 1.0))}
        if dynamic:
            optimizer.update({k: ls[k] for k in ("last_overflow_iter", "scale_factor", "scale_window")})
    return {MODEL_FILE: _model_state(source, 0, world_size, config, module, None, optimizer)}


def _zero12(source, stage: int, world_size: int, config: dict) -> dict[str, dict]:
    """ZeRO-1/2: per param group one flat buffer padded to a multiple of 2N, cut into N
    partitions; rank r's file holds partition r of the fp32 master (without its tail padding)
    and of Adam's moments (with it), in torch's Adam state_dict over one flat tensor per group."""
    lp = DTYPES[source.dtype]
    groups = _groups(source)
    files = {}
    param_shapes = [OrderedDict((n, torch.Size(source.shapes[n])) for n in g["names"]) for g in groups]
    for r in range(world_size):
        masters, state, pgs, paddings = [], {}, [], []
        for gi, g in enumerate(groups):
            shapes = [source.shapes[n] for n in g["names"]]
            total = sum(math.prod(s) for s in shapes)
            part = zero12_partition_numel(total, world_size)
            pad = zero12_tail_padding(total, world_size, r)
            args = (g["names"], shapes, r * part, (r + 1) * part)
            masters.append(build_shard(source, "master", *args)[:part - pad].clone())
            if source.has_optimizer_state:
                state[gi] = {"step": _step(g), "exp_avg": build_shard(source, "exp_avg", *args),
                             "exp_avg_sq": build_shard(source, "exp_avg_sq", *args)}
            pgs.append({**_hparams(g), "params": [gi]})
            paddings.append(pad)
        osd = {"loss_scaler": _loss_scaler(source), "dynamic_loss_scale": "cur_iter" in (source.loss_scaler or {}),
               "overflow": False, "clip_grad": float(config.get("gradient_clipping", 1.0)),
               "base_optimizer_state": {"state": state, "param_groups": pgs},
               "single_partition_of_fp32_groups": masters, "zero_stage": stage, "group_paddings": paddings,
               "param_alignment_paddings": [[0] * len(g["names"]) for g in groups],
               "partition_count": [world_size] * len(groups), "ds_version": _ds_version()}
        files[_optim_name(source, r)] = {"optimizer_state_dict": osd, "ds_config": config, "ds_version": _ds_version()}
    module = OrderedDict((n, source.read("master", n).view(source.shapes[n]).to(lp)) for n in source.names)
    files[MODEL_FILE] = _model_state(source, stage, world_size, config, module, param_shapes)
    return files


def zero3_sub_groups(numels: list[int], world_size: int, sub_group_size) -> list[list[int]]:
    """ZeRO-3 splits each param group into sub-groups of about sub_group_size partitioned
    elements (stage3.py, _create_fp16_sub_groups): indices into the group's parameters."""
    total = sum(zero3_partition_numel(n, world_size) for n in numels)
    if sub_group_size is None or sub_group_size >= total:
        return [list(range(len(numels)))]
    out, cur, size = [], [], 0
    for i, n in enumerate(numels):
        cur.append(i)
        size += zero3_partition_numel(n, world_size)
        if size >= sub_group_size or i == len(numels) - 1:
            out.append(cur)
            cur, size = [], 0
    return out


def _zero3(source, world_size: int, config: dict) -> dict[str, dict]:
    """ZeRO-3: every parameter padded to ceil(n/N) per rank; per sub-group, rank r's pieces
    laid end to end (fp32_flat_groups) and Adam's state over that flat tensor; one model-states
    file per rank with empty module tensors (the weights live in the optimizer files)."""
    lp = DTYPES[source.dtype]
    sub_group_size = int(float((config.get("zero_optimization") or {}).get("sub_group_size", 1e9)))
    subs = []   # (group index, names)
    for gi, g in enumerate(_groups(source)):
        numels = [math.prod(source.shapes[n]) for n in g["names"]]
        subs += [(gi, [g["names"][i] for i in idx]) for idx in zero3_sub_groups(numels, world_size, sub_group_size)]
    param_shapes = [OrderedDict((n, torch.Size(source.shapes[n])) for n in names) for _, names in subs]
    files = {}
    for r in range(world_size):
        flats, state = [], {}
        pgs = [{**_hparams(g), "params": []} for g in _groups(source)]
        for k, (gi, names) in enumerate(subs):
            per_kind = {}
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                if kind != "master" and not source.has_optimizer_state:
                    continue
                parts = []
                for n in names:
                    numel = math.prod(source.shapes[n])
                    c = zero3_partition_numel(numel, world_size)
                    piece = torch.zeros(c, dtype=torch.float32)
                    lo, hi = r * c, min((r + 1) * c, numel)
                    if lo < hi:
                        piece[:hi - lo] = source.read(kind, n, lo, hi)
                    parts.append(piece)
                per_kind[kind] = torch.cat(parts)
            flats.append(per_kind["master"])
            if source.has_optimizer_state:
                state[k] = {"step": _step(_groups(source)[gi]), "exp_avg": per_kind["exp_avg"],
                            "exp_avg_sq": per_kind["exp_avg_sq"]}
            pgs[gi]["params"].append(k)
        osd = {"zero_stage": 3, "loss_scaler": _loss_scaler(source),
               "dynamic_loss_scale": "cur_iter" in (source.loss_scaler or {}), "overflow": False,
               "partition_count": world_size, "optimizer_state_dict": {"state": state, "param_groups": pgs},
               "fp32_flat_groups": flats}
        files[_optim_name(source, r)] = {"optimizer_state_dict": osd, "ds_config": config, "ds_version": _ds_version()}
        module = OrderedDict((n, torch.empty(0, dtype=lp)) for n in source.names)
        files[ZERO3_MODEL_FILE.format(r=r)] = _model_state(source, 3, world_size, config, module, param_shapes)
    return files


def _optim_name(source, r: int) -> str:
    return ("bf16_" if source.dtype == "bf16" else "") + OPTIM_FILE.format(r=r)


def deepspeed_files(source, stage: int | None = None, world_size: int | None = None) -> dict[str, dict]:
    """file name -> what DeepSpeed would have saved in it, for this state at (stage, world_size)."""
    stage = source.zero_stage if stage is None else stage
    world_size = source.world_size if world_size is None else world_size
    if stage not in (0, 1, 2, 3) or world_size < 1:
        raise CheckpointError(f"stage must be 0..3 and world size >= 1, got stage {stage}, world size {world_size}")
    config = _config(source, stage)
    if stage == 0:
        return _stage0(source, world_size, config)
    if stage == 3:
        return _zero3(source, world_size, config)
    return _zero12(source, stage, world_size, config)


def _deepspeed_script_dir() -> str | None:
    """deepspeed/utils, found without importing deepspeed (None when it is not installed)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "utils")


def export(source, dst_dir: str, tag: str | None = None, stage: int | None = None,
           world_size: int | None = None) -> str:
    """Write the source as DeepSpeed's checkpoint `dst_dir/<tag>` and point `dst_dir/latest`
    at it; DeepSpeed's recovery scripts are copied beside `latest` as save_checkpoint does,
    when DeepSpeed is installed. Returns the tag folder."""
    tag = tag or f"global_step{source.counters['global_steps']}"
    final = os.path.join(dst_dir, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already: export into another folder or with another --tag")
    read_every_file(source)   # a refused or damaged file is said before DST exists
    files = deepspeed_files(source, stage, world_size)
    with offline_tmp(dst_dir, tag) as tmp:
        for name, obj in files.items():
            torch_save(obj, os.path.join(tmp, name))   # fsynced (durable.py)
    os.replace(tmp, final)
    durable.fsync_dir(dst_dir)
    scripts = _deepspeed_script_dir()
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        if scripts and os.path.isfile(os.path.join(scripts, script)):
            shutil.copyfile(os.path.join(scripts, script), os.path.join(dst_dir, script))
    durable.write_text(os.path.join(dst_dir, "latest"), tag)
    return final


def open_checkpoint(checkpoint_dir: str, tag: str | None = None):
    """The CheckpointSource of a checkpoint folder (its `latest`, or `tag`): minizero's, a DCP
    folder (FSDP2's, torchtitan's: dcp_source.py), or DeepSpeed's (so a DeepSpeed
    checkpoint can be rewritten for another world size or stage)."""
    tag, path = tag_folder(checkpoint_dir, tag)
    if is_dcp_folder(path):
        source = open_dcp(path)
        source.require_optimizer_state()   # DeepSpeed's folder cannot be without Adam's state
        return source
    if os.path.isfile(os.path.join(path, MODEL_FILE)):
        meta = load_file(checkpoint_dir, tag, MODEL_FILE, mmap=True)
        if isinstance(meta, dict) and "layout" in meta:
            return MinizeroSource(path, meta)
    return open_source(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    ap.add_argument("src", help="checkpoint folder (with a 'latest' file and <tag>/ sub-folders): minizero's, a "
                                "DCP one (FSDP2's, torchtitan's), or DeepSpeed's, to rewrite it for another --stage or "
                                "--world-size")
    ap.add_argument("dst", help="folder to write DeepSpeed's checkpoint into (its 'latest' and <tag>/)")
    ap.add_argument("--tag", default=None, help="the minizero tag to export (default: the one 'latest' names); "
                                                "the DeepSpeed folder gets the same name")
    ap.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO stage (default: as saved)")
    ap.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default: as saved)")
    args = ap.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        print(f"{PROG}: error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    try:
        source = open_checkpoint(args.src, args.tag)
        out = export(source, args.dst, os.path.basename(source.folder), args.stage, args.world_size)
    except Exception as e:
        return command_error(PROG, e, args.src, args.dst)
    stage = source.zero_stage if args.stage is None else args.stage
    n = source.world_size if args.world_size is None else args.world_size
    print(f"wrote {out}: DeepSpeed ZeRO stage {stage}, {n} rank{'s' if n != 1 else ''}, {source.dtype}, "
          f"{len(source.names)} parameters (load it with engine.load_checkpoint({args.dst!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
