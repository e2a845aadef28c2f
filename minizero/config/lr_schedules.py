"""Learning-rate schedules: DeepSpeed's three warmup schedules (`scheduler` in the config).

The DeepSpeed ones are re-derived from `deepspeed/runtime/lr_schedules.py` (0.19.8) and
give bit-identical learning rates (same float operations in the same order). Behaviours
worth knowing, all copied on purpose:

- Construction already writes an lr into the optimizer: with the default
  `last_batch_iteration=-1` the schedule is "before step 0" and sets `warmup_min_lr`
  (WarmupLR/WarmupDecayLR) or 0.0 (WarmupCosineLR). The first `step()` moves to
  iteration 0, whose lr is again the minimum for "log" warmup (log(1) = 0).
- `warmup_num_steps` is raised to at least 2 (the log warmup divides by log(n)).
- WarmupLR's `warmup_max_lr` defaults to the optimizer's lr, but WarmupDecayLR's
  defaults to 0.001 (the subclass keeps the old default).
- WarmupCosineLR scales the optimizer's lr *at construction* by a ratio; it has no
  min/max lr of its own.
- `state_dict()` holds only `last_batch_iteration`; `load_state_dict` does not rewrite
  the optimizer's lr (the optimizer's own state dict carries it).
"""
from __future__ import annotations

import inspect
import math

import torch

from .schema import ConfigError

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def update_lr(param_groups, lrs):
    """As DS `update_lr`: writes each group's lr (tensor lrs are filled in place)."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def torch_optimizer(optimizer):
    """As DS `get_torch_optimizer`: accept a wrapper that holds the torch optimizer as `.optimizer`."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(optimizer, value, name):
    """As DS `_format_param`: a scalar for every group, or a list with one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected {len(optimizer.param_groups)} values (one per param group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_warmup(warmup_num_steps, warmup_type):
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    # DS logs a warning and falls back to "log"; a typo should not silently change the curve.
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(f"warmup_type must be \"log\" or \"linear\", got {warmup_type!r}")


class _Schedule:
    """What the three DS schedules share: step(), get_last_lr(), state_dict()."""

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self):
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd):
        self.last_batch_iteration = sd["last_batch_iteration"]

    def _warmup_gamma(self):
        """Fraction of the warmup done at `last_batch_iteration` (< warmup_num_steps)."""
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_Schedule):
    """min_lr -> max_lr over warmup_num_steps ("log" or "linear"), then constant. DS `WarmupLR`."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer = torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:   # DS sets the lr at construction
            self._last_lr = update_lr(optimizer.param_groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps. DS `WarmupDecayLR`."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Ratio warmup_min_ratio -> 1, then cosine to cos_min_ratio, times the initial lr. DS `WarmupCosineLR`."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        _check_warmup(warmup_num_steps, warmup_type)
        self.optimizer = optimizer = torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            ratio = self._warmup_gamma()
            return self.warmup_min_ratio + ratio * (1. - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)   # stays at the floor after the end
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def _config_keys(cls) -> dict:
    """{name: required?} of the keys `scheduler.params` may set for `cls`: its constructor's
    arguments but the optimizer (the signature is their one declaration)."""
    args = list(inspect.signature(cls.__init__).parameters.values())[2:]   # self, optimizer
    return {a.name: a.default is inspect.Parameter.empty for a in args}


def check_scheduler_params(name, params) -> None:
    """ConfigError unless `scheduler.type` is one we implement and its params fit it.

    DS looks the name up with getattr on its lr_schedules module (case-sensitive), then
    falls back to torch.optim.lr_scheduler; minizero implements only the three warmups.
    """
    if name not in SCHEDULERS:
        hint = [s for s in SCHEDULERS if s.lower() == str(name).lower()]
        did = f" (did you mean {hint[0]!r}? names are case-sensitive, as in DeepSpeed)" if hint else ""
        raise ConfigError(f"scheduler.type {name!r} is not implemented in minizero{did}; "
                          f"use one of {sorted(SCHEDULERS)}")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"scheduler.params must be a JSON object, got {params!r}")
    keys = _config_keys(SCHEDULERS[name])
    for key in params:
        if key not in keys:
            raise ConfigError(f"unknown config key 'scheduler.params.{key}' for {name}; "
                              f"accepted keys: {', '.join(keys)}")
    for key, required in keys.items():
        if required and key not in params:
            raise ConfigError(f"scheduler.params.{key} is required by {name}")


def build_scheduler(optimizer, sched_cfg):
    """The schedule for the config's `scheduler` section; None -> None.

    `sched_cfg` is the parsed section (`Config.scheduler`, checked by load_config). As
    `DeepSpeedEngine._scheduler_from_config`: `cls(optimizer, **params)`.
    """
    if sched_cfg is None:
        return None
    return SCHEDULERS[sched_cfg.type](optimizer, **(sched_cfg.params or {}))
