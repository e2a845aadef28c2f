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
tells all ranks which hosts cannot see it (a rank that does not see it at once first
re-reads the folders for up to a minute: a shared file system's cache, shared_folder.py).
(Supporting node-local saving would mean one rank per node publishing and `latest` per
node; not worth it for a teaching tool.)

Loading never runs code: every file is read with torch.load(weights_only=True), and a save
writes only what that loads, so a `client_state` (or a config) holding anything but tensors
and plain data (dict, list, tuple, str, numbers, None) is refused on every rank before a
file is written, in one line naming the entry (safe_load.refuse_unsafe_values). (Converting it
instead would hand the user back another type than they saved, silently.) A file that
names any other global when unpickled is refused on every rank, naming it (safe_load.py).

Every file is fsynced as it is written, and each rank fsyncs the `<tag>.tmp` folder after
its files, before the barrier that lets rank 0 publish it (durable.py): a checkpoint
`latest` names survives a crash of a node or of the file server.

Resuming on several nodes: rank 0 alone reads `latest` (after re-reading the folder, for a
shared file system's cache) and tells the others the tag; a rank that does not see that
tag's folder yet looks again, as for a save (shared_folder.py), instead of reading a stale
`latest` of its own, or none.

Three more things are refused with one line instead of written or loaded half-way:

- Non-finite weights. `save` checks every rank's master and low-precision shards and
  agrees through one MAX all-reduce: if any rank holds an inf/NaN, every rank raises
  CheckpointError before anything is written, and `latest` keeps naming the last good
  checkpoint. (DeepSpeed saves whatever it holds.)
- Damaged or missing files, and a checkpoint of another model or other param groups:
  every rank reads and checks its files first, then all agree
  (`comm.raise_if_any_rank_failed`), so every rank raises the same one-line CheckpointError
  before the engine is touched.

Resume is bit-exact on a CPU: the shards, Adam's moments and step counts, the LR
scheduler, the loss scaler, the step counters and every rank's RNG state are restored, and
the trainer keeps its data position in `client_state`. On a GPU the same state is restored,
but the resumed run's losses equal the uninterrupted run's bit for bit only with
deterministic kernels (MINIZERO_DETERMINISTIC=1; otherwise some backward kernels add in a
scheduling-dependent order and the runs are close, not equal: docs/gpu.md, "What bit-exact
means on a GPU").

A checkpoint saved at another world size or stage (or with another reduce_bucket_size,
or by DeepSpeed) is resharded as it loads: each rank builds its own master and moment
shards from the saved slices it needs (checkpoint_state.py; the arithmetic is in
partition.py, the walk-through in docs/checkpoints.md). Masters, moments, Adam's step,
schedule, loss scale and counters carry over exactly; what cannot (the RNG state of ranks
the saving run did not have, the data order at another world size) is said in one line
on rank 0. The same layout loads as saved, file for file, as it always did.

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
import socket

import torch  # noqa: F401  (checkpoint_io.torch: the tests replace torch.save through it)

from .. import comm
from . import durable, shared_folder
from .checkpoint_folder import (DS_ZERO3_MODEL_FILE, MODEL_FILE, CheckpointError, describe_tags, load_file, unreadable,
                                open_tmp, optim_file, publish_together, resolve_tag, rng_file)
from .safe_load import numbers_as_python, refuse_unsafe_values
from .dcp_files import is_dcp_folder
from .checkpoint_state import (DTYPE_NAMES, MinizeroSource, check_same_groups, check_same_model,  # noqa: F401
                               fill_missing_hparams, rank_state)
from .save_guards import refuse_non_finite as _refuse_non_finite, refuse_unshared as _refuse_unshared
from .save_guards import rng_state as _rng_state, set_rng_state as _set_rng_state
from .load_notes import _dtype_change, _dtype_name, _moved_note, rank_span  # noqa: F401  (rank_span: reshard.py)
from ..version import __version__

logger = logging.getLogger("minizero")
COUNTERS = ("global_steps", "skipped_steps", "micro_steps", "global_samples")   # the engine's, in the model file

# ----------------------------------------------------------------------------- save

def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True, format: str = "minizero") -> str:
    """Collective: every rank writes its engine.state_dict() into `<tag>.tmp`, which becomes
    `<tag>` once all have written (checkpoint_folder.publish). Returns the tag's folder.
    format "dcp": PyTorch's Distributed Checkpoint instead (dcp_checkpoint.save), what FSDP2 and
    torchtitan load."""
    if format == "dcp":
        from .dcp_checkpoint import save as save_dcp
        return save_dcp(engine, save_dir, tag, client_state, save_latest)
    if format != "minizero":
        raise CheckpointError(f"save_checkpoint(format={format!r}): use \"minizero\" (the default, any world "
                              f"size and stage, and DeepSpeed through export_deepspeed) or \"dcp\" (PyTorch's "
                              f"Distributed Checkpoint, what FSDP2 and torchtitan load)")
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise CheckpointError(f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient-"
                              f"accumulation window of {engine.gradient_accumulation_steps()}: the partial "
                              f"gradients would be lost; save right after the engine.step() that steps")
    tag = str(tag or f"global_step{engine.global_steps}")
    if tag.endswith(".tmp"):
        raise CheckpointError(f"checkpoint tag {tag!r}: use a name that does not end in .tmp (.tmp folders are "
                              f"unfinished saves)")
    state = engine.state_dict()
    rank, stage, shard = engine.global_rank, state["stage"], state["shard_index"]
    meta = {
        "minizero_version": __version__, "stage": stage, "world_size": state["world_size"],
        "partition_count": state["partition_count"],
        "dtype": state["dtype"], "layout": state["layout"], "param_names": state["param_names"],
        **state["counters"], "lr_scheduler": state["lr_scheduler"], "loss_scaler": state["loss_scaler"],
        "client_state": client_state or {}, "config": numbers_as_python(state["config"]),
    }
    optimizer = state["optimizer"]
    if isinstance(optimizer, dict) and "param_groups" in optimizer:
        optimizer = dict(optimizer, param_groups=numbers_as_python(optimizer["param_groups"]))
    shard_state = {"rank": shard, "masters": state["masters"], "shards": state["shards"],
                   "optimizer": optimizer, "partition_count": state["partition_count"]}
    # What a load reads back with weights_only=True, checked before anything is written (a numpy
    # number in the config or a param group is the Python number it means; anything else that
    # is not plain data is refused). Every rank alike, before any collective: all refuse together.
    try:
        for key, value in (*meta.items(), ("optimizer", shard_state["optimizer"])):
            refuse_unsafe_values(value, key)
    except ValueError as e:
        raise CheckpointError(f"refusing to save checkpoint {tag}: {e}; nothing was written") from None
    _refuse_non_finite(engine, state, save_dir, tag)
    tmp = open_tmp(save_dir, tag)
    _refuse_unshared(engine, save_dir, tmp)
    if rank == 0:
        durable.save(meta, os.path.join(tmp, MODEL_FILE))
    if rank == shard:   # the first rank of each shard writes it (stage 0 and HSDP: copies elsewhere)
        durable.save(shard_state, os.path.join(tmp, optim_file(shard)))
    # RNG differs per rank even at stage 0 (dropout masks): every rank saves its own.
    durable.save(_rng_state(), os.path.join(tmp, rng_file(rank)))
    return publish_together(save_dir, tag, save_latest)


# ----------------------------------------------------------------------------- load

def load(engine, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True):
    """Collective. Returns (tag folder, client_state), or (None, None) when there is no
    `latest` and no tag. Every file is read and checked on every rank before the engine is
    touched; a damaged file or an incompatible checkpoint raises CheckpointError on all ranks.

    A minizero checkpoint of this very layout (world size, stage, grouping) is loaded as
    saved: each rank reads its own file. Any other (another world size or stage, another
    bucket size, or a DeepSpeed folder) is resharded: each rank builds its shards from the
    saved slices that it needs (checkpoint_state.py)."""
    tag, named, seen = agreed_tag(load_dir, tag)
    if tag is None:
        logger.warning(f"no checkpoint found in {load_dir} (no 'latest' file)")
        return None, None
    path = os.path.join(load_dir, tag)
    rank, stage = engine.global_rank, engine.zero_optimization_stage()
    if seen:   # rank 0 sees the tag's folder: every rank must (after a while, on a lagging NFS client)
        _refuse_unseen(engine, load_dir, path)
    meta = shard_state = rng = source = None
    err = None
    try:
        if not seen:
            why = " ('latest' names it)" if named else ""
            raise CheckpointError(f"{path}: no such checkpoint{why}; {describe_tags(load_dir)}")
        meta = _minizero_meta(load_dir, tag)
        if meta is not None and _same_layout(meta, engine):
            shard_state = load_file(load_dir, tag, optim_file(engine.partition[1]))
            # A stage-0 checkpoint may be resumed on more ranks than saved it: those start their own RNG.
            if rank < meta["world_size"]:
                rng = load_file(load_dir, tag, rng_file(rank))
        else:
            source = open_checkpoint(path, meta)
            shard_state = _reshard_state(engine, source, path, load_optimizer_states)
            rng = source.rng_state(rank)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:   # a file that unpickles but is not what it should be: one line, on all ranks
        logger.debug("reading checkpoint %s", path, exc_info=True)
        err = unreadable(path, e)
    # every rank raises the first failing rank's one line, rank 0 prints it (names the file even
    # when another rank's file is the damaged one)
    comm.raise_if_any_rank_failed(err, CheckpointError, label="checkpoint_ok")
    if source is not None:
        return _load_resharded(engine, source, shard_state, rng, path, load_lr_scheduler_states)

    same_dtype = meta["dtype"] == str(engine.dtype)
    engine.load_state_dict({
        "masters": shard_state["masters"],
        # in another dtype the low-precision weights are the masters rounded, as a step makes them
        "shards": shard_state["shards"] if same_dtype else None,
        "optimizer": shard_state["optimizer"], "lr_scheduler": meta["lr_scheduler"], "loss_scaler": meta["loss_scaler"],
        "counters": {k: meta[k] for k in COUNTERS},
    }, load_optimizer_states, load_lr_scheduler_states)
    if rng is not None:
        _set_rng_state(rng)
    if rank == 0 and meta["world_size"] != engine.world_size:   # stage 0, on another number of ranks
        logger.warning(_moved_note(path, "minizero", meta["world_size"], meta["stage"], _dtype_name(meta["dtype"]),
                                   meta["loss_scaler"], engine, has_rng=rng is not None, optimizer=load_optimizer_states,
                                   how="loaded as saved"))
    elif not same_dtype and rank == 0:
        logger.warning(_dtype_change(meta, engine, path))
    return path, meta["client_state"]


def agreed_tag(load_dir: str, tag: str | None) -> tuple[str | None, bool, bool]:
    """Collective: (the tag to load, whether `latest` named it, whether rank 0 sees its
    folder), the same on every rank. Rank 0 alone reads `latest` (after listing the folder,
    which makes an NFS client drop what it remembered of it: shared_folder.py), so that a rank
    on a node with a stale view neither loads another tag nor finds none."""
    decided = None
    if comm.get_rank() == 0:
        shared_folder.reread_toward(os.path.join(load_dir, "latest"))
        named = tag is None
        tag = resolve_tag(load_dir, tag)
        decided = (tag, named, tag is not None and os.path.isdir(os.path.join(load_dir, tag)))
    return comm.broadcast_object(decided)


def _refuse_unseen(engine, load_dir: str, path: str) -> None:
    """Collective: every rank sees the tag folder rank 0 sees, after re-reading its folders
    for up to VISIBLE_WAIT_S (shared_folder.py), or every rank raises one line."""
    blind = shared_folder.ranks_blind_to(path, os.path.isdir, shared_folder.uncounted_max, engine.device)
    if not blind:
        os.listdir(path)   # opened once: a name this node remembered missing inside it is looked up again
        return
    hosts = comm.all_gather_object(socket.gethostname())
    where = ", ".join(f"rank {r} on {hosts[r]}" for r in blind[:4]) + (" ..." if len(blind) > 4 else "")
    raise CheckpointError(f"{path}: {where} cannot see this checkpoint, which rank 0 (on {hosts[0]}) sees, after "
                          f"{shared_folder.VISIBLE_WAIT_S:g} s of looking: the folder a run resumes from must be on a "
                          f"file system every node mounts (NFS, Lustre, ...)")


def _minizero_meta(load_dir: str, tag: str) -> dict | None:
    """The model-states file of a minizero tag folder; None for a DeepSpeed one (its
    model-states file has no layout; at ZeRO-3 it writes one per rank instead) or a DCP one.
    mmap: a DeepSpeed model-states file holds the whole model, only a few small entries are read."""
    folder = os.path.join(load_dir, tag)
    if is_dcp_folder(folder):
        return None
    if not os.path.exists(os.path.join(folder, MODEL_FILE)) and os.path.exists(os.path.join(folder, DS_ZERO3_MODEL_FILE)):
        return None
    meta = load_file(load_dir, tag, MODEL_FILE, mmap=True)
    return meta if isinstance(meta, dict) and "layout" in meta else None


def saved_partition_count(meta: dict) -> int:
    """How many shards a minizero checkpoint's states are cut into (before HSDP, the world size
    at ZeRO-1/2/3 and 1 at stage 0, as its files say)."""
    return meta.get("partition_count", meta["world_size"] if meta["stage"] > 0 else 1)


def tag_library(load_dir: str, tag: str) -> str:
    """Which format a tag is in: "minizero", "deepspeed" or "dcp" (PyTorch's Distributed
    Checkpoint: FSDP2's, torchtitan's, `python -m minizero.export_dcp`'s). A folder several
    have written holds tags of each; a trainer resuming it must know which one it loads."""
    if is_dcp_folder(os.path.join(load_dir, tag)):
        return "dcp"
    return "minizero" if _minizero_meta(load_dir, tag) is not None else "deepspeed"


def open_checkpoint(folder: str, meta: dict | None = None):
    """The CheckpointSource of a tag folder: minizero's, a DCP folder's (dcp_source.py),
    or DeepSpeed's when the folder looks like one (deepspeed_checkpoint.py). `meta`: its
    model-states file, when already read."""
    if is_dcp_folder(folder):
        from .dcp_source import open_source
        return open_source(folder)
    load_dir, tag = os.path.split(os.path.normpath(folder))
    meta = meta if meta is not None else _minizero_meta(load_dir, tag)
    return MinizeroSource(folder, meta) if meta is not None else _deepspeed_source(folder)


def read_every_file(source) -> None:
    """Open every file of the source's tag folder through its library's allow-list, mmap'd
    (the pickles are read, the tensors' bytes are not): a file that would run code, or a
    damaged one, is one CheckpointError before anything is written. (A DCP source has read
    its `.metadata` and every non-tensor value through the allow-list, and checked every chunk
    file's length, when it opened: dcp_files.py.)"""
    if is_dcp_folder(source.folder):
        return
    if source.library == "deepspeed":
        from .deepspeed_pickle import torch_load
        for name in sorted(os.listdir(source.folder)):
            if name.endswith(".pt"):
                torch_load(os.path.join(source.folder, name))
        return
    load_dir, tag = os.path.split(source.folder)
    for name in sorted(os.listdir(source.folder)):
        if name.endswith(".pt"):
            load_file(load_dir, tag, name, mmap=True)


def saved_batch(folder: str) -> tuple[int, int | None]:
    """(world size, micro-batch per rank) of the run that saved a tag folder; the micro-batch
    is None when its config does not say. A trainer needs them to carry its data position
    to another world size (runsetup.py)."""
    load_dir, tag = os.path.split(os.path.normpath(folder))
    meta = _minizero_meta(load_dir, tag)
    if meta is not None:
        world, cfg = meta["world_size"], meta.get("config") or {}
    elif is_dcp_folder(folder):
        from .dcp_source import open_source
        src = open_source(folder)
        world, cfg = src.world_size, src.config or {}
    else:
        src = _deepspeed_source(folder)
        world, cfg = src.world_size, src.config or {}
    micro = cfg.get("train_micro_batch_size_per_gpu")
    if micro is None and cfg.get("train_batch_size"):
        micro = cfg["train_batch_size"] // (world * (cfg.get("gradient_accumulation_steps") or 1))
    return world, micro


def _deepspeed_source(path: str):
    try:
        from .deepspeed_checkpoint import open_source
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.deepspeed_checkpoint":
            raise
        raise CheckpointError(f"{path} is not a minizero checkpoint and looks like DeepSpeed's: reading DeepSpeed "
                              f"checkpoints is not available in this minizero") from None
    return open_source(path)


def _same_layout(meta: dict, engine) -> bool:
    """Does the checkpoint hold exactly the shards this engine has (same FlatParams, same
    parameters in each, cut into as many shards)? The world size may differ where a shard is
    held by several ranks (stage 0; HSDP's replicas)."""
    if meta["stage"] != engine.zero_optimization_stage() or saved_partition_count(meta) != engine.partition[0]:
        return False
    saved = [(list(f["names"]), [tuple(s) for s in f["shapes"]]) for f in meta["layout"]]
    return saved == [(list(f["names"]), f["shapes"]) for f in engine.layout()]


def _reshard_state(engine, source, path: str, load_optimizer_states: bool) -> dict:
    """This rank's masters and Adam state, built from the source for this engine's layout."""
    layout = engine.layout()
    check_same_model(source, {n: tuple(s) for f in layout for n, s in zip(f["names"], f["shapes"])}, path)
    groups = [set() for _ in engine.optimizer.param_groups]
    for f in layout:
        groups[f["group"]].update(f["names"])
    if hasattr(source, "adopt_groups"):   # a DCP folder FSDP2 wrote keeps no param groups: take ours
        source.adopt_groups(groups, path)
        if load_optimizer_states:
            source.require_optimizer_state(path)
    check_same_groups(source, groups, path)
    state = rank_state(source, layout, *engine.partition, optimizer=load_optimizer_states)
    if state["optimizer"] is not None:
        fill_missing_hparams(state["optimizer"], engine.optimizer.param_groups)
    return state


def _load_resharded(engine, source, state: dict, rng: dict | None, path: str, load_lr_scheduler_states: bool):
    """Put the resharded state into the engine: masters, the low-precision shards rounded
    from them (as a step does), Adam's moments and step, schedule, loss scale, counters,
    this rank's RNG when the saving run had this rank."""
    engine.load_state_dict({"masters": state["masters"], "shards": None, "optimizer": state["optimizer"],
                            "lr_scheduler": source.lr_scheduler, "loss_scaler": source.loss_scaler,
                            "counters": source.counters}, True, load_lr_scheduler_states)
    if rng is not None:
        _set_rng_state(rng)
    if engine.global_rank == 0:
        logger.warning(_moved_note(path, source.library, source.world_size, source.zero_stage, source.dtype,
                                   source.loss_scaler, engine, has_rng=rng is not None,
                                   optimizer=state["optimizer"] is not None, how="resharded"))
    return path, source.client_state
