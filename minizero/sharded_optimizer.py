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
Which torch optimizer runs (DeepSpeed's choice from the config) is adam.py's.

With ZeRO-Offload the masters and moments live in host memory (`states`, offload.HostStates,
owned here): `step` then copies the gradient shards to the host, runs the same arithmetic
there, and writes the new low-precision shards back to wherever each lives (its FlatParam's
storage). The norm stays on the device, before any copy.
"""
from __future__ import annotations

import torch

from . import comm
from .adam import init_optimizer_states
from .flat_param import FlatParam, write_shards
from .partition import unflatten

GRAD_SQ_CHUNK = 1 << 20  # elements per fp64 temporary in grad_norm_sq (8 MB)


class ShardedOptimizer:
    def __init__(self, flat_params: list[FlatParam], param_groups: list[dict], optimizer_factory, states=None):
        """states: where the masters and moments live (offload.HostStates), None: the device."""
        self.flat_params = flat_params
        self.mixed = flat_params[0].dtype != torch.float32
        self.states = states
        self.on_host = states is not None             # masters and moments in host memory
        # fp32 master copy of what this rank owns. In fp32 training the shard itself is the
        # master: DeepSpeed keeps a second fp32 copy even then (docs/deepspeed.md, "fp32 ZeRO
        # keeps a second fp32 master copy"); we do not, and memory_breakdown says so. With
        # offload the master is in host memory, so it is always a copy.
        if self.on_host:
            self.masters = [states.new_master(f) for f in flat_params]
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

        Every gradient shard's norm in fp64 by one foreach call (`torch._foreach_norm`: one
        kernel launch on a GPU, one C++ loop on a CPU, whatever the number of FlatParams), then
        squared and summed. A shard longer than GRAD_SQ_CHUNK elements is cut into chunks of
        that size first, so no fp64 temporary exceeds 8 MB (a CPU's foreach norm converts each
        tensor to fp64 whole) rather than 8 bytes per gradient element of the shard. The
        squares of fp32/bf16/fp16 numbers are exact in fp64; the additions, each chunk's square
        root and its square round, each about 1e-16 relative, which the norm's rounding to fp32
        (6e-8) almost always absorbs. Padding is zero, so it adds nothing.
        """
        pieces = []
        for f in self.flat_params:
            g = f.grad_shard
            if g is not None:
                pieces += g.split(GRAD_SQ_CHUNK) if g.numel() > GRAD_SQ_CHUNK else [g]
        if pieces:
            total = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.flat_params[0].device)
        if self.grads_sharded():   # over the ranks of one shard group (HSDP: its replicas hold the same)
            comm.all_reduce(total, label="grad_norm", group=self.flat_params[0].sharding.group)
        return total

    def combined_scale(self, norm_sq: torch.Tensor, loss_scale: float, clip_value: float) -> torch.Tensor:
        """The one number the reduced gradient is divided by: loss scale x clip factor.

        DeepSpeed's `unscale_and_clip_grads`, in its fp32 tensor arithmetic: the norm is of
        the *scaled* gradient; clip = max(1, (norm / S + 1e-6) / clip_value)."""
        # torch.full, not torch.tensor(loss_scale, device=...): the same fp32 number, made by a
        # fill kernel on the device rather than a blocking copy from pageable host memory (a
        # host sync on a GPU; the step's one sync is the engine's read of the norm).
        if clip_value <= 0:
            return torch.full((), loss_scale, dtype=torch.float32, device=norm_sq.device)
        norm = norm_sq.sqrt().float()
        clip = torch.clamp(((norm / loss_scale) + 1e-6) / clip_value, min=1.0)
        return clip * loss_scale

    def step(self, norm_sq: torch.Tensor, loss_scale: float, clip_value: float) -> None:
        """Unscale and clip the gradient shards into fp32, Adam on the masters, round back."""
        if self.on_host:   # ZeRO-Offload: the same arithmetic, on the host's copies
            grads = self.states.grads_to_host(self.flat_params, self.swappable())
            norm_sq = norm_sq.to(self.masters[0].device)   # a scalar; the engine already synced on it
        else:
            grads = [f.grad_shard for f in self.flat_params]
        combined = self.combined_scale(norm_sq, loss_scale, clip_value)
        # bf16/fp16 on the host: Adam converts each slice as it steps it (adam.ChunkedAdamW),
        # rather than a whole fresh fp32 copy of the gradient here
        sliced = self.optimizer.steps_in_slices()
        inverse = 1.0 / combined   # once per step, not per FlatParam (ZeRO-3 has one per unit)
        grads = [g if g is not None else torch.zeros(f.shard_numel, dtype=torch.float32, device=m.device)
                 for f, m, g in zip(self.flat_params, self.masters, grads)]
        unscaled = []              # (master, fp32 gradient) to unscale here, all in one foreach call
        for m, g in zip(self.masters, grads):
            if sliced and g.dtype != torch.float32 and g.is_contiguous():
                self.optimizer.set_low_precision_grad(m, g, inverse)
            else:
                unscaled.append((m, g.float()))   # a copy in bf16/fp16; in fp32 the reduced buffer itself
        if unscaled:
            torch._foreach_mul_([g for _, g in unscaled], inverse)
            for m, g in unscaled:
                m.grad = g
        if self.on_host:
            self.states.before_adam(self.swappable())   # nvme: the states' reads, done
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        write_shards(self.flat_params, self.masters, from_host=self.on_host, pin=self.on_host and self.states.pin)
        if not self.on_host and any(f.storage.on_host for f in self.flat_params):
            # offload_param alone wrote the host shards by asynchronous device-to-host copies:
            # wait for them before anything on the CPU (a file, a checkpoint) reads them.
            # (Copies to the device need no wait: the stream orders them before the gathers.)
            comm.wait_for_device(self.flat_params[0].device)
        for f in self.flat_params:
            f.storage.written()                 # nvme: the new shard to its file, in the background
        if self.on_host:
            self.states.after_step(self.swappable())   # nvme: the new states to their files

    def swappable(self):
        """(key, tensor) of the states offload may keep in files: each fp32 master and Adam's
        moments (not the scalar step), looked up each time: loading a checkpoint gives the
        optimizer new state tensors."""
        for f, m in zip(self.flat_params, self.masters):
            yield f"{f.label}.master", m
            for name, v in self.optimizer.state.get(m, {}).items():
                if torch.is_tensor(v) and v.dim() > 0:
                    yield f"{f.label}.{name}", v

    def own_swapped_states(self) -> None:
        """After a checkpoint load, Adam's moments may share a storage that cannot be resized
        (a view of what torch.load read): give each one a storage of its own to swap."""
        for st in self.optimizer.state.values():
            for name, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0 and (
                        not v.untyped_storage().resizable()
                        or v.untyped_storage().nbytes() != v.numel() * v.element_size()):
                    st[name] = v.clone(memory_format=torch.contiguous_format)

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
                                            label="consolidate", group=f.sharding.group)
            else:
                full.copy_(m.detach())
            out.update({name: t.cpu().clone() for name, t in unflatten(full, f.names, f.shapes).items()})
        return out


