"""fp16 loss scaling: DeepSpeed's DynamicLossScaler, step for step.

Why scale at all (Micikevicius et al., "Mixed Precision Training", ICLR 2018): fp16 has
a 5-bit exponent, so gradient values below ~6e-8 flush to zero and a large share of a
network's gradients would vanish. Multiplying the loss by S before backward shifts every
gradient up by S (the chain rule is linear), into fp16's representable range; the fp32
master update divides by S again, so the maths is unchanged.

Why *dynamic*: the best S is the largest that does not overflow, and it drifts during
training. So start high (2**16), and after every step:
- overflow (an inf/NaN anywhere in the gradients, on any rank) -> skip the update and
  halve S;
- no overflow -> count it. The update of a clean step that follows k * `scale_window`
  clean steps in a row (k >= 1; the start counts as an overflow at step -1) doubles S. So
  the first doubling ends the (`scale_window` + 1)-th clean step, and each later one
  `scale_window` clean steps after it: with the default window of 1000, steps 0-1000 run
  at S, 1001-2000 at 2S. That is `stable_interval` in `update_scale` below, DeepSpeed's
  arithmetic line for line (tests/agreement/test_loss_scaler.py pins it against
  DeepSpeed's class).

Why *hysteresis* (`delayed_shift`, DeepSpeed's "hysteresis", default 2 in the config): a
single overflow is often a spike, not a sign that S is too high. With hysteresis h, the
first h-1 overflows only use up a budget (the step is still skipped) and the h-th one
halves S. The budget is *not* refilled by halving: every further overflow halves again
until S is next raised (or, with `consecutive_hysteresis`, until one clean step). Without
it, one spike costs `scale_window` + 1 steps at half the scale.

DeepSpeed quirks, not copied (docs/deepspeed.md, "Stage 0 fp16 loss scaler has no
hysteresis" and "Stage 0 fp16 never scales the loss"): at ZeRO stage 0, DeepSpeed's fp16
path is `FP16_UnfusedOptimizer` (with `torch_adam`; `FP16_Optimizer` with FusedAdam),
whose own scaler has no hysteresis (halves on the first overflow) and clamps at the
minimum instead of raising; and since that stage never multiplies the loss by S, no
backward can overflow, so its S doubles by the rule above for ever while the gradients are
still divided by it. The ZeRO-1/2/3 optimizers use this class via `CreateLossScaler`
(runtime/fp16/loss_scaler.py) with hysteresis and `raise_error_at_min_scale=True`.
minizero scales the loss and uses that ZeRO behaviour at every stage.
"""
from __future__ import annotations

import logging

import torch

from minizero import comm

logger = logging.getLogger("minizero")


def overflow_message(cur_scale, next_scale=None, rank=0, dtype=torch.float16, hysteresis=None, prefix=""):
    """The overflow line, in DeepSpeed's words (`DynamicLossScaler.update_scale`).

    DeepSpeed prints it with the prefix "[deepspeed] " on rank 0, e.g.
    "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768".
    With `hysteresis` (the budget left before this overflow) it is the "but hysteresis
    is ..." variant: the scale stays and the budget drops by one. The scale part is only
    printed for fp16 (DS checks `dtype == torch.half`).
    """
    msg = f"{prefix}OVERFLOW! Rank {rank} Skipping step."
    if dtype == torch.half:
        if hysteresis is None:
            msg += f" Attempted loss scale: {int(cur_scale)}, reducing to {int(next_scale)}"
        else:
            msg += (f" Attempted loss scale: {int(cur_scale)}, but hysteresis is {hysteresis}. "
                    f"Reducing hysteresis to {hysteresis - 1}")
    return msg


def has_inf_or_nan(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds any inf or NaN.

    As DS `runtime.utils.has_inf_or_nan`: reduce first (amax propagates NaN and shows +inf,
    amin shows -inf) so nothing the size of the tensor is allocated.
    """
    if tensor.numel() == 0:
        return False
    hi, lo = tensor.amax(), tensor.amin()
    return bool(torch.isnan(hi) | torch.isinf(hi) | torch.isinf(lo))


def overflow_vote(norm_sq: torch.Tensor) -> torch.Tensor:
    """True (1.0) on every rank if any rank's gradient norm is inf/NaN: every rank must skip
    the same step, or the replicas (and the partitions of the sharded optimizer) drift apart.
    One MAX all-reduce of a one-element fp32 flag (label "overflow"), as DeepSpeed's
    `DeepSpeedZeroOptimizer.has_overflow`; the flag stays on the device, so the engine reads
    it together with the norm in the step's one host sync instead of syncing for it."""
    flag = torch.isfinite(norm_sq).logical_not().to(torch.float32).reshape(1)
    comm.all_reduce(flag, op="max", label="overflow")
    return flag


class MinLossScaleError(RuntimeError):
    """fp16 overflowed again at the minimum loss scale: the run cannot go on.

    The first sentence is DeepSpeed's, word for word, so logs read alike. Its own advice
    (lower min_loss_scale) rarely helps: gradients that overflow at a scale of 1 are
    non-finite *unscaled*, which almost always means the loss itself is inf/NaN, i.e.
    training diverged. The message says that instead.
    """

    def __init__(self, min_scale: float):
        super().__init__(
            f"Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. The gradients "
            f"overflowed even at the minimum loss scale {min_scale:g} (fp16.min_loss_scale), so they are inf/NaN "
            f"unscaled: training diverged (or the loss itself is inf/NaN). A smaller scale cannot help; lower the "
            f"learning rate, set gradient_clipping, or train in bf16, from the last good checkpoint")


class LossScaler:
    """A fixed loss scale (`"loss_scale": S > 0` in the fp16 section; 1.0 without fp16).

    As DS `LossScaler`: the scale never changes; an overflowed step is still skipped by
    the optimizer, this only logs it.
    """

    dynamic = False

    def __init__(self, scale=1.0):
        self.cur_scale = scale

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_loss(self, loss):
        return loss * self.loss_scale

    def update_scale(self, overflow: bool) -> None:
        if overflow and comm.get_rank() == 0:
            logger.warning("[minizero] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.")

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = sd["cur_scale"]


StaticLossScaler = LossScaler


class DynamicLossScaler(LossScaler):
    """DS `DynamicLossScaler`, same attributes and the same `cur_scale` trajectory.

    `delayed_shift` is the config's `hysteresis`. `raise_error_at_min_scale` (DS default
    True, and what the ZeRO optimizers get): an overflow while already at `min_scale`
    aborts training instead of looping forever on skipped steps.
    DS hard-codes scale_factor = 2.0; minizero lets you change it.
    """

    dynamic = True

    def __init__(self, init_scale=2**16, scale_factor=2.0, scale_window=1000, min_scale=1, delayed_shift=1,
                 consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.float16):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dtype = dtype

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise MinLossScaleError(self.min_scale)
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                if comm.get_rank() == 0:
                    logger.info(overflow_message(self.cur_scale, next_scale, 0, self.dtype))
                self.cur_scale = next_scale
            else:
                if comm.get_rank() == 0:
                    logger.info(overflow_message(self.cur_scale, None, 0, self.dtype, self.cur_hysteresis))
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    _STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
              "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, sd: dict) -> None:
        for k in self._STATE:
            setattr(self, k, sd[k])


def create_loss_scaler(fp16_cfg) -> LossScaler:
    """The scaler DS's ZeRO optimizers build from the parsed `fp16` section (Config.fp16).

    As `CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args)` with
    `FP16Config.dynamic_loss_scale_args()` (runtime/precision_config.py):
    init_scale = 2**initial_scale_power, scale_window = loss_scale_window,
    delayed_shift = hysteresis, min_scale = min_loss_scale. fp16 off (fp32/bf16) -> a
    static scaler of 1.0; `loss_scale` > 0 -> a static scaler of that value.
    """
    if not fp16_cfg.enabled:
        return LossScaler(1.0)
    if fp16_cfg.loss_scale != 0:
        return LossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(init_scale=2**fp16_cfg.initial_scale_power,
                             scale_window=fp16_cfg.loss_scale_window,
                             min_scale=fp16_cfg.min_loss_scale,
                             delayed_shift=fp16_cfg.hysteresis,
                             consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
                             raise_error_at_min_scale=True)
