"""The DeepSpeed JSON config, parsed into typed dataclasses with DeepSpeed 0.19.8's defaults.

Each section is one table: a dataclass whose every field is one key, declared once with
`key(default, check, alias=..., acts=...)` (schema.py: how a table parses; the
`zero_optimization` section and its offload sub-sections are in zero.py). The
parser, the defaults, the list of accepted keys in error messages and the typed result all
come from that one declaration.

Why a strict parser: DeepSpeed silently ignores unknown *top-level* keys (only the
pydantic sub-sections such as `zero_optimization` forbid extras). A student who types
`"gradient_cliping"` then trains with the default clip of 1.0 and never knows. minizero
refuses every key it does not implement, naming the key's path and the keys accepted
there. DeepSpeed keys that minizero does not implement are accepted either only at the
value matching minizero's behaviour (`only`), or, for pure performance knobs, at any
value with `acts=False`: minizero then does nothing with them (`ignored_knobs` lists
those a config sets).

Defaults come from `deepspeed/runtime/constants.py`, `runtime/precision_config.py`,
`runtime/zero/config.py` and `runtime/activation_checkpointing/config.py`; the batch-size
arithmetic mirrors `DeepSpeedConfig._set_batch_related_parameters` / `_batch_assertion`
(`runtime/config.py`); the optimizer choice mirrors `DeepSpeedEngine._configure_basic_optimizer`
and `get_optimizer_configuration` (`runtime/engine.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from . import lr_schedules
from .schema import (ConfigError, Section, anything, boolean, integer, key, list_of, number, only, optional, real,
                            string)
from .zero import (AioConfig, OffloadConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig,  # noqa: F401
                          _zero, check_world_size, ignored_knobs, ignored_knobs_note, renamed_keys_note)

__all__ = ["ConfigError", "Config", "AioConfig", "FP16Config", "BF16Config", "ZeroConfig", "OffloadConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
           "ActivationCheckpointingConfig", "CollectivesConfig", "CommsLoggerConfig", "TraceConfig", "OptimizerConfig", "SchedulerConfig", "load_config", "read_json",
           "ignored_knobs", "ignored_knobs_note", "resolve_batch_size"]


# ----------------------------------------------------------------------------- sections

def _betas(v, path):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{path} must be a list of two numbers like [0.9, 0.999], got {v!r}")
    return tuple(number(lo=0)(b, path) for b in v)


@dataclass
class AdamParams(Section):
    """`optimizer.params`. None: not given, the torch optimizer's own default applies."""
    lr: Optional[float] = key(None, number(lo=0))
    betas: Optional[tuple] = key(None, _betas)
    eps: Optional[float] = key(None, number(lo=0, lo_open=True))
    weight_decay: Optional[float] = key(None, number(lo=0))
    torch_adam: bool = key(False, boolean)       # see adam.build_optimizer
    adam_w_mode: bool = key(True, boolean)


def _adam_params(v, path) -> dict:
    """The params dict build_optimizer passes on: the keys given, plus torch_adam and adam_w_mode."""
    if isinstance(v, dict) and "max_grad_norm" in v:
        # Same refusal as DeepSpeedEngine._configure_basic_optimizer.
        raise ConfigError(f"{path}.max_grad_norm is not supported; use the top-level "
                          "\"gradient_clipping\" key instead")
    params = AdamParams.parse(v, path).to_dict()
    return {k: value for k, value in params.items() if value is not None}


def _optimizer_type(name, path):
    # DS lower-cases names it knows (runtime/config.py: DEEPSPEED_OPTIMIZERS), so any case works.
    canon = {"adam": "Adam", "adamw": "AdamW"}.get(str(name).lower())
    if canon is None:
        raise ConfigError(f"{path} {name!r} is not implemented in minizero; use \"Adam\" or \"AdamW\"")
    return canon


@dataclass
class OptimizerConfig(Section):
    type: Optional[str] = key(None, _optimizer_type)   # canonical "Adam" or "AdamW"
    params: dict = key(dict, _adam_params)


def _optimizer(v, path) -> OptimizerConfig:
    opt = OptimizerConfig.parse(v, path)
    if opt.type is None:
        raise ConfigError(f"{path}.type is missing; set it to \"Adam\" or \"AdamW\"")
    if "params" not in opt.given:
        opt.params = _adam_params({}, f"{path}.params")
    return opt


@dataclass
class SchedulerConfig(Section):
    type: Optional[str] = key(None, anything)   # "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR"
    params: dict = key(dict, anything)          # checked against the schedule's constructor


def _scheduler(v, path) -> SchedulerConfig:
    sched = SchedulerConfig.parse(v, path)
    if sched.type is None:
        raise ConfigError(f"{path}.type is missing; use one of {sorted(lr_schedules.SCHEDULERS)}")
    lr_schedules.check_scheduler_params(sched.type, sched.params)
    sched.params = dict(sched.params or {})
    return sched


@dataclass
class FP16Config(Section):
    """`fp16`, as DeepSpeedFP16Config (runtime/precision_config.py)."""
    enabled: bool = key(False, boolean)
    loss_scale: float = key(0.0, real(lo=0))                # 0 = dynamic loss scaling
    initial_scale_power: int = key(16, integer(lo=0))            # dynamic scaling starts at 2**16
    loss_scale_window: int = key(1000, integer(lo=1))
    # DS accepts hysteresis 0, but then DynamicLossScaler never lowers the scale (it only
    # shifts when cur_hysteresis == 1, and 0 counts down past it): reject it.
    hysteresis: int = key(2, integer(lo=1))
    consecutive_hysteresis: bool = key(False, boolean)
    min_loss_scale: float = key(1, number(lo=0, lo_open=True))
    auto_cast: bool = key(False, boolean, acts=False)           # minizero's engine always casts float inputs
    fp16_master_weights_and_grads: bool = key(False, only(False, "master weights are always fp32"))

    @property
    def dynamic(self) -> bool:
        return self.enabled and self.loss_scale == 0


@dataclass
class BF16Config(Section):
    enabled: bool = key(False, boolean)
    # DeepSpeed >= 0.16: skip a step whose gradient norm is inf/NaN (as fp16 does), default on.
    check_grad_overflow: bool = key(True, boolean)


def _number_checkpoints(v, path):
    if v is False:   # configs in the wild write false for "not set"
        return None
    return optional(integer(lo=1))(v, path)


@dataclass
class ActivationCheckpointingConfig(Section):
    """`activation_checkpointing`, as DeepSpeedActivationCheckpointingConfig
    (runtime/activation_checkpointing/config.py). DeepSpeed only parses it; minizero applies
    it (docs/deepspeed.md, "activation_checkpointing is parsed, not applied"). What each key
    does under pure data parallelism: checkpointing/options.py."""
    partition_activations: bool = key(False, boolean)   # one model-parallel rank: nothing to split, see there
    contiguous_memory_optimization: bool = key(False, boolean)
    cpu_checkpointing: bool = key(False, boolean)
    number_checkpoints: Optional[int] = key(None, _number_checkpoints)
    synchronize_checkpoint_boundary: bool = key(False, boolean)
    profile: bool = key(False, boolean)


@dataclass
class CollectivesConfig(Section):
    """`minizero_collectives`: minizero's own key (DeepSpeed ignores unknown top-level keys:
    docs/deepspeed.md, "Unknown top-level config keys are ignored", so the config still runs
    under DeepSpeed). check: the desync check before every collective (also on with
    MINIZERO_DEBUG_COLLECTIVES=1); timeout_s: how long a collective may wait before the run
    ends naming it (None: the process group's own, 1800 s when minizero started it, with
    the check on or off; on NCCL it is named only with the check on). docs/debugging.md."""
    check: bool = key(False, boolean)
    timeout_s: Optional[float] = key(None, optional(real(lo=1)))


_COMM_OP_NAMES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")


def _comm_op_name(v, path):
    """An op minizero issues, by the name DeepSpeed's logger gives it (comms_logger.OP_NAMES)."""
    if v not in _COMM_OP_NAMES:
        raise ConfigError(f"{path} = {v!r}: minizero issues only {', '.join(_COMM_OP_NAMES)}; name one of those")
    return v


@dataclass
class CommsLoggerConfig(Section):
    """`comms_logger`, as DeepSpeed's CommsLoggerConfig (comm/config.py): time every
    collective and print DeepSpeed's summary table (comms_logger.py says what each key does).
    Unlike DeepSpeed, `enabled` decides (docs/deepspeed.md, "comms_logger is on whenever the
    section is present")."""
    enabled: bool = key(False, boolean)
    prof_all: bool = key(True, boolean)
    prof_ops: list = key(list, list_of(_comm_op_name))
    verbose: bool = key(False, boolean)
    debug: bool = key(False, boolean)


@dataclass
class TraceConfig(Section):
    """`minizero_trace`: minizero's own key (DeepSpeed ignores it). Write a Chrome-trace
    timeline of the chosen optimizer steps (1-based) to output_path: one JSON per rank, the
    merged JSON and timeline.png (trace.py)."""
    enabled: bool = key(False, boolean)
    output_path: str = key("trace", string)
    steps: tuple = key((2,), list_of(integer(lo=1)))


_BATCH = optional(integer(lo=1))


@dataclass
class Config(Section):
    """The whole config; its fields are the top-level table. load_config fills in the
    batch-size triple (resolve_batch_size) and raw, the dict it parsed (kept for
    checkpoint metadata; nothing parses it again)."""
    train_batch_size: Optional[int] = key(None, _BATCH)
    train_micro_batch_size_per_gpu: Optional[int] = key(None, _BATCH)
    gradient_accumulation_steps: Optional[int] = key(None, _BATCH)
    optimizer: Optional[OptimizerConfig] = key(None, optional(_optimizer))
    scheduler: Optional[SchedulerConfig] = key(None, optional(_scheduler))
    gradient_clipping: float = key(1.0, real(lo=0))     # DS default is 1.0, not "off" (runtime/constants.py)
    fp16: FP16Config = key(FP16Config, FP16Config.parse)
    bf16: BF16Config = key(BF16Config, BF16Config.parse, alias="bfloat16")   # DS's old name (BFLOAT16_OLD)
    zero: ZeroConfig = key(ZeroConfig, _zero, name="zero_optimization")
    # None when the config has none: then the engine leaves minizero.checkpointing unconfigured.
    activation_checkpointing: Optional[ActivationCheckpointingConfig] = key(
        None, optional(ActivationCheckpointingConfig.parse))
    steps_per_print: Optional[int] = key(None, optional(integer(lo=1)))   # DS 0.19.8 default: None (never print)
    collectives: CollectivesConfig = key(CollectivesConfig, CollectivesConfig.parse, name="minizero_collectives")
    comms_logger: CommsLoggerConfig = key(CommsLoggerConfig, CommsLoggerConfig.parse)
    trace: TraceConfig = key(TraceConfig, TraceConfig.parse, name="minizero_trace")
    aio: AioConfig = key(AioConfig, AioConfig.parse)       # the NVMe swapper's I/O (offload/nvme.py)
    wall_clock_breakdown: bool = key(False, boolean, acts=False)
    zero_allow_untested_optimizer: bool = key(False, boolean, acts=False)
    zero_force_ds_cpu_optimizer: bool = key(True, boolean, acts=False)
    # accepted only at the value that is what minizero always does
    prescale_gradients: bool = key(False, only(False, "gradients are averaged after the reduction"))
    gradient_predivide_factor: float = key(1.0, only(1.0, "gradients are averaged after the reduction"))
    communication_data_type: Optional[str] = key(None, only(None, "gradients are reduced in the training dtype"))
    memory_breakdown: bool = key(False, only(False, "use engine.memory_breakdown()"))
    dump_state: bool = key(False, only(False, "there is no state dump"))
    dataloader_drop_last: bool = key(False, only(False, "the DistributedSampler loader keeps the last batch"))
    # not a key: the user's dict as given (saved in checkpoint metadata; never parsed again)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The training (low-precision module) dtype."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32


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


def load_config(config: dict | str | Path, world_size: int | None = None) -> Config:
    """Parse a DeepSpeed-style config (dict or JSON path) for a data-parallel world of `world_size`.

    world_size None means the current process group's size (1 without one).
    """
    raw = _read(config)
    if world_size is None:
        from minizero import comm
        world_size = comm.get_world_size()
    cfg = Config.parse(raw, "")
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16 and bf16 cannot both be enabled; set one of them to false")
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = \
        resolve_batch_size(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                           cfg.gradient_accumulation_steps, world_size)
    check_world_size(cfg.zero, world_size)
    cfg.raw = raw
    return cfg
