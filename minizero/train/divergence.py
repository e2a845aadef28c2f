"""When a run's numbers go inf/NaN: stop it, and say in one line what is safe and what to try.

Two ways a run diverges, one per dtype family:
- bf16 and fp32: NonFiniteGuard counts optimizer steps in a row with an inf/NaN loss or
  gradient norm and stops the run at --max-nonfinite-steps;
- fp16: the loss scaler owns overflow and gives up at its minimum scale (both libraries
  raise then, with the same words: FP16_GAVE_UP).
Either way train.py turns it into TrainingDiverged(diverged_message(...)).
"""
from __future__ import annotations

import math
import os

# What minizero's and DeepSpeed's loss scalers both say when they give up (fp16.MinLossScaleError).
FP16_GAVE_UP = "Current loss scale already at minimum"


class TrainingDiverged(Exception):
    """The loss or gradient norm stayed inf/NaN: the run stops, its results stay on disk."""


class NonFiniteGuard:
    """Stop a run after `patience` consecutive optimizer steps with an inf/NaN loss or
    gradient norm (bf16 and fp32; under fp16 the loss scaler decides, see FP16_GAVE_UP).

    A lone bad step is not the end: both libraries skip an optimizer step whose gradient
    norm is inf/NaN (weights unchanged), so training can go on after one bad batch. A
    streak of them means the run diverged; going on would only burn time and, with a
    library that applies the step, fill every later checkpoint with NaN.
    """

    def __init__(self, patience: int, enabled: bool):
        self.patience, self.enabled = patience, enabled
        self.streak, self.first_bad = 0, None

    def bad(self, step: int, loss: float, grad_norm) -> bool:
        """Record this step; True if it was bad. Raises TrainingDiverged at the patience."""
        if not self.enabled:
            return False
        norm_bad = grad_norm is not None and not math.isfinite(float(grad_norm))
        if math.isfinite(loss) and not norm_bad:
            self.streak, self.first_bad = 0, None
            return False
        self.streak += 1
        self.first_bad = self.first_bad or step
        self.last_what = f"loss {loss:g}" + (f", gradient norm {float(grad_norm):g}" if grad_norm is not None else "")
        if self.streak >= self.patience:
            raise TrainingDiverged(f"steps {self.first_bad}-{step}")
        return True

    def bad_step_line(self, step: int) -> str:
        """The line printed at a logged step that was bad (the run goes on)."""
        return (f"step={step:>4d} {self.last_what}: not finite ({self.streak} in a row, "
                f"--max-nonfinite-steps {self.patience})")


def what_diverged(e: Exception, guard: NonFiniteGuard, step: int) -> str | None:
    """What went non-finite, if the error `e`, raised during optimizer step `step`, means the
    run diverged; None for any other error."""
    if isinstance(e, TrainingDiverged):   # the guard's; e names the steps
        return f"{guard.last_what} at {e} ({guard.streak} steps in a row; --max-nonfinite-steps {guard.patience})"
    if FP16_GAVE_UP in str(e):
        return (f"at step {step} the fp16 gradients overflowed even at the minimum loss scale, so they are "
                f"inf/NaN unscaled (a smaller min_loss_scale cannot help)")
    return None


def diverged_message(what: str, cfg: dict, dtype: str, save_dir: str) -> str:
    """One line: what went non-finite, what is safe on disk, and what to try."""
    lr = ((cfg.get("optimizer") or {}).get("params") or {}).get("lr")
    latest = os.path.join(save_dir, "latest")
    ckpt = "no checkpoint was saved"
    if os.path.isfile(latest):
        with open(latest) as f:
            ckpt = f"the newest checkpoint, with finite weights, is {f.read().strip()} (--resume {save_dir})"
    other = "bf16" if dtype == "fp16" else "fp32"
    return (f"training diverged: {what}; {ckpt}; try a lower learning rate (lr {lr}), gradient_clipping"
            + (f", or {other}" if dtype != "fp32" else ""))
