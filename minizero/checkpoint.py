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

Atomic: everything goes into `<tag>.tmp` first; after a barrier rank 0 renames the folder
to `<tag>` and only then rewrites `latest` (via a temp file and `os.replace`). A crash
mid-save leaves a `.tmp` folder behind and `latest` still pointing at the previous
complete checkpoint.

Resume is bit-exact: the shards, Adam's moments and step counts, the LR scheduler, the
loss scaler, the step counters and every rank's RNG state are restored, and the trainer
keeps its data position in `client_state`.
"""
from __future__ import annotations

import os
import shutil

import torch

from . import __version__, comm

MODEL_FILE = "mp_rank_00_model_states.pt"


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


def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True) -> str:
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise CheckpointError(f"save_checkpoint at micro-step {engine.micro_steps} is inside a gradient-"
                              f"accumulation window of {engine.gradient_accumulation_steps()}: the partial "
                              f"gradients would be lost; save right after the engine.step() that steps")
    tag = tag or f"global_step{engine.global_steps}"
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    rank, zero = engine.global_rank, engine.zero
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
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
            "masters": [m.detach().cpu().clone() for m in zero.masters],
            "shards": [f.shard.detach().cpu().clone() for f in zero.flat_params],
            "optimizer": zero.optimizer.state_dict(),
            "partition_count": zero.shard_world(),
        }, os.path.join(tmp, optim_file(rank)))
    # RNG differs per rank even at stage 0 (dropout masks): every rank saves its own.
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank_{rank}.pt"))
    comm.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if save_latest:
            with open(os.path.join(save_dir, "latest.tmp"), "w") as fh:
                fh.write(tag)
            os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
    comm.barrier()
    return final


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()


def load(engine, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True):
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, MODEL_FILE)):
        raise CheckpointError(f"no minizero checkpoint at {path} (missing {MODEL_FILE})")
    meta = torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=False)
    zero = engine.zero
    _check_compatible(meta, engine, path)
    zero.zero_grad()  # a resumed step starts with no gradient, as the saved one did
    rank = engine.global_rank
    src = rank if zero.stage > 0 else 0
    shard_state = torch.load(os.path.join(path, optim_file(src)), map_location="cpu", weights_only=False)
    with torch.no_grad():
        for f, m, saved_m, saved_s in zip(zero.flat_params, zero.masters, shard_state["masters"], shard_state["shards"]):
            m.copy_(saved_m)
            f.shard.copy_(saved_s)
            if f.keep_full and zero.shard_world() > 1:
                f.all_gather(label="load")
    if load_optimizer_states:
        zero.optimizer.load_state_dict(shard_state["optimizer"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.global_steps, engine.skipped_steps = meta["global_steps"], meta["skipped_steps"]
    engine.micro_steps, engine.global_samples = meta["micro_steps"], meta["global_samples"]
    rng_file = os.path.join(path, f"rng_rank_{rank}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    return path, meta["client_state"]


def _check_compatible(meta: dict, engine, path: str) -> None:
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


def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 state dict (name -> tensor) from a sharded checkpoint, on one process.

    The fp32 masters of every rank are concatenated in rank order into each FlatParam's
    padded buffer, the padding is cut off, and each parameter is viewed back into its
    shape: the exact inverse of the partitioning in flat_param.py. Loadable by a plain
    `GPT` with `model.load_state_dict(sd)`. (DeepSpeed's equivalent is zero_to_fp32.py.)
    """
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir} (no 'latest' file; pass a tag)")
    path = os.path.join(checkpoint_dir, tag)
    meta = torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=False)
    n = meta["world_size"] if meta["stage"] > 0 else 1
    ranks = [torch.load(os.path.join(path, optim_file(r)), map_location="cpu", weights_only=False)
             for r in range(n)]
    out = {}
    for i, f in enumerate(meta["layout"]):
        full = torch.cat([r["masters"][i].float() for r in ranks])
        assert full.numel() == f["padded_numel"], (f["label"], full.numel(), f["padded_numel"])
        off = 0
        for name, shape in zip(f["names"], f["shapes"]):
            k = int(torch.Size(shape).numel())
            out[name] = full[off:off + k].view(shape).clone()
            off += k
    return out
