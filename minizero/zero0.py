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

    prepare_backward(b)  before each micro-batch's backward (b: it is the step's last)
    finish_backward()    after it returns
    reduce_gradients()   at the accumulation boundary, before the step
    after_step()         after the optimizer updated this rank's shard
    grad_bytes()         gradient bytes a rank holds at the end of backward

Stage 0: one FlatParam per gradient bucket (reduce_bucket_size elements; DeepSpeed's
default makes that one per param group), not sharded (num_shards = 1: a rank's "shard" is
the whole buffer), each reduced by one all-reduce at the boundary, or with `overlap_comm`
from backward hooks as it fills (buckets.py).
"""
from __future__ import annotations

import torch

from .buckets import GradBuckets, replicated_buckets


class DataParallel:
    stage = 0

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg):
        buckets = replicated_buckets(module, param_groups, int(zero_cfg.reduce_bucket_size))
        self.flat_params = [f for b in buckets for f in b.flats]
        self.grads = GradBuckets(buckets, lambda f, async_op: f.all_reduce_grad(async_op),
                                 every_micro_step=False, overlap=bool(zero_cfg.overlap_comm))

    def prepare_backward(self, boundary: bool = True) -> None:
        """Gradients accumulate in p.grad over the micro-steps; with overlap_comm the last
        micro-step's backward all-reduces each bucket as it fills (DDP)."""
        self.grads.prepare_backward(boundary)

    def finish_backward(self) -> None:
        self.grads.finish_backward()

    def reduce_gradients(self) -> None:
        """Average the gradient across ranks: one all-reduce per bucket's flat buffer (one
        collective per bucket rather than one per parameter); already done in backward
        with overlap_comm."""
        self.grads.reduce_all()

    def after_step(self) -> None:
        """Nothing: every rank took the same step on the whole model."""

    def grad_bytes(self) -> int:
        return sum(f.numel for f in self.flat_params) * self.flat_params[0].full.element_size()
