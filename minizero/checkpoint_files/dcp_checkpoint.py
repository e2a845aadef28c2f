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
process, and `DcpSource` reads a DCP folder as a CheckpointSource, so loading, resharding
and exporting it to DeepSpeed are the paths every other format takes (checkpoint_state.py).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch

from .. import comm
from ..partition import params_in_range, shard_range
from ..version import __version__
from . import durable
from .checkpoint_folder import CheckpointError, publish
from .checkpoint_state import KINDS, CheckpointSource
from .dcp_files import METADATA_FILE, check_files, load_items, read_metadata, save_items, saved_step  # noqa: F401
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
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    rank = engine.global_rank
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()
    refuse_unshared(engine, save_dir, tmp)
    entries = engine_entries(state, client_state, rng_state())
    save_items(entries, tmp, no_dist=not torch.distributed.is_initialized())
    durable.fsync_dir(tmp)
    comm.barrier()
    if rank == 0:
        publish(save_dir, tag, save_latest)
    comm.barrier()
    return final


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


# ----------------------------------------------------------------------------- reading

_STATE_KEY = re.compile(r"state\.(.+)\.(exp_avg|exp_avg_sq|step|max_exp_avg_sq)$")
_GROUP_KEY = re.compile(r"param_groups\.(.+)\.([A-Za-z_][A-Za-z0-9_]*)$")


def _set(root: dict, path: tuple, value) -> None:
    """Put `value` at `path` in `root`: dict keys, and list positions where the path's next
    element is an int (how DCP's planner_data spells a value's place in the nested state)."""
    cur = root
    for here, nxt in zip(path[:-1], path[1:]):
        if isinstance(cur, list):
            cur.extend([None] * (here + 1 - len(cur)))
            if cur[here] is None:
                cur[here] = [] if isinstance(nxt, int) else {}
            cur = cur[here]
        else:
            cur = cur.setdefault(here, [] if isinstance(nxt, int) else {})
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    cur[path[-1]] = value


class DcpSource(CheckpointSource):
    """A DCP folder (written by FSDP2, torchtitan, minizero's `save` or export_dcp) as a
    CheckpointSource: names and shapes from `.metadata`; a parameter's slice read through
    DCP's own resharding reader (only the saved chunks that overlap it), a rank's slices all
    at once when rank_state announces them (`prefetch`).

    Recognised layouts: torchtitan's (model at the top level, `optimizer.` flattened per
    parameter, above) and the DCP tutorial's (`model.` and `optim.`/`optimizer.`, either
    optimizer form). Without a `run` record (a folder FSDP2 or torchtitan wrote) the param
    groups are the parameters of equal hyper-parameters, and a loading engine's own groups
    are adopted when the saved values agree with them (`adopt_groups`), as
    set_optimizer_state_dict does."""
    library = "dcp"
    KEEP_NUMEL = 1 << 26   # fp32 elements read and held for later slices: 256 MB

    def __init__(self, folder: str):
        self.folder = os.path.normpath(folder)
        self.metadata = md = read_metadata(self.folder)
        check_files(self.folder, md)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        paths = md.planner_data or {}
        self._tensor = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        path_of = {k: tuple(paths.get(k, (k,))) for k in md.state_dict_metadata}
        # in metadata order: rank 0's keys first, which is the model's order for FSDP2 (every rank holds every key)
        top = [k for k, p in path_of.items() if len(p) == 1 and k in self._tensor and p[0] not in NAMESPACES]
        model_ns = None
        if not top:   # the DCP tutorial's {"model": ..., "optim": ...}
            model_ns = "model" if any(p[0] == "model" for p in path_of.values()) else None
            top = [k for k, p in path_of.items() if model_ns and p[0] == model_ns and k in self._tensor]
        if not top:
            raise CheckpointError(f"{self.folder}: a DCP checkpoint with no model parameters minizero can find "
                                  f"(neither torchtitan's top-level names nor a 'model.' section)")
        self._model_key = {(path_of[k][-1] if model_ns else k): k for k in top}
        self._state_key, self._hparam = {}, {}
        self._nested_groups: dict[int, dict] = {}
        for k, p in path_of.items():
            if p[0] not in ("optimizer", "optim"):
                continue
            rest = p[1:]
            if len(rest) == 1 and (m := _STATE_KEY.match(rest[0])):      # flattened per parameter
                self._state_key[(m.group(2), m.group(1))] = k
            elif len(rest) == 1 and (m := _GROUP_KEY.match(rest[0])):
                self._hparam.setdefault(m.group(1), {})[m.group(2)] = k
            elif len(rest) == 3 and rest[0] == "state":                       # nested: state.<fqn>.<kind>
                self._state_key[(rest[2], rest[1])] = k
            elif len(rest) >= 3 and rest[0] == "param_groups" and isinstance(rest[1], int):
                self._nested_groups.setdefault(rest[1], {})[rest[2]] = k
        self._paths = path_of
        small = {k for k, p in path_of.items() if p[0] in ("train_state", "lr_scheduler", "loss_scaler",
                                                            "client_state", "run")}
        small |= {k for (kind, _), k in self._state_key.items() if kind == "step"}
        self._small = self._read(small)
        run = self._small.get("run") or {}
        self.run = run
        names = list(run.get("param_names") or [])
        mine = set(self._model_key)
        if names and set(names) != mine:
            raise CheckpointError(f"{self.folder}: its run record names other parameters than its metadata; the "
                                  f"folder is damaged")
        self.names = names or [n for n in self._model_key]   # metadata order: rank 0's, the model's for FSDP2
        self.shapes = {n: tuple(md.state_dict_metadata[self._model_key[n]].size) for n in self.names}
        self.world_size = int(run.get("world_size") or len({i.relative_path for i in md.storage_data.values()}) or 1)
        self.zero_stage = int(run.get("zero_stage", 3))
        self.dtype = run.get("dtype") or "fp32"
        self.writer = run.get("library") or "dcp"   # who wrote it: minizero, torch, or unknown
        self.config = json.loads(run["config"]) if run.get("config") else None
        self.has_optimizer_state = any(kind == "exp_avg" for kind, _ in self._state_key)
        self.lr_scheduler = self._small.get("lr_scheduler") or None
        self.loss_scaler = self._small.get("loss_scaler") or None
        self.client_state = self._small.get("client_state") or {}
        self._steps = {name: float(self._small_value(k)) for (kind, name), k in self._state_key.items()
                       if kind == "step"}
        self._read_groups(run.get("param_groups"))
        self.counters = self._counters()
        self._have: dict = {}   # (kind, name) -> (lo, hi, elements [lo, hi)), oldest first
        self._held = 0

    # ------------------------------------------------------------------ small values
    def _read(self, keys) -> dict:
        """The values of these keys, unflattened to their nested form (DCP's planner_data)."""
        md = self.metadata.state_dict_metadata
        flat = {k: (torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) if k in self._tensor else None)
                for k in keys}
        if flat:
            load_items(self.folder, flat, metadata=self.metadata)
        out: dict = {}
        for k, v in flat.items():
            _set(out, self._paths[k], v)
        self._flat_small = {**getattr(self, "_flat_small", {}), **flat}
        return out

    def _small_value(self, key):
        return self._flat_small[key]

    def _counters(self) -> dict:
        ts = self._small.get("train_state") or {}
        cfg = self.config or {}
        steps = int(ts["step"]) if "step" in ts else int(max(self._steps.values(), default=0))
        gas = int(cfg.get("gradient_accumulation_steps") or 1)
        batch = cfg.get("train_batch_size") or 0
        return {"global_steps": steps,
                "skipped_steps": int(ts.get("skipped_steps", 0)),
                "micro_steps": int(ts["micro_steps"]) if "micro_steps" in ts else steps * gas,
                "global_samples": int(ts["global_samples"]) if "global_samples" in ts else steps * int(batch)}

    def _hparams_of(self, name: str) -> dict:
        keys = self._hparam.get(name, {})
        missing = [k for k in keys.values() if k not in self._flat_small]
        if missing:
            self._read(missing)
        return {h: self._flat_small[k] for h, k in keys.items()}

    def _read_groups(self, recorded) -> None:
        order = {n: i for i, n in enumerate(self.names)}
        if recorded:
            members = [sorted(g, key=order.__getitem__) for g in recorded]
        elif self._nested_groups:
            got = self._read([k for g in self._nested_groups.values() for k in g.values()])
            ns = "optimizer" if "optimizer" in got else "optim"
            pgs = got[ns]["param_groups"]
            members = [sorted(pg.get("params", []), key=lambda n: order.get(n, 1 << 30)) for pg in pgs]
            self.groups = [{"names": m, "hparams": {k: v for k, v in pg.items() if k != "params"},
                            "step": int(self._steps.get(m[0], 0)) if m else 0} for m, pg in zip(members, pgs)]
            return
        else:   # FSDP2's flattened form keeps no grouping: parameters of equal hyper-parameters
            seen: list[tuple[dict, list]] = []
            for n in self.names:
                h = self._hparams_of(n)
                for hp, ms in seen:
                    if hp == h:
                        ms.append(n)
                        break
                else:
                    seen.append((h, [n]))
            members = [ms for _, ms in seen]
        self.groups = [self._group(ms) for ms in members]

    def _group(self, names: list) -> dict:
        hp = self._hparams_of(names[0]) if names else {}
        return {"names": list(names), "hparams": hp, "step": int(self._steps.get(names[0], 0)) if names else 0}

    def adopt_groups(self, ours: list[set], path: str) -> None:
        """Take the loading run's param groups when the folder keeps none of its own (FSDP2's
        flattened optimizer state): every member of each group must have the same saved
        hyper-parameters and Adam step, else one CheckpointError line."""
        if self.run.get("param_groups") or self._nested_groups:
            return
        order = {n: i for i, n in enumerate(self.names)}
        groups = []
        for g, names in enumerate(ours):
            names = sorted((n for n in names if n in order), key=order.__getitem__)
            if not names:
                groups.append({"names": [], "hparams": {}, "step": 0})
                continue
            first = self._hparams_of(names[0])
            odd = [n for n in names if self._hparams_of(n) != first or
                   self._steps.get(n, 0) != self._steps.get(names[0], 0)]
            if odd:
                raise CheckpointError(f"checkpoint {path}: param group {g} of this run holds {names[0]} and {odd[0]}, "
                                      f"whose saved hyper-parameters or Adam steps differ; build the param groups "
                                      f"as the saved run did")
            groups.append(self._group(names))
        self.groups = groups

    def require_optimizer_state(self, path: str | None = None) -> None:
        """One CheckpointError line when the folder holds no optimizer state (a model-only
        DCP save): it cannot continue training, and nothing is converted or loaded from it."""
        if not self.has_optimizer_state:
            raise CheckpointError(f"{path or self.folder} holds no optimizer state (no optimizer.state.<name>.exp_avg "
                                  f"entries: saved without the optimizer?): it cannot continue training; save it with "
                                  f"the optimizer's state (get_optimizer_state_dict), or start a new run from its weights")

    # ------------------------------------------------------------------ tensors
    def _key(self, kind: str, name: str) -> str:
        if kind == "master":
            return self._model_key[name]
        try:
            return self._state_key[(kind, name)]
        except KeyError:
            raise CheckpointError(f"{self.folder}: no Adam {kind} for {name} (saved without optimizer state?)") from None

    def prefetch(self, wanted) -> None:
        """Read these slices, (kind, name, lo, hi) each, in one DCP load: each becomes the
        `boxes` it covers, and DCP reads the saved chunks that overlap them."""
        sd, where = {}, {}
        for kind, name, lo, hi in wanted:
            if hi <= lo or (kind != "master" and not self.has_optimizer_state):
                continue
            key = self._key(kind, name)
            t = Pieces.empty(self.shapes[name], lo, hi)
            t.loading = True
            sd[key], where[key] = t, (kind, name, lo, hi)
        if sd:
            load_items(self.folder, sd, metadata=self.metadata)
        for key, (kind, name, lo, hi) in where.items():
            self._keep((kind, name), (lo, hi, sd[key].flat()))

    def _keep(self, key, held) -> None:
        """Hold what was read, the oldest dropped beyond KEEP_NUMEL elements (a reader that
        comes back to each parameter once per rank, as a DeepSpeed export does, reads its
        whole tensor once)."""
        old = self._have.pop(key, None)
        self._held += held[1] - held[0] - (old[1] - old[0] if old else 0)
        self._have[key] = held
        while len(self._have) > 1 and self._held > self.KEEP_NUMEL:
            lo, hi, _ = self._have.pop(next(iter(self._have)))
            self._held -= hi - lo

    def read(self, kind: str, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if kind not in KINDS:
            raise ValueError(f"read: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if name not in self.shapes:
            raise KeyError(f"{self.folder} holds no parameter {name!r}")
        n = self.numel(name)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"read {name}[{start}:{stop}): the parameter has {n} elements")
        have = self._have.get((kind, name))
        if have is None or not (have[0] <= start and stop <= have[1]):
            self.prefetch([(kind, name, 0, n)])   # a slice not announced: the whole tensor, kept
            have = self._have[(kind, name)]
        return have[2][start - have[0]:stop - have[0]].clone()

    def rng_state(self, rank: int) -> dict | None:
        key = f"rank_{rank}"
        if not hasattr(self, "_rng"):
            self._rng = self._read({k for k, p in self._paths.items() if p[0] == "rng"}).get("rng", {})
        st = self._rng.get(key)
        return dict(st) if st else None

    def describe(self) -> str:
        who = {"minizero": "minizero", "torch": "PyTorch", "deepspeed": "DeepSpeed"}.get(self.writer, "an unknown writer")
        return f"{self.folder} (DCP, written by {who}: {self.world_size} rank{'s' if self.world_size != 1 else ''})"


def open_source(folder: str) -> DcpSource:
    return DcpSource(folder)


__all__ = ["boxes", "Pieces", "save", "write_source", "DcpSource", "open_source", "saved_step", "METADATA_FILE"]
