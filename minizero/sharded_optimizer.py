"""The optimizer step, on this rank's shard only: fp32 masters, norm, clip, Adam, copy back.

This is the part of ZeRO that every stage shares (Rajbhandari et al., SC'20, section 5.1):
Adam's update is element-wise, so rank r can update slice r of every FlatParam alone,
with the 12 bytes per element it needs (fp32 master, two moments) held for that slice
only. The stages differ in *how the reduced gradient got here* (zero0-3.py); from the
gradient shard on, a step is the same at every stage:

    grad_norm_sq()   sum of squares of my gradient shard; summed over ranks when the
                     gradient is sharded (stages 1-3): one scalar all-reduce
    step(...)        combined_scale = loss_scale * clip factor, computed and applied here:
                     fp32 grad = reduced grad / combined_scale, Adam on the fp32 masters,
                     round the masters into this rank's low-precision shard

After `step` the low-precision shard holds the new weights; sharing them with the other
ranks (an all-gather, now or on next use) is the stage's `after_step`.

At stage 0 the "shard" is the whole buffer (num_shards = 1) and nothing is summed.
`build_optimizer` picks the torch optimizer DeepSpeed would build from the config.

With ZeRO-Offload (`offload`, offload.py) the masters and moments live in host memory:
`step` then copies the gradient shards to the host, runs the same arithmetic there, and
copies the new low-precision shards back. The norm stays on the device, before any copy.
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam as adam_update   # the function torch's Adam.step calls

from . import comm
from .flat_param import FlatParam
from .offload import HostOffload
from .partition import unflatten

GRAD_SQ_CHUNK = 1 << 20  # elements per fp64 temporary in grad_norm_sq (8 MB)


class ShardedOptimizer:
    def __init__(self, flat_params: list[FlatParam], param_groups: list[dict], optimizer_factory,
                 offload: HostOffload | None = None):
        self.flat_params = flat_params
        self.mixed = flat_params[0].dtype != torch.float32
        self.offload = offload                      # None: everything on the device
        self.on_host = offload is not None and offload.optimizer   # masters and moments in host memory
        # fp32 master copy of what this rank owns. In fp32 training the shard itself is the
        # master: DeepSpeed keeps a second fp32 copy even then (docs/deepspeed.md, "fp32 ZeRO
        # keeps a second fp32 master copy"); we do not, and memory_breakdown says so. With
        # offload the master is in host memory, so it is always a copy.
        if self.on_host:
            self.masters = [self.offload.new_master(f) for f in flat_params]
        else:
            self.masters = [f.shard.detach().float().clone() if self.mixed else f.shard for f in flat_params]
        groups = []
        for gi, g in enumerate(param_groups):
            hyper = {k: v for k, v in g.items() if k not in ("params", "names")}
            groups.append({**hyper, "params": [m for m, f in zip(self.masters, flat_params) if f.group == gi]})
        self.optimizer = optimizer_factory(groups)   # empty groups kept: get_lr() has one entry per group
        init_optimizer_states(self.optimizer)

    def grads_sharded(self) -> bool:
        """Do ranks hold disjoint parts of the gradient (so the norm must be summed)?"""
        return self.flat_params[0].num_shards > 1

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared global norm of the reduced gradient, in fp64, on the device (no host sync).

        The square of an fp32/bf16/fp16 number is exact in fp64; only the additions round.
        Chunk by chunk, so the fp64 temporaries are GRAD_SQ_CHUNK elements (8 MB each)
        rather than 8 bytes per gradient element of the shard. A shard of at most one chunk
        is summed exactly as in one `sum()`; a longer one as its chunk sums added in order:
        another order of fp64 additions, a relative change of about one fp64 rounding per
        chunk (~1e-16), which the norm's rounding to fp32 (6e-8) almost always absorbs.
        Padding is zero, so it adds nothing.
        """
        total = torch.zeros((), dtype=torch.float64, device=self.flat_params[0].device)
        for f in self.flat_params:
            g = f.grad_shard
            if g is not None:
                for i in range(0, g.numel(), GRAD_SQ_CHUNK):
                    total += g[i:i + GRAD_SQ_CHUNK].double().pow_(2).sum()   # in place on the fp64 copy: one temporary, not two
        if self.grads_sharded():
            comm.all_reduce(total, label="grad_norm")
        return total

    def combined_scale(self, norm_sq: torch.Tensor, loss_scale: float, clip_value: float) -> torch.Tensor:
        """The one number the reduced gradient is divided by: loss scale x clip factor.

        DeepSpeed's `unscale_and_clip_grads`, in its fp32 tensor arithmetic: the norm is of
        the *scaled* gradient; clip = max(1, (norm / S + 1e-6) / clip_value)."""
        # torch.full, not torch.tensor(loss_scale, device=...): the same fp32 number, made by a
        # fill kernel on the device rather than a blocking copy from pageable host memory (a
        # host sync on a GPU; the step's one sync is the engine's read of the norm).
        combined = torch.full((), loss_scale, dtype=torch.float32, device=norm_sq.device)
        if clip_value > 0:
            norm = norm_sq.sqrt().float()
            clip = torch.clamp(((norm / loss_scale) + 1e-6) / clip_value, min=1.0)
            combined = clip * loss_scale
        return combined

    def step(self, norm_sq: torch.Tensor, loss_scale: float, clip_value: float) -> None:
        """Unscale and clip the gradient shards into fp32, Adam on the masters, round back."""
        if self.on_host:   # ZeRO-Offload: the same arithmetic, on the host's copies
            grads = self.offload.grads_to_host(self.flat_params)
            norm_sq = norm_sq.to(self.masters[0].device)   # a scalar; the engine already synced on it
        else:
            grads = [f.grad_shard for f in self.flat_params]
        combined = self.combined_scale(norm_sq, loss_scale, clip_value)
        # bf16/fp16 on the host: Adam converts each slice as it steps it (ChunkedAdamW, below),
        # rather than a whole fresh fp32 copy of the gradient here
        sliced = getattr(self.optimizer, "steps_in_slices", lambda: False)()
        for f, m, g in zip(self.flat_params, self.masters, grads):
            if g is None:
                g = torch.zeros(f.shard_numel, dtype=torch.float32, device=m.device)
            if sliced and g.dtype != torch.float32 and g.is_contiguous():
                self.optimizer.set_low_precision_grad(m, g, 1.0 / combined)
                continue
            g = g.float()          # a copy in bf16/fp16; in fp32 the reduced buffer itself
            g.mul_(1.0 / combined)
            m.grad = g
        self.optimizer.step()
        for f, m in zip(self.flat_params, self.masters):
            m.grad = None
            if self.offload is not None:
                self.offload.write_shard(f, m)   # wherever the master and the shard live
            elif m is not f.shard:
                f.shard.copy_(m)                 # round the updated fp32 master to bf16/fp16
        if self.offload is not None:
            self.offload.finish_writes(self.flat_params)

    def zero_grad(self) -> None:
        for f in self.flat_params:
            f.zero_grad()

    def load_optimizer_state(self, state_dict: dict) -> None:
        """torch's load_state_dict, keeping *this* run's Adam implementation: a checkpoint
        saved with offload (fused CPU Adam) may resume without it, and the other way round.
        torch would adopt the saved groups' `fused`/`foreach` flags and put `step` where a
        fused Adam wants it; here `step` goes where this run's Adam wants it."""
        impl = [{k: g.get(k) for k in ("fused", "foreach", "capturable")} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state_dict)
        for g, keep in zip(self.optimizer.param_groups, impl):
            g.update(keep)
            for p in g["params"]:
                st = self.optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    on_param = keep["fused"] or keep["capturable"]
                    st["step"] = st["step"].to(dtype=torch.float32, device=p.device if on_param else "cpu")

    # ------------------------------------------------------------------ introspection
    def master_bytes(self) -> int:
        """Bytes of fp32 masters kept apart from the shards: all of them in bf16/fp16 or with
        offload_optimizer; in fp32 only where offload_param moved the shard away from its
        master (the device keeps the fp32 master the optimizer updates)."""
        return sum(m.numel() * m.element_size() for m, f in zip(self.masters, self.flat_params) if m is not f.shard)

    def state_bytes(self) -> int:
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total

    def full_fp32_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value (from the masters), gathered on every rank.

        With offload_optimizer the master is in host memory: it is copied to the device
        first, one shard at a time, since NCCL takes only device tensors on both sides."""
        out = {}
        for f, m in zip(self.flat_params, self.masters):
            full = torch.empty(f.padded_numel, dtype=torch.float32, device=f.device)
            if f.num_shards > 1:
                comm.all_gather_into_tensor(full, m.detach().to(device=f.device, dtype=torch.float32).contiguous(),
                                            label="consolidate")
            else:
                full.copy_(m.detach())
            out.update({name: t.cpu().clone() for name, t in unflatten(full, f.names, f.shapes).items()})
        return out


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
# torch's Adam and AdamW, stepped a slice of the flat master at a time on a CPU.
#
# Every stage hands the optimizer one flat fp32 master per bucket (ShardedOptimizer above):
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
# (tests/core/test_chunked_adam.py pins it). The state is torch's own, one entry per flat
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

    def steps_in_slices(self) -> bool:
        """Will step() go slice by slice (every group on torch's for-loop path, on the host)?"""
        return all(_chunkable(g) for g in self.param_groups)

    def set_low_precision_grad(self, p: torch.Tensor, grad: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """The next step() reads p's gradient as grad.float() * inv_scale, a slice at a time
        (p.grad must be None). Only where steps_in_slices()."""
        assert p.grad is None and grad.is_contiguous() and self.steps_in_slices()
        self.__dict__.setdefault("_low_precision_grads", {})[p] = (grad.view(-1), inv_scale)

    def step(self, closure=None):
        groups = self.param_groups
        low = self.__dict__.pop("_low_precision_grads", {})
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
            # set_low_precision_grad), and a check that skipped grad-less parameters once sent
            # GPU masters down the sliced path: 40 slices of 6 one-tensor foreach launches per
            # bucket, 20 ms of host time per step on an H200. FSDP2's DTensor shards
            # (reference/torch_engine.py) cannot be viewed flat, so they take torch's own step
            and all(type(p.data) is torch.Tensor and p.device.type == "cpu" and not torch.is_complex(p)
                    and p.is_contiguous() for p in group["params"])
            and all(not p.grad.is_sparse and p.grad.is_contiguous() for p in group["params"] if p.grad is not None))


class ChunkedAdam(_StepsInChunks, torch.optim.Adam):
    """torch.optim.Adam, stepped in slices on a CPU (the section comment above _StepsInChunks)."""


class ChunkedAdamW(_StepsInChunks, torch.optim.AdamW):
    """torch.optim.AdamW, stepped in slices on a CPU (the section comment above _StepsInChunks)."""
