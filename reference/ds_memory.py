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

Where each byte lives: "device" / "host" (ZeRO-Offload)
-------------------------------------------------------
On the CPU accelerator every tensor's `.device` is cpu, so the place comes from the
optimizer's own flags (`_offload_places`), as DeepSpeed's source allocates them.
b = bytes per low-precision element (2 bf16/fp16, 4 fp32), L = numel of the largest
parameter, P and S below.
offload_optimizer, ZeRO-1/2 (`cpu_offload`): host = fp32 master slice 4P/N, Adam moments
               8P/N, the master's fp32 .grad 4P/N (filled during backward; persistent),
               param_buffer_of_bit16_for_cpu_offload_groups bP/N ("params": the updated
               slice cast to low precision before its copy to the device),
               temp_grad_buffer_for_cpu_offload bL ("grads"); device = bit16_groups_flat
               bP, temp_grad_buffer_for_gpu_offload bL ("grads"). After backward the
               device holds no gradient partition: each piece went to the host's fp32 .grad.
offload_optimizer, ZeRO-3: host = fp32_partitioned_groups_flat 4S, moments 8S,
               grad_partitions_flat_buffer bS, fp32_partitioned_groups_flat[i].grad 4S.
offload_param, ZeRO-3: the lp partitions bS in param_groups_fp16_flat_cpu_memory (host)
               instead of lp_param_buffer (device); parameters kept gathered
               (persistence threshold) stay on the device in full, their partition on the host.
Everything else (the ipg bucket included) is on the device.

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
gradient-reduction dtype); scalars listed in `details` only (category "scalars"):
`_global_grad_norm` (4 or 8 bytes), ZeRO-3's `inf_or_nan_tracker` (1 byte) and, with
offload, `norm_for_param_grads` (one 4-byte norm per parameter, from backward to step).

Time (same machine, 2 cores): one 3-step run under tests.support.launcher is 3-15 s wall, of
which deepspeed.initialize is 1.6-13.7 s (noisy; stage 3 and fp16 slowest). Steps:
fp32 ~20 ms (stage 0), ~40 (1/2), ~100-130 (3); bf16 ~100 (0), ~65-75 (1/2), ~140-200
(3); fp16 ~115 (2), ~200 (3).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from reference.ds_nvme import nvme_bytes

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


PLACES = ("device", "host")


class _Ledger:
    def __init__(self):
        self.owner: Dict[int, str] = {}  # storage ptr -> category
        self.bytes = {c: 0 for c in CATEGORIES}
        self.placed = {w: {c: 0 for c in MODEL_STATE_CATEGORIES} for w in PLACES}
        self.details: Dict[str, int] = {}  # "category:source" -> bytes newly claimed
        self.details_by_place = {w: {} for w in PLACES}  # the same, split by place

    def claim(self, category: str, source: str, obj: Any, place: str = "device") -> None:
        """Claim obj's storages not yet owned for `category`, held in `place` ("device" or
        "host"). The CPU accelerator puts every tensor on the CPU, so the place is not read
        from the tensor: the caller says where DeepSpeed would have put it."""
        assert place in PLACES, place
        for t in _iter_tensors(obj):
            key = _storage_key(t)
            if key is None or key[0] in self.owner:
                continue
            self.owner[key[0]] = category
            if category in self.bytes:
                self.bytes[category] += key[1]
            if category in MODEL_STATE_CATEGORIES:
                self.placed[place][category] += key[1]
            name = f"{category}:{source}"
            self.details[name] = self.details.get(name, 0) + key[1]
            where = self.details_by_place[place]
            where[name] = where.get(name, 0) + key[1]


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


def _offload_places(opt, kind: str) -> Dict[str, Any]:
    """Where this optimizer keeps what, from DeepSpeed's own flags (not from tensor.device,
    which is "cpu" for everything on the CPU accelerator):

    ZeRO-1/2 (stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__): `cpu_offload` (from
      offload_optimizer.device "cpu") sets `self.device = 'cpu'`; the fp32 master slice, its
      fp32 .grad, Adam's moments and the offload staging buffers are created there.
    ZeRO-3 (stage3.py: DeepSpeedZeroOptimizer_Stage3): `offload_optimizer` sets `self.device`
      to cpu for grad_partitions_flat_buffer and the fp32 .grad buffers; the fp32 master and
      moments of sub-group i go to `subgroup_to_device[i]`, the host for
      i >= int((1 - partial_offload) * n_subgroups) (offload_optimizer.ratio, default 1: all).
      `offload_param` keeps the lp partitions in param_groups_fp16_flat_cpu_memory (host)
      instead of lp_param_buffer (device)."""
    if kind == "DeepSpeedZeroOptimizer":
        host = bool(getattr(opt, "cpu_offload", False))
        return {"optimizer": host, "grad_buffer": host, "param": False, "subgroup": lambda i: host}
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        off = bool(getattr(opt, "offload_optimizer", False))
        n = len(_attr(opt, "fp32_partitioned_groups_flat") or [])
        ratio = float(getattr(opt, "partial_offload", 1.0))
        return {"optimizer": off, "grad_buffer": off, "param": bool(getattr(opt, "offload_param", False)),
                "subgroup": lambda i: off and i >= int((1 - ratio) * n)}
    return {"optimizer": False, "grad_buffer": False, "param": False, "subgroup": lambda i: False}


def _where(host: bool) -> str:
    return "host" if host else "device"


def deepspeed_model_state_bytes(engine) -> Dict[str, Any]:
    """This rank's persistent model-state bytes, by category, from a live DeepSpeed engine.

    Returns {"params", "master_params", "optimizer_states", "grads", "buffers": int bytes,
    "model_states": sum of the first four, "device"/"host": the four categories split by
    where DeepSpeed keeps them (ZeRO-Offload; without it everything is "device"), and
    "nvme" when it swaps states to files (ds_nvme.py; the totals include them),
    "kind": which optimizer wrapper was found, "details": {"category:source": bytes},
    "details_by_place": {"device"/"host": {"category:source": bytes}},
    "unclaimed": {"attr": bytes}}.

    ZeRO-Offload's extra buffers go in the category of what they carry (docs/deepspeed.md,
    "ZeRO-Offload's extra host buffers"): the fp32 gradient partitions
    (`single_partition_of_fp32_groups[i].grad`, `fp32_partitioned_groups_flat[i].grad`),
    ZeRO-1/2's per-parameter gradient staging (`temp_grad_buffer_for_cpu_offload` on the
    host, `temp_grad_buffer_for_gpu_offload` on the device, `accumulated_grads_in_cpu`
    with gradient accumulation) in "grads"; ZeRO-1/2's low-precision copy of the updated
    slice (`param_buffer_of_bit16_for_cpu_offload_groups`, host) in "params".
    """
    opt = engine.optimizer
    kind = type(opt).__name__
    led = _Ledger()
    params = _module_params(engine)
    inner = getattr(opt, "optimizer", opt)  # the torch optimizer inside a wrapper
    at = _offload_places(opt, kind)
    opt_place, grad_place = _where(at["optimizer"]), _where(at["grad_buffer"])

    # ---------------- params ----------------
    if kind == "DeepSpeedZeroOptimizer":  # ZeRO-1/2
        led.claim("params", "bit16_groups_flat", opt.bit16_groups_flat)
        # offload: the updated fp32 slice is cast into this host lp buffer, then copied to
        # the device's bit16 partition (step(): bit16_partition_buffer.data.copy_(fp32_partition))
        led.claim("params", "param_buffer_of_bit16_for_cpu_offload_groups",
                  _attr(opt, "param_buffer_of_bit16_for_cpu_offload_groups"), "host")
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        lp_place = _where(at["param"])
        led.claim("params", "lp_param_buffer", _attr(opt, "lp_param_buffer"), lp_place)
        led.claim("params", "param_groups_fp16_flat_cpu_memory",
                  _attr(opt, "param_groups_fp16_flat_cpu_memory"), "host")
        led.claim("params", "fp16_partitioned_groups_flat", _attr(opt, "fp16_partitioned_groups_flat"), lp_place)
        led.claim("params", "ds_tensor", [getattr(p, "ds_tensor", None) for p in params], lp_place)
        # parameters that are still gathered (ds_persist: numel <= persistence threshold)
        led.claim("params", "gathered p.data", [p.data for p in params])
    elif kind == "BF16_Optimizer":
        led.claim("params", "bf16_groups_flat", opt.bf16_groups_flat)
    elif kind == "FP16_Optimizer":
        led.claim("params", "fp16_groups_flat", opt.fp16_groups_flat)
    led.claim("params", "module params", [p.data for p in params])

    # ---------------- master params ----------------
    z3_fp32 = _attr(opt, "fp32_partitioned_groups_flat") if kind == "DeepSpeedZeroOptimizer_Stage3" else None
    if kind == "DeepSpeedZeroOptimizer":
        led.claim("master_params", "single_partition_of_fp32_groups", opt.single_partition_of_fp32_groups, opt_place)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        for i, t in enumerate(z3_fp32 or []):
            led.claim("master_params", "fp32_partitioned_groups_flat", t, _where(at["subgroup"](i)))
    elif kind == "BF16_Optimizer":
        led.claim("master_params", "fp32_groups_flat_partition", opt.fp32_groups_flat_partition)
    elif kind == "FP16_Optimizer":
        led.claim("master_params", "fp32_groups_flat", opt.fp32_groups_flat)
    elif kind == "FP16_UnfusedOptimizer":
        led.claim("master_params", "fp32_groups", opt.fp32_groups)

    # ---------------- optimizer states ----------------
    # Adam's moments live where their parameter (the fp32 master it steps) lives.
    subgroup_of = {id(t): i for i, t in enumerate(z3_fp32 or [])}
    for param, st in (getattr(inner, "state", None) or {}).items():
        if kind == "DeepSpeedZeroOptimizer_Stage3":
            place = _where(at["subgroup"](subgroup_of.get(id(param), -1)))
        else:
            place = opt_place
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                if k == "step":  # details only
                    led.claim("optimizer_step_counters", "optimizer.state[step]", v, place)
                else:
                    led.claim("optimizer_states", "optimizer.state", v, place)

    # ---------------- grads ----------------
    if kind == "DeepSpeedZeroOptimizer":
        led.claim("grads", "averaged_gradients", _attr(opt, "averaged_gradients"))
        led.claim("grads", "grads_in_partition", _attr(opt, "grads_in_partition"))
        # offload: backward copies each gradient piece into the fp32 .grad of the master
        # slice (async_inplace_copy_grad_to_fp32_buffer_from_gpu), on the host; the two
        # staging buffers of the largest parameter's size are allocated in __init__
        led.claim("grads", "single_partition_of_fp32_groups[i].grad",
                  [t.grad for t in opt.single_partition_of_fp32_groups], opt_place)
        led.claim("grads", "temp_grad_buffer_for_cpu_offload", _attr(opt, "temp_grad_buffer_for_cpu_offload"),
                  "host")
        led.claim("grads", "temp_grad_buffer_for_gpu_offload", _attr(opt, "temp_grad_buffer_for_gpu_offload"))
        led.claim("grads", "accumulated_grads_in_cpu", _attr(opt, "accumulated_grads_in_cpu"), "host")
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        led.claim("grads", "grad_partitions_flat_buffer", _attr(opt, "grad_partitions_flat_buffer"), grad_place)
        led.claim("grads", "averaged_gradients", _attr(opt, "averaged_gradients"), grad_place)
        for i, t in enumerate(z3_fp32 or []):
            led.claim("grads", "fp32_partitioned_groups_flat[i].grad", t.grad, _where(at["subgroup"](i)))
    elif kind == "BF16_Optimizer":
        led.claim("grads", "fp32_groups_gradients_flat", opt.fp32_groups_gradients_flat)
    elif kind == "FP16_Optimizer":
        led.claim("grads", "fp32_groups_flat.grad", [t.grad for t in opt.fp32_groups_flat])
    elif kind == "FP16_UnfusedOptimizer":
        led.claim("grads", "fp32_groups[i][j].grad", [t.grad for g in opt.fp32_groups for t in g])
    # master-param .grad attributes (wrappers assign them around step)
    g = _attr(opt, "fp32_groups_flat_partition")
    if isinstance(g, list):
        led.claim("grads", "fp32_groups_flat_partition[i].grad", [t.grad for t in g if isinstance(t, torch.Tensor)])
    led.claim("grads", "module p.grad", [p.grad for p in params])

    # ---------------- communication buffers ----------------
    buckets = _attr(opt, "ipg_buckets")
    if isinstance(buckets, dict):
        led.claim("buffers", "ipg_buckets", [getattr(b, "buffer", None) for b in buckets.values()])
    # offload_states() (not called in training) pins a host copy of the lp buffer here
    led.claim("buffers", "lp_param_contiguous_pin_buffer", _attr(opt, "lp_param_contiguous_pin_buffer"), "host")

    # ---------------- scalars (details only, not a model state) ----------------
    for name in ("_global_grad_norm", "inf_or_nan_tracker", "norm_for_param_grads"):
        led.claim("scalars", name, _attr(opt, name))

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
    out["device"], out["host"] = led.placed["device"], led.placed["host"]
    nvme = nvme_bytes(opt)          # "device": "nvme": what lives in swap files (ds_nvme.py)
    if nvme is not None:
        out["nvme"] = nvme
        for c in MODEL_STATE_CATEGORIES:
            out[c] += nvme[c]
    out["model_states"] = sum(out[c] for c in MODEL_STATE_CATEGORIES)
    out["kind"] = kind
    out["details"] = led.details
    out["details_by_place"] = led.details_by_place
    out["unclaimed"] = unclaimed
    return out


def layout_elements(engine) -> Dict[str, int]:
    """The layout this rank's bytes come from, in elements, padding included (the shape of
    minizero.memory.held_bytes' "elements"): "full", the parameters kept whole on every rank
    (ZeRO-1/2: the 2N-padded flat buffers; ZeRO-3: the persistent parameters' padded
    all-gather buffers; stage 0: the module), and "shard", this rank's partition (ZeRO-1/2:
    the fp32 master slices; ZeRO-3: every parameter's ds_tensor, ceil(n/N) each; stage 0:
    the module)."""
    opt = engine.optimizer
    kind = type(opt).__name__
    params = _module_params(engine)
    if kind == "DeepSpeedZeroOptimizer":
        return {"full": sum(t.numel() for t in opt.bit16_groups_flat),
                "shard": sum(t.numel() for t in opt.single_partition_of_fp32_groups)}
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        world = engine.dp_world_size
        return {"full": sum(p.ds_tensor.numel() * world for p in params if getattr(p, "ds_persist", False)),
                "shard": sum(p.ds_tensor.numel() for p in params)}
    whole = sum(p.numel() for p in params)
    return {"full": whole, "shard": whole}


def held_bytes(engine) -> Dict[str, Any]:
    """deepspeed_model_state_bytes plus layout_elements (as "elements"): what reference/train.py
    reads at the memory moments (minizero.train.runlog.MemoryMoments), shaped like minizero's
    memory.held_bytes."""
    return {**deepspeed_model_state_bytes(engine), "elements": layout_elements(engine)}


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


def zero12_grad_partition_numel(group_param_numels: Iterable[Iterable[int]], world_size: int, rank: int) -> int:
    """ZeRO-1/2 without offload at gradient_accumulation_steps 1, after backward: the
    gradient partition (`averaged_gradients`) holds WHOLE parameters that overlap this
    rank's slice of each 2N-padded group buffer (a parameter straddling a boundary is held
    entirely by both ranks), plus the zero-padding tensor on the last rank (`_zero_padding`).
    `group_param_numels`: the parameters' numels, per param group, in order."""
    total = 0
    for g in group_param_numels:
        g = list(g)
        padded = zero12_padded_numel([sum(g)], world_size)
        lo, hi = rank * padded // world_size, (rank + 1) * padded // world_size
        off = 0
        for n in g:
            if off < hi and off + n > lo:
                total += n
            off += n
        if rank == world_size - 1:
            total += padded - sum(g)
    return total


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


# ----------------------------------------------------------------------------- DeepSpeed's estimators beside minizero's exact bytes

ESTIMATOR_MULTIPLIERS = """\
DeepSpeed's estimators (stage_1_and_2.py: estimate_zero2_model_states_mem_needs, stage3.py:
estimate_zero3_model_states_mem_needs; the *_all_live wrappers take Ψ and L from the model
with model_to_params and print these numbers in GB of 2^30 bytes). Ψ = total parameters
(shared ones once), L = the largest module's own parameters (recurse=False), N = GPUs,
G = GPUs per node, n = nodes, 1.5 = additional_buffer_factor:
  ZeRO-2           per GPU 2Ψ + 18Ψ/N: 2 = the replicated 16-bit parameters; 18 = "2 grads16 +
                   4 grads32 + 4 params32 + 8 optimizer states" (its code's comment), all
                   partitioned. minizero makes that fp32 gradient shard (4Ψ/N) only inside
                   step() and drops it after (sharded_optimizer.py), so memory_breakdown(),
                   which counts what persists, gives 2Ψ + 14Ψ/N + padding.
                   per CPU 4ΨG x 1.5: each of the node's G processes holding an fp32 copy
                   of the model while it loads.
  ZeRO-2 offload   per GPU 2Ψ (the 16-bit parameters only: DeepSpeed sends each gradient
                   piece to the host); per CPU max(4ΨN, 16Ψ) x 1.5 (N, total_gpus, where the
                   branch above uses G): 16 = 4 params32 + 4 grads32 + 8 states for the whole
                   model. minizero puts 12Ψ/N per rank on the host and keeps the 16-bit
                   gradient shard (2Ψ/N) on the device.
  ZeRO-3           per GPU 4L + 18Ψ/N: 4L = the largest layer gathered, 16-bit parameters
                   and 16-bit gradients (2 + 2 bytes); 18Ψ/N the same 18 as ZeRO-2's.
                   minizero's breakdown counts what stays between uses, 16Ψ/N + padding
                   (2 params16 + 2 grads16 + 4 params32 + 8 states): DeepSpeed adds 2Ψ/N
                   and the 4L working set. per CPU (zero_init) 4LG x 1.5.
  ZeRO-3 offload optimizer   per GPU 4L + 2Ψ/N (the 16-bit parameter partition); per CPU
                   16Ψ/n x 1.5 (the node's share of params32 + grads32 + states).
  ZeRO-3 offload optimizer+param   per GPU 4L; per CPU 18Ψ/n x 1.5 (16 + the 16-bit
                   parameter partition).
"""


def nodes_of(world_size: int, gpus_per_node: int = 8) -> Tuple[int, int]:
    """(num_gpus_per_node, num_nodes) for N GPUs: full nodes of `gpus_per_node`, or one
    node when N is smaller."""
    g = min(world_size, gpus_per_node)
    assert world_size % g == 0, f"N = {world_size} is not a whole number of {g}-GPU nodes"
    return g, world_size // g


def estimator_rows(model: torch.nn.Module, world_size: int, gpus_per_node: int = 8) -> List[Dict[str, Any]]:
    """DeepSpeed's estimator per offload option, in bytes (per GPU, per CPU = per node), for
    the options its *_all_live printouts list (ZeRO-3 with zero_init, DeepSpeed's default)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = model_to_params(model)
    g, n = nodes_of(world_size, gpus_per_node)
    rows = []
    for off in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=g, num_nodes=n, cpu_offload=off)
        rows.append({"stage": 2, "offload": "optimizer" if off else "none", "gpu": gpu, "cpu": cpu})
    for off, off_param, name in ((False, False, "none"), (True, False, "optimizer"), (True, True, "both")):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=g, num_nodes=n,
                                                            cpu_offload=off, cpu_offload_params=off_param)
        rows.append({"stage": 3, "offload": name, "gpu": gpu, "cpu": cpu})
    for r in rows:
        r.update(total_params=int(total), largest_layer_params=int(largest), gpus_per_node=g, nodes=n)
    return rows


def side_by_side(model_name: str, worlds: Iterable[int], gpus_per_node: int = 8) -> List[Dict[str, Any]]:
    """DeepSpeed's estimate beside minizero's exact bytes per rank (bf16, computed from the
    layout plans by minizero.memory_table; ZeRO-3 with every parameter partitioned)."""
    from minizero.memory import total as state_total
    from minizero.observe.memory_table import compute
    from minizero.gpt.model import GPT, get_preset

    torch.manual_seed(0)
    model = GPT(get_preset(model_name))   # real storage: model_to_params tells parameters apart by data_ptr
    out = []
    for n in worlds:
        for r in estimator_rows(model, n, gpus_per_node):
            mz = compute(model_name, [n], "bf16", (r["stage"],), r["offload"])[n][r["stage"]][0]
            out.append({**r, "world": n, "minizero_device": state_total(mz["device"]),
                        "minizero_host": state_total(mz["host"])})
    return out


def print_side_by_side(model_name: str, worlds: Iterable[int]) -> None:
    rows = side_by_side(model_name, worlds)
    print(f"model={model_name}: Ψ = {rows[0]['total_params']:,}, largest layer L = "
          f"{rows[0]['largest_layer_params']:,}; bytes per rank (minizero) or per GPU / per CPU (DeepSpeed)\n")
    print("| N | stage | offload | DeepSpeed per GPU | minizero on device | DeepSpeed per CPU (node) | "
          "minizero on host (rank) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['stage']} | {r['offload']} | {r['gpu']:,} | {r['minizero_device']:,} | "
              f"{r['cpu']:,} | {r['minizero_host']:,} |")
    print("\n" + ESTIMATOR_MULTIPLIERS)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m reference.ds_memory",
                                 description="DeepSpeed's model-state estimators beside minizero's exact bytes")
    ap.add_argument("--model", default="tutorial")
    ap.add_argument("--world-size", type=int, nargs="+", default=[8, 64, 1024])
    args = ap.parse_args(argv)
    from minizero.gpt.model import PRESETS
    if args.model not in PRESETS:
        ap.error(f"unknown --model {args.model!r}: choose one of {', '.join(PRESETS)}")
    bad = [n for n in args.world_size if n < 1 or n % min(n, 8)]
    if bad:
        ap.error(f"world sizes {bad}: use 1-8 or a multiple of 8 (8-GPU nodes)")
    print_side_by_side(args.model, args.world_size)


if __name__ == "__main__":
    main()
