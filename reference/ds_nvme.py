"""What a LIVE DeepSpeed engine keeps in NVMe swap files right now ("device": "nvme").

reference/ds_memory.py counts storages; a state DeepSpeed swapped out holds none (its
tensor's `.data` is an empty tensor until swapped back in), so the walker sees nothing and
this module says where those bytes are. DeepSpeed 0.19.8, ZeRO-3 with
`offload_optimizer.device: "nvme"` (runtime/swap_tensor/optimizer_utils.py and
partitioned_optimizer_swapper.py): `optimizer.optimizer_swapper.swap_params_info` holds one
OptimizerStateSwapInfo per swappable sub-group (a param group, sub_group_size 1e9, whose
fp32 partition reaches 1 MiB), each with its tensors in a fixed order: the fp32 partition
(the master) first, then Adam's exp_avg and exp_avg_sq once the first step made them. A
tensor whose `compute_tensor` is empty lives in its file; `numel()` elements of the
sub-group's dtype (fp32) each. Gradients of such a sub-group in `swapped_gradients` are in
files too (fp32, `length` elements each); those in `unswapped_gradients` are host memory.

Measured (micro GPT at width 171, ZeRO-3 bf16, N = 2, both offloads on NVMe, max_in_cpu 0):
one swappable sub-group of S = 356,197 elements per rank; after the first step and after
every later backward and step, its three tensors are swapped out (12S = 4,274,364 bytes of
state; the files, each rounded up to 356,352 elements, take 4,276,224 bytes on disk) and no
gradient is. Parameters (`offload_param.device: "nvme"`) are not counted here: DeepSpeed
swaps a parameter's partition only when it has at least max(1 MiB, `aio.block_size`) bytes
(partition_parameters.py, `_partition_param`; partitioned_param_swapper.py, `min_aio_bytes`),
and these partitions are 114 KiB at most, so each is an ordinary host tensor, which the
walker counts (tests/agreement/test_agreement_nvme.py::test_deepspeed_swaps_no_parameter_partition_under_1_mib).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from minizero.memory import CATEGORIES   # the four model-state categories, as minizero counts them


def nvme_bytes(optimizer) -> Optional[Dict[str, int]]:
    """{category: bytes} in swap files now, or None when the optimizer swaps nothing."""
    swapper = getattr(optimizer, "optimizer_swapper", None)
    infos = getattr(swapper, "swap_params_info", None)
    if not isinstance(infos, dict):
        return None
    out = dict.fromkeys(CATEGORIES, 0)
    for info in infos.values():
        size = torch.empty((), dtype=info.dtype()).element_size()
        for i, t in enumerate(info.tensors):
            if t.compute_tensor.numel() == 0:           # swapped out: its bytes are in its file
                out["master_params" if i == 0 else "optimizer_states"] += info.numel() * size
        out["grads"] += sum(g.length for g in info.swapped_gradients.values()) * size
    return out
