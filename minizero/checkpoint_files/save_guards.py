"""What a save checks before it writes anything, whatever the format (minizero's own,
checkpoint_io.py; DCP, dcp_checkpoint.py), and the RNG state each rank saves and restores.

`refuse_non_finite` and `refuse_unshared` are collectives: every rank checks its own side,
and all agree through one all-reduce, so every rank refuses together, before any file is
written (checkpoint_io.py's docstring says why each refusal exists).
"""
from __future__ import annotations

import os
import shutil
import socket

import torch

from .. import comm
from . import shared_folder
from .checkpoint_errors import CheckpointError
from .checkpoint_folder import read_latest


def rng_state() -> dict:
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    if "cpu" not in st:   # a rank the saving run did not have (python -m minizero.reshard writes {})
        return
    torch.set_rng_state(st["cpu"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def refuse_non_finite(engine, state: dict, save_dir: str, tag: str) -> None:
    """Collective: every rank checks its own shards; one MAX all-reduce tells all which
    ranks hold an inf/NaN, and then all of them refuse, before anything is written."""
    bad = any(not bool(torch.isfinite(t).all()) for t in [*state["masters"], *state["shards"]])
    flags = torch.zeros(engine.world_size, device=engine.device)
    flags[engine.global_rank] = float(bad)
    comm.all_reduce(flags, op="max", label="checkpoint_finite")
    ranks = [r for r, v in enumerate(flags.tolist()) if v > 0]
    if ranks:
        prev = read_latest(save_dir)
        kept = f"'latest' still names {prev}" if prev is not None else "there is no 'latest' yet"
        raise CheckpointError(f"refusing to save checkpoint {tag}: the weights are non-finite (inf/NaN) on rank "
                              f"{', '.join(map(str, ranks))}; nothing was written, {kept}")


def refuse_unshared(engine, save_dir: str, tmp: str) -> None:
    """Collective: does every rank see the `<tag>.tmp` folder rank 0 just made (after a while
    of re-reading, for a shared file system's cache: shared_folder.py)? If not, the save
    folder is node-local: every rank raises, and rank 0 removes its folder."""
    blind = shared_folder.ranks_blind_to(
        tmp, os.path.isdir, lambda f: comm.all_reduce(f, op="max", label="checkpoint_shared"), engine.device)
    if not blind:
        return
    hosts = comm.all_gather_object(socket.gethostname())
    if engine.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    where = ", ".join(f"rank {r} on {hosts[r]}" for r in blind[:4]) + (" ..." if len(blind) > 4 else "")
    raise CheckpointError(f"save folder {save_dir} is not shared by all ranks: {where} cannot see the folder rank 0 "
                          f"(on {hosts[0]}) created in it, after {shared_folder.VISIBLE_WAIT_S:g} s of looking. Every "
                          f"rank writes its shard into one folder: put --save-dir on a filesystem all nodes mount "
                          f"(NFS, Lustre, ...)")
