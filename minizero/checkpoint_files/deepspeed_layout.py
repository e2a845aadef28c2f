"""DeepSpeed's checkpoint files by name, and the arithmetic of its two partitionings.

ZeRO-1/2 pad each param group's flat buffer to a multiple of 2N and cut it into N
partitions; ZeRO-3 pads each parameter on its own to ceil(n / N) elements per rank
(stage_1_and_2.py, stage3.py). deepspeed_checkpoint.py reads a folder with these,
export_deepspeed.py writes one (docs/checkpoints.md, "DeepSpeed's layout").
"""
from __future__ import annotations

import math

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{r}_mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("master", "exp_avg", "exp_avg_sq")

# The model-states entries DeepSpeed writes itself; every other top-level key is the
# client_state the user passed to save_checkpoint (engine.py: _load_checkpoint).
DS_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                 "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                 "checkpoint_parallel_dimensions", "universal_checkpoint_info"}


def zero12_partition_numel(numel: int, world_size: int) -> int:
    """ZeRO-1/2 pad a param group's flat buffer to a multiple of 2N (nccl_start_alignment_factor
    2 times the world size), then cut it into N equal partitions (stage_1_and_2.py)."""
    align = 2 * world_size
    return math.ceil(numel / align) * align // world_size


def zero12_tail_padding(numel: int, world_size: int, rank: int) -> int:
    """Padding elements inside rank's partition (`groups_padding`): DeepSpeed saves the
    fp32 master partition without them, Adam's moments with them."""
    p = zero12_partition_numel(numel, world_size)
    return min(p, max(0, (rank + 1) * p - numel))


def zero12_offsets(numels, alignment_paddings=None) -> list[int]:
    """Offset of each parameter in its group's flat buffer: laid end to end, each followed
    by its `param_alignment_paddings` entry (zeros unless parameter_alignment is on)."""
    pads = alignment_paddings or [0] * len(numels)
    out, off = [], 0
    for n, pad in zip(numels, pads):
        out.append(off)
        off += n + pad
    return out


def zero3_partition_numel(numel: int, world_size: int) -> int:
    """ZeRO-3 pads each parameter on its own to ceil(n / N) elements per rank."""
    return math.ceil(numel / world_size)


def assign_groups(names, shapes: dict, group_shapes: list[list]) -> list[list[str]]:
    """Stage 0 saves no parameter names with the optimizer: torch numbers its state by group,
    each group in the order it was given. Given the module's names in order and each group's
    shapes in order, find the names of each group, supposing each group lists its parameters
    in module order (as model.configure_param_groups does). Unique or None."""
    found = []

    def walk(i, heads, taken):
        if len(found) > 1:
            return
        if i == len(names):
            if all(h == len(gs) for h, gs in zip(heads, group_shapes)):
                found.append([list(t) for t in taken])
            return
        for g, gs in enumerate(group_shapes):
            if heads[g] < len(gs) and tuple(gs[heads[g]]) == tuple(shapes[names[i]]):
                heads[g] += 1
                taken[g].append(names[i])
                walk(i + 1, heads, taken)
                taken[g].pop()
                heads[g] -= 1

    if sum(map(len, group_shapes)) == len(names):
        walk(0, [0] * len(group_shapes), [[] for _ in group_shapes])
    return found[0] if len(found) == 1 else None
