"""The checkpoint folder: file names, `latest`, which tags are complete, damaged files.

Layout (DeepSpeed's names, so the folders look familiar):

    <save_dir>/latest                                   the newest complete tag
    <save_dir>/<tag>/mp_rank_00_model_states.pt         rank 0: counters, LR schedule, loss
                                                        scaler, client_state, the layout,
                                                        the parameter names in model order
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                        rank r: its fp32 master shards, its
                                                        low-precision shards, its Adam state
    <save_dir>/<tag>/rng_rank_<r>.pt                    rank r: its RNG state (dropout)

The names are DeepSpeed's (it also prefixes bf16 optimizer files with `bf16_` and writes
per-rank model-state files at ZeRO-3: docs/deepspeed.md, "Checkpoint folder layout").
docs/checkpoints.md says what each file holds at each stage, and how a folder is
resharded for another world size.

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
rank's optimizer and RNG files (`complete_tags`); a DCP folder, when its `.metadata` reads and
every chunk file it names is whole. Leftover `.tmp` folders are only garbage.

Durable. Every file is fsynced as it is written, the `<tag>.tmp` folder before the barrier,
the save folder after each rename, and `latest` is replaced by a fsynced temp file
(durable.py): after a crash of the node or of the file server, `latest` still names a tag
whose files hold all their bytes.

Loading never runs code. Every read goes through `load_file`, which unpickles with
`torch.load(weights_only=True)`: tensors and plain data only, and a file that names any
other global (an `os.system` planted in it) is refused before anything of it runs, in one
line naming the file and the global (safe_load.py; DeepSpeed's files: deepspeed_pickle.py).

Damaged files. A truncated, garbled or missing file becomes "<file>: damaged or incomplete
checkpoint file (...)" with the list of the other complete checkpoints. Only the rank that reads the damaged file sees the damage, so
all ranks agree (a MAX all-reduce of a failure flag, then the message is gathered) before
the engine is touched (checkpoint_io.py): every rank raises the same error, and none
waits in a collective.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import zipfile

from .. import comm
from . import durable
from .checkpoint_errors import CheckpointError, UnsafeCheckpointError  # noqa: F401  (imported from here too)
from .safe_load import refusal, torch_load

MODEL_FILE = "mp_rank_00_model_states.pt"
DS_ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"   # DeepSpeed's ZeRO-3 writes one per rank


def unreadable(path: str, e: Exception) -> str:
    """The one line for a file that unpickles but is not what a checkpoint holds."""
    return f"{path}: cannot be read as a checkpoint ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"


class CommandParser(argparse.ArgumentParser):
    """The checkpoint commands' parser: a mistake in the command line is one line on stderr,
    `<prog>: error: <what>`, exit status 2 (argparse's own prints its usage first)."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def command_error(prog: str, e: Exception, src: str, dst: str) -> int:
    """What a checkpoint-rewriting command (reshard, export_deepspeed) prints when it fails,
    one line on stderr, and its exit status: a CheckpointError says what is wrong with SRC; an
    OSError is DST (no permission, disk full, ...); anything else is a file in SRC that
    unpickles but is not what a checkpoint holds."""
    if isinstance(e, CheckpointError):
        why = str(e)
    elif isinstance(e, OSError):
        why = f"cannot write {dst}: {(str(e).splitlines() or [''])[0]}"
    else:
        why = unreadable(src, e)
    print(f"{prog}: error: {why}", file=sys.stderr)
    return 2


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank}.pt"


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
               [(rng_file(r),) for r in range(n)]
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
    if ".metadata" in names:   # a DCP folder (FSDP2's, torchtitan's, export_dcp's): dcp_source.py
        return _complete_dcp_step(folder)
    model = next((m for m in (MODEL_FILE, DS_ZERO3_MODEL_FILE) if m in names), None)
    if model is None:
        return None
    try:   # mmap: a DeepSpeed model-states file holds the weights; read only the small entries
        meta = _load(os.path.join(folder, model), mmap=True)
        need = _needed_files(meta)
    except UnsafeCheckpointError:   # not "incomplete": a file that would run code is said, by name
        raise
    except Exception:   # truncated or not a checkpoint: not complete
        return None
    if not all(any(name in names for name in options) for options in need):
        return None
    return int(meta.get("global_steps", -1))


def _complete_dcp_step(folder: str) -> int | None:
    """A DCP folder is complete when its `.metadata` reads (through the allow-list) and every
    chunk file it names is there, whole; its step is train_state.step (-1 without one)."""
    from .dcp_files import check_files, read_metadata, saved_step
    try:
        check_files(folder, read_metadata(folder))
        return saved_step(folder)
    except UnsafeCheckpointError:
        raise
    except Exception:
        return None


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


def later_tags(save_dir: str, tag: str) -> list[str]:
    """Complete checkpoints in save_dir saved after `tag` (a run resumed from `tag` into
    save_dir would overwrite them); complete_tags is ordered by the step each one saved."""
    tags = complete_tags(save_dir)
    return tags[tags.index(tag) + 1:] if tag in tags else []


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


# ----------------------------------------------------------------------------- reading

def _load(path: str, mmap: bool = False):
    """torch.load(weights_only=True) of one file; a file the allow-list refuses is an
    UnsafeCheckpointError naming the file and the global it asked for (safe_load.py)."""
    try:
        return torch_load(path, mmap=mmap)
    except Exception as e:
        line = refusal(path, e)
        if line is not None:
            raise UnsafeCheckpointError(line) from None
        raise


def load_file(save_dir: str, tag: str, name: str, mmap: bool = False):
    """torch.load one checkpoint file, through the allow-list; any failure is a one-line
    CheckpointError naming it. mmap: the tensors stay in the file until read (resharding
    reads slices of shards)."""
    path = os.path.join(save_dir, tag, name)
    try:
        return _load(path, mmap=mmap)
    except UnsafeCheckpointError:
        raise
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


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    return tag if tag is not None else read_latest(load_dir)


def tag_folder(checkpoint_dir: str, tag: str | None) -> tuple[str, str]:
    """(tag, its folder) of a checkpoint dir: `tag`, or the one `latest` names; a missing dir,
    `latest` or tag folder is one CheckpointError line listing the complete tags there."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: no such directory")
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        if not complete_tags(checkpoint_dir):   # one statement, not "no checkpoint; no complete checkpoint"
            raise CheckpointError(f"{checkpoint_dir} holds no checkpoint (no 'latest' file, no complete "
                                  f"<tag>/ folder): pass the folder a run saved into (its --save-dir)")
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; {describe_tags(checkpoint_dir)}")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint; {describe_tags(checkpoint_dir)}")
    return tag, path


# ----------------------------------------------------------------------------- publishing

def _write_latest(save_dir: str, tag: str) -> None:
    durable.write_text(os.path.join(save_dir, "latest"), tag)   # temp file, fsync, rename, fsync the folder


def _discard(path: str) -> None:
    """Delete a checkpoint folder so that no half-deleted folder ever has a non-.tmp name."""
    trash = path + ".old.tmp"
    shutil.rmtree(trash, ignore_errors=True)   # left by a crash mid-delete
    if not os.path.exists(path):
        return
    os.replace(path, trash)   # atomic: `path` is whole until this instant, gone after it
    durable.fsync_dir(os.path.dirname(path))
    shutil.rmtree(trash, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)     # a second name for the same bytes: instant, no extra disk
    except OSError:           # a filesystem without hard links
        shutil.copy2(src, dst)


def open_tmp(save_dir: str, tag: str) -> str:
    """Collective, the start of every format's save: rank 0 makes `<tag>.tmp` afresh (a
    leftover of a crashed save goes), every rank waits for it. Returns its path."""
    tmp = os.path.join(save_dir, tag) + ".tmp"
    if comm.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    return tmp


@contextlib.contextmanager
def offline_tmp(dst_dir: str, tag: str):
    """One process, for the commands that rewrite a checkpoint (reshard, export_dcp,
    export_deepspeed): `<tag>.tmp` in dst_dir made afresh and yielded to be filled; its names
    on disk when the block ends; if the block fails, no folder of ours is left behind (dst_dir
    too, when this made it). Publishing it is the caller's (`publish`, or DeepSpeed's own way)."""
    tmp = os.path.join(dst_dir, tag) + ".tmp"
    made = not os.path.exists(dst_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        durable.fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(dst_dir if made else tmp, ignore_errors=True)
        raise


def publish_together(save_dir: str, tag: str, save_latest: bool) -> str:
    """Collective, the end of every format's save, once this rank has written its files into
    `<tag>.tmp`: their names on disk, then, when every rank's are, rank 0 publishes the folder
    (publish). Returns the folder `<tag>`."""
    durable.fsync_dir(os.path.join(save_dir, tag) + ".tmp")
    comm.barrier()
    if comm.get_rank() == 0:
        publish(save_dir, tag, save_latest)
    comm.barrier()
    return os.path.join(save_dir, tag)


def publish(save_dir: str, tag: str, save_latest: bool) -> None:
    """Rank 0, after every rank has written `<tag>.tmp`: make it `<tag>` and point `latest`
    at it, such that at every instant `latest` names a complete checkpoint (module docstring)."""
    final = os.path.join(save_dir, tag)
    aside_tag = tag + ".prev"
    aside = os.path.join(save_dir, aside_tag)
    named = read_latest(save_dir)
    if named == tag and os.path.isdir(final):   # `latest` must not name the folder being replaced:
        _discard(aside)                          # give it a second name first (a leftover of an
        shutil.copytree(final, aside, copy_function=_link_or_copy)   # earlier crash goes: `latest` names `tag`)
        durable.fsync_dir(aside)                 # its names on disk before `latest` names it
        durable.fsync_dir(save_dir)
        _write_latest(save_dir, aside_tag)
        named = aside_tag
    _discard(final)
    os.replace(final + ".tmp", final)
    durable.fsync_dir(save_dir)                  # the rename on disk before `latest` names it
    if save_latest or named == aside_tag:      # (the aside stood in for `tag`: hand `latest` back)
        _write_latest(save_dir, tag)
        named = tag
    if named != aside_tag:
        _discard(aside)
