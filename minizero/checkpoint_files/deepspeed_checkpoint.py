"""DeepSpeed's checkpoint folders as a CheckpointSource: read without importing deepspeed.

A tag folder DeepSpeed's `engine.save_checkpoint` wrote holds the same training state as a
minizero one (fp32 masters, Adam's moments and step, counters, lr schedule, loss scale),
laid out DeepSpeed's way (docs/checkpoints.md, "DeepSpeed's layout"):

    stage 0   mp_rank_00_model_states.pt: the module's weights, and the optimizer whole
              (fp32: torch's Adam state_dict, the module is the master; bf16/fp16:
              FP16_UnfusedOptimizer's, one fp32 master per parameter in `fp32_groups`)
    ZeRO-1/2  mp_rank_00_model_states.pt: the module, param_shapes, counters, schedule;
              [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt: rank r's partition of each
              param group's flat buffer (fp32 master without its tail padding, Adam's
              moments with it)
    ZeRO-3    zero_pp_rank_<r>_mp_rank_00_model_states.pt (one per rank, empty module
              tensors), and the optimizer files: per sub-group, rank r's piece of every
              parameter, each parameter padded to ceil(n / N) per rank

The arithmetic of both partitionings is in deepspeed_layout.py (`zero12_*`, `zero3_*`;
which ranks hold a range is partition.shards_holding, as for minizero's own);
`open_source(tag_folder)` checks the folder and returns a
`DeepSpeedSource`, which reads a parameter's slice from only the files that hold it,
mmap'd. What minizero cannot continue from (pipeline or tensor parallelism, MoE, NVMe
offload, frozen parameters, a damaged file) is one CheckpointError line.

DeepSpeed pickles some of its own classes into these files (the loss scaler, ZeroStageEnum,
fragment_address). `torch_load` (deepspeed_pickle.py) unpickles them as `Foreign` stand-ins
that keep their attributes, so nothing here imports deepspeed; export_deepspeed.py writes
them back the same way.
"""
from __future__ import annotations

import math
import os
import re

import torch

from .checkpoint_folder import CheckpointError, _why
from .checkpoint_state import CheckpointSource
# DeepSpeed's file names and partition arithmetic, and its pickled classes read without it:
# imported from here by export_deepspeed.py and the tests too.
from .deepspeed_layout import (DS_MODEL_KEYS, DTYPES, KINDS, MODEL_FILE, OPTIM_FILE, ZERO3_MODEL_FILE,  # noqa: F401
                               assign_groups, zero3_partition_numel, zero12_offsets, zero12_partition_numel,
                               zero12_tail_padding)
from .deepspeed_pickle import Foreign, foreign_class, foreign_object, torch_load, torch_save  # noqa: F401
from ..partition import shards_holding


# ----------------------------------------------------------------------------- the source

def _dtype(cfg: dict) -> str:
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        sec = cfg.get(key)
        if isinstance(sec, dict) and sec.get("enabled", False):
            return name
    return "fp32"


def _int(v) -> int:
    return int(v.item()) if torch.is_tensor(v) else int(v)


def open_source(folder: str) -> "DeepSpeedSource":
    """The CheckpointSource of a tag folder DeepSpeed's save_checkpoint wrote; CheckpointError
    (one line) for a folder minizero cannot continue from."""
    return DeepSpeedSource(folder)


class DeepSpeedSource(CheckpointSource):
    library = "deepspeed"

    def __init__(self, folder: str):
        self.folder = os.path.normpath(folder)
        if not os.path.isdir(self.folder):
            raise CheckpointError(f"{self.folder}: no such checkpoint folder")
        files = sorted(os.listdir(self.folder))
        self._refuse_foreign_files(files)
        z3 = ZERO3_MODEL_FILE.format(r=0)
        model_file = MODEL_FILE if MODEL_FILE in files else z3 if z3 in files else None
        if model_file is None:
            raise CheckpointError(f"{self.folder} is not a DeepSpeed checkpoint (no {MODEL_FILE} or {z3})")
        meta = torch_load(self._path(model_file))
        if not isinstance(meta, dict) or "ds_config" not in meta or "dp_world_size" not in meta:
            raise CheckpointError(f"{self._path(model_file)} is not a DeepSpeed model-states file (no ds_config)")
        self._refuse_foreign_meta(meta, model_file)
        cfg = meta["ds_config"] or {}
        self.config = cfg
        self.zero_stage = _int((cfg.get("zero_optimization") or {}).get("stage", 0) or 0)
        if (model_file == z3) != (self.zero_stage == 3):
            raise CheckpointError(f"{self.folder}: its config says ZeRO stage {self.zero_stage} but it holds "
                                  f"{model_file}; the folder mixes two checkpoints")
        self.world_size = _int(meta["dp_world_size"])
        self.dtype = _dtype(cfg)
        self.meta = meta
        gas = _int(cfg.get("gradient_accumulation_steps", 1) or 1)
        self.counters = {"global_steps": _int(meta["global_steps"]), "skipped_steps": _int(meta["skipped_steps"]),
                         "global_samples": _int(meta.get("global_samples", 0)),
                         # not saved: checkpoints are taken at a boundary, gas micro-steps per step
                         "micro_steps": _int(meta["global_steps"]) * gas}
        self.lr_scheduler = meta.get("lr_scheduler")
        self.client_state = {k: v for k, v in meta.items() if k not in DS_MODEL_KEYS}
        module_names = [k for k in (meta.get("module") or {}) if k not in set(meta.get("buffer_names") or ())]
        self._files = {}
        if self.zero_stage == 0:
            self._read_stage0(meta, module_names)
        else:
            self._read_zero(meta, module_names)
        self.loss_scaler = self._loss_scaler()

    # -- refusals ---------------------------------------------------------------------
    def _refuse_foreign_files(self, files) -> None:
        if "offloaded_tensors" in files:
            raise CheckpointError(f"{self.folder} holds NVMe-offloaded optimizer state (offloaded_tensors/): minizero "
                                  f"cannot read it; resume it with DeepSpeed")
        for f in files:
            m = re.search(r"mp_rank_(\d+)", f)
            if f.startswith("layer_") or (m and m.group(1) != "00"):
                what = "pipeline parallelism (layer_* files)" if f.startswith("layer_") else \
                    f"tensor/model parallelism ({f})"
                raise CheckpointError(f"{self.folder} was saved with {what}: minizero does data parallelism only; "
                                      f"consolidate it with DeepSpeed's tools first")
            if f.startswith(("expp_rank_", "expert_")):
                raise CheckpointError(f"{self.folder} holds mixture-of-experts state ({f}): minizero cannot read it")

    def _refuse_foreign_meta(self, meta: dict, model_file: str) -> None:
        dims = meta.get("checkpoint_parallel_dimensions") or {}
        pp, tp = _int(dims.get("pp_degree", 1) or 1), _int(dims.get("tp_degree", 1) or 1)
        if pp > 1 or tp > 1 or _int(meta.get("mp_world_size", 1) or 1) > 1:
            raise CheckpointError(f"{self.folder} was saved with pipeline/tensor parallelism (pp {pp}, tp {tp}, "
                                  f"mp_world_size {meta.get('mp_world_size')}): minizero does data parallelism only")
        zero = (meta.get("ds_config") or {}).get("zero_optimization") or {}
        off = zero.get("offload_optimizer") or {}
        if isinstance(off, dict) and off.get("device") == "nvme":
            raise CheckpointError(f"{self.folder} was saved with offload_optimizer to NVMe: its optimizer state is "
                                  f"not in the folder's files; resume it with DeepSpeed")
        if meta.get("frozen_param_shapes"):
            raise CheckpointError(f"{self.folder} holds frozen parameters (requires_grad=False): minizero trains all "
                                  f"parameters; load the weights only")

    # -- stage 0: the optimizer is whole in the model-states file -----------------------
    def _read_stage0(self, meta: dict, module_names: list) -> None:
        opt, module = meta.get("optimizer"), meta["module"]
        self.names = module_names
        self.shapes = {n: tuple(module[n].shape) for n in module_names}
        if opt is None:
            raise CheckpointError(f"{self._path(MODEL_FILE)} holds no optimizer state (saved without an optimizer?)")
        if "fp32_groups_flat" in opt:
            raise CheckpointError(f"{self._path(MODEL_FILE)} was saved by FP16_Optimizer (FusedAdam at stage 0): "
                                  f"minizero reads stage 0 with torch_adam (FP16_UnfusedOptimizer) or ZeRO-1..3")
        if "optimizer_state_dict" in opt:      # FP16_UnfusedOptimizer (bf16, fp16): a master per parameter
            torch_sd = opt["optimizer_state_dict"]
            group_shapes = [[tuple(t.shape) for t in g] for g in opt["fp32_groups"]]
        elif "state" in opt and "param_groups" in opt:   # fp32: the torch optimizer itself
            torch_sd = opt
            group_shapes = [[tuple(torch_sd["state"][i]["exp_avg"].shape) if i in torch_sd["state"] else None
                             for i in g["params"]] for g in torch_sd["param_groups"]]
            if any(s is None for g in group_shapes for s in g):
                raise CheckpointError(f"{self._path(MODEL_FILE)}: stage 0 without Adam state: cannot tell which "
                                      f"parameter is which")
        else:
            raise CheckpointError(f"{self._path(MODEL_FILE)}: an optimizer DeepSpeed saved in a form minizero does "
                                  f"not know (keys {sorted(opt)[:6]})")
        pgs, state = torch_sd["param_groups"], torch_sd["state"]
        names = assign_groups(module_names, self.shapes, group_shapes)
        if names is None:
            raise CheckpointError(f"{self._path(MODEL_FILE)}: cannot tell which saved optimizer entry is which "
                                  f"parameter (stage 0 saves no names; the param groups are not in module order)")
        self._stage0 = {}   # name -> (fp32 master, Adam state id)
        for g, (pg, gnames) in enumerate(zip(pgs, names)):
            for j, (sid, n) in enumerate(zip(pg["params"], gnames)):
                master = opt["fp32_groups"][g][j] if "fp32_groups" in opt else module[n]   # fp32: the module
                self._stage0[n] = (master, sid)
        order = {n: k for k, n in enumerate(module_names)}
        self._state = state
        self.groups = [self._group(pg, state, sorted(gn, key=order.__getitem__)) for pg, gn in zip(pgs, names)]
        self.has_optimizer_state = bool(state)

    @staticmethod
    def _group(pg: dict, state: dict, names: list) -> dict:
        """A param group as CheckpointSource has it; Adam's step is in each of its state entries."""
        first = state.get(pg["params"][0]) if pg["params"] else None
        step = first["step"] if first and "step" in first else 0
        return {"names": names, "hparams": {k: v for k, v in pg.items() if k != "params"}, "step": _int(step)}

    # -- ZeRO-1/2/3: one optimizer file per rank ------------------------------------------
    def _read_zero(self, meta: dict, module_names: list) -> None:
        shapes_per_group = meta.get("param_shapes")
        if not shapes_per_group:
            raise CheckpointError(f"{self.folder}: the model-states file has no param_shapes; not a ZeRO checkpoint "
                                  f"minizero knows")
        self.shapes = {n: tuple(s) for g in shapes_per_group for n, s in g.items()}
        trainable = set(self.shapes)
        self.names = [n for n in module_names if n in trainable] or list(self.shapes)
        missing = [r for r in range(self.world_size) if self._optim_name(r) is None]
        if missing:
            raise CheckpointError(f"{self.folder}: missing the optimizer file of rank {missing[0]} "
                                  f"({OPTIM_FILE.format(r=missing[0])}); the checkpoint is incomplete")
        sd0 = self._rank(0)
        count = sd0.get("partition_count")
        counts = count if isinstance(count, list) else [count]
        if any(_int(c) != self.world_size for c in counts):
            raise CheckpointError(f"{self.folder}: its optimizer files are partitioned {counts} ways, the model-states "
                                  f"file says {self.world_size} ranks (expert parallelism?); minizero cannot read it")
        order = {n: k for k, n in enumerate(self.names)}
        self._where = {}
        if self.zero_stage == 3:
            self._layout_zero3(sd0, shapes_per_group, order)
        else:
            self._layout_zero12(sd0, shapes_per_group, order)

    def _layout_zero12(self, sd0: dict, shapes_per_group: list, order: dict) -> None:
        if "single_partition_of_fp32_groups" not in sd0:
            raise CheckpointError(f"{self._path(self._optim_name(0))}: not a ZeRO-1/2 optimizer file "
                                  f"(no single_partition_of_fp32_groups)")
        base = sd0["base_optimizer_state"]
        if not isinstance(base, dict):
            raise CheckpointError(f"{self.folder} was saved with zero_optimization.elastic_checkpoint, which keeps no "
                                  f"param-group hyper-parameters; minizero reads the default (rigid) form only")
        state, pgs = base["state"], base["param_groups"]
        if len(pgs) != len(shapes_per_group):
            raise CheckpointError(f"{self.folder}: {len(pgs)} optimizer param groups, param_shapes has "
                                  f"{len(shapes_per_group)}; the files are not from one checkpoint")
        paddings = sd0.get("param_alignment_paddings") or [None] * len(shapes_per_group)
        self._part, self._group_state, self.groups, totals = [], [], [], []
        for g, (shapes, pg) in enumerate(zip(shapes_per_group, pgs)):
            names = list(shapes)
            numels = [math.prod(s) for s in shapes.values()]
            offs = zero12_offsets(numels, paddings[g])
            total = offs[-1] + numels[-1] if numels else 0
            self._part.append(zero12_partition_numel(total, self.world_size))
            for n, o in zip(names, offs):
                self._where[n] = (g, o)
            self._group_state.append(pg["params"][0])
            self.groups.append(self._group(pg, state, sorted(names, key=order.__getitem__)))
            totals.append(total)
        self.has_optimizer_state = bool(state)
        for g, m in enumerate(sd0["single_partition_of_fp32_groups"]):
            if m.numel() != self._part[g] - zero12_tail_padding(totals[g], self.world_size, 0):
                raise CheckpointError(f"{self._path(self._optim_name(0))}: group {g} holds {m.numel()} values, "
                                      f"its layout says {self._part[g]} per rank; the files are not from one checkpoint")

    def _layout_zero3(self, sd0: dict, shapes_per_group: list, order: dict) -> None:
        if "fp32_flat_groups" not in sd0:
            raise CheckpointError(f"{self._path(self._optim_name(0))}: not a ZeRO-3 optimizer file (no fp32_flat_groups)")
        osd = sd0["optimizer_state_dict"]
        state, pgs = osd["state"], osd["param_groups"]
        # torch numbers state entries group by group; each param group's entries are its
        # sub-groups in order (stage3.py: _set_fp32_optimizer_param_groups)
        sub_ids = [sid for pg in pgs for sid in pg["params"]]
        if len(sub_ids) != len(shapes_per_group) or len(sd0["fp32_flat_groups"]) != len(shapes_per_group):
            raise CheckpointError(f"{self.folder}: {len(sub_ids)} optimizer entries for {len(shapes_per_group)} "
                                  f"sub-groups; the files are not from one checkpoint")
        self._sub_state = sub_ids
        for k, shapes in enumerate(shapes_per_group):
            off = 0
            for n, s in shapes.items():
                c = zero3_partition_numel(math.prod(s), self.world_size)
                self._where[n] = (k, off, c)
                off += c
            if sd0["fp32_flat_groups"][k].numel() != off:
                raise CheckpointError(f"{self._path(self._optim_name(0))}: sub-group {k} holds "
                                      f"{sd0['fp32_flat_groups'][k].numel()} values, its parameters need {off}; "
                                      f"the files are not from one checkpoint")
        self.groups, k = [], 0
        for pg in pgs:
            names = [n for kk in range(k, k + len(pg["params"])) for n in shapes_per_group[kk]]
            k += len(pg["params"])
            self.groups.append(self._group(pg, state, sorted(names, key=order.__getitem__)))
        self.has_optimizer_state = bool(state)

    # -- files ---------------------------------------------------------------------------
    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _optim_name(self, r: int) -> str | None:
        for prefix in (("bf16_", "") if self.dtype == "bf16" else ("", "bf16_")):
            name = prefix + OPTIM_FILE.format(r=r)
            if os.path.isfile(self._path(name)):
                return name
        return None

    def _rank(self, r: int) -> dict:
        """Rank r's optimizer_state_dict, mmap'd (only the pages read are read)."""
        if r not in self._files:
            name = self._optim_name(r)
            d = torch_load(self._path(name))
            if not isinstance(d, dict) or not isinstance(d.get("optimizer_state_dict"), dict):
                raise CheckpointError(f"{self._path(name)}: not a DeepSpeed optimizer file (no optimizer_state_dict)")
            self._files[r] = d["optimizer_state_dict"]
        return self._files[r]

    def _tensor(self, r: int, kind: str, g: int) -> torch.Tensor:
        sd = self._rank(r)
        if self.zero_stage == 3:
            if kind == "master":
                return sd["fp32_flat_groups"][g]
            return sd["optimizer_state_dict"]["state"][self._sub_state[g]][kind]
        if kind == "master":
            return sd["single_partition_of_fp32_groups"][g]
        return sd["base_optimizer_state"]["state"][self._group_state[g]][kind]

    # -- reading ---------------------------------------------------------------------------
    def read(self, kind: str, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if kind not in KINDS:
            raise ValueError(f"read: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if name not in self.shapes:
            raise KeyError(f"{self.folder} holds no parameter {name!r}")
        n = math.prod(self.shapes[name])
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"read {name}[{start}:{stop}): the parameter has {n} elements")
        if kind != "master" and not self.has_optimizer_state:
            raise CheckpointError(f"{self.folder}: no Adam {kind} (saved before the first step?)")
        try:
            if self.zero_stage == 0:
                master, sid = self._stage0[name]
                t = master if kind == "master" else self._state[sid][kind]
                return t.reshape(-1)[start:stop].float().clone()
            if self.zero_stage == 3:
                k, off, c = self._where[name]
                parts = [self._tensor(r, kind, k)[off + lo:off + hi] for r, lo, hi in shards_holding(start, stop, c)]
            else:
                g, off = self._where[name]
                parts = [self._tensor(r, kind, g)[lo:hi]
                         for r, lo, hi in shards_holding(off + start, off + stop, self._part[g])]
        except CheckpointError:
            raise
        except (KeyError, IndexError) as e:
            raise CheckpointError(f"{self.folder}: the optimizer files hold no {kind} for {name} ({e!r}); "
                                  f"the files are not from one checkpoint") from None
        out = torch.cat(parts).float() if parts else torch.zeros(0)
        if out.numel() != stop - start:
            raise CheckpointError(f"{self.folder}: {name}[{start}:{stop}) has {out.numel()} values in the optimizer "
                                  f"files; the files are not from one checkpoint")
        return out.clone()

    def rng_state(self, rank: int):
        return None   # DeepSpeed does not save RNG states

    # -- the loss scaler ---------------------------------------------------------------------
    def _loss_scaler(self) -> dict | None:
        """minizero's fp16 scaler state_dict (fp16.py), or None when not fp16. ZeRO-1/2/3 pickle
        DeepSpeed's own DynamicLossScaler / LossScaler (the same attribute names as minizero's);
        stage 0 (FP16_UnfusedOptimizer) saves only some of them: the rest come from the config,
        as that optimizer does without hysteresis (docs/deepspeed.md, "Stage 0 fp16 loss scaler
        has no hysteresis")."""
        if self.dtype != "fp16":
            return None
        fp16 = self.config.get("fp16") or {}
        hyst = _int(fp16.get("hysteresis", 2))
        if self.zero_stage == 0:
            opt = self.meta["optimizer"]
            if not opt.get("dynamic_loss_scale"):
                return {"cur_scale": float(opt["cur_scale"])}
            return {"cur_scale": float(opt["cur_scale"]), "cur_iter": _int(opt["cur_iter"]),
                    "last_overflow_iter": _int(opt["last_overflow_iter"]), "scale_factor": float(opt["scale_factor"]),
                    "scale_window": _int(opt["scale_window"]), "min_scale": float(fp16.get("min_loss_scale", 1)),
                    "delayed_shift": hyst, "cur_hysteresis": hyst,
                    "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
                    "raise_error_at_min_scale": True}
        scaler = self._rank(0).get("loss_scaler")
        attrs = getattr(scaler, "__dict__", {})
        if "cur_scale" not in attrs:
            raise CheckpointError(f"{self._path(self._optim_name(0))}: fp16 checkpoint without a loss scaler")
        if not attrs.get("dynamic"):
            return {"cur_scale": float(attrs["cur_scale"])}
        keys = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
                "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale")
        return {k: attrs[k] for k in keys}
