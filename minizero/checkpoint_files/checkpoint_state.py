"""A saved training state apart from how it was laid out, and a layout's shards built from it.

A checkpoint folder is one layout of a training state: N ranks, ZeRO stage s, one way
of grouping parameters into flat buffers. The state itself does not depend on any of
that: per parameter, its fp32 master and Adam's two moments; per param group, Adam's
hyper-parameters and step; and the run's counters, lr schedule, loss scale and
client_state. `CheckpointSource` is that state, read slice by slice from whatever
layout holds it (`MinizeroSource` here; DeepSpeed's folders in deepspeed_checkpoint.py, PyTorch
DCP folders in dcp_source.py).

Resharding is then slicing (partition.py has the arithmetic): for each FlatParam of the
new layout, rank r's shard is [r * S, (r + 1) * S) of the padded buffer; the parameter
slices inside it (`params_in_range`) are read from the source, which finds the shards
that hold them in the old layout (`shards_holding`) and reads only those files, mmap'd.
`rank_state` builds what one rank holds, in the form a rank's optimizer file holds it;
checkpoint_io.load uses it for this rank, `python -m minizero.reshard` for every rank.
docs/checkpoints.md walks through it with numbers.
"""
from __future__ import annotations

import math
import os
import re

import torch

from .checkpoint_folder import MODEL_FILE, CheckpointError, load_file, optim_file, rng_file
from ..partition import padded_numel, param_offsets, params_in_range, shard_range, shards_holding

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
KINDS = ("master", "exp_avg", "exp_avg_sq")
COUNTERS = ("global_steps", "skipped_steps", "micro_steps", "global_samples")


class CheckpointSource:
    """A saved training state, described independently of its layout.

    library             "minizero" | "deepspeed" | "dcp"
    folder              the tag folder
    world_size          ranks that wrote it
    zero_stage          0..3
    dtype               "fp32" | "bf16" | "fp16"
    names               trainable parameter names (model.named_parameters() names), model order
    shapes              name -> shape
    groups              per optimizer param group, in order: {"names": [...] (model order),
                        "hparams": {lr, betas, eps, weight_decay, ...}, "step": Adam's step (0: no state)}
    has_optimizer_state whether Adam's moments were saved
    counters            global_steps, skipped_steps, micro_steps, global_samples
    lr_scheduler        state_dict as minizero's lr_schedules saves it, or None
    loss_scaler         minizero's fp16 loss scaler state_dict, or None when not fp16
    client_state        what the trainer saved beside the model
    config              the DeepSpeed-style config the run used, when saved (else None)

    read(kind, name, start, stop): fp32, elements [start, stop) of that parameter
    (flattened, row-major); kind is "master", "exp_avg" or "exp_avg_sq". Reads only the
    files that hold the slice.
    rng_state(rank): that rank's saved RNG state, or None.
    """
    library: str
    folder: str
    world_size: int
    zero_stage: int
    dtype: str
    names: list
    shapes: dict
    groups: list
    has_optimizer_state: bool
    counters: dict
    lr_scheduler: dict | None = None
    loss_scaler: dict | None = None
    client_state: dict
    config: dict | None = None

    def read(self, kind: str, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def rng_state(self, rank: int) -> dict | None:
        return None

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def describe(self) -> str:
        lib = "DeepSpeed" if self.library == "deepspeed" else self.library
        return (f"{self.folder} ({lib}: {self.world_size} rank{'s' if self.world_size != 1 else ''}, "
                f"ZeRO stage {self.zero_stage}, {self.dtype})")


def slice_bounds(source: CheckpointSource, kind: str, name: str, start: int, stop: int | None) -> tuple[int, int]:
    """[start, stop) of parameter `name` checked against what `source` holds, stop defaulting to
    its end: the argument checks of every CheckpointSource.read."""
    if kind not in KINDS:
        raise ValueError(f"read: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if name not in source.shapes:
        raise KeyError(f"{source.folder} holds no parameter {name!r}")
    n = source.numel(name)
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"read {name}[{start}:{stop}): the parameter has {n} elements")
    return start, stop


class MinizeroSource(CheckpointSource):
    """A minizero tag folder, any stage, any world size.

    Its model-states file has the layout (each FlatParam's names and shapes, in buffer
    order); rank r's optimizer file holds slice r of every FlatParam's fp32 master and of
    Adam's moments (stage 0: rank 0's file holds them whole). A parameter at `offset` in
    FlatParam i lies at [offset, offset + numel) of that padded buffer, cut into shards of
    padded_numel / N elements."""
    library = "minizero"

    def __init__(self, folder: str, meta: dict | None = None):
        self.folder = os.path.normpath(folder)
        self._dir, self._tag = os.path.split(self.folder)
        meta = meta if meta is not None else load_file(self._dir, self._tag, MODEL_FILE)
        if "layout" not in meta:
            raise CheckpointError(f"{self.folder} is not a minizero checkpoint (no layout in {MODEL_FILE})")
        self.meta, self.layout = meta, meta["layout"]
        self.world_size, self.zero_stage = meta["world_size"], meta["stage"]
        self.dtype = DTYPE_NAMES.get(meta["dtype"], meta["dtype"])
        # one optimizer file per shard: the world size at ZeRO-1/2/3, one at stage 0, S under HSDP
        self.files = meta.get("partition_count", self.world_size if self.zero_stage > 0 else 1)
        self._where, self.shapes = {}, {}
        for i, f in enumerate(self.layout):
            numels = [math.prod(s) for s in f["shapes"]]
            for name, shape, off in zip(f["names"], f["shapes"], param_offsets(numels)):
                self._where[name] = (i, off)
                self.shapes[name] = tuple(shape)
        # Model order is saved since resharding exists; older folders: buffer order.
        self.names = list(meta.get("param_names") or [n for f in self.layout for n in f["names"]])
        self.counters = {k: meta[k] for k in COUNTERS}
        self.lr_scheduler, self.loss_scaler = meta["lr_scheduler"], meta["loss_scaler"]
        self.client_state, self.config = meta["client_state"], meta.get("config")
        self._files = {}
        self._read_groups()

    def _read_groups(self) -> None:
        """Param groups from rank 0's optimizer file: hyper-parameters, Adam's step, and which
        state entry is which FlatParam (torch numbers them group by group, in buffer order)."""
        opt = self._rank_file(0)["optimizer"]
        flat_group = [f.get("group", _group_from_label(f["label"])) for f in self.layout]
        order = {n: k for k, n in enumerate(self.names)}
        self._state_id, self.groups = {}, []
        for g, pg in enumerate(opt["param_groups"]):
            flats = [i for i, fg in enumerate(flat_group) if fg == g]
            if len(flats) != len(pg["params"]):
                raise CheckpointError(f"{self._path(optim_file(0))}: its param group {g} holds {len(pg['params'])} "
                                      f"buffers, the layout says {len(flats)}; the files are not from one checkpoint")
            self._state_id.update(zip(flats, pg["params"]))
            st = opt["state"].get(pg["params"][0]) if pg["params"] else None
            names = sorted((n for i in flats for n in self.layout[i]["names"]), key=order.__getitem__)
            self.groups.append({"names": names, "hparams": {k: v for k, v in pg.items() if k != "params"},
                                "step": int(st["step"]) if st and "step" in st else 0})
        self.has_optimizer_state = bool(opt["state"])

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _rank_file(self, r: int) -> dict:
        """Rank r's optimizer file, mmap'd (only the pages read are read), checked once."""
        if r not in self._files:
            d = load_file(self._dir, self._tag, optim_file(r), mmap=True)
            masters = d.get("masters") if isinstance(d, dict) else None
            if masters is None or "optimizer" not in d or len(masters) != len(self.layout):
                raise CheckpointError(f"{self._path(optim_file(r))}: not an optimizer file of this checkpoint's "
                                      f"layout ({len(self.layout)} buffers); the files are not from one checkpoint")
            for f, m in zip(self.layout, masters):
                if m.numel() * self.files != f["padded_numel"]:
                    raise CheckpointError(f"{self.folder}: the shards of {f['label']} hold {m.numel() * self.files} "
                                          f"values, the layout says {f['padded_numel']}; the optimizer files are "
                                          f"not from one checkpoint")
            self._files[r] = d
        return self._files[r]

    def _shard(self, r: int, kind: str, i: int) -> torch.Tensor:
        d = self._rank_file(r)
        if kind == "master":
            return d["masters"][i]
        try:
            return d["optimizer"]["state"][self._state_id[i]][kind]
        except KeyError:
            raise CheckpointError(f"{self._path(optim_file(r))}: no Adam {kind} for {self.layout[i]['label']} "
                                  f"(saved without optimizer state?)") from None

    def read(self, kind: str, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        start, stop = slice_bounds(self, kind, name, start, stop)
        i, off = self._where[name]
        shard = self.layout[i]["padded_numel"] // self.files
        parts = [self._shard(r, kind, i)[lo:hi] for r, lo, hi in shards_holding(off + start, off + stop, shard)]
        return torch.cat(parts).float() if parts else torch.zeros(0)   # a copy: nothing mmap'd escapes

    def rng_state(self, rank: int) -> dict | None:
        if rank >= self.world_size:
            return None
        return load_file(self._dir, self._tag, rng_file(rank)) or None


def _group_from_label(label: str) -> int:
    """The param group of a FlatParam saved before layouts recorded it: stages 0-2 label
    theirs group<g>..., ZeRO-3 <unit>.g<g>[.persist]."""
    m = re.match(r"group(\d+)", label) or re.search(r"\.g(\d+)(\.persist)?$", label)
    if m is None:
        raise CheckpointError(f"cannot tell the param group of the saved buffer {label!r}")
    return int(m.group(1))


# ----------------------------------------------------------------------------- a layout from a source

def model_difference(saved: dict, ours: dict) -> str:
    """Which names differ between two {name: shape} tables, in a few words: the names only
    in the checkpoint, only in the model, and the shapes that differ (three of each at most)."""
    saved = {n: tuple(s) for n, s in saved.items()}
    ours = {n: tuple(s) for n, s in ours.items()}
    def few(names):
        names = sorted(names)
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    only_saved, only_ours = set(saved) - set(ours), set(ours) - set(saved)
    shaped = sorted(n for n in set(saved) & set(ours) if saved[n] != ours[n])
    return "; ".join(x for x in (
        f"only in the checkpoint: {few(only_saved)}" if only_saved else "",
        f"only in this model: {few(only_ours)}" if only_ours else "",
        "other shapes: " + ", ".join(f"{n} {saved[n]} saved, {ours[n]} here" for n in shaped[:2]) if shaped else "")
        if x)


def check_same_model(source: CheckpointSource, ours: dict, path: str) -> None:
    """ours: name -> shape of the model being loaded into."""
    what = model_difference(source.shapes, ours)
    if what:
        raise CheckpointError(f"checkpoint {path} is from a different model ({what}); load it into the model it "
                              f"was saved from, or start a new run")


def check_same_groups(source: CheckpointSource, ours: list[set], path: str) -> None:
    """ours: per param group of this run, its parameter names. Adam's hyper-parameters and
    step are per group, so the groups must hold the same parameters."""
    saved = [set(g["names"]) for g in source.groups]
    if saved != ours:
        if len(saved) != len(ours):
            what = f"{len(saved)} param groups, this run has {len(ours)}"
        else:
            g = next(k for k, (a, b) in enumerate(zip(saved, ours)) if a != b)
            what = f"param group {g} holds other parameters (e.g. {sorted(saved[g] ^ ours[g])[:2]})"
        raise CheckpointError(f"checkpoint {path} has {what}; build the param groups as the saved run did")
    amsgrad = [k for k, g in enumerate(source.groups) if g["hparams"].get("amsgrad")]
    if amsgrad:
        raise CheckpointError(f"checkpoint {path} uses amsgrad (param group {amsgrad[0]}): its max_exp_avg_sq is "
                              f"not resharded; resume at the world size, stage and grouping it was saved with")


def build_shard(source: CheckpointSource, kind: str, names, shapes, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the padded flat fp32 buffer of these parameters (in this
    order), read from the source slice by slice; padding is zero, as a live buffer's is."""
    out = torch.zeros(stop - start, dtype=torch.float32)
    numels = [math.prod(s) for s in shapes]
    for i, lo, hi, at in params_in_range(numels, start, stop):
        out[at:at + hi - lo] = source.read(kind, names[i], lo, hi)
    return out


def rank_state(source: CheckpointSource, layout: list[dict], num_shards: int, shard_index: int,
               optimizer: bool = True) -> dict:
    """What rank `shard_index` of a run with this layout holds, from the source:
    {"masters": [fp32 shard per FlatParam], "optimizer": torch Adam state_dict or None},
    the form of a minizero optimizer file. layout: per FlatParam, in buffer order,
    {"names", "shapes", "group"}; num_shards: the world size (1 at stage 0)."""
    masters, moments = [], []
    if hasattr(source, "prefetch"):   # a DCP folder reads every slice this rank needs in one load
        kinds = KINDS if optimizer and source.has_optimizer_state else KINDS[:1]
        source.prefetch([(k, f["names"][i], lo, hi) for f in layout for k in kinds
                         for i, lo, hi, _ in params_in_range([math.prod(s) for s in f["shapes"]],
                                                             *shard_range(sum(math.prod(s) for s in f["shapes"]),
                                                                          num_shards, shard_index))])
    for f in layout:
        numel = sum(math.prod(s) for s in f["shapes"])
        start, stop = shard_range(numel, num_shards, shard_index)
        assert stop - start == padded_numel(numel, num_shards) // num_shards
        args = (f["names"], f["shapes"], start, stop)
        masters.append(build_shard(source, "master", *args))
        if optimizer and source.has_optimizer_state:
            moments.append({k: build_shard(source, k, *args) for k in ("exp_avg", "exp_avg_sq")})
    return {"masters": masters, "optimizer": adam_state_dict(source, layout, moments) if moments else None}


def adam_state_dict(source: CheckpointSource, layout: list[dict], moments: list[dict]) -> dict:
    """torch's Adam state_dict for these shards: state entries numbered group by group, each
    group's FlatParams in buffer order (as ShardedOptimizer hands them to Adam), every entry
    with its group's step; each group's hyper-parameters as saved."""
    state, groups, sid = {}, [], 0
    for g, saved in enumerate(source.groups):
        ids = []
        for f, mom in zip(layout, moments):
            if f["group"] == g:
                state[sid] = {"step": torch.tensor(float(saved["step"]), dtype=torch.float32), **mom}
                ids.append(sid)
                sid += 1
        groups.append({**saved["hparams"], "params": ids})
    return {"state": state, "param_groups": groups}


def fill_missing_hparams(state_dict: dict, defaults: list[dict]) -> None:
    """Give each saved param group the hyper-parameters it does not carry (a source from
    another library may leave out torch's flags), from `defaults` (per group; this run's
    groups when loading). torch would fill what is missing with Adam's defaults, and Adam's
    `decoupled_weight_decay` default is False: an AdamW run would silently become Adam."""
    for saved, ours in zip(state_dict["param_groups"], defaults):
        for k, v in ours.items():
            if k != "params":
                saved.setdefault(k, v)
