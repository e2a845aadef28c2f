"""The DeepSpeed JSON config, parsed into typed dataclasses with DeepSpeed 0.19.8's defaults.

Why a strict parser: DeepSpeed silently ignores unknown *top-level* keys (only the
pydantic sub-sections such as `zero_optimization` forbid extras). A student who types
`"gradient_cliping"` then trains with the default clip of 1.0 and never knows. minizero
refuses every key it does not implement, naming the key's path and the keys accepted
there. Keys that DeepSpeed accepts but that change nothing in minizero ("harmless") are
accepted only at the value that matches minizero's behaviour.

Defaults come from `deepspeed/runtime/constants.py`, `runtime/precision_config.py`,
`runtime/zero/config.py` and `runtime/activation_checkpointing/config.py`; the batch-size
arithmetic mirrors `DeepSpeedConfig._set_batch_related_parameters` / `_batch_assertion`
(`runtime/config.py`); the optimizer choice mirrors `DeepSpeedEngine._configure_basic_optimizer`
and `get_optimizer_configuration` (`runtime/engine.py`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from minizero import lr_schedules
from minizero.errors import ConfigError

__all__ = ["ConfigError", "Config", "load_config", "read_json", "build_optimizer", "resolve_batch_size"]


_MISSING = object()


# ----------------------------------------------------------------------------- value checks
# Each takes (value, path) and returns the cleaned value or raises ConfigError.

def _bool(v, path):
    if not isinstance(v, bool):
        raise ConfigError(f"{path} must be true or false, got {v!r}")
    return v


def _number(lo=None, lo_open=False):
    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{path} must be a finite number, got {v!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ConfigError(f"{path} must be {'>' if lo_open else '>='} {lo}, got {v!r}")
        return v
    return check


def _int(lo=0):
    """Integers; integral floats such as 5e8 (JSON has no int exponent form) are accepted."""
    def check(v, path):
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{path} must be an integer, got {v!r}")
        if v < lo:
            raise ConfigError(f"{path} must be >= {lo}, got {v}")
        return v
    return check


def _optional(check):
    return lambda v, path: None if v is None else check(v, path)


def _only(value, why):
    """A DeepSpeed key minizero accepts only at the value matching what minizero does."""
    def check(v, path):
        if v != value:
            raise ConfigError(f"{path} = {v!r} is not implemented in minizero ({why}); "
                              f"remove it or set it to {json.dumps(value)}")
        return v
    return check


def _any(v, path):
    return v


def _section(d, path, spec, aliases=None):
    """Validate dict `d` at `path` against spec {key: (default, check)} -> {key: value}."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must be a JSON object, got {d!r}")
    aliases = aliases or {}
    out = {}
    for key, value in d.items():
        name = aliases.get(key, key)
        if name not in spec:
            where = path or "the top level"
            accepted = ", ".join(sorted(list(spec) + list(aliases)))
            full = f"{path}.{key}" if path else key
            raise ConfigError(f"unknown config key '{full}': minizero does not implement it. "
                              f"Accepted keys in {where}: {accepted}")
        if name in out:
            raise ConfigError(f"{path}.{key} given twice (as '{name}' and its alias); keep one")
        out[name] = spec[name][1](value, f"{path}.{key}" if path else key)
    for key, (default, _) in spec.items():
        out.setdefault(key, default)
    return out


# ----------------------------------------------------------------------------- dataclasses

@dataclass
class OptimizerConfig:
    type: str                      # canonical "Adam" or "AdamW"
    params: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str                      # "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR"
    params: dict = field(default_factory=dict)


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0        # 0 = dynamic loss scaling
    initial_scale_power: int = 16  # dynamic scaling starts at 2**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1
    auto_cast: bool = False        # minizero's engine always casts float inputs

    @property
    def dynamic(self) -> bool:
        return self.enabled and self.loss_scale == 0


@dataclass
class BF16Config:
    enabled: bool = False
    # DeepSpeed >= 0.16: skip a step whose gradient norm is inf/NaN (as fp16 does), default on.
    check_grad_overflow: bool = True


@dataclass
class ZeroConfig:
    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False     # DS default is None -> True only at stage 3
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    memory_efficient_linear: bool = True
    sub_group_size: int = 1_000_000_000
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"


@dataclass
class ActivationCheckpointingConfig:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass
class Config:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = 1.0     # DS default is 1.0, not "off" (runtime/constants.py)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    steps_per_print: Optional[int] = None   # DS 0.19.8 default: None (never print)
    wall_clock_breakdown: bool = False
    raw: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        """The training (low-precision module) dtype."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32


# ----------------------------------------------------------------------------- specs

_BATCH = _optional(_int(lo=1))

_OPTIMIZER_PARAMS = {
    "lr": (_MISSING, _number(lo=0)),
    "betas": (_MISSING, lambda v, p: _betas(v, p)),
    "eps": (_MISSING, _number(lo=0, lo_open=True)),
    "weight_decay": (_MISSING, _number(lo=0)),
    "torch_adam": (False, _bool),
    "adam_w_mode": (True, _bool),
}


def _betas(v, path):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path} must be a list of two numbers like [0.9, 0.999], got {v!r}")
    return tuple(_number(lo=0)(b, path) for b in v)


_FP16 = {
    "enabled": (False, _bool),
    "loss_scale": (0.0, _number(lo=0)),
    "initial_scale_power": (16, _int(lo=0)),
    "loss_scale_window": (1000, _int(lo=1)),
    # DS accepts hysteresis 0, but then DynamicLossScaler never lowers the scale (it only
    # shifts when cur_hysteresis == 1, and 0 counts down past it): reject it.
    "hysteresis": (2, _int(lo=1)),
    "consecutive_hysteresis": (False, _bool),
    "min_loss_scale": (1, _number(lo=0, lo_open=True)),
    "auto_cast": (False, _bool),
    "fp16_master_weights_and_grads": (False, _only(False, "master weights are always fp32")),
}

_BF16 = {"enabled": (False, _bool), "check_grad_overflow": (True, _bool)}


def _offload(v, path):
    d = _section(v, path, {"device": ("none", _optional(_any)), "pin_memory": (False, _bool)})
    dev = d["device"]
    dev = "none" if dev is None else dev
    if dev not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{path}.device must be \"none\", \"cpu\" or \"nvme\", got {dev!r}")
    if dev != "none":
        raise ConfigError(f"{path}.device = {dev!r}: ZeRO-Offload is not implemented in minizero; "
                          f"remove '{path}' or set its device to \"none\"")
    return dev


_ZERO = {
    "stage": (0, lambda v, p: _stage(v, p)),
    "contiguous_gradients": (True, _bool),
    "reduce_scatter": (True, _bool),
    "reduce_bucket_size": (500_000_000, _int(lo=1)),
    "allgather_bucket_size": (500_000_000, _int(lo=1)),
    "overlap_comm": (None, _optional(_bool)),
    "stage3_prefetch_bucket_size": (50_000_000, _int(lo=0)),
    "stage3_param_persistence_threshold": (100_000, _int(lo=0)),
    "stage3_max_live_parameters": (1_000_000_000, _int(lo=0)),
    "stage3_max_reuse_distance": (1_000_000_000, _int(lo=0)),
    "memory_efficient_linear": (True, _bool),
    "sub_group_size": (1_000_000_000, _int(lo=0)),
    "offload_optimizer": ("none", _offload),
    "offload_param": ("none", _offload),
    # harmless: DeepSpeed keys whose accepted value is what minizero always does
    "allgather_partitions": (True, _only(True, "parameters are always all-gathered")),
    "load_from_fp32_weights": (True, _only(True, "checkpoints always restore the fp32 master")),
    "ignore_unused_parameters": (True, _only(True, "unused parameters get a zero gradient")),
    "round_robin_gradients": (False, _only(False, "it is an offload optimization")),
    "elastic_checkpoint": (False, _only(False, "use the same world size to resume")),
    "use_multi_rank_bucket_allreduce": (True, _bool),
    "stage3_gather_16bit_weights_on_model_save": (False, _only(False, "there is no save_16bit_model")),
}
# DeepSpeedZeroConfig fields carry these as pydantic aliases (populate_by_name=True): both
# spellings are accepted by DS.
_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


def _stage(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 3:
        raise ConfigError(f"{path} must be 0, 1, 2 or 3 (ZeRO stage), got {v!r}")
    return v


def _number_checkpoints(v, path):
    if v is None or v is False:   # configs in the wild write false for "not set"
        return None
    return _int(lo=1)(v, path)


_ACT = {
    "partition_activations": (False, _bool),
    "cpu_checkpointing": (False, _bool),
    "contiguous_memory_optimization": (False, _bool),
    "number_checkpoints": (None, _number_checkpoints),
    "synchronize_checkpoint_boundary": (False, _bool),
    "profile": (False, _bool),
}

_TOP = {
    "train_batch_size": (None, _BATCH),
    "train_micro_batch_size_per_gpu": (None, _BATCH),
    "gradient_accumulation_steps": (None, _BATCH),
    "optimizer": (None, _any),
    "scheduler": (None, _any),
    "gradient_clipping": (1.0, _number(lo=0)),
    "fp16": (None, _any),
    "bf16": (None, _any),
    "bfloat16": (None, _any),     # DS's old name for bf16 (precision_config.BFLOAT16_OLD)
    "zero_optimization": (None, _any),
    "activation_checkpointing": (None, _any),
    "steps_per_print": (None, _optional(_int(lo=1))),
    "wall_clock_breakdown": (False, _bool),
    # harmless
    "zero_allow_untested_optimizer": (False, _bool),
    "zero_force_ds_cpu_optimizer": (True, _bool),
    "prescale_gradients": (False, _only(False, "gradients are averaged after the reduction")),
    "gradient_predivide_factor": (1.0, _only(1.0, "gradients are averaged after the reduction")),
    "communication_data_type": (None, _only(None, "gradients are reduced in the training dtype")),
    "memory_breakdown": (False, _only(False, "use engine.memory_breakdown()")),
    "dump_state": (False, _only(False, "there is no state dump")),
    "dataloader_drop_last": (False, _only(False, "the DistributedSampler loader keeps the last batch")),
}


# ----------------------------------------------------------------------------- batch sizes

def resolve_batch_size(train_batch_size, micro_batch, grad_acc, world_size):
    """Fill in the missing of (train_batch_size, micro, gas), as DeepSpeed does.

    Mirrors `DeepSpeedConfig._set_batch_related_parameters` then `_batch_assertion`
    (runtime/config.py). DeepSpeed floor-divides and then asserts
    train == micro * gas * world_size; we check divisibility first so the error says which
    number does not divide, but accept exactly the same inputs.
    """
    t, m, g, n = train_batch_size, micro_batch, grad_acc, world_size
    hint = ("set train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
            "x world size, or give only two of them")
    if t is not None and m is not None and g is not None:
        if t != m * g * n:
            raise ConfigError(f"train_batch_size {t} != train_micro_batch_size_per_gpu {m} x "
                              f"gradient_accumulation_steps {g} x world size {n}; {hint}")
    elif t is not None and m is not None:
        if t % (m * n):
            raise ConfigError(f"train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu "
                              f"{m} x world size {n}; {hint}")
        g = t // m // n
    elif t is not None and g is not None:
        if t % (g * n):
            raise ConfigError(f"train_batch_size {t} is not divisible by gradient_accumulation_steps "
                              f"{g} x world size {n}; {hint}")
        m = t // n // g
    elif m is not None and g is not None:
        t = m * g * n
    elif t is not None:
        if t % n:
            raise ConfigError(f"train_batch_size {t} is not divisible by world size {n}; {hint}")
        g, m = 1, t // n
    elif m is not None:
        t, g = m * n, 1
    else:
        raise ConfigError("either train_batch_size or train_micro_batch_size_per_gpu must be given")
    return t, m, g


# ----------------------------------------------------------------------------- loading

def read_json(path, name: str | None = None) -> dict:
    """The JSON object in the file at `path`; one ConfigError line for each way that fails.

    `name` is how messages call the file (default: "config file '<path>'"). Duplicate keys
    are refused, as DeepSpeed does (config_utils.dict_raise_error_on_duplicate_keys): plain
    json.load would silently keep the last one.
    """
    path = Path(path)
    hint = "" if name else "; pass a dict or a path to a JSON file"
    name = name or f"config file {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{name} does not exist{hint}")
    if not path.is_file():
        raise ConfigError(f"{name} is a directory, not a JSON file")

    def no_dupes(pairs):
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ConfigError(f"{name}: duplicate key(s) {dupes}; keep one of each")
        return dict(pairs)
    try:
        d = json.loads(path.read_text(), object_pairs_hook=no_dupes)
    except ConfigError:
        raise
    except ValueError as e:   # JSONDecodeError, or bytes that are not UTF-8
        raise ConfigError(f"{name} is not valid JSON ({e}); minizero reads plain JSON, no comments") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{name} must hold a JSON object {{...}}, got {type(d).__name__}")
    return d


def _read(config) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        return read_json(config)
    raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def _parse_optimizer(d) -> Optional[OptimizerConfig]:
    if d is None:
        return None
    d = _section(d, "optimizer", {"type": (_MISSING, _any), "params": ({}, _any)})
    name = d["type"]
    if name is _MISSING:
        raise ConfigError("optimizer.type is missing; set it to \"Adam\" or \"AdamW\"")
    # DS lower-cases names it knows (runtime/config.py: DEEPSPEED_OPTIMIZERS), so any case works.
    canon = {"adam": "Adam", "adamw": "AdamW"}.get(str(name).lower())
    if canon is None:
        raise ConfigError(f"optimizer.type {name!r} is not implemented in minizero; use \"Adam\" or \"AdamW\"")
    params = d["params"]
    if isinstance(params, dict) and "max_grad_norm" in params:
        # Same refusal as DeepSpeedEngine._configure_basic_optimizer.
        raise ConfigError("optimizer.params.max_grad_norm is not supported; use the top-level "
                          "\"gradient_clipping\" key instead")
    params = _section(params, "optimizer.params", _OPTIMIZER_PARAMS)
    return OptimizerConfig(canon, {k: v for k, v in params.items() if v is not _MISSING})


def _parse_scheduler(d) -> Optional[SchedulerConfig]:
    if d is None:
        return None
    d = _section(d, "scheduler", {"type": (_MISSING, _any), "params": ({}, _any)})
    if d["type"] is _MISSING:
        raise ConfigError(f"scheduler.type is missing; use one of {sorted(lr_schedules.SCHEDULERS)}")
    lr_schedules.check_scheduler_params(d["type"], d["params"])
    return SchedulerConfig(d["type"], dict(d["params"] or {}))


def load_config(config: dict | str | Path, world_size: int | None = None) -> Config:
    """Parse a DeepSpeed-style config (dict or JSON path) for a data-parallel world of `world_size`.

    world_size None means the current process group's size (1 without one).
    """
    raw = _read(config)
    if world_size is None:
        from minizero import comm
        world_size = comm.get_world_size()
    top = _section(raw, "", _TOP)

    zero_raw = top["zero_optimization"]
    if isinstance(zero_raw, bool):
        # DS's deprecated form (zero/config.py: read_zero_config_deprecated): true = stage 1.
        zero_raw = {"stage": 1 if zero_raw else 0}
    zero = _section(zero_raw, "zero_optimization", _ZERO, _ZERO_ALIASES)
    if zero["overlap_comm"] is None:   # DeepSpeedZeroConfig.overlap_comm_valid
        zero["overlap_comm"] = zero["stage"] == 3
    zero_cfg = ZeroConfig(**{k: v for k, v in zero.items() if k in ZeroConfig.__dataclass_fields__},
                          offload_optimizer_device=zero["offload_optimizer"],
                          offload_param_device=zero["offload_param"])

    fp16 = _section(top["fp16"], "fp16", _FP16)
    fp16.pop("fp16_master_weights_and_grads")
    fp16["loss_scale"] = float(fp16["loss_scale"])
    if top["bf16"] is not None and top["bfloat16"] is not None:
        raise ConfigError("both 'bf16' and its old name 'bfloat16' are given (DeepSpeed would silently "
                          "ignore 'bfloat16'); keep only 'bf16'")
    bf16_path = "bfloat16" if top["bfloat16"] is not None else "bf16"
    bf16 = _section(top["bf16"] if top["bf16"] is not None else top["bfloat16"], bf16_path, _BF16)
    if fp16["enabled"] and bf16["enabled"]:
        raise ConfigError("fp16 and bf16 cannot both be enabled; set one of them to false")

    act = _section(top["activation_checkpointing"], "activation_checkpointing", _ACT)

    t, m, g = resolve_batch_size(top["train_batch_size"], top["train_micro_batch_size_per_gpu"],
                                 top["gradient_accumulation_steps"], world_size)
    return Config(
        train_batch_size=t, train_micro_batch_size_per_gpu=m, gradient_accumulation_steps=g,
        world_size=world_size,
        optimizer=_parse_optimizer(top["optimizer"]),
        scheduler=_parse_scheduler(top["scheduler"]),
        gradient_clipping=float(top["gradient_clipping"]),
        fp16=FP16Config(**fp16), bf16=BF16Config(**bf16), zero=zero_cfg,
        activation_checkpointing=ActivationCheckpointingConfig(**act),
        steps_per_print=top["steps_per_print"], wall_clock_breakdown=top["wall_clock_breakdown"],
        raw=raw,
    )


# ----------------------------------------------------------------------------- optimizer

def build_optimizer(param_groups, opt_cfg: OptimizerConfig | dict) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed would build from the `optimizer` config section.

    Mirrors `DeepSpeedEngine._configure_basic_optimizer` + `get_optimizer_configuration`
    (runtime/engine.py):

    - `adam_w_mode` (default true) is popped; "AdamW" forces it on. So "Adam" means
      AdamW math (decoupled weight decay) unless `"adam_w_mode": false`.
    - with `"torch_adam": true` DS builds `torch.optim.AdamW` / `torch.optim.Adam` with
      the remaining params: torch's own defaults apply, notably AdamW's weight_decay 0.01.
    - without `torch_adam` DS builds its `FusedAdam` (same update, results < 1e-6 apart),
      whose weight_decay default is 0.0. minizero always builds the torch optimizer, so
      in that case it passes weight_decay=0.0 explicitly to keep DS's effective default.
    """
    if isinstance(opt_cfg, dict):
        opt_cfg = _parse_optimizer(opt_cfg)
    params = dict(opt_cfg.params)
    unknown = set(params) - set(_OPTIMIZER_PARAMS)
    if unknown:
        raise ConfigError(f"unknown optimizer.params {sorted(unknown)}; accepted: {sorted(_OPTIMIZER_PARAMS)}")
    adam_w_mode = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = opt_cfg.type == "AdamW" or adam_w_mode
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)   # FusedAdam.__init__ default
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(param_groups, **params)
