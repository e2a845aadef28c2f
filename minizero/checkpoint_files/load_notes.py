"""What a load says it changed: the one line rank 0 logs after loading a checkpoint onto
another world size, stage, layout, library or dtype (checkpoint_io.py), naming what carried
over exactly and what could not (the RNG of ranks the saving run did not have, the data
order, the dtype's rounding and loss scale).
"""
from __future__ import annotations

from .checkpoint_state import DTYPE_NAMES


def rank_span(a: int, b: int) -> str:
    return f"rank {a}" if a == b else f"ranks {a}-{b}"


def _moved_note(path: str, library: str, n: int, stage: int, dtype: str, saved_scaler: dict | None, engine,
                has_rng: bool, optimizer: bool, how: str) -> str:
    """The one line a load onto another world size or layout says: what it did, and what
    did not carry over."""
    m = engine.world_size
    ranks = lambda k: f"{k} rank{'s' if k != 1 else ''}"
    lib = {"deepspeed": "DeepSpeed checkpoint", "dcp": "DCP checkpoint"}.get(library, "checkpoint")
    carried = "fp32 master weights" + (", Adam's moments and step" if optimizer else "") + \
        ", lr schedule, loss scale and step counters carried over exactly"
    lost = []
    ours = _dtype_name(engine.dtype)
    if dtype != ours:
        lost.append(f"saved in {dtype}, this run is {ours}: the {ours} weights are rounded from the masters, "
                    f"{_scale_clause(saved_scaler, engine)}")
    if not optimizer:
        lost.append("Adam's moments and step start fresh (not loaded)")
    if not has_rng:
        lost.append("no saved RNG state (dropout) to restore")
    elif m > n:
        lost.append(f"{rank_span(n, m - 1)} {'have' if m - n > 1 else 'has'} no saved RNG state (dropout) and "
                    f"keep{'' if m - n > 1 else 's'} {'their' if m - n > 1 else 'its'} own")
    elif m < n:
        lost.append(f"the RNG state{'s' if n - m > 1 else ''} of {rank_span(m, n - 1)} "
                    f"{'are' if n - m > 1 else 'is'} dropped")
    if m != n:
        lost.append(f"each batch is split over {ranks(m)}, not {n}, so data order and dropout masks differ from "
                    f"a run that never stopped")
    return (f"{path}: {lib} of {ranks(n)} at ZeRO stage {stage} {how} onto {ranks(m)} at stage "
            f"{engine.zero_optimization_stage()}: {carried}" + "".join(f"; {x}" for x in lost))


def _dtype_name(d) -> str:
    return DTYPE_NAMES.get(str(d), str(d))


def _scale_clause(saved_scaler: dict | None, engine) -> str:
    if engine.loss_scaler is not None and saved_scaler is None:
        return f"the loss scale starts fresh at {engine.loss_scale:g} (initial_scale_power)"
    if engine.loss_scaler is None and saved_scaler is not None:
        return f"the saved loss scale {saved_scaler['cur_scale']:g} is dropped"
    return "there is no loss scale either side"


def _dtype_change(meta: dict, engine, path: str) -> str:
    saved, ours = _dtype_name(meta["dtype"]), _dtype_name(engine.dtype)
    scale = _scale_clause(meta["loss_scaler"], engine)
    return (f"{path} was saved in {saved}, this run is {ours}: fp32 master weights and Adam state restored "
            f"exactly, the {ours} weights rounded from them, {scale}; the run will not match one continued "
            f"in {saved}")
