"""Stage 0: plain data parallelism, the baseline every ZeRO stage is measured against.

Every rank holds everything: low-precision parameters (2Ψ bytes in bf16/fp16), their
gradients (2Ψ), an fp32 master copy (4Ψ) and Adam's two moments (8Ψ): the 16Ψ of the
ZeRO paper's baseline (Rajbhandari et al., SC'20, section 3.1). After backward, one
all-reduce of the flat gradient averages it across ranks; each rank then takes the same
optimizer step on the same numbers.

Each stage (zero0-3.py) is a `Stage` (stage.py): the same four methods, called by
engine.py; this one adds nothing to them but its buckets and its collective.

Stage 0: one FlatParam per gradient bucket (reduce_bucket_size elements; DeepSpeed's
default makes that one per param group), not sharded (num_shards = 1: a rank's "shard" is
the whole buffer), each reduced by one all-reduce at the boundary, or with `overlap_comm`
from backward hooks as it fills (buckets.py).
"""
from __future__ import annotations

import torch

from .buckets import replicated_buckets
from .flat_param import FlatParam
from .stage import Stage, keep_grad_buffers


class DataParallel(Stage):
    """Gradients accumulate in p.grad over the micro-steps; with overlap_comm the last
    micro-step's backward all-reduces each bucket as it fills (DDP); without, one all-reduce
    per bucket's flat buffer at the boundary (one collective per bucket rather than one per
    parameter)."""
    stage = 0

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], zero_cfg):
        buckets = replicated_buckets(module, param_groups, int(zero_cfg.reduce_bucket_size))
        super().__init__(buckets, FlatParam.all_reduce_grad, every_micro_step=False, zero_cfg=zero_cfg)
        keep_grad_buffers(self.flat_params)
