"""The `activation_checkpointing` options: what each key means, and DeepSpeed's precedence.

The keys and their defaults are declared once, as `ActivationCheckpointingConfig` in
config/__init__.py (load_config parses the section there; `configure` below reads the same table).
Precedence as DeepSpeed's `configure` (checkpointing.py): start from the defaults, apply
the config's `activation_checkpointing` section (a dict or a JSON path), then any explicit
keyword. Under pure data parallelism (minizero's only mode) the keys mean:

- partition_activations: split saved inputs across the *model-parallel* group, which has
  one rank here: a no-op (`describe` says so at configure).
- cpu_checkpointing: keep saved block inputs in (pinned) CPU memory until backward.
- contiguous_memory_optimization / number_checkpoints: copy saved inputs into one
  preallocated buffer of `number_checkpoints` slots per input position.
- synchronize_checkpoint_boundary: device synchronize around each checkpoint.
- profile: time forward, recompute and backward of each checkpoint.

This module is pure (no module state): the current config, the contiguous buffers and the
timings live in exactly one place, `minizero.checkpointing`, whose `configure` and
`configure_from` call `resolve`, `check` and `describe` from here.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..config import ActivationCheckpointingConfig, read_json

__all__ = ["resolve", "check", "describe"]

SECTION = "activation_checkpointing"


def _section_of(deepspeed_config) -> ActivationCheckpointingConfig:
    """The parsed `activation_checkpointing` section of a config given as a dict or a JSON path."""
    if isinstance(deepspeed_config, (str, os.PathLike)):
        deepspeed_config = read_json(deepspeed_config)
    if not isinstance(deepspeed_config, dict):
        raise TypeError(f"deepspeed_config must be a dict or a path to a JSON file, got {type(deepspeed_config).__name__}")
    # DeepSpeed ignores unknown keys here silently; a typo would silently turn a feature off.
    return ActivationCheckpointingConfig.parse(deepspeed_config.get(SECTION), SECTION)


def _mp_world_size(mpu) -> int:
    if mpu is None:
        return 1
    if hasattr(mpu, "get_tensor_model_parallel_world_size"):
        return mpu.get_tensor_model_parallel_world_size()
    return mpu.get_model_parallel_world_size()


def resolve(deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
            num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None
            ) -> ActivationCheckpointingConfig:
    """The options `minizero.checkpointing.configure(...)` sets, with DeepSpeed's precedence."""
    cfg = _section_of(deepspeed_config) if deepspeed_config is not None else ActivationCheckpointingConfig()
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def check(cfg: ActivationCheckpointingConfig, mpu) -> None:
    """DeepSpeed's checks in configure(); `mpu` is the one configure will keep."""
    if _mp_world_size(mpu) > 1:
        raise NotImplementedError("activation checkpointing: minizero is data-parallel only; an mpu with "
                                  "model-parallel world size > 1 would need activation partitioning across it")
    # DeepSpeed's two assertions, word for word.
    if cfg.contiguous_memory_optimization:
        assert cfg.partition_activations, "Contiguous Checkpointing is only available with partitioned activations. Set partitioned activations to true in deepspeed config"
    if cfg.contiguous_memory_optimization:
        assert cfg.number_checkpoints is not None, "Must specify the number of layers with contiguous memory checkpointing"


def describe(cfg: ActivationCheckpointingConfig) -> str:
    """What each option does in *this* run, said once (at configure, on rank 0)."""
    on_cuda = torch.cuda.is_available()
    lines = [f"activation checkpointing (Chen et al. 2016): {cfg}"]
    if cfg.partition_activations:
        lines.append("  partition_activations: splits each checkpointed input across the *model-parallel* group; "
                     "pure data parallelism has one model-parallel rank, so there is nothing to split: no-op here "
                     "(DeepSpeed makes a full flat copy of the input and empties the original)")
    if cfg.cpu_checkpointing:
        lines.append("  cpu_checkpointing: saved block inputs move to CPU memory" +
                     (" (pinned) and back to their device in backward" if on_cuda else
                      "; here they already are in CPU memory, so the move runs but copies nothing"))
    if cfg.contiguous_memory_optimization:
        lines.append(f"  contiguous_memory_optimization: saved inputs are copied into one preallocated buffer of "
                     f"{cfg.number_checkpoints} slots per input position (fights allocator fragmentation on GPU; "
                     f"on CPU it is only an extra copy)")
    if cfg.synchronize_checkpoint_boundary:
        lines.append("  synchronize_checkpoint_boundary: " + ("torch.cuda.synchronize() at each checkpoint's "
                     "forward/backward start and end" if on_cuda else "device synchronize is a no-op on CPU"))
    if cfg.profile:
        lines.append("  profile: forward, recompute and backward of every checkpoint timed with "
                     "time.perf_counter and logged; totals in minizero.checkpointing.timings()")
    return "\n".join(lines)
