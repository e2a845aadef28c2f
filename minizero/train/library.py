"""What differs between minizero and DeepSpeed in the training script: a `Library`.

train.py runs the same loop under either; minizero's is MINIZERO here, DeepSpeed's is
reference/train.py's DEEPSPEED. USER_ERRORS: the exceptions that mean bad input (one line,
no traceback).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from minizero import memory
from minizero.checkpoint_files.checkpoint_io import CheckpointError
from minizero.gpt.cifar10 import DatasetNotFoundError
from minizero.gpt.data import UnknownDatasetError
from minizero.gpt.images import DataConfigError
from minizero.gpt.model import ModelConfigError, UnknownPresetError
from minizero.config import ConfigError, load_config
from minizero.train import runlog
from minizero.train.train_args import UserError


@dataclass
class Library:
    """What differs between minizero and DeepSpeed in this script (everything else is shared)."""
    name: str
    initialize: Callable            # (model, param_groups, cfg, args) -> engine
    loss_scale: Callable            # engine -> float
    model_state_bytes: Callable     # engine -> dict (this rank)
    comm_snapshot: Callable         # engine -> {op: {"wire_bytes": int, ...}} since start
    check_config: Callable          # (cfg, world_size) -> cfg as the engine will use it
    user_errors: tuple = field(default_factory=tuple)   # exception types that mean bad input
    held_bytes: Callable | None = None   # engine -> dict: what it holds right now (runlog.MemoryMoments)
    peaks: Callable | None = None        # engine -> a recorder of the last step's peaks (runlog.MemoryMoments)
    # run -> (summary dict, printed table) of the comms logger, or None when it is off; called
    # by runlog.finish on every rank when all are there (DeepSpeed's log_summary is collective)
    comms_summary: Callable | None = None


def _minizero_initialize(model, param_groups, cfg, args):
    import minizero
    import minizero.checkpointing
    engine, _, _, _ = minizero.initialize(model=model, model_parameters=param_groups, config=cfg)
    if "activation_checkpointing" in cfg:   # the engine configured it; the model checkpoints its blocks
        model.checkpoint_fn = minizero.checkpointing.checkpoint
    return engine


def _minizero_check_config(cfg, world_size):
    load_config(cfg, world_size)   # unknown keys / bad values -> ConfigError naming the key
    return cfg


def _minizero_comms_summary(run):
    """minizero's comms logger (the config's comms_logger section): DeepSpeed's log_summary
    numbers and table, this rank's (comms_logger.py); rank 0 prints the table."""
    from minizero.observe import comms_logger
    if comms_logger.current is None:
        return None
    summary = comms_logger.current.summary()
    table = comms_logger.format_table(summary) + "\n"
    runlog.log0(f"minizero: comms logger, rank 0 (DeepSpeed's log_summary table; also in "
                f"{os.path.join(run.save_dir, 'comms_summary.txt')}):\n{table}", end="")
    return summary, table


MINIZERO = Library(
    name="minizero",
    initialize=_minizero_initialize,
    loss_scale=lambda engine: float(engine.loss_scale),
    model_state_bytes=lambda engine: engine.memory_breakdown(),
    comm_snapshot=lambda engine: engine.comm_stats(),
    check_config=_minizero_check_config,
    held_bytes=memory.held_bytes,
    peaks=runlog.MinizeroPeaks,
    comms_summary=_minizero_comms_summary,
)

USER_ERRORS = (UserError, ConfigError, DataConfigError, DatasetNotFoundError, UnknownDatasetError,
               ModelConfigError, UnknownPresetError, CheckpointError)
