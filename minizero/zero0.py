"""Stage 0: plain data parallelism, the baseline every ZeRO stage is measured against.

Every rank holds everything: low-precision parameters (2Ψ bytes in bf16/fp16), their
gradients (2Ψ), an fp32 master copy (4Ψ) and Adam's two moments (8Ψ): the 16Ψ of the
ZeRO paper's baseline (Rajbhandari et al., SC'20, section 3.1). After backward, one
all-reduce of the flat gradient averages it across ranks; each rank then takes the same
optimizer step on the same numbers.

Each stage (zero0-3.py) is a class with the same four methods, called by engine.py in
this order (plus `grad_bytes` for memory_breakdown); they say *where state lives and which
collective moves it*. The step itself
(norm, clip, Adam on the fp32 masters) is the same at every stage: sharded_optimizer.py.

    prepare_backward()   before each micro-batch's backward
    finish_backward()    after it returns
    reduce_gradients()   at the accumulation boundary, before the step
    after_step()         after the optimizer updated this rank's shard
    grad_bytes()         gradient bytes a rank holds at the end of backward

Stage 0: one FlatParam per param group, not sharded (num_shards = 1: a rank's "shard"
is the whole buffer), reduced by one all-reduce at the boundary.
"""
from __future__ import annotations

import torch

from .flat_param import build_flat, group_plan


class DataParallel:
    stage = 0

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg):
        by_name = dict(module.named_parameters())
        self.flat_params = [build_flat(plan, by_name, num_shards=1, shard_index=0)
                            for plan in group_plan(module, param_groups)]

    def prepare_backward(self) -> None:
        """Nothing: gradients accumulate in p.grad over the micro-steps."""

    def finish_backward(self) -> None:
        """Nothing: reduced once, at the boundary."""

    def reduce_gradients(self) -> None:
        """Average the gradient across ranks: one all-reduce per param group's flat buffer
        (one collective per group rather than one per parameter)."""
        for f in self.flat_params:
            f.all_reduce_grad()

    def after_step(self) -> None:
        """Nothing: every rank took the same step on the whole model."""

    def grad_bytes(self) -> int:
        return sum(f.numel for f in self.flat_params) * self.flat_params[0].full.element_size()
