"""Every place the tests look inside minizero's engine (its ZeRO object, FlatParams, fp32
masters, optimizer state) or replace a piece of it, gathered in one module.

The rest of the test suite reads only what a user reads (losses, norms, loss scale,
memory_breakdown, full_fp32_state_dict, the comm ledger) plus what these functions return,
which is plain data (lists, dicts, numbers, CPU tensors). When the engine's internals change,
this is the one file to update.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


# ----------------------------------------------------------------------------- layout

def flat_layout(engine) -> List[Dict[str, Any]]:
    """One dict per FlatParam: label, param group, element counts (unpadded, padded, this
    rank's shard), ZeRO-3 persistence, how many parameters it holds, bytes per element."""
    return [{"label": f.label, "group": f.group, "numel": f.numel, "padded": f.padded_numel,
             "shard": f.shard_numel, "persistent": bool(f.persistent), "n_params": len(f.params),
             "elem": f.full.element_size()}
            for f in engine.zero.flat_params]


# ----------------------------------------------------------------------------- memory

def _storage_key(t):
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def measured_bytes(engine) -> dict:
    """Walk the live tensors of the model state (as reference/ds_memory.py counts DeepSpeed's),
    deduplicated by storage: what this rank really holds right now."""
    z, opt = engine.zero, engine.sharded_optimizer
    seen = set()

    def count(tensors):
        tot = 0
        for t in tensors:
            if t is None:
                continue
            k = _storage_key(t)
            if k[1] == 0 or k in seen:
                continue
            seen.add(k)
            tot += k[1]
        return tot

    params = count([f.full for f in z.flat_params] + [f.shard for f in z.flat_params])
    grads = count([p.grad for f in z.flat_params for p in f.params] + [f.grad_shard for f in z.flat_params])
    master = count(opt.masters) if opt.mixed else 0
    states = count([v for st in opt.optimizer.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0])
    return {"params": params, "grads": grads, "master_params": master, "optimizer_states": states}


def watch_live_grad_numel(engine) -> dict:
    """Register hooks (after the engine's own) that record in the returned dict's "max" the
    most full-gradient elements alive at once on this rank."""
    z = engine.zero
    all_params = [p for f in z.flat_params for p in f.params]
    live = {"max": 0}

    def on_grad(_p):
        live["max"] = max(live["max"], sum(p.grad.numel() for p in all_params if p.grad is not None))
    for p in all_params:
        p.register_post_accumulate_grad_hook(on_grad)
    return live


def watch_z3_gathered(engine) -> dict:
    """ZeRO-3: record in the returned dict's "max" how many partitioned FlatParams are
    gathered at once during forward (checked before each unit's forward)."""
    z = engine.zero
    gathered_fwd = {"max": 0}

    def count_gathered(*_):
        gathered_fwd["max"] = max(gathered_fwd["max"],
                                  sum(1 for f in z.flat_params if not f.persistent and f.full_is_allocated()))
    for u in z.buckets:            # ZeRO-3: each bucket is a Unit (one module)
        u.module.register_forward_pre_hook(count_gathered)
    return gathered_fwd


def watch_live_numel() -> dict:
    """ZeRO-3's live parameters, the elements stage3_max_live_parameters bounds: partitioned
    FlatParams whose full buffer is allocated, in this process. Wraps FlatParam.alloc_full and
    release_full (where the storage is really allocated and freed) until `unwatch_live_numel()`
    (or for the rest of the process: a rank of run_ranks); the returned dict's "now" and
    "peak" follow, from this call on."""
    from minizero.flat_param import FlatParam
    unwatch_live_numel()
    live, count = set(), {"now": 0, "peak": 0}
    alloc, free = FlatParam.alloc_full, FlatParam.release_full
    _UNWATCHED["FlatParam"] = (alloc, free)

    def alloc_full(f):
        alloc(f)
        if not f.persistent and id(f) not in live:
            live.add(id(f))
            count["now"] += f.padded_numel
            count["peak"] = max(count["peak"], count["now"])

    def release_full(f):
        if id(f) in live:
            live.discard(id(f))
            count["now"] -= f.padded_numel
        free(f)
    FlatParam.alloc_full, FlatParam.release_full = alloc_full, release_full
    return count


_UNWATCHED: Dict[str, Any] = {}     # FlatParam's own alloc_full, release_full while watched


def unwatch_live_numel() -> None:
    """Put FlatParam's own alloc_full and release_full back (the next run in the same
    process watches afresh)."""
    if "FlatParam" in _UNWATCHED:
        from minizero.flat_param import FlatParam
        FlatParam.alloc_full, FlatParam.release_full = _UNWATCHED.pop("FlatParam")


def after_backward(engine) -> dict:
    """Where the gradients are right after backward: are the parameters' .grad all None,
    how many elements they hold, each FlatParam's reduced-gradient shard size (or None)."""
    z = engine.zero
    all_params = [p for f in z.flat_params for p in f.params]
    return dict(
        p_grad_none=all(p.grad is None for p in all_params),
        p_grad_numel=sum(p.grad.numel() for p in all_params if p.grad is not None),
        grad_shards=[None if f.grad_shard is None else f.grad_shard.numel() for f in z.flat_params])


def z3_between_steps(engine) -> dict:
    """ZeRO-3 between steps: the partitioned FlatParams, the bytes their full buffers hold,
    the element counts of the parameters they hold, and every unit's shard state."""
    z = engine.zero
    part = [f for f in z.flat_params if not f.persistent]
    return dict(
        n_partitioned=len(part),
        full_nbytes=[f.full.untyped_storage().nbytes() for f in part],
        param_numels=[p.numel() for f in part for p in f.params],
        shard_states=[u.state.name for u in z.buckets])


# ----------------------------------------------------------------------------- overflow

def poison_reduced_grad(engine, stage: int) -> None:
    """Set one element of this rank's *reduced* gradient to inf right after the engine's
    reduction (the first FlatParam holding a grad_shard: its last element at stage 0, its
    first otherwise). Undo with `unpoison`."""
    z = engine.zero
    orig = z.reduce_gradients

    def poisoned():
        orig()
        next(f for f in z.flat_params if f.grad_shard is not None).grad_shard[-1 if stage == 0 else 0] = float("inf")
    z.reduce_gradients = poisoned


def unpoison(engine) -> None:
    engine.zero.__dict__.pop("reduce_gradients", None)


def opt_step_counts(engine) -> list:
    """The distinct optimizer step counts over the inner optimizer's state."""
    return sorted({float(st["step"]) for st in engine.optimizer.state.values()})


def grads_left(engine) -> int:
    """Gradient tensors still held: parameters' .grad plus FlatParams' grad_shard."""
    z = engine.zero
    return (sum(1 for f in z.flat_params for p in f.params if p.grad is not None)
            + sum(1 for f in z.flat_params if f.grad_shard is not None))


# ----------------------------------------------------------------------------- DeepSpeed's arithmetic, patched in

def apply_variant(engine, variant: str) -> Optional[List[float]]:
    """Patch `engine` for one of run_minizero's variants (tests/support/agreement.py); return the
    list the "ds_norm" variant fills with DeepSpeed's norms, else None."""
    ds_norms = patch_clip(engine, variant)
    if variant == "ds_stage0":
        ds_stage0_arithmetic(engine)
    if variant == "ds_grown_scale":
        unscale_by_updated_scale(engine)
    return ds_norms


def patch_clip(engine, variant: str) -> Optional[List[float]]:
    """Replace the clip factor minizero's step computes (`ShardedOptimizer.combined_scale`).

    Used only by the clipping tests: minizero and DeepSpeed differ in exactly one piece of
    arithmetic, the global gradient norm (test_grad_norm_matches_to_fp32_rounding), which
    reaches the weights only through the clip factor. "ds_norm" computes that factor the way
    DeepSpeed 0.19.8 does for this stage (`ds_clip_scale`), so a run can be compared
    with DeepSpeed bitwise; "jitter<k>" moves minizero's own factor by a few fp32 ulps, the
    size of the norm gap, to sample how far such a change carries. fp32/bf16 only (the
    loss scale is 1)."""
    if not (variant == "ds_norm" or variant.startswith("jitter")):
        return None
    opt = engine.sharded_optimizer
    orig = opt.combined_scale
    assert engine.loss_scaler is None, "patch_clip: fp32/bf16 runs only"
    if variant == "ds_norm":
        norms: List[float] = []

        def combined_scale(norm_sq, loss_scale, clip_value):
            total = ds_grad_norm(engine)
            norms.append(float(total))
            return ds_clip_scale(total, clip_value)
        opt.combined_scale = combined_scale
        return norms
    gen = torch.Generator().manual_seed(int(variant[len("jitter"):]))

    def combined_scale(norm_sq, loss_scale, clip_value):
        combined = orig(norm_sq, loss_scale, clip_value)
        u = int(torch.randint(-3, 4, (), generator=gen))       # same draw on every rank
        if float(combined) > 1.0:                               # the step clips
            toward = torch.tensor(float("inf") if u > 0 else 0.0, device=combined.device)
            for _ in range(abs(u)):
                combined = torch.nextafter(combined, toward)
        return combined
    opt.combined_scale = combined_scale
    return None


def ds_stage0_arithmetic(engine) -> None:
    """Give minizero's stage 0 what DeepSpeed's stage-0 bf16/fp16 path does (engine.py
    allreduce_bucket + runtime/fp16/unfused_optimizer.py FP16_UnfusedOptimizer):

    1. __init__ -> initialize_optimizer_states: zero gradients on every fp32 master,
       optimizer.step() (AdamW's step count becomes 1, weight decay applied once), and the
       low-precision weights are NOT refreshed from the masters;
    2. fp16: DeepSpeedEngine.backward never multiplies the loss by the scale (the step
       still divides by it: minizero's engine does that part already);
    3. gradients all-reduced as a sum, then multiplied by 1/N (postscale_gradients)."""
    import torch.distributed as dist

    zero, opt = engine.zero, engine.sharded_optimizer
    assert zero.stage == 0 and opt.mixed
    for m in opt.masters:
        m.grad = torch.zeros_like(m)
    opt.optimizer.step()
    for m in opt.masters:
        m.grad = None

    if engine.loss_scaler is not None:
        backward, scaler = engine.backward, engine.loss_scaler

        def unscaled_backward(loss):
            scale, scaler.cur_scale = scaler.cur_scale, 1.0
            try:
                return backward(loss)
            finally:
                scaler.cur_scale = scale
        engine.backward = unscaled_backward

    def reduce_gradients():
        for f in zero.flat_params:
            buf = f.flat_grad()
            dist.all_reduce(buf)
            buf.mul_(1.0 / dist.get_world_size())
            f.clear_param_grads()
            f.grad_shard = buf
    zero.reduce_gradients = reduce_gradients


def unscale_by_updated_scale(engine) -> None:
    """DeepSpeed's ZeRO-1/2 fp16 step (stage_1_and_2.py: DeepSpeedZeroOptimizer.step) calls
    _update_scale before unscale_and_clip_grads, which then reads the NEW scale S'. The
    engine updates its scaler before the step too, so here cur_scale is already S'.
    Exact only while clipping is inactive, where both factors are 1 and the combined
    scale is the loss scale alone (asserted)."""
    opt, scaler = engine.sharded_optimizer, engine.loss_scaler
    orig = opt.combined_scale

    def combined_scale(norm_sq, loss_scale, clip_value):
        new = torch.tensor(scaler.cur_scale, dtype=torch.float32, device=norm_sq.device)
        old = float(orig(norm_sq, loss_scale, clip_value))
        assert old in (float(new), float(new) / scaler.scale_factor), "clipping active: not exact"
        return new
    opt.combined_scale = combined_scale


def _param_groups(engine) -> List[List[torch.nn.Parameter]]:
    """The engine's param groups, each in model order (FlatParam.group says which group a
    parameter is in; ZeRO-2's buckets hold them in another order). The harness builds its
    groups in named_parameters() order (GPT.configure_param_groups, or model.parameters()),
    so this is the order DeepSpeed laid them out in."""
    group_of = {id(p): f.group for f in engine.zero.flat_params for p in f.params}
    n = len(engine.optimizer.param_groups)
    return [[p for p in engine.module.parameters() if group_of.get(id(p)) == gi] for gi in range(n)]


def _full_grads(engine) -> Dict[int, torch.Tensor]:
    """id(param) -> its full reduced gradient (every rank's grad_shard gathered; plain
    torch.distributed, so minizero's comm ledger does not see it)."""
    import torch.distributed as dist

    out = {}
    for f in engine.zero.flat_params:
        full = f.grad_shard
        if f.num_shards > 1:
            full = torch.empty(f.padded_numel, dtype=f.grad_shard.dtype, device=f.grad_shard.device)
            dist.all_gather_into_tensor(full, f.grad_shard.contiguous())
        off = 0
        for p, n in zip(f.params, f.numels):
            out[id(p)] = full[off:off + n]
            off += n
    return out


def ds_grad_norm(engine) -> torch.Tensor:
    """DeepSpeed 0.19.8's global gradient norm, with its data layout and op order.

    ZeRO-1/2 (stage_1_and_2.py: get_grad_norm_direct per param group, scaled_global_norm):
    each group is laid end to end and padded to a multiple of 2N, rank r owns elements
    [r*P, (r+1)*P), P = padded/N; per piece of a parameter inside that range, fp64
    vector_norm; stack().pow(2).sum() ROUNDED TO fp32; fp32 all-reduce (N = 2: a + b);
    fp32 pow(1/2); then combine_grad_norm_groups = fp32 vector_norm of the group norms.
    ZeRO-3 (stage3.py: get_grad_norm_direct): every parameter padded to ceil(n/N) per rank;
    per partition, fp64 norm; sum of squares, all-reduce, pow(1/2) and the group combine
    all in fp64. ZeRO-3 with offload_optimizer (stage3.py:
    complete_grad_norm_calculation_for_cpu_offload, `_offload_norm`): other arithmetic, fp32
    across ranks. Every rank computes every rank's partial sum from the gathered gradient;
    the fp32/fp64 all-reduce of 2 values is one commutative addition, so this is exact."""
    import torch.distributed as dist

    N = dist.get_world_size()
    grads = _full_grads(engine)
    if engine.zero_optimization_stage() == 3 and engine.offload is not None and engine.offload.optimizer:
        return _offload_norm(grads, _param_groups(engine), N)
    group_norms = []
    for params in _param_groups(engine):
        if engine.zero_optimization_stage() == 3:
            partial = []
            for r in range(N):
                norms = []
                for p in params:
                    norms.append(_zero3_partition(grads[id(p)], r, N).to(torch.float64).norm(2.0))
                partial.append(torch.sum(torch.pow(torch.stack(norms), 2.0)))
            total = partial[0]
            for t in partial[1:]:
                total = total + t
            group_norms.append(total ** (1. / 2.0))
        else:
            numels = [grads[id(p)].numel() for p in params]
            padded = -(-sum(numels) // (2 * N)) * (2 * N)
            P = padded // N
            partial = []
            for r in range(N):
                norms, off = [], 0
                for p, n in zip(params, numels):
                    lo, hi = max(off, r * P), min(off + n, (r + 1) * P)
                    if lo < hi:
                        piece = grads[id(p)] if hi - lo == n else grads[id(p)][lo - off:hi - off]
                        norms.append(torch.linalg.vector_norm(piece.to(torch.float64), ord=2.0))
                    off += n
                partial.append(torch.stack(norms).pow(2.0).sum().float() if norms
                               else torch.tensor(0.0, dtype=torch.float32))
            total = partial[0]
            for t in partial[1:]:
                total = total + t
            group_norms.append(total.pow(1. / 2.0))
    return torch.linalg.vector_norm(torch.stack(group_norms), ord=2.0)


def _zero3_partition(full: torch.Tensor, r: int, N: int) -> torch.Tensor:
    """Rank r's ZeRO-3 partition of one parameter's gradient as DeepSpeed holds it: ceil(n/N)
    elements (partition_parameters.py: Init._partition_param), zero-padded past the end."""
    n = full.numel()
    s = -(-n // N)
    part = torch.zeros(s, dtype=full.dtype)
    lo, hi = min(r * s, n), min((r + 1) * s, n)
    part[:hi - lo] = full[lo:hi]
    return part


def _offload_norm(grads: Dict[int, torch.Tensor], groups, N: int) -> torch.Tensor:
    """DeepSpeed 0.19.8's ZeRO-3 norm with offload_optimizer, op for op. At the gradient
    boundary each parameter's partition (ceil(n/N) elements, zero-padded; a rank whose
    partition starts past the end records nothing) gets `_constant_buffered_norm2`: its fp64
    norm, squared, then square-rooted. `complete_grad_norm_calculation_for_cpu_offload` adds
    the squares of those norms to a Python 0.0 in parameter order (fp64), puts the sum in an
    fp32 tensor (`FloatTensor([float(total)])`: the rounding that makes offload differ),
    all-reduces it in fp32 and takes the fp32 square root; `combine_grad_norm_groups` is the
    fp32 vector_norm of the group norms. docs/deepspeed.md, "ZeRO-3 with offload_optimizer
    sums the gradient norm in fp32"."""
    group_norms = []
    for params in groups:
        partial = []
        for r in range(N):
            total = 0.0
            for p in params:
                full = grads[id(p)]
                if r * -(-full.numel() // N) >= full.numel():
                    continue                                  # partition_grads skips an empty partition
                norm = (_zero3_partition(full, r, N).to(torch.float64).norm(2) ** 2.0) ** 0.5
                total += norm ** 2
            partial.append(torch.tensor([float(total)], dtype=torch.float32))
        summed = partial[0]
        for t in partial[1:]:
            summed = summed + t
        group_norms.append(summed[0] ** (1. / 2.0))
    return torch.linalg.vector_norm(torch.stack(group_norms), ord=2)


def ds_clip_scale(total_norm: torch.Tensor, clip_value: float) -> torch.Tensor:
    """DeepSpeed's unscale_and_clip_grads combined scale (loss scale 1): fp32 at ZeRO-1/2,
    fp64 at ZeRO-3 (its norm is fp64). The step then multiplies the fp32 gradient by
    1 / this, as DeepSpeed does (a 0-dim fp64 factor is rounded to fp32 by the multiply)."""
    clip = ((total_norm / 1.0) + 1e-6) / clip_value
    return torch.clamp(clip, min=1.0) * 1.0
