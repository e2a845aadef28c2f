"""Sharded checkpoints: each rank saves what it owns; `consolidate` glues the shards back.

Layout (DeepSpeed's names, so the folders look familiar):

    <save_dir>/latest                                   the newest complete tag
    <save_dir>/<tag>/mp_rank_00_model_states.pt         rank 0: counters, LR schedule, loss
                                                        scaler, client_state, the layout
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                        rank r: its fp32 master shards, its
                                                        low-precision shards, its Adam state
    <save_dir>/<tag>/rng_rank_<r>.pt                    rank r: its RNG state (dropout)

The names are DeepSpeed-like (DeepSpeed also prefixes bf16 optimizer files with `bf16_`
and writes per-rank model-state files at ZeRO-3). Under ZeRO each rank owns 1/N of the
optimizer state, so each rank writes its own file, in parallel, and nobody ever
materialises the full state (DeepSpeed does the same). Stage 0 holds the same optimizer
state everywhere: only rank 0 writes an optimizer file (every rank writes its RNG).

Checkpoints are taken at a gradient-accumulation boundary, where no partial gradient
exists, so gradients are never saved; loading drops any gradient the engine holds.

`latest` always names a complete checkpoint. A kill -9 of any rank, or of the whole job,
at any instant (even mid-write) leaves it on one:

1. Everything goes into `<tag>.tmp` first. After a barrier rank 0 publishes it: the old
   `<tag>` folder, if any, is renamed to `<tag>.old.tmp` and deleted (a rename is atomic;
   a half-deleted folder only ever carries a `.tmp` name), `<tag>.tmp` is renamed to
   `<tag>`, and only then `latest` is rewritten (a temp file and `os.replace`).
2. Saving a tag that `latest` already names (a fixed tag, or the same step twice) would
   leave `latest` on a missing folder between those two renames. So first rank 0 hard-links
   the old files into `<tag>.prev` (no data is copied) and points `latest` there; after
   the swap `latest` names `<tag>` again and `<tag>.prev` goes. A crash in between leaves
   `latest` on `<tag>.prev`, a complete checkpoint that resumes like any other.

A folder is complete when it has no `.tmp` suffix and holds the model-states file and every
rank's optimizer and RNG files (`complete_tags`). Leftover `.tmp` folders are only garbage.

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
- Damaged files. Every read goes through `_load_file`: a truncated, garbled or missing
  file becomes "<file>: damaged or incomplete checkpoint file (...)" with the list of the
  other complete checkpoints. Only the rank that reads the damaged file sees the damage, so
  all ranks agree (a MAX all-reduce of a failure flag, then the message is gathered) before
  the engine is touched: every rank raises the same error, and none waits in a collective.

Resume is bit-exact: the shards, Adam's moments and step counts, the LR scheduler, the
loss scaler, the step counters and every rank's RNG state are restored, and the trainer
keeps its data position in `client_state`.

Resuming in another dtype is allowed, and said (a warning on rank 0). Every dtype keeps
fp32 masters and fp32 Adam state, so those are restored exactly; the low-precision
weights are rounded from the masters (as every step does); the fp16 loss scale starts
fresh at `initial_scale_power` when the checkpoint has none, and a saved one is dropped
when the run is not fp16. DeepSpeed 0.19.8 is no model here (measured on CPU, ZeRO-1 and
-3 and stage 0): bf16 <-> fp16/fp32 fails (FileNotFoundError: it looks for optimizer files
with the other `bf16_` prefix), stage 0 fp32 -> fp16 fails (KeyError 'dynamic_loss_scale'),
and at ZeRO-1..3 loading replaces the engine's loss scaler with the saved one without a
word: fp32 -> fp16 trains fp16 with a static scale of 1.0 (no loss scaling at all), fp16
-> fp32 scales an fp32 run's loss dynamically.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import zipfile

import torch

from . import comm
from .version import __version__
from .partition import unflatten

logger = logging.getLogger("minizero")

MODEL_FILE = "mp_rank_00_model_states.pt"
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class CheckpointError(RuntimeError):
    pass


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


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


# ----------------------------------------------------------------------------- listing

def read_latest(save_dir: str) -> str | None:
    """The tag `latest` names, or None when there is no `latest` file."""
    try:
        with open(os.path.join(save_dir, "latest")) as fh:
            return fh.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _needed_files(meta: dict) -> list[tuple[str, ...]]:
    """The per-rank files a checkpoint cannot resume without (each: one of these names),
    from its model-states file."""
    if "layout" in meta:   # minizero: every rank's optimizer file (stage 0: rank 0's) and RNG
        n = meta["world_size"]
        return [(optim_file(r),) for r in range(n if meta["stage"] > 0 else 1)] + \
               [(f"rng_rank_{r}.pt",) for r in range(n)]
    # DeepSpeed (the reference trainer resumes its own folders through complete_tags too):
    # ZeRO writes one optimizer file per rank (bf16_-prefixed in bf16), ZeRO-3 also one
    # model-states file per rank; stage 0 keeps the optimizer in the model-states file.
    ds = meta.get("ds_config") or {}
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0) or 0)
    n = int(meta.get("dp_world_size", 1))
    need = []
    if stage > 0:
        need += [(optim_file(r), "bf16_" + optim_file(r)) for r in range(n)]
    if stage == 3:
        need += [(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",) for r in range(n)]
    return need


def _complete_step(folder: str) -> int | None:
    """The checkpoint's global step if `folder` is a complete checkpoint, else None."""
    if folder.endswith(".tmp") or not os.path.isdir(folder):
        return None
    names = set(os.listdir(folder))
    model = next((m for m in (MODEL_FILE, "zero_pp_rank_0_mp_rank_00_model_states.pt") if m in names), None)
    if model is None:
        return None
    try:   # mmap: a DeepSpeed model-states file holds the weights; read only the small entries
        meta = torch.load(os.path.join(folder, model), map_location="cpu", weights_only=False, mmap=True)
        need = _needed_files(meta)
    except Exception:   # truncated or not a checkpoint: not complete
        return None
    if not all(any(name in names for name in options) for options in need):
        return None
    return int(meta.get("global_steps", -1))


def complete_tags(save_dir: str) -> list[str]:
    """Tags of the complete checkpoints in save_dir (see the module docstring), oldest first
    (by the saved global step, then by name). [] when save_dir does not exist. Complete means
    every file is there (the model-states file is read); a file damaged inside is found on load."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        step = _complete_step(os.path.join(save_dir, name))
        if step is not None:
            found.append((step, _natural(name), name))
    return [name for *_, name in sorted(found)]


def _natural(name: str) -> list:
    # global_step9 before global_step10 when two folders hold the same step
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in re.split(r"(\d+)", name)]


def describe_tags(save_dir: str, exclude: str | None = None) -> str:
    """One clause naming the complete checkpoints in save_dir other than `exclude`."""
    tags = [t for t in complete_tags(save_dir) if t != exclude]
    other = "other " if exclude is not None else ""
    if not tags:
        return f"no {other}complete checkpoint in {save_dir}"
    return f"{other}complete checkpoints in {save_dir}: {', '.join(tags)} (pick one with --tag TAG)"


def describe_missing_latest(save_dir: str) -> str:
    """What to say when save_dir has no `latest` file, e.g. "'latest' is missing; complete
    checkpoints here: global_step20, global_step40; pass --tag global_step40 to resume one"."""
    tags = complete_tags(save_dir)
    if not tags:
        return "'latest' is missing and there is no complete checkpoint here"
    return f"'latest' is missing; complete checkpoints here: {', '.join(tags)}; pass --tag {tags[-1]} to resume one"


# ----------------------------------------------------------------------------- reading

def _load_file(save_dir: str, tag: str, name: str):
    """torch.load one checkpoint file; any failure is a one-line CheckpointError naming it."""
    path = os.path.join(save_dir, tag, name)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # truncated zip, EOF, unpickling error, missing file, ...
        raise CheckpointError(f"{path}: damaged or incomplete checkpoint file ({_why(path, e)}); "
                              f"{describe_tags(save_dir, exclude=tag)}") from None


def _why(path: str, e: Exception) -> str:
    """A few words on why torch.load failed (its own messages name no file, and a truncated
    file can surface as a bare '[Errno 22] Invalid argument')."""
    if isinstance(e, FileNotFoundError):
        return "missing"
    if os.path.isfile(path) and not zipfile.is_zipfile(path):   # torch.save writes a zip archive
        return f"truncated or overwritten: not a complete zip archive, {os.path.getsize(path)} bytes"
    first = (str(e).split(". ")[0].splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:160]


def _agree(engine, err: str | None) -> None:
    """Collective. If any rank failed (err is its message), every rank raises the first
    failing rank's message, so rank 0, which prints, names the file even when another
    rank's file is the damaged one, and no rank goes on into a later collective."""
    flag = torch.tensor([0.0 if err is None else 1.0], device=engine.device)
    comm.all_reduce(flag, op="max", label="checkpoint_ok")
    if flag.item() > 0:
        errs = comm.all_gather_object(err)
        raise CheckpointError(next(e for e in errs if e is not None))


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    return tag if tag is not None else read_latest(load_dir)


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
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank_{rank}.pt"))
    comm.barrier()
    if rank == 0:
        _publish(save_dir, tag, save_latest)
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


def _write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, "latest.tmp")
    with open(tmp, "w") as fh:
        fh.write(tag)
    os.replace(tmp, os.path.join(save_dir, "latest"))


def _discard(path: str) -> None:
    """Delete a checkpoint folder so that no half-deleted folder ever has a non-.tmp name."""
    trash = path + ".old.tmp"
    shutil.rmtree(trash, ignore_errors=True)   # left by a crash mid-delete
    if not os.path.exists(path):
        return
    os.replace(path, trash)   # atomic: `path` is whole until this instant, gone after it
    shutil.rmtree(trash, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)     # a second name for the same bytes: instant, no extra disk
    except OSError:           # a filesystem without hard links
        shutil.copy2(src, dst)


def _publish(save_dir: str, tag: str, save_latest: bool) -> None:
    """Rank 0, after every rank has written `<tag>.tmp`: make it `<tag>` and point `latest`
    at it, such that at every instant `latest` names a complete checkpoint (module docstring)."""
    final = os.path.join(save_dir, tag)
    aside_tag = tag + ".prev"
    aside = os.path.join(save_dir, aside_tag)
    named = read_latest(save_dir)
    if named == tag and os.path.isdir(final):   # `latest` must not name the folder being replaced:
        _discard(aside)                          # give it a second name first (a leftover of an
        shutil.copytree(final, aside, copy_function=_link_or_copy)   # earlier crash goes: `latest` names `tag`)
        _write_latest(save_dir, aside_tag)
        named = aside_tag
    _discard(final)
    os.replace(final + ".tmp", final)
    if save_latest or named == aside_tag:      # (the aside stood in for `tag`: hand `latest` back)
        _write_latest(save_dir, tag)
        named = tag
    if named != aside_tag:
        _discard(aside)


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
    rng_name = f"rng_rank_{rank}.pt"
    meta = shard_state = rng = None
    err = None
    try:
        if not os.path.isdir(path):
            named = " ('latest' names it)" if tag == read_latest(load_dir) else ""
            raise CheckpointError(f"{path}: no such checkpoint{named}; {describe_tags(load_dir)}")
        meta = _load_file(load_dir, tag, MODEL_FILE)
        _check_compatible(meta, engine, path)
        shard_state = _load_file(load_dir, tag, optim_file(src))
        # A stage-0 checkpoint may be resumed on more ranks than saved it: those start their own RNG.
        if rank < meta["world_size"]:
            rng = _load_file(load_dir, tag, rng_name)
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
        opt.optimizer.load_state_dict(shard_state["optimizer"])
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


# ----------------------------------------------------------------------------- consolidate

def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 state dict (name -> tensor) from a sharded checkpoint, on one process.

    The fp32 masters of every rank are concatenated in rank order into each FlatParam's
    padded buffer, the padding is cut off, and each parameter is viewed back into its
    shape: the exact inverse of the partitioning in flat_param.py. Loadable by a plain
    `GPT` with `model.load_state_dict(sd)`. (DeepSpeed's equivalent is zero_to_fp32.py.)
    """
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: no such directory")
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir} ('latest' is missing); {describe_tags(checkpoint_dir)}")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint; {describe_tags(checkpoint_dir)}")
    meta = _load_file(checkpoint_dir, tag, MODEL_FILE)
    if "layout" not in meta:
        raise CheckpointError(f"{path} is not a minizero checkpoint (saved by DeepSpeed? use the zero_to_fp32.py "
                              f"DeepSpeed saves next to its tag folders)")
    n = meta["world_size"] if meta["stage"] > 0 else 1
    ranks = [_load_file(checkpoint_dir, tag, optim_file(r)) for r in range(n)]
    out = {}
    for i, f in enumerate(meta["layout"]):
        full = torch.cat([r["masters"][i].float() for r in ranks])
        if full.numel() != f["padded_numel"]:
            raise CheckpointError(f"{path}: the shards of {f['label']} hold {full.numel()} values, the layout says "
                                  f"{f['padded_numel']}; the optimizer files are not from one checkpoint")
        out.update({name: t.clone() for name, t in unflatten(full, f["names"], f["shapes"]).items()})
    return out
