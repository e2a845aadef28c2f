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

DeepSpeed's estimators (reference/ds_estimates.py) for tiny, N = 2, no offload: zero2
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


def deepspeed_model_state_bytes(engine, discover: bool = True) -> Dict[str, Any]:
    """This rank's persistent model-state bytes, by category, from a live DeepSpeed engine.

    Returns {"params", "master_params", "optimizer_states", "grads", "buffers": int bytes,
    "model_states": sum of the first four, "device"/"host": the four categories split by
    where DeepSpeed keeps them (ZeRO-Offload; without it everything is "device"), and
    "nvme" when it swaps states to files (ds_nvme.py; the totals include them),
    "kind": which optimizer wrapper was found, "details": {"category:source": bytes},
    "details_by_place": {"device"/"host": {"category:source": bytes}},
    "unclaimed": {"attr": bytes}} (the walk over every attribute of the optimizer that finds
    them is skipped with `discover=False`, as the peak recorder's many readings do).

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
        # hpZ (zero_hpz_partition_size k > 1): the second, node-local partition, padded/k elements
        # of each parameter in its low precision, alive from forward's release to the step
        led.claim("params", "ds_secondary_tensor", [getattr(p, "ds_secondary_tensor", None) for p in params],
                  lp_place)
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
    for holder_name, holder in holders if discover else ():
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
        out = {"full": sum(p.ds_tensor.numel() * world for p in params if getattr(p, "ds_persist", False)),
               "shard": sum(p.ds_tensor.numel() for p in params)}
        secondary = [p.ds_secondary_tensor for p in params if getattr(p, "ds_secondary_tensor", None) is not None]
        if secondary:   # hpZ, between forward and the step
            out["secondary"] = sum(t.numel() for t in secondary)
        return out
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


def peak_reading(engine) -> Dict[str, Any]:
    """What a DeepSpeed engine holds right now, in runlog.PhasePeaks' shape: the walk above
    (its four categories where they live, and the communication buckets, which are on the
    device), without the discovery pass."""
    held = deepspeed_model_state_bytes(engine, discover=False)
    by_category = {**held["device"], "buffers": held["buffers"]}
    detail = {k: v for k, v in held["details_by_place"]["device"].items() if k.split(":", 1)[0] in by_category}
    return {"total": sum(by_category.values()), "by_category": by_category,
            "host": sum(held["host"].values()), "detail": detail}


def track_peaks(engine):
    """A runlog.PhasePeaks of a live DeepSpeed engine: its forward, backward and step wrapped
    (on this instance) as phases, and a reading (`peak_reading`) at each event inside them that
    changes what it holds, as DeepSpeed 0.19.8 runs them:

    stage 0        before and after engine.allreduce_gradients (the bucketed all-reduce after
                   loss.backward), before and after the inner optimizer's step
    ZeRO-1/2       (stage_1_and_2.py) before reduce_gradients (ZeRO-1: every gradient made,
                   none reduced), before and after each average_tensor (a bucket's all-reduce:
                   the ipg bucket full), after each reduce_ipg_grads (the bucket's gradients
                   copied into the partition and freed), before and after the inner optimizer's
                   step (the fp32 gradient partition single_partition_of_fp32_groups[i].grad
                   made for it)
    ZeRO-3         (stage3.py, partitioned_param_coordinator.py) after each fetch_sub_module
                   (a submodule's parameters gathered), before each release_sub_module, before
                   and after each __reduce_and_partition_ipg_grads (a bucket's reduce-scatter)
                   and partition_grads, before and after each sub-group's inner optimizer step
                   (its fp32 gradient made in _prepare_sub_group)

    and at each phase's start and end. arm() before the step to read, result() after it."""
    from minizero.train.runlog import PhasePeaks, wrap_phase, wrap_sample

    peaks = PhasePeaks(lambda: peak_reading(engine))
    opt = engine.optimizer
    kind = type(opt).__name__
    for method, phase in (("forward", "forward"), ("backward", "backward"), ("step", "step")):
        wrap_phase(engine, method, peaks, phase)
    inner = getattr(opt, "optimizer", None)
    if inner is not None and hasattr(inner, "step"):
        wrap_sample(inner, "step", peaks, "optimizer.step")
    elif hasattr(opt, "step") and kind not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
        wrap_sample(opt, "step", peaks, "optimizer.step")   # stage 0 fp32: the torch optimizer itself
    if kind == "DeepSpeedZeroOptimizer":
        wrap_sample(opt, "reduce_gradients", peaks, "reduce_gradients", after=False)
        wrap_sample(opt, "average_tensor", peaks, "average_tensor")
        wrap_sample(opt, "reduce_ipg_grads", peaks, "reduce_ipg_grads", before=False)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        coordinator = opt.parameter_offload.get_param_coordinator()
        wrap_sample(coordinator, "fetch_sub_module", peaks, "fetch_sub_module", before=False)
        wrap_sample(coordinator, "release_sub_module", peaks, "release_sub_module", after=False)
        wrap_sample(opt, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", peaks,
                    "reduce_and_partition_ipg_grads")
        wrap_sample(opt, "partition_grads", peaks, "partition_grads")
    else:
        wrap_sample(engine, "allreduce_gradients", peaks, "allreduce_gradients")
    return peaks
