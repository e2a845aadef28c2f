"""Saving and resuming an engine: each rank writes and reads what it owns (checkpoint_folder.py
has the folder's names and how a save is published).

Under ZeRO each rank owns 1/N of the optimizer state, so each rank writes its own file,
in parallel, and nobody ever materialises the full state (DeepSpeed does the same). Stage 0
holds the same optimizer state everywhere: only rank 0 writes an optimizer file (every
rank writes its RNG).

Checkpoints are taken at a gradient-accumulation boundary, where no partial gradient
exists, so gradients are never saved; loading drops any gradient the engine holds.

Every rank writes into the same `<tag>.tmp` folder, so the save folder must be one that
all ranks see: a shared filesystem on a multi-node job (NFS, Lustre, ...). A node-local
folder (each node's own /tmp or local disk) is refused with one line before any file is
written: after rank 0 creates `<tag>.tmp`, every rank looks for it, and one MAX all-reduce
tells all ranks which hosts cannot see it. (Supporting node-local saving would mean one
rank per node publishing and `latest` per node; not worth it for a teaching tool.)

Two more things are refused with one line instead of written or loaded half-way:

- Non-finite weights. `save` checks every rank's master and low-precision shards and
  agrees through one MAX all-reduce: if any rank holds an inf/NaN, every rank raises
  CheckpointError before anything is written, and `latest` keeps naming the last good
  checkpoint. (DeepSpeed saves whatever it holds.)
- Damaged or missing files, and a checkpoint of another model, stage, world size or
  grouping: every rank reads and checks its files first, then all agree (`_agree`), so
  every rank raises the same one-line CheckpointError before the engine is touched.

Resume is bit-exact: the shards, Adam's moments and step counts, the LR scheduler, the
loss scaler, the step counters and every rank's RNG state are restored, and the trainer
keeps its data position in `client_state`.

Resuming in another dtype is allowed, and said (a warning on rank 0). Every dtype keeps
fp32 masters and fp32 Adam state, so those are restored exactly; the low-precision
weights are rounded from the masters (as every step does); the fp16 loss scale starts
fresh at `initial_scale_power` when the checkpoint has none, and a saved one is dropped
when the run is not fp16. (DeepSpeed fails or silently changes the loss scaling here:
docs/deepspeed.md, "Resuming in another dtype".)
"""
from __future__ import annotations

import logging
import os
import shutil
import socket

import torch

from . import comm
from .checkpoint_folder import (MODEL_FILE, CheckpointError, describe_tags, load_file, optim_file, publish,
                                read_latest, resolve_tag, rng_file)
from .version import __version__

logger = logging.getLogger("minizero")

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _layout(engine) -> list[dict]:
    return [{"label": f.label, "names": f.names, "shapes": [tuple(s) for s in f.shapes],
             "numel": f.numel, "padded_numel": f.padded_numel, "keep_full": f.keep_full}
            for f in engine.zero.flat_params]


def _rng_state() -> dict:
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


# ----------------------------------------------------------------------------- save

def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True) -> str:
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise CheckpointError(f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient-"
                              f"accumulation window of {engine.gradient_accumulation_steps()}: the partial "
                              f"gradients would be lost; save right after the engine.step() that steps")
    tag = str(tag or f"global_step{engine.global_steps}")
    if tag.endswith(".tmp"):
        raise CheckpointError(f"checkpoint tag {tag!r}: use a name that does not end in .tmp (.tmp folders are "
                              f"unfinished saves)")
    _refuse_non_finite(engine, save_dir, tag)
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    rank, zero, opt = engine.global_rank, engine.zero, engine.sharded_optimizer
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    _refuse_unshared(engine, save_dir, tmp)
    if rank == 0:
        torch.save({
            "minizero_version": __version__, "stage": zero.stage, "world_size": engine.world_size,
            "dtype": str(engine.dtype), "layout": _layout(engine),
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
            "micro_steps": engine.micro_steps, "global_samples": engine.global_samples,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "client_state": client_state or {}, "config": engine.config.raw,
        }, os.path.join(tmp, MODEL_FILE))
    if zero.stage > 0 or rank == 0:
        torch.save({
            "rank": rank,
            "masters": [m.detach().cpu().clone() for m in opt.masters],
            "shards": [f.shard.detach().cpu().clone() for f in zero.flat_params],
            "optimizer": opt.optimizer.state_dict(),
            "partition_count": zero.flat_params[0].num_shards,
        }, os.path.join(tmp, optim_file(rank)))
    # RNG differs per rank even at stage 0 (dropout masks): every rank saves its own.
    torch.save(_rng_state(), os.path.join(tmp, rng_file(rank)))
    comm.barrier()
    if rank == 0:
        publish(save_dir, tag, save_latest)
    comm.barrier()
    return final


def _refuse_non_finite(engine, save_dir: str, tag: str) -> None:
    """Collective: every rank checks its own shards; one MAX all-reduce tells all which
    ranks hold an inf/NaN, and then all of them refuse, before anything is written."""
    opt = engine.sharded_optimizer
    bad = any(not bool(torch.isfinite(t).all()) for t in [*opt.masters, *(f.shard for f in opt.flat_params)])
    flags = torch.zeros(engine.world_size, device=engine.device)
    flags[engine.global_rank] = float(bad)
    comm.all_reduce(flags, op="max", label="checkpoint_finite")
    ranks = [r for r, v in enumerate(flags.tolist()) if v > 0]
    if ranks:
        prev = read_latest(save_dir)
        kept = f"'latest' still names {prev}" if prev is not None else "there is no 'latest' yet"
        raise CheckpointError(f"refusing to save checkpoint {tag}: the weights are non-finite (inf/NaN) on rank "
                              f"{', '.join(map(str, ranks))}; nothing was written, {kept}")


def _refuse_unshared(engine, save_dir: str, tmp: str) -> None:
    """Collective: does every rank see the `<tag>.tmp` folder rank 0 just made? If not, the
    save folder is node-local: every rank raises, and rank 0 removes its folder."""
    flags = torch.zeros(engine.world_size, device=engine.device)
    flags[engine.global_rank] = float(not os.path.isdir(tmp))
    comm.all_reduce(flags, op="max", label="checkpoint_shared")
    blind = [r for r, v in enumerate(flags.tolist()) if v > 0]
    if not blind:
        return
    hosts = comm.all_gather_object(socket.gethostname())
    if engine.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    where = ", ".join(f"rank {r} on {hosts[r]}" for r in blind[:4]) + (" ..." if len(blind) > 4 else "")
    raise CheckpointError(f"save folder {save_dir} is not shared by all ranks: {where} cannot see the folder rank 0 "
                          f"(on {hosts[0]}) created in it. Every rank writes its shard into one folder: put "
                          f"--save-dir on a filesystem all nodes mount (NFS, Lustre, ...)")


# ----------------------------------------------------------------------------- load

def load(engine, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True):
    """Collective. Returns (tag folder, client_state), or (None, None) when there is no
    `latest` and no tag. Every file is read and checked on every rank before the engine is
    touched; a damaged file or an incompatible checkpoint raises CheckpointError on all ranks."""
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    rank, zero, opt = engine.global_rank, engine.zero, engine.sharded_optimizer
    src = rank if zero.stage > 0 else 0
    rng_name = rng_file(rank)
    meta = shard_state = rng = None
    err = None
    try:
        if not os.path.isdir(path):
            named = " ('latest' names it)" if tag == read_latest(load_dir) else ""
            raise CheckpointError(f"{path}: no such checkpoint{named}; {describe_tags(load_dir)}")
        meta = load_file(load_dir, tag, MODEL_FILE)
        _check_compatible(meta, engine, path)
        shard_state = load_file(load_dir, tag, optim_file(src))
        # A stage-0 checkpoint may be resumed on more ranks than saved it: those start their own RNG.
        if rank < meta["world_size"]:
            rng = load_file(load_dir, tag, rng_name)
    except CheckpointError as e:
        err = str(e)
    _agree(engine, err)

    opt.zero_grad()  # a resumed step starts with no gradient, as the saved one did
    same_dtype = meta["dtype"] == str(engine.dtype)
    with torch.no_grad():
        for f, m, saved_m, saved_s in zip(opt.flat_params, opt.masters, shard_state["masters"], shard_state["shards"]):
            m.copy_(saved_m)
            # In another dtype the low-precision weights are the masters rounded, as a step makes them.
            f.shard.copy_(saved_s if same_dtype else m)
            if f.keep_full and f.num_shards > 1:
                f.all_gather(label="load")
    if load_optimizer_states:
        opt.load_optimizer_state(shard_state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps, engine.skipped_steps = meta["global_steps"], meta["skipped_steps"]
    engine.micro_steps, engine.global_samples = meta["micro_steps"], meta["global_samples"]
    if rng is not None:
        _set_rng_state(rng)
    if not same_dtype and rank == 0:
        logger.warning(_dtype_change(meta, engine, path))
    return path, meta["client_state"]


def _dtype_name(d) -> str:
    return DTYPE_NAMES.get(str(d), str(d))


def _dtype_change(meta: dict, engine, path: str) -> str:
    saved, ours = _dtype_name(meta["dtype"]), _dtype_name(engine.dtype)
    if engine.loss_scaler is not None and meta["loss_scaler"] is None:
        scale = f"the loss scale starts fresh at {engine.loss_scale:g} (initial_scale_power)"
    elif engine.loss_scaler is None and meta["loss_scaler"] is not None:
        scale = f"the saved loss scale {meta['loss_scaler']['cur_scale']:g} is dropped"
    else:
        scale = "there is no loss scale either side"
    return (f"{path} was saved in {saved}, this run is {ours}: fp32 master weights and Adam state restored "
            f"exactly, the {ours} weights rounded from them, {scale}; the run will not match one continued "
            f"in {saved}")


def _check_compatible(meta: dict, engine, path: str) -> None:
    if "layout" not in meta:
        raise CheckpointError(f"{path} is not a minizero checkpoint (no layout in {MODEL_FILE}; saved by DeepSpeed?)")
    ours = _layout(engine)
    saved = meta["layout"]
    saved_names = [(n, tuple(s)) for f in saved for n, s in zip(f["names"], f["shapes"])]
    our_names = [(n, tuple(s)) for f in ours for n, s in zip(f["names"], f["shapes"])]
    if sorted(saved_names) != sorted(our_names):
        diff = sorted(set(saved_names) ^ set(our_names))[:3]
        raise CheckpointError(f"checkpoint {path} is from a different model (parameters differ, e.g. {diff}); "
                              f"load it into the model it was saved from, or start a new run")
    if meta["stage"] != engine.zero.stage:
        raise CheckpointError(f"checkpoint {path} was saved at ZeRO stage {meta['stage']}, this run is stage "
                              f"{engine.zero.stage}: use the same stage, or consolidate it "
                              f"(python -m minizero.zero_to_fp32 {os.path.dirname(path)} out.pt) and start from the weights")
    if meta["world_size"] != engine.world_size and engine.zero.stage > 0:
        raise CheckpointError(f"checkpoint {path} holds {meta['world_size']} shards, this run has world size "
                              f"{engine.world_size}: resume with {meta['world_size']} processes, or consolidate it "
                              f"(python -m minizero.zero_to_fp32 {os.path.dirname(path)} out.pt) and start from the weights")
    if [f["numel"] for f in saved] != [f["numel"] for f in ours]:
        raise CheckpointError(f"checkpoint {path} groups parameters differently (different param groups or "
                              f"reduce_bucket_size / stage3_param_persistence_threshold); use the saved config")


def _agree(engine, err: str | None) -> None:
    """Collective. If any rank failed (err is its message), every rank raises the first
    failing rank's message, so rank 0, which prints, names the file even when another
    rank's file is the damaged one, and no rank goes on into a later collective."""
    flag = torch.tensor([0.0 if err is None else 1.0], device=engine.device)
    comm.all_reduce(flag, op="max", label="checkpoint_ok")
    if flag.item() > 0:
        errs = comm.all_gather_object(err)
        raise CheckpointError(next(e for e in errs if e is not None))
