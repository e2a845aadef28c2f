"""A training state as a PyTorch Distributed Checkpoint (DCP): what FSDP2 and torchtitan save.

DCP keys a checkpoint by names, not by ranks: every parameter under its fully qualified
name (`blocks.0.attn.key.weight`), every optimizer state per parameter. Each rank writes the
pieces it holds, says in `.metadata` which rectangle of the tensor each piece is (offsets,
sizes), and a load at any world size reads the rectangles it needs (dcp_files.py has the
folder and its safe reading). The keys here are torchtitan's (its CheckpointManager):

    <fqn>                                   the fp32 parameter (minizero's master, FSDP2's sharded parameter)
    optimizer.state.<fqn>.exp_avg           Adam's moments, the parameter's shape; and .exp_avg_sq
    optimizer.state.<fqn>.step              Adam's step (an fp32 scalar, as torch keeps it)
    optimizer.param_groups.<fqn>.<name>     the hyper-parameters of the parameter's group (lr, betas, ...)
    lr_scheduler.<name>                     the schedule's state_dict
    train_state.step                        optimizer steps (engine.global_steps); minizero adds
                                            .skipped_steps, .micro_steps, .global_samples
    loss_scaler.<name>                      fp16's dynamic loss scaler (no such key otherwise)
    rng.rank_<r>.cpu (.cuda)                rank r's RNG state, one key per rank (as torchtitan
                                            keeps per-rank data: dataloader.dp_rank_<r>)
    client_state.<...>                      what the trainer passed to save_checkpoint
    run.<name>                              who wrote it: library, world_size, zero_stage, dtype,
                                            config (JSON), param_groups (names per group), param_names

The optimizer keys are the flattened per-parameter form of
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer,
options=StateDictOptions(flatten_optimizer_state_dict=True))`, which `set_optimizer_state_dict`
loads into FSDP2 at any world size.

**The trap, and what minizero declares.** FSDP2 cuts every parameter along dim 0, so each
rank's piece is a block of rows. minizero's flat shard cuts parameters at any element: rank r
may hold the last 210 elements of a 21 x 21 weight, i.e. the tail of row 10 (11 elements)
and rows 11..20. A writer that recorded only "rank r holds part of this tensor" would have a
loader assume the canonical even split and read the wrong offsets, silently. So each rank
declares the rectangles its range covers: a contiguous range of a row-major tensor is at most
three of them in 2-D (the tail of a first row, whole rows, the head of a last row; `boxes`),
each a DCP chunk with its own offsets and sizes, and DCP's planner checks that the ranks'
chunks tile every tensor exactly, with no gap or overlap, before anything is written.

`save` writes an engine's state from every rank in parallel (a collective), `write_source`
any saved state (a minizero or DeepSpeed folder: `python -m minizero.export_dcp`) from one
process; dcp_source.py reads a DCP folder back as a CheckpointSource, so loading, resharding
and exporting it to DeepSpeed are the paths every other format takes (checkpoint_state.py).
"""
from __future__ import annotations

import json
import math

import torch

from ..partition import params_in_range, shard_range
from ..version import __version__
from .checkpoint_folder import CheckpointError, open_tmp, publish_together
from .checkpoint_state import CheckpointSource
from .dcp_files import METADATA_FILE, save_items  # noqa: F401  (METADATA_FILE: the folder's one pickle)
from .save_guards import refuse_non_finite, refuse_unshared, rng_state
from .safe_load import numbers_as_python, refuse_unsafe_values

STATE_KINDS = ("exp_avg", "exp_avg_sq")
COUNTERS = ("global_steps", "skipped_steps", "micro_steps", "global_samples")
TRAIN_STATE = {"global_steps": "step", "skipped_steps": "skipped_steps", "micro_steps": "micro_steps",
               "global_samples": "global_samples"}
NAMESPACES = ("optimizer", "lr_scheduler", "train_state", "loss_scaler", "rng", "client_state", "run")
DTYPE_OF = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


# ----------------------------------------------------------------------------- rectangles

def boxes(shape, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Elements [lo, hi) of a row-major tensor of this shape as rectangles, (offsets, sizes)
    each, in order: the tail of the first row (of dim 0), the whole rows, the head of the
    last; recursively, so a 3-D tensor gives at most five. [] for an empty range."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, a = divmod(lo, inner)
    r1, b = divmod(hi, inner)
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], a, b)]
    out = []
    if a:
        out += [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], a, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if b:
        out += [((r1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, b)]
    return out


class Pieces(torch.Tensor):
    """Elements [lo, hi) of a tensor of `global_shape`, held as the block of dim-0 rows they
    fall in (at most two rows more than the range), and declared to DCP as the `boxes` they
    cover: DTensor's checkpoint protocol (__create_write_items__, __create_chunk_list__,
    __get_tensor_shard__), which DCP asks any tensor for before treating it as a whole one.

    Saving, each box is handed over as a copy of its own (torch.save of a view would write
    the whole block); loading, as a view DCP copies the saved values into."""

    @staticmethod
    def __new__(cls, block: torch.Tensor, row0: int, global_shape, lo: int, hi: int):
        t = torch.Tensor._make_subclass(cls, block)
        t.row0, t.global_shape, t.lo, t.hi = row0, torch.Size(global_shape), lo, hi
        t.boxes = boxes(global_shape, lo, hi)
        return t

    @classmethod
    def of(cls, flat: torch.Tensor, global_shape, lo: int, hi: int) -> "Pieces":
        """The pieces of these values, elements [lo, hi) of the flattened tensor."""
        block, row0, at = cls._block(global_shape, lo, hi, flat.dtype)
        block.view(-1)[at:at + hi - lo] = flat
        return cls(block, row0, global_shape, lo, hi)

    @classmethod
    def empty(cls, global_shape, lo: int, hi: int, dtype=torch.float32) -> "Pieces":
        block, row0, _ = cls._block(global_shape, lo, hi, dtype)
        return cls(block, row0, global_shape, lo, hi)

    @staticmethod
    def _block(shape, lo: int, hi: int, dtype):
        shape = tuple(shape)
        if len(shape) == 0:
            return torch.zeros((), dtype=dtype), 0, 0
        inner = math.prod(shape[1:])
        row0, row1 = lo // inner, (hi - 1) // inner + 1
        return torch.zeros((row1 - row0, *shape[1:]), dtype=dtype), row0, lo - row0 * inner

    def flat(self) -> torch.Tensor:
        """Elements [lo, hi), flattened (a plain tensor)."""
        inner = math.prod(self.global_shape[1:]) if len(self.global_shape) else 1
        at = self.lo - self.row0 * inner
        return self.as_subclass(torch.Tensor).reshape(-1)[at:at + self.hi - self.lo].clone()

    def _box(self, k: int) -> torch.Tensor:
        offsets, sizes = self.boxes[k]
        local = (offsets[0] - self.row0, *offsets[1:]) if offsets else ()
        plain = self.as_subclass(torch.Tensor)
        return plain[tuple(slice(o, o + s) for o, s in zip(local, sizes))]

    def _index(self, index) -> int:
        if index.index is not None and index.index < len(self.boxes) and \
                torch.Size(self.boxes[index.index][0]) == index.offset:
            return index.index
        for k, (offsets, _) in enumerate(self.boxes):
            if torch.Size(offsets) == index.offset:
                return k
        raise ValueError(f"{index.fqn}: no piece at {tuple(index.offset)}")

    # DTensor's _Checkpointable protocol (torch/distributed/checkpoint/planner_helpers.py)
    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o), k), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), torch.Size(s)),
                                                      properties=props, size=self.global_shape))
                for k, (o, s) in enumerate(self.boxes)]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in self.boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        box = self._box(self._index(index))
        return box if self.loading else box.clone()

    loading = False

    def size(self, dim=None):
        # what DCP compares with the saved shape (DTensor's size() is its global shape too)
        return self.global_shape if dim is None else self.global_shape[dim]


# ----------------------------------------------------------------------------- writing

def _run_record(library: str, world_size: int, stage: int, dtype: str, config: dict | None, groups: list,
                names: list) -> dict:
    return {"library": library, "world_size": world_size, "zero_stage": stage, "dtype": dtype,
            "config": json.dumps(numbers_as_python(config or {}), sort_keys=True, default=str),
            "param_groups": [list(g) for g in groups], "param_names": list(names), "version": __version__}


def _common(counters: dict, lr_scheduler, loss_scaler, client_state, run: dict) -> dict:
    out = {"train_state": {TRAIN_STATE[k]: torch.tensor(int(counters[k]), dtype=torch.int64) for k in COUNTERS},
           "run": run}
    if lr_scheduler:
        out["lr_scheduler"] = lr_scheduler
    if loss_scaler:
        out["loss_scaler"] = loss_scaler
    if client_state:
        out["client_state"] = client_state
    return out


def _rng_entry(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}


def engine_entries(state: dict, client_state: dict | None, rng: dict) -> dict:
    """This rank's DCP state dict, from engine.state_dict(): its pieces of every parameter and
    moment (the `boxes` of its flat range), the steps and hyper-parameters of the parameters
    it holds a piece of, its RNG; rank 0 also the counters, schedule, scaler, client_state
    and the run record."""
    layout, masters, opt = state["layout"], state["masters"], state["optimizer"]
    num_shards, shard = state["partition_count"], state["shard_index"]
    sid = {}   # FlatParam index -> Adam state id: numbered group by group, buffer order (checkpoint_state.adam_state_dict)
    for g, pg in enumerate(opt["param_groups"]):
        sid.update(zip([i for i, f in enumerate(layout) if f["group"] == g], pg["params"]))
    sd, optim = {}, {}
    for i, f in enumerate(layout):
        numels = [math.prod(s) for s in f["shapes"]]
        start, stop = shard_range(sum(numels), num_shards, shard)
        st = opt["state"].get(sid[i])
        hparams = {k: v for k, v in opt["param_groups"][f["group"]].items() if k != "params"}
        for j, lo, hi, at in params_in_range(numels, start, stop):
            name, shape = f["names"][j], tuple(f["shapes"][j])
            sd[name] = Pieces.of(masters[i][at:at + hi - lo].float(), shape, lo, hi)
            if st:
                for kind in STATE_KINDS:
                    optim[f"state.{name}.{kind}"] = Pieces.of(st[kind][at:at + hi - lo].float(), shape, lo, hi)
                optim[f"state.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()
            for k, v in numbers_as_python(hparams).items():
                optim[f"param_groups.{name}.{k}"] = v
    sd["optimizer"] = optim
    sd["rng"] = {f"rank_{state['rank']}": _rng_entry(rng)}
    if state["rank"] == 0:
        groups = [[n for n in state["param_names"] if any(n in f["names"] and f["group"] == g for f in layout)]
                  for g in range(len(opt["param_groups"]))]
        run = _run_record("minizero", state["world_size"], state["stage"], DTYPE_OF.get(state["dtype"], state["dtype"]),
                          state["config"], groups, state["param_names"])
        sd.update(_common(state["counters"], state["lr_scheduler"], state["loss_scaler"], client_state, run))
    return sd


def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True) -> str:
    """Collective: every rank writes its pieces of the engine's state into `<save_dir>/<tag>`,
    a DCP folder (`.metadata` and one `__<r>_0.distcp` per rank), published as
    checkpoint_io.save publishes minizero's (`<tag>.tmp` first, then renamed, then `latest`).
    FSDP2 loads the folder with torch.distributed.checkpoint.load; minizero with
    engine.load_checkpoint(save_dir, tag), at any world size and stage."""
    if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
        raise CheckpointError(f"saving at micro-step {engine.micro_steps}, inside a gradient-accumulation window: "
                              f"save right after the engine.step() that steps")
    tag = str(tag or f"global_step{engine.global_steps}")
    if tag.endswith(".tmp"):
        raise CheckpointError(f"checkpoint tag {tag!r}: use a name that does not end in .tmp")
    try:
        refuse_unsafe_values(client_state or {}, "client_state")
    except ValueError as e:
        raise CheckpointError(f"refusing to save checkpoint {tag}: {e}; nothing was written") from None
    state = engine.state_dict()
    refuse_non_finite(engine, state, save_dir, tag)
    tmp = open_tmp(save_dir, tag)
    refuse_unshared(engine, save_dir, tmp)
    entries = engine_entries(state, client_state, rng_state())
    save_items(entries, tmp, no_dist=not torch.distributed.is_initialized())
    return publish_together(save_dir, tag, save_latest)


def source_entries(source: CheckpointSource) -> dict:
    """A whole saved state (any CheckpointSource) as one process's DCP state dict: every
    tensor whole, one chunk each (python -m minizero.export_dcp)."""
    sd, optim = {}, {}
    group_of = {n: g for g in source.groups for n in g["names"]}
    for name in source.names:
        shape = tuple(source.shapes[name])
        sd[name] = source.read("master", name).view(shape).clone()
        g = group_of[name]
        if source.has_optimizer_state:
            for kind in STATE_KINDS:
                optim[f"state.{name}.{kind}"] = source.read(kind, name).view(shape).clone()
            optim[f"state.{name}.step"] = torch.tensor(float(g["step"]), dtype=torch.float32)
        for k, v in numbers_as_python(g["hparams"]).items():
            if k != "params":
                optim[f"param_groups.{name}.{k}"] = v
    sd["optimizer"] = optim
    sd["rng"] = {f"rank_{r}": _rng_entry(st) for r in range(source.world_size)
                 if (st := source.rng_state(r))}
    run = _run_record(source.library, source.world_size, source.zero_stage, source.dtype, source.config,
                      [g["names"] for g in source.groups], source.names)
    sd.update(_common(source.counters, source.lr_scheduler, source.loss_scaler, source.client_state, run))
    return sd


def write_source(source: CheckpointSource, folder: str) -> None:
    """Write the source's state as a DCP folder, from this process alone."""
    save_items(source_entries(source), folder, no_dist=True)


__all__ = ["boxes", "Pieces", "save", "engine_entries", "source_entries", "write_source", "METADATA_FILE"]
