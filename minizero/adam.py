"""The optimizer a ZeRO stage steps: torch's Adam / AdamW, as DeepSpeed would build it from
the config, with its state made at init, stepped a slice at a time on a CPU.

Every stage hands the optimizer one flat fp32 master per FlatParam (sharded_optimizer.py);
what is here is only *which* Adam that is (`build_optimizer`, DeepSpeed's choices),
`init_optimizer_states` (the 12Ψ/N shows before the first step, as in DeepSpeed), and
`ChunkedAdam` / `ChunkedAdamW`: torch's classes, bit for bit, with a step that walks each
long flat master in slices (why: the section comment below).
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam as adam_update   # the function torch's Adam.step calls


def init_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Allocate Adam's moments now, as torch.optim.Adam(W) would on its first step.

    DeepSpeed's ZeRO optimizers do the same at init, so memory measured before the first
    step already shows the 12Ψ/N optimizer term. The values and places are exactly what
    torch's `_init_group` would create, so the first step is unchanged: `step` is a CPU
    scalar, except for a fused or capturable Adam, whose kernels read it on the parameter's
    device (a CPU `step` there fails or syncs the host every step on a GPU).
    """
    for group in optimizer.param_groups:
        on_param = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = optimizer.state[p]
            if len(st) == 0 and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                _fill_state(st, p, bool(group.get("amsgrad")), on_param)


def _fill_state(st: dict, p: torch.Tensor, amsgrad: bool, on_param: bool = False) -> None:
    """A fresh Adam state for p, as torch's _init_group makes it: `step` a CPU scalar, or on
    p's device for a fused or capturable Adam (on_param); the moments zeros like p."""
    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_param else \
        torch.tensor(0.0, dtype=torch.float32)
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if amsgrad:
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def build_optimizer(param_groups, opt_cfg, on_host: bool = False) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed would build from the parsed `optimizer` section.

    Mirrors `DeepSpeedEngine._configure_basic_optimizer` + `get_optimizer_configuration`
    (runtime/engine.py):

    - `adam_w_mode` (default true) is popped; "AdamW" forces it on. So "Adam" means
      AdamW math (decoupled weight decay) unless `"adam_w_mode": false`.
    - with `"torch_adam": true` DS builds `torch.optim.AdamW` / `torch.optim.Adam` with
      the remaining params: torch's own defaults apply, notably AdamW's weight_decay 0.01.
    - without `torch_adam` DS builds its `FusedAdam` (same update, results < 1e-6 apart),
      whose weight_decay default is 0.0. minizero always builds the torch optimizer, so
      in that case it passes weight_decay=0.0 explicitly to keep DS's effective default.
    - with ZeRO-Offload and without `torch_adam`, DS builds `DeepSpeedCPUAdam`, its
      vectorised C++ CPU Adam (weight_decay default 0.0). minizero builds torch's fused
      CPU AdamW (`fused=True`), the fastest Adam torch has on a CPU (launch/bench_offload.py
      measures it against the default for-loop). It rounds differently from the for-loop:
      with `torch_adam` both libraries run torch's default, so they stay bit-identical.
    - the class is torch's, stepped a slice at a time on a CPU (ChunkedAdamW, below): the same
      numbers bit for bit and the same state, without two mmap'd temporaries per step.
    """
    params = dict(opt_cfg.params)
    adam_w_mode = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = opt_cfg.type == "AdamW" or adam_w_mode
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)   # FusedAdam.__init__ / DeepSpeedCPUAdam default
        if on_host:
            params["fused"] = True
    cls = ChunkedAdamW if adam_w_mode else ChunkedAdam
    return cls(param_groups, **params)

# ----------------------------------------------------------------------------- Adam, a slice at a time
#
# Every stage hands the optimizer one flat fp32 master per bucket (sharded_optimizer.py):
# millions of elements in one tensor. torch's for-loop Adam (what it runs on a CPU) makes
# two full-size temporaries per parameter and step (`exp_avg_sq.sqrt()` and its division
# by the bias correction). For a 40 MB master those are 40 MB allocations, above glibc's
# largest mmap threshold (32 MB on 64-bit), so each is a fresh mmap that the kernel zeroes
# page by page on first touch and an munmap when freed: every step, twice per bucket. Cut
# into slices of CHUNK_NUMEL elements, the temporaries are 1 MB, come from the heap's free
# list after the first step, and the slice's master, gradient and moments stay in the cache
# while Adam's six passes run over them (`python launch/bench_overlap.py` shows the step).
#
# The update is element-wise, so each element sees the same operations on the same values
# whatever the slicing: the result is bit-identical to one `step()` on the whole tensor
# (tests/core/test_adam.py pins it). The state is torch's own, one entry per flat
# master, so checkpoints keep their layout and old ones load. `step` counts optimizer
# steps, not slices: each slice steps a copy of the counter, the counter steps once.
#
# A bf16/fp16 run's gradient arrives in low precision and must become fp32, divided by the loss
# scale and clip factor, before Adam reads it. Made whole that is one more fresh fp32 tensor the
# size of the master per step; `set_low_precision_grad` hands the optimizer the low-precision
# gradient and the divisor instead, and each slice is converted as it is stepped (the same
# `.float()` then `.mul_(1 / divisor)`, element by element, so the same fp32 gradient).
#
# The slices are stepped a few at a time (BATCH_NUMEL elements: a small model's masters in one
# call) by torch's foreach kernels where those give the for-loop's bits (AdamW, or Adam without
# weight decay), so the per-slice work is torch's C++ loop, not Python's. The common case calls
# those kernels itself (`_adamw_foreach`, below); the rest goes through torch's function.
#
# Only where it helps: on a GPU (torch's foreach/fused kernels, a caching allocator), with a
# fused Adam or a closure, it is torch's `step()` as is (`steps_in_slices` says which; a
# low-precision gradient needs it).

CHUNK_NUMEL = 1 << 18   # 1 MB of fp32 per temporary: below the mmap threshold, inside L2
BATCH_NUMEL = 1 << 20   # elements of slices stepped by one call: four slices' temporaries alive at once


class _StepsInChunks:
    chunk_numel = CHUNK_NUMEL
    batch_numel = BATCH_NUMEL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.low_precision_grads: dict = {}   # master -> (its low-precision gradient, 1 / divisor), for one step
        self._slices_ok: bool | None = None   # steps_in_slices(), asked once: the masters never move

    def steps_in_slices(self) -> bool:
        """Will step() go slice by slice (every group on torch's for-loop path, on the host)?"""
        if self._slices_ok is None:
            self._slices_ok = all(_chunkable(g) for g in self.param_groups)
        return self._slices_ok

    def set_low_precision_grad(self, p: torch.Tensor, grad: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """The next step() reads p's gradient as grad.float() * inv_scale, a slice at a time
        (p.grad must be None). Only where steps_in_slices()."""
        assert p.grad is None and grad.is_contiguous() and self.steps_in_slices()
        self.low_precision_grads[p] = (grad.view(-1), inv_scale)

    def step(self, closure=None):
        low, self.low_precision_grads = self.low_precision_grads, {}
        if closure is not None or not self.steps_in_slices():
            assert not low, "a low-precision gradient needs the sliced step"
            return super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                stepped = [p for p in group["params"] if p.grad is not None or p in low]
                if stepped:
                    self._step_group(group, stepped, low)
        return None

    def _step_group(self, group: dict, params: list, low: dict) -> None:
        """Every slice of every stepped master, BATCH_NUMEL elements of slices per call:
        AdamW's foreach kernels called here directly where they give the for-loop's bits
        (`_direct`), else torch's functional Adam."""
        direct = _direct(group)
        counters = [self._state(p, group)["step"] for p in params]
        if direct:   # as torch's foreach Adam: the counts step first, then the bias corrections read them
            torch._foreach_add_(counters, 1.0)
        cols, per_slice, numel = [[] for _ in range(5 if group["amsgrad"] else 4)], [], 0
        for p, step in zip(params, counters):
            state, lp = self.state[p], low.get(p)
            flat = [_flat(p), _flat(p.grad) if lp is None else lp[0], _flat(state["exp_avg"]),
                    _flat(state["exp_avg_sq"])] + ([_flat(state["max_exp_avg_sq"])] if group["amsgrad"] else [])
            corrections = _bias_corrections(group, step.item()) if direct else None
            whole = p.numel() <= self.chunk_numel   # one slice: the tensors themselves, no views to make
            for a in range(0, p.numel(), self.chunk_numel):
                piece = list(flat) if whole else [t[a:a + self.chunk_numel] for t in flat]
                if lp is not None:   # what the whole gradient's .float().mul_ gives here
                    piece[1] = piece[1].float().mul_(lp[1])
                for col, t in zip(cols, piece):
                    col.append(t)
                # torch's path: each slice increments its own copy of the counter; the counter steps once below
                per_slice.append(corrections if direct else step.clone())
                numel += piece[0].numel()
                if numel >= self.batch_numel:
                    _adamw_foreach(group, cols, per_slice) if direct else _torch_adam(group, cols, per_slice)
                    cols, per_slice, numel = [[] for _ in cols], [], 0
        if per_slice:
            _adamw_foreach(group, cols, per_slice) if direct else _torch_adam(group, cols, per_slice)
        if not direct:
            for step in counters:
                step.add_(1)

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        """p's state, made as torch's _init_group would if it is not there yet (ShardedOptimizer
        makes it at init anyway)."""
        state = self.state[p]
        if len(state) == 0:
            _fill_state(state, p, group["amsgrad"])
        return state


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as one dimension (every stage's master already is: no view to make then)."""
    return t if t.dim() == 1 else t.view(-1)


# torch's functional `adam()` spends more host time on bookkeeping (argument checks, grouping
# the tensors by device and dtype, a copy of every step counter) than the arithmetic takes on a
# small model's masters (`python3 launch/bench_host.py` times a step's parts). The common
# case, AdamW (or Adam without weight decay) with no amsgrad and no maximize, is eight foreach
# calls: torch's `_multi_tensor_adam` for host tensors, the same calls with the same
# scalars in the same order, so the same bits (tests/core/test_adam.py compares every
# variant with torch's own class). Every other variant goes through torch's function.

def _foreach_matches_loop(group: dict) -> bool:
    """Do torch's foreach Adam kernels give its for-loop's bits for this group? AdamW, or Adam
    without weight decay, and no amsgrad: the same operations, element by element."""
    return not group["amsgrad"] and (group["decoupled_weight_decay"] or group["weight_decay"] == 0)


def _direct(group: dict) -> bool:
    """Does this group take `_adamw_foreach`? A group whose foreach kernels match the for-loop,
    without maximize, with plain float hyperparameters."""
    return (_foreach_matches_loop(group) and not group["maximize"]
            and all(isinstance(v, float | int) for v in (group["lr"], *group["betas"])))


def _bias_corrections(group: dict, step: float) -> tuple:
    """(-lr / (1 - beta1^t), sqrt(1 - beta2^t)) for step t, in Python floats, each written as
    torch's `_multi_tensor_adam` writes it (its rounding is part of the result)."""
    beta1, beta2 = group["betas"]
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    return (group["lr"] / bias_correction1) * -1, bias_correction2 ** 0.5


def _adamw_foreach(group: dict, cols: list, per_slice: list) -> None:
    """One AdamW update over the slices in `cols` (params, grads, exp_avgs, exp_avg_sqs)."""
    params, grads, exp_avgs, exp_avg_sqs = cols
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [c[1] for c in per_slice])
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denom, [c[0] for c in per_slice])


def _torch_adam(group: dict, cols: list, steps: list) -> None:
    """torch's functional Adam over the slices, with the flags its Adam.step passes: its foreach
    kernels where they give the for-loop's bits (Adam without weight decay, or decoupled), else
    its for-loop."""
    beta1, beta2 = group["betas"]
    adam_update(cols[0], cols[1], cols[2], cols[3], cols[4] if len(cols) > 4 else [], steps,
                amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=_foreach_matches_loop(group), capturable=False, differentiable=False, fused=None,
                has_complex=False, decoupled_weight_decay=group["decoupled_weight_decay"])


def _chunkable(group: dict) -> bool:
    """torch's for-loop path on host tensors, with the flags this torch's Adam.step passes."""
    return (not group.get("fused") and not group.get("foreach") and not group.get("capturable")
            and not group.get("differentiable") and "decoupled_weight_decay" in group
            # plain host tensors only, every parameter whether or not it has a .grad yet: the
            # engine asks before it sets any (a low-precision gradient is handed over instead,
            # set_low_precision_grad), and a GPU master must never take the sliced path (a
            # slice is a launch of its own: torch's foreach kernel over the whole master is the
            # fast path there). FSDP2's DTensor shards (reference/torch_engine.py) cannot be
            # viewed flat, so they take torch's own step
            and all(type(p.data) is torch.Tensor and p.device.type == "cpu" and not torch.is_complex(p)
                    and p.is_contiguous() for p in group["params"])
            and all(not p.grad.is_sparse and p.grad.is_contiguous() for p in group["params"] if p.grad is not None))


class ChunkedAdam(_StepsInChunks, torch.optim.Adam):
    """torch.optim.Adam, stepped in slices on a CPU (the section comment above _StepsInChunks)."""


class ChunkedAdamW(_StepsInChunks, torch.optim.AdamW):
    """torch.optim.AdamW, stepped in slices on a CPU (the section comment above _StepsInChunks)."""
