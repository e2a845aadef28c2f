"""Stage 0: plain data parallelism, and the machinery every ZeRO stage shares.

Every rank holds everything: low-precision parameters (2Ψ bytes in bf16/fp16), their
gradients (2Ψ), an fp32 master copy (4Ψ) and Adam's two moments (8Ψ): the 16Ψ of the
ZeRO paper's baseline (Rajbhandari et al., SC'20, section 3.1). After backward, one
all-reduce of the flat gradient averages it across ranks; each rank then takes the same
optimizer step on the same numbers.

The class below is written so ZeRO-1, -2 and -3 (zero1.py, zero2.py, zero3.py) only
change *where state lives and which collective moves it*; the arithmetic of a step
(unscale, clip, Adam on fp32 masters, copy back to low precision) is here, once:

    reduce_gradients()   stage 0: all-reduce     | ZeRO-1: reduce-scatter at the boundary
                                                 | ZeRO-2/3: reduce-scatter in backward hooks
    step(combined_scale) unscale + clip into fp32 grads, Adam on the masters, copy to lp
    after_step()         stage 0: nothing        | ZeRO-1/2: all-gather the new parameters
                                                 | ZeRO-3: nothing (gathered on next use)
"""
from __future__ import annotations

import torch

from . import comm
from .flat_param import FlatParam

GRAD_SQ_CHUNK = 1 << 20  # elements per fp64 temporary in local_grad_sq (8 MB)


class DataParallel:
    """ZeRO stage 0. `shard_world` = 1: every rank's "shard" is the whole buffer."""

    stage = 0

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], dtype: torch.dtype,
                 optimizer_factory, zero_cfg=None):
        self.module, self.dtype, self.zero_cfg = module, dtype, zero_cfg
        self.world_size, self.rank = comm.get_world_size(), comm.get_rank()
        self.mixed = dtype != torch.float32
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.param_groups = param_groups
        # (group index, FlatParam); built by the stage's own layout rule
        self.flat_params: list[FlatParam] = []
        self.flat_group: list[int] = []
        self.build_flat_params()
        # fp32 master copy of what this rank owns. In fp32 training the shard itself is the
        # master: DeepSpeed keeps a second fp32 copy even then (DEEPSPEED_FACTS: "fp32 ZeRO
        # keeps a duplicate fp32 master copy"); we do not, and memory_breakdown says so.
        self.masters = [f.shard.detach().float().clone() if self.mixed else f.shard
                        for f in self.flat_params]
        groups = []
        for gi, g in enumerate(param_groups):
            hp = {k: v for k, v in g.items() if k not in ("params", "names")}
            groups.append({**hp, "params": [m for m, fg in zip(self.masters, self.flat_group) if fg == gi]})
        self.optimizer = optimizer_factory(groups)   # empty groups kept: get_lr() has one entry per group
        init_optimizer_states(self.optimizer)

    # ------------------------------------------------------------------ layout (per stage)
    def shard_world(self) -> int:
        return 1

    def build_flat_params(self) -> None:
        """One FlatParam per param group, unsharded (stage 0) or sharded (ZeRO-1)."""
        for gi, g in enumerate(self.param_groups):
            params = list(g["params"])
            if params:
                self._add_flat(gi, params, f"group{gi}", keep_full=True)

    def _add_flat(self, gi: int, params, label: str, keep_full: bool) -> FlatParam:
        flat = FlatParam(params, [self.names[id(p)] for p in params], self.shard_world(),
                         self.rank if self.shard_world() > 1 else 0, label, keep_full=keep_full)
        self.flat_params.append(flat)
        self.flat_group.append(gi)
        return flat

    # ------------------------------------------------------------------ backward
    def pre_backward(self) -> None:
        """Called by the engine before each micro-batch's backward."""

    def post_backward(self) -> None:
        """Called by the engine after each micro-batch's backward returns."""

    def reduce_gradients(self) -> None:
        """At the accumulation boundary: average gradients across ranks (all-reduce).

        The gradient is flattened into one padded buffer per group so there is one
        collective per group rather than one per parameter: this is the "flat gradient"
        the ledger counts (2Ψ(N-1)/N elements on the wire per rank, the ring all-reduce).
        """
        for f in self.flat_params:
            buf = f.flat_grad(divide_by=self.world_size)
            comm.all_reduce(buf, label=f"{f.label}.grads")
            f.clear_param_grads()
            f.grad_shard = buf

    # ------------------------------------------------------------------ step
    def grads_partitioned(self) -> bool:
        """Do ranks hold disjoint parts of the gradient (so norms must be summed)?"""
        return self.shard_world() > 1

    def local_grad_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradient, in fp64 (padding is zero).

        The square of an fp32/bf16/fp16 number is exact in fp64; only the additions round.
        Chunk by chunk, so the fp64 temporaries are GRAD_SQ_CHUNK elements (8 MB each)
        rather than 8 bytes per gradient element of the shard. A shard of at most one chunk
        is summed exactly as before (the same ops on the same tensor); a longer one as its
        chunk sums added in order: another order of fp64 additions, a relative change of
        about one fp64 rounding per chunk (~1e-16), which the norm's rounding to fp32 (6e-8)
        almost always absorbs.
        """
        dev = self.flat_params[0].device
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for f in self.flat_params:
            g = f.grad_shard
            if g is not None:
                for i in range(0, g.numel(), GRAD_SQ_CHUNK):
                    total += g[i:i + GRAD_SQ_CHUNK].double().pow(2).sum()
        return total

    def step(self, combined_scale: torch.Tensor) -> None:
        """Adam on this rank's fp32 masters with grad = reduced_grad * (1 / combined_scale).

        combined_scale = loss_scale * clip, as DeepSpeed's `unscale_and_clip_grads`:
        one multiply both undoes fp16 loss scaling and applies gradient clipping.
        """
        for f, m in zip(self.flat_params, self.masters):
            g = f.grad_shard
            if g is None:
                g = torch.zeros(f.shard_numel, dtype=torch.float32, device=f.device)
            g = g.float()          # a copy in bf16/fp16; in fp32 the reduced buffer itself
            g.mul_(1.0 / combined_scale)
            m.grad = g
        self.optimizer.step()
        for f, m in zip(self.flat_params, self.masters):
            m.grad = None
            if self.mixed:
                f.shard.copy_(m)  # round the updated fp32 master to bf16/fp16
        self.after_step()

    def after_step(self) -> None:
        """Stage 0: every rank already holds the updated parameters."""

    def zero_grad(self) -> None:
        for f in self.flat_params:
            f.clear_param_grads()
            f.grad_shard = None

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(self) -> dict:
        """Bytes of model state this rank holds (see memory.py for the paper's formulas).

        grads: what a rank holds at the end of backward, before the step: stage 0/1 the
        full low-precision gradient, ZeRO-2/3 only its reduced shard.
        """
        lp = self.flat_params[0].full.element_size()
        params = sum(f.padded_numel if f.keep_full else f.shard_numel for f in self.flat_params) * lp
        grads = self.grad_bytes()
        master = sum(m.numel() * m.element_size() for m in self.masters) if self.mixed else 0
        opt = optimizer_state_bytes(self.optimizer)
        return {"params": params, "grads": grads, "master_params": master, "optimizer_states": opt}

    def grad_bytes(self) -> int:
        return sum(f.numel for f in self.flat_params) * self.flat_params[0].full.element_size()

    def full_fp32_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value (from the masters), gathered on every rank."""
        out = {}
        for f, m in zip(self.flat_params, self.masters):
            full = torch.empty(f.padded_numel, dtype=torch.float32, device=f.device)
            if self.shard_world() > 1:
                comm.all_gather_into_tensor(full, m.detach().float().contiguous(), label="consolidate")
            else:
                full.copy_(m.detach())
            off = 0
            for name, shape, n in zip(f.names, f.shapes, f.numels):
                out[name] = full[off:off + n].view(shape).cpu().clone()
                off += n
        return out


def init_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Allocate Adam's moments now, as torch.optim.Adam(W) would on its first step.

    DeepSpeed's ZeRO optimizers do the same at init, so memory measured before the first
    step already shows the 12Ψ/N optimizer term. The values are exactly what torch's
    `_init_group` would create, so the first step is unchanged.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if len(st) == 0 and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total
