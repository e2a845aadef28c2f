"""Count the model-state bytes a LIVE DeepSpeed engine holds on this rank.

`deepspeed_model_state_bytes(engine)` walks the attributes where DeepSpeed 0.19.8 keeps
its tensors and sorts every storage into one category:

    params            the module's (low-precision) parameters as this rank holds them
    master_params     fp32 master copies
    optimizer_states  Adam exp_avg / exp_avg_sq (the scalar `step` counters are listed
                      in `details` only, they are not a model state)
    grads             gradients held between backward and step
    buffers           communication bucket buffers (not model states)

Each storage is counted once (key: `untyped_storage().data_ptr()`), whole
(`untyped_storage().nbytes()`, so a view into a flat buffer costs nothing extra), and
attributed to the FIRST category that claims it in the order above. Storages reachable
from the optimizer objects that no rule claims are reported under `unclaimed`
(name -> bytes) and are not part of any category: that is how a new DeepSpeed buffer
shows up instead of being silently missed.

Where DeepSpeed keeps what (file: class)
-----------------------------------------
stage 0 fp32   (no wrapper; engine.optimizer is torch.optim.AdamW/Adam)
               params = module params, grads = p.grad, states = optimizer.state
stage 0 bf16/fp16 with torch_adam (what the tests use): runtime/fp16/unfused_optimizer.py:
               FP16_UnfusedOptimizer (engine.py: _configure_fp16_optimizer picks it
               whenever the basic optimizer is not FusedAdam; bf16 at stage 0 is its
               DDP_BFLOAT16 case). params = module params (unflattened), master =
               fp32_groups (one full fp32 copy per parameter, NOT partitioned),
               grads = module p.grad (low precision); the fp32 .grad it builds in step()
               is dropped again at the end of step().
stage 0 bf16, other paths (read in the source, not measured): runtime/bf16_optimizer.py: BF16_Optimizer
               params = bf16_groups_flat, master = fp32_groups_flat_partition
               (partitioned over the data-parallel group, like ZeRO-1!),
               grads = fp32_groups_gradients_flat (a FULL fp32 gradient copy) + p.grad
stage 0 fp16 with FusedAdam (read, not measured): runtime/fp16/fused_optimizer.py: FP16_Optimizer
               params = fp16_groups_flat, master = fp32_groups_flat (full, not partitioned)
stage 1/2      runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer
               params = bit16_groups_flat, master = single_partition_of_fp32_groups,
               grads = averaged_gradients / grads_in_partition / p.grad,
               buffers = ipg_buckets[dtype].buffer
stage 3        runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3
               params = lp_param_buffer / fp16_partitioned_groups_flat / p.ds_tensor
               + p.data of parameters still gathered (persistent ones),
               master = fp32_partitioned_groups_flat,
               grads = grad_partitions_flat_buffer (+ averaged_gradients),
               buffers = ipg_buckets[dtype].buffer (reduce_bucket_size elements, allocated
               at init in the communication dtype)

Measured (DeepSpeed 0.19.8, CPU, gloo, N = 2, torch_adam, minizero "tiny" GPT, dropout 0)
------------------------------------------------------------------------------------
Ψ = 108,801 in 2 param groups (decay 99,162, no-decay 9,639), 37 tensors. Bytes per rank
after the 3rd step's backward (before engine.step) / after the step.
  P = ZeRO-1/2 padded flat size = 99,164 + 9,640 = 108,804 (each GROUP padded to a
      multiple of 2N = 4), slice P/N = 54,402 (stage_1_and_2.py: DeepSpeedZeroOptimizer
      .__init__, align_dense_tensors(nccl_start_alignment_factor * dp_size)).
  S = ZeRO-3 partition = Σ ceil(n/N) over the 37 parameters = 54,415
      (partition_parameters.py: Init._partition_param; padding is per PARAMETER).

bf16, reduce_bucket_size 2e4, stage3_param_persistence_threshold 0:
| stage | params        | master_params | optimizer_states | grads bwd / step          | model states bwd / step   | buffers |
|-------|---------------|---------------|------------------|---------------------------|---------------------------|---------|
| 0     | 217,602 = 2Ψ  | 435,204 = 4Ψ  | 870,408 = 8Ψ     | 217,602 = 2Ψ / 0          | 1,740,816 / 1,523,214=14Ψ | none |
| 1     | 217,608 = 2P  | 217,608 = 4P/N| 435,216 = 8P/N   | r0 118,944, r1 114,414 / 0| r0 989,376 / 870,432      | 40,000 transient (backward only) |
| 2     | as stage 1, byte for byte (at gradient_accumulation_steps 1)                                                     |
| 3     | 108,830 = 2S  | 217,660 = 4S  | 435,320 = 8S     | 108,830 = 2S / 108,830    | 870,640 = 16S / same      | 40,000 persistent |
 - stage 0 bf16/fp16 with torch_adam is FP16_UnfusedOptimizer: nothing partitioned,
   fp32 master for every parameter; the bf16 p.grad is freed by step (set_to_none).
 - stage 1/2 grads after backward: the bf16 gradient partition holds WHOLE parameters
   that straddle the slice boundary: 59,472 (r0) / 57,207 (r1) elements vs a 54,402 slice.
 - stage 3 grads never go away: grad_partitions_flat_buffer (2S bytes, low precision) is
   allocated in the optimizer's __init__ and kept, so ZeRO-3 holds 16S at all times.
 - Adam's exp_avg/exp_avg_sq appear at the first step (lazy): optimizer_states is 0 in
   the first after_backward probe. Adam's scalar `step` tensors (4 bytes per param
   tensor) are not counted.
 - DeepSpeed's own defaults: stage 3 with persistence 1e5 and reduce_bucket_size 5e8
   holds params 326,490 = 2S + 217,660 (every tiny parameter is <= 1e5 elements, so all
   stay gathered, each in its padded N*ceil(n/N) all-gather buffer) -> model states
   1,088,300, plus a 1,000,000,000-byte bf16 ipg bucket allocated at init. Stage 1/2 with
   the default bucket allocate 1,000,000,000 bytes (5e8 bf16, torch.empty) at the start of
   EVERY backward and free it at the end (track_transient_buckets); ×2 with overlap_comm.
fp32 (same settings):
| 0     | 435,204 = 4Ψ  | 0             | 870,408 = 8Ψ     | 435,204 / 0               | 1,740,816 / 1,305,612     | none |
| 1, 2  | 435,216 = 4P  | 217,608 = 4P/N| 435,216 = 8P/N   | r0 237,888, r1 228,828 / 0| r0 1,325,928 / 1,088,040  | 80,000 transient |
| 3     | 217,660 = 4S  | 217,660 = 4S  | 435,320 = 8S     | 217,660 / 217,660         | 1,088,300 = 20S           | 80,000 persistent |
   (fp32 ZeRO keeps a second fp32 copy as "master": 4P/N or 4S wasted bytes.)
fp16: stages 0, 2 and 3 give exactly the bf16 numbers (stage 1 not measured separately).

DeepSpeed's estimators (deepspeed_estimates) for tiny, N = 2, no offload: zero2
1,196,811 (2Ψ + 18Ψ/N) vs 870,432 measured after a step (989,376 peak after backward);
zero3 1,043,721 (4*16,128 largest layer + 18Ψ/N) vs 870,640 measured (+ the bucket).

Not model states: the ipg bucket buffers above (reduce_bucket_size elements of the
gradient-reduction dtype), `_global_grad_norm` (4 or 8 bytes) and ZeRO-3's
`inf_or_nan_tracker` (1 byte), which show up under `unclaimed`.

Time (same machine, 2 cores): one 3-step run under tests.launcher is 3-15 s wall, of
which deepspeed.initialize is 1.6-13.7 s (noisy; stage 3 and fp16 slowest). Steps:
fp32 ~20 ms (stage 0), ~40 (1/2), ~100-130 (3); bf16 ~100 (0), ~65-75 (1/2), ~140-200
(3); fp16 ~115 (2), ~200 (3).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

CATEGORIES = ("params", "master_params", "optimizer_states", "grads", "buffers")
MODEL_STATE_CATEGORIES = ("params", "master_params", "optimizer_states", "grads")

def _iter_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors inside obj (tensor, list/tuple, dict values, dataclass-like buckets)."""
    if obj is None or depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set)):
        for o in obj:
            yield from _iter_tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):  # IPGBucket / IPGBucketZ3
        for f in obj.__dataclass_fields__:
            yield from _iter_tensors(getattr(obj, f, None), depth + 1)


def _storage_key(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    try:
        s = t.untyped_storage()
    except Exception:  # meta / sparse / tensor subclasses without storage
        return None
    if s.nbytes() == 0 or s.data_ptr() == 0:
        return None
    return (s.data_ptr(), s.nbytes())


class _Ledger:
    def __init__(self):
        self.owner: Dict[int, str] = {}  # storage ptr -> category
        self.bytes = {c: 0 for c in CATEGORIES}
        self.details: Dict[str, int] = {}  # "category:source" -> bytes newly claimed

    def claim(self, category: str, source: str, obj: Any) -> None:
        for t in _iter_tensors(obj):
            key = _storage_key(t)
            if key is None or key[0] in self.owner:
                continue
            self.owner[key[0]] = category
            if category in self.bytes:
                self.bytes[category] += key[1]
            name = f"{category}:{source}"
            self.details[name] = self.details.get(name, 0) + key[1]


def _attr(obj, name):
    """getattr that also finds name-mangled private attributes (`__x` -> `_Cls__x`)."""
    if hasattr(obj, name):
        return getattr(obj, name)
    for k, v in vars(obj).items():
        if k.endswith(name) and k.startswith("_"):
            return v
    return None


def _module_params(engine) -> List[torch.nn.Parameter]:
    return list(engine.module.parameters())


def _adam_states(opt) -> Tuple[list, list]:
    """(exp_avg/exp_avg_sq tensors, scalar step tensors) of a torch optimizer."""
    big, small = [], []
    state = getattr(opt, "state", None) or {}
    for st in state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                (small if k == "step" else big).append(v)
    return big, small


def deepspeed_model_state_bytes(engine) -> Dict[str, Any]:
    """This rank's persistent model-state bytes, by category, from a live DeepSpeed engine.

    Returns {"params", "master_params", "optimizer_states", "grads", "buffers": int bytes,
    "model_states": sum of the first four, "kind": which optimizer wrapper was found,
    "details": {"category:source": bytes}, "unclaimed": {"attr": bytes}}.
    """
    opt = engine.optimizer
    kind = type(opt).__name__
    led = _Ledger()
    params = _module_params(engine)
    inner = getattr(opt, "optimizer", opt)  # the torch optimizer inside a wrapper
    big_states, step_states = _adam_states(inner)

    # ---------------- params ----------------
    if kind == "DeepSpeedZeroOptimizer":  # ZeRO-1/2
        led.claim("params", "bit16_groups_flat", opt.bit16_groups_flat)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        led.claim("params", "lp_param_buffer", _attr(opt, "lp_param_buffer"))
        led.claim("params", "fp16_partitioned_groups_flat", _attr(opt, "fp16_partitioned_groups_flat"))
        led.claim("params", "ds_tensor", [getattr(p, "ds_tensor", None) for p in params])
        # parameters that are still gathered (ds_persist: numel <= persistence threshold)
        led.claim("params", "gathered p.data", [p.data for p in params])
    elif kind == "BF16_Optimizer":
        led.claim("params", "bf16_groups_flat", opt.bf16_groups_flat)
    elif kind == "FP16_Optimizer":
        led.claim("params", "fp16_groups_flat", opt.fp16_groups_flat)
    led.claim("params", "module params", [p.data for p in params])

    # ---------------- master params ----------------
    if kind == "DeepSpeedZeroOptimizer":
        led.claim("master_params", "single_partition_of_fp32_groups", opt.single_partition_of_fp32_groups)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        led.claim("master_params", "fp32_partitioned_groups_flat", _attr(opt, "fp32_partitioned_groups_flat"))
    elif kind == "BF16_Optimizer":
        led.claim("master_params", "fp32_groups_flat_partition", opt.fp32_groups_flat_partition)
    elif kind == "FP16_Optimizer":
        led.claim("master_params", "fp32_groups_flat", opt.fp32_groups_flat)
    elif kind == "FP16_UnfusedOptimizer":
        led.claim("master_params", "fp32_groups", opt.fp32_groups)

    # ---------------- optimizer states ----------------
    led.claim("optimizer_states", "optimizer.state", big_states)
    led.claim("optimizer_step_counters", "optimizer.state[step]", step_states)  # details only

    # ---------------- grads ----------------
    if kind == "DeepSpeedZeroOptimizer":
        led.claim("grads", "averaged_gradients", _attr(opt, "averaged_gradients"))
        led.claim("grads", "grads_in_partition", _attr(opt, "grads_in_partition"))
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        led.claim("grads", "grad_partitions_flat_buffer", _attr(opt, "grad_partitions_flat_buffer"))
        led.claim("grads", "averaged_gradients", _attr(opt, "averaged_gradients"))
    elif kind == "BF16_Optimizer":
        led.claim("grads", "fp32_groups_gradients_flat", opt.fp32_groups_gradients_flat)
    elif kind == "FP16_Optimizer":
        led.claim("grads", "fp32_groups_flat.grad", [t.grad for t in opt.fp32_groups_flat])
    elif kind == "FP16_UnfusedOptimizer":
        led.claim("grads", "fp32_groups[i][j].grad", [t.grad for g in opt.fp32_groups for t in g])
    # master-param .grad attributes (wrappers assign them around step)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        g = _attr(opt, name)
        if isinstance(g, list):
            led.claim("grads", f"{name}[i].grad", [t.grad for t in g if isinstance(t, torch.Tensor)])
    led.claim("grads", "module p.grad", [p.grad for p in params])

    # ---------------- communication buffers ----------------
    buckets = _attr(opt, "ipg_buckets")
    if isinstance(buckets, dict):
        led.claim("buffers", "ipg_buckets", [getattr(b, "buffer", None) for b in buckets.values()])
    for name in ("temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload",
                 "param_groups_fp16_flat_cpu_memory", "lp_param_contiguous_pin_buffer"):
        led.claim("buffers", name, _attr(opt, name))

    # ---------------- discovery: anything else the optimizer objects hold ----------------
    unclaimed: Dict[str, int] = {}
    holders = [("optimizer", opt)] + ([("optimizer.optimizer", inner)] if inner is not opt else [])
    for holder_name, holder in holders:
        for k, v in list(vars(holder).items()):
            for t in _iter_tensors(v):
                key = _storage_key(t)
                if key is None or key[0] in led.owner:
                    continue
                led.owner[key[0]] = "unclaimed"
                n = f"{holder_name}.{k}"
                unclaimed[n] = unclaimed.get(n, 0) + key[1]

    out = dict(led.bytes)
    out["model_states"] = sum(led.bytes[c] for c in MODEL_STATE_CATEGORIES)
    out["kind"] = kind
    out["details"] = led.details
    out["unclaimed"] = unclaimed
    return out


def track_transient_buckets(engine) -> Dict[str, int]:
    """ZeRO-1/2 allocate their gradient bucket buffers at the start of every backward
    (stage_1_and_2.py: DeepSpeedZeroOptimizer.setup_buckets: `reduce_bucket_size`
    elements of `_gradient_reduction_buffer_dtype()`, twice with overlap_comm) and free
    them at the end of it (independent_gradient_partition_epilogue ->
    _release_ipg_buffers), so a probe after backward never sees them. This wraps
    setup_buckets on the live optimizer and records the bytes it allocated; returns the
    dict it keeps updating ({"max_bytes": ..., "calls": ...}). No-op for other optimizers
    (ZeRO-3's buckets are persistent and counted by deepspeed_model_state_bytes)."""
    rec = {"max_bytes": 0, "calls": 0}
    opt = engine.optimizer
    if type(opt).__name__ != "DeepSpeedZeroOptimizer" or not hasattr(opt, "setup_buckets"):
        return rec
    orig = opt.setup_buckets

    def setup_buckets(*a, **k):
        r = orig(*a, **k)
        seen, total = set(), 0
        for b in opt.ipg_buckets.values():
            for t in _iter_tensors(getattr(b, "buffer", None)):
                key = _storage_key(t)
                if key and key[0] not in seen:
                    seen.add(key[0])
                    total += key[1]
        rec["calls"] += 1
        rec["max_bytes"] = max(rec["max_bytes"], total)
        return r

    opt.setup_buckets = setup_buckets
    return rec


# ---------------------------------------------------------------------------------------
# Arithmetic: what the numbers above should be
# ---------------------------------------------------------------------------------------

def zero12_padded_numel(group_numels: Iterable[int], world_size: int) -> int:
    """ZeRO-1/2 (stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__) pads each param
    group's flat buffer to a multiple of 2*N elements (`align_dense_tensors` with
    `nccl_start_alignment_factor * dp_size`, factor 2) and splits it into N equal slices."""
    a = 2 * world_size
    return sum(int(math.ceil(n / a)) * a for n in group_numels)


def zero3_partition_numel(param_numels: Iterable[int], world_size: int) -> int:
    """ZeRO-3 (partition_parameters.py: _partition_param) gives each parameter
    ceil(n/N) elements on every rank, padding the last rank's slice."""
    return sum(int(math.ceil(n / world_size)) for n in param_numels)


def deepspeed_estimates(model: torch.nn.Module, world_size: int) -> Dict[str, int]:
    """DeepSpeed's own arithmetic estimators, in bytes per rank (no offload), for comparison
    with what deepspeed_model_state_bytes measures.

    stage_1_and_2.py: estimate_zero2_model_states_mem_needs -> 2Ψ + 18Ψ/N ("2 grads16 +
    4 grads32 + 4 params32 + 8 optimizer states", i.e. it assumes an fp32 gradient
    partition besides the 16-bit one; measured bf16 ZeRO-2 holds 2Ψ + 12Ψ/N + the bf16
    gradient partition instead). stage3.py: estimate_zero3_model_states_mem_needs ->
    4 * largest_layer + 18Ψ/N. (The *_all_live wrappers only print these rounded to GB,
    useless for a small model.)"""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = model_to_params(model)
    _, z2 = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world_size, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world_size, cpu_offload=False)
    return {"total_params": int(total), "largest_layer_params": int(largest), "zero2": int(z2), "zero3": int(z3)}
