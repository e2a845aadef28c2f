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
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_param else \
                    torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
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
# Only where it helps: on a GPU (torch's foreach/fused kernels, a caching allocator), with a
# fused Adam, a closure, or a parameter of at most one slice, it is torch's `step()` as is
# (`steps_in_slices` says which; a low-precision gradient needs it).

CHUNK_NUMEL = 1 << 18   # 1 MB of fp32 per temporary: below the mmap threshold, inside L2


class _StepsInChunks:
    chunk_numel = CHUNK_NUMEL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.low_precision_grads: dict = {}   # master -> (its low-precision gradient, 1 / divisor), for one step

    def steps_in_slices(self) -> bool:
        """Will step() go slice by slice (every group on torch's for-loop path, on the host)?"""
        return all(_chunkable(g) for g in self.param_groups)

    def set_low_precision_grad(self, p: torch.Tensor, grad: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """The next step() reads p's gradient as grad.float() * inv_scale, a slice at a time
        (p.grad must be None). Only where steps_in_slices()."""
        assert p.grad is None and grad.is_contiguous() and self.steps_in_slices()
        self.low_precision_grads[p] = (grad.view(-1), inv_scale)

    def step(self, closure=None):
        groups = self.param_groups
        low, self.low_precision_grads = self.low_precision_grads, {}
        if closure is not None or not all(_chunkable(g) for g in groups):
            assert not low, "a low-precision gradient needs the sliced step"
            return super().step(closure)
        with torch.no_grad():
            for group in groups:
                for p in group["params"]:
                    if p.grad is not None or p in low:
                        self._step_one(group, p, low.get(p))
        return None

    def _step_one(self, group: dict, p: torch.Tensor, low=None) -> None:
        state = self.state[p]
        if len(state) == 0:   # as torch's _init_group (ShardedOptimizer makes the state at init anyway)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        hyper = dict(amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                     foreach=group["foreach"], capturable=group["capturable"],
                     differentiable=group["differentiable"], fused=group["fused"], has_complex=False,
                     decoupled_weight_decay=group["decoupled_weight_decay"])
        grad = p.grad.view(-1) if low is None else low[0]
        flat = [p.view(-1), grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
        if group["amsgrad"]:
            flat.append(state["max_exp_avg_sq"].view(-1))
        n, step = p.numel(), state["step"]
        if n <= self.chunk_numel:
            slices, one_slice = [slice(0, n)], True
        else:
            slices, one_slice = [slice(a, a + self.chunk_numel) for a in range(0, n, self.chunk_numel)], False
        for s in slices:
            param, grad, exp_avg, exp_avg_sq, *max_sq = (t[s] for t in flat)
            if low is not None:
                grad = grad.float().mul_(low[1])   # what the whole gradient's .float().mul_ gives here
            # each slice increments its own copy of the counter, which then holds the step's t
            adam_update([param], [grad], [exp_avg], [exp_avg_sq], max_sq, [step if one_slice else step.clone()],
                        **hyper)
        if not one_slice:
            step.add_(1)


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
