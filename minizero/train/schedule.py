"""minGPT's learning-rate schedule, driven by tokens: what `python -m minizero.train` uses when
its config names no `scheduler` (DeepSpeed's own schedules are the config's: config/lr_schedules.py)."""
from __future__ import annotations

import math

from minizero.config.lr_schedules import torch_optimizer, update_lr


class MinGPTSchedule:
    """minGPT's trainer schedule (karpathy/minGPT `trainer.py`, `lr_decay=True`), driven by tokens.

    Linear warmup over `warmup_tokens`, then cosine decay that floors at 10% of the peak:
    lr_mult = tokens / warmup_tokens during warmup, else
    max(0.1, 0.5 * (1 + cos(pi * progress))), progress = (tokens - warmup) / (final - warmup).
    Counting tokens instead of steps makes the schedule independent of the batch size.
    Like minGPT, the lr applies to the *next* step: call `step(tokens=n)` after each
    optimizer step with the number of tokens that step consumed. At construction
    (0 tokens) the lr is 0.
    """

    def __init__(self, optimizer, learning_rate, warmup_tokens, final_tokens):
        if not final_tokens > warmup_tokens >= 0:
            raise ValueError(f"need final_tokens > warmup_tokens >= 0, got {final_tokens} and {warmup_tokens}")
        self.optimizer = optimizer = torch_optimizer(optimizer)
        self.learning_rate = learning_rate
        self.warmup_tokens = warmup_tokens
        self.final_tokens = final_tokens
        self.tokens = 0
        self._last_lr = update_lr(optimizer.param_groups, self.get_lr())

    def lr_mult(self):
        if self.tokens < self.warmup_tokens:
            return float(self.tokens) / float(max(1, self.warmup_tokens))
        progress = float(self.tokens - self.warmup_tokens) / float(max(1, self.final_tokens - self.warmup_tokens))
        return max(0.1, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def get_lr(self):
        return [self.learning_rate * self.lr_mult()] * len(self.optimizer.param_groups)

    def step(self, tokens=0):
        self.tokens += int(tokens)
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        # The shape of the schedule too, not only the position: a run resumed with another
        # --max-steps keeps the schedule it started with (an uninterrupted run would have).
        return {"tokens": self.tokens, "learning_rate": self.learning_rate,
                "warmup_tokens": self.warmup_tokens, "final_tokens": self.final_tokens}

    def load_state_dict(self, sd):
        self.tokens = sd["tokens"]
        for k in ("learning_rate", "warmup_tokens", "final_tokens"):   # absent in older checkpoints
            if k in sd:
                setattr(self, k, sd[k])
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())
