"""PyTorch's own data parallelism behind DeepSpeed's engine API: DDP for stage 0, FSDP2 for 2 and 3.

    engine = TorchEngine(model, param_groups, cfg)   # cfg: the same DeepSpeed JSON dict
    _, loss = engine(x, y); engine.backward(loss); engine.step()

So minizero's training loop (minizero/train/train.py) runs PyTorch unchanged
(reference/torch_train.py), and the agreement tests set PyTorch beside minizero number for
number. The stage names what is sharded, as in the ZeRO paper:

    stage 0   DistributedDataParallel: every rank holds everything; one all-reduce per bucket
    stage 2   fully_shard(reshard_after_forward=False): FSDP2's nearest to ZeRO-2 (it keeps the
              gathered parameters from forward to backward, so it gathers once per step and
              reduce-scatters the gradients; unlike ZeRO-2 the parameters *are* sharded between
              steps: its model-state bytes are ZeRO-3's, its wire bytes ZeRO-2's)
    stage 3   fully_shard(reshard_after_forward=True): ZeRO-3 (gather in forward, free,
              gather again in backward, reduce-scatter)
    stage 1   refused: FSDP2 has no "shard only the optimizer state" setting

fully_shard is applied to each transformer block and then to the root (tok_emb, pos_emb,
ln_f, head): minizero's ZeRO-3 units are the same modules (docs/fsdp.md draws both).

Two settings for a job on several nodes (S, k: ranks; torchrun puts ranks r*L .. r*L+L-1 on
node r, so a block of consecutive ranks is a node):

    zero_optimization.hsdp_shard_size S   HSDP (FSDP arXiv 2304.11277, section 3.2.2): a 2-D
              mesh init_device_mesh(device, (N/S, S), mesh_dim_names=("replicate", "shard")),
              each parameter sharded over the S ranks of its row (ranks r*S .. r*S+S-1) and
              replicated over the N/S rows. Gathers stay inside a row; the gradient is
              reduce-scattered inside the row, then its shard all-reduced across the rows
              (HSDP_GRADIENT below). A key of minizero's own: DeepSpeed has none (its MiCS keys
              were removed in 0.19.8 and now raise).
    zero_optimization.zero_hpz_partition_size k   DeepSpeed's hpZ key, read as FSDP2's own
              version of it: fully_shard(reshard_after_forward=k) reshards after forward to a
              k-rank copy (ranks grouped k by k) and backward all-gathers from it; stage 3 only.
              (The primary shard and the gradient stay on all N ranks, as in DeepSpeed.)

The two keys are taken out of the config before minizero's parser reads the rest, so they
work whether or not minizero's own config knows them.

What follows DeepSpeed's semantics, so the numbers can agree (docs/fsdp.md):
- the loss is divided by gradient_accumulation_steps before backward (DeepSpeed's
  engine.backward); each micro-batch's backward reduces (FSDP2 and DDP sync by default,
  as DeepSpeed's ZeRO-2/3 reduce every micro-batch);
- gradient_clipping (DeepSpeed's default 1.0) through torch.nn.utils.clip_grad_norm_;
- the optimizer: minizero's build_optimizer, i.e. the torch.optim.AdamW DeepSpeed builds
  with torch_adam, on FSDP2's fp32 DTensor shards (its "master" weights);
- bf16 at stages 2/3: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): the
  forward and backward run in bf16 on fp32 shards cast at gather time, and gradients are
  reduced in bf16, as DeepSpeed's bf16 ZeRO does; the initial weights are rounded to bf16
  first, since DeepSpeed's fp32 master is copied up from its bf16 module. At stage 0 DDP has no public mixed
  precision: torch.autocast(bf16) on the fp32 model, gradients reduced in fp32 (not
  DeepSpeed's semantics: matmuls in bf16 only, and twice the wire bytes).
- fp16 is refused (FSDP2 has no loss scaler; DeepSpeed's dynamic scaler is minizero's).

Collectives are counted by reference.comm_counter (FSDP2 calls torch.distributed's
all_gather_into_tensor / reduce_scatter_tensor; DDP's C++ reducer is given the stock
allreduce_hook, which goes through torch.distributed.all_reduce). The gradient norm's
all-reduce of a DTensor goes through functional collectives and is not counted (1 element).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minizero.config import load_config
from minizero.adam import build_optimizer
from reference.comm_counter import COUNTER


class TorchEngineError(ValueError):
    """A config the PyTorch reference cannot run (one line, no traceback)."""


def is_sharded(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


HSDP_GRADIENT = """FSDP2's HSDP gradient, in order (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py: foreach_reduce and _get_gradient_divide_factors), for reduce_dtype fp32
or bf16 (MixedPrecisionPolicy.reduce_dtype, else the parameter's dtype):
  1. the block's unsharded gradients (param dtype: bf16 under MixedPrecisionPolicy(bf16)) are
     copied into one flat reduce-scatter input in reduce_dtype (each parameter's dim 0 padded
     to a multiple of S);
  2. reduce_scatter_tensor(op=ReduceOp.AVG) over the S ranks of the shard group, in
     reduce_dtype: the shard sum over S ranks, divided by S inside the collective;
  3. all_reduce(op=ReduceOp.AVG) of that shard over the N/S ranks of the replicate group,
     in reduce_dtype: divided by N/S inside the collective;
  4. cast to the sharded parameter's dtype (fp32) and assigned (or added) to its .grad.
No pre- or post-division outside the collectives (both are AVG for fp32/bf16: the
pre/post factors apply only to fp16). So the gradient a rank steps with is
AVG_replicas(round(AVG_shard(g))): two roundings in bf16, each after a sum of S or N/S
terms; at S = N/S = 2 every division is by 2 (exact) and each sum has two terms
(commutative), so the result does not depend on gloo's order."""


def hierarchy(cfg: dict, world: int) -> tuple[dict, int | None, int | None]:
    """(the config without the two hierarchical keys, hsdp_shard_size, zero_hpz_partition_size);
    None for a key that is absent or 1 (no hierarchy). Bad values: TorchEngineError, one line."""
    zero = dict(cfg.get("zero_optimization") or {}) if isinstance(cfg.get("zero_optimization"), dict) else None
    if zero is None:
        return cfg, None, None
    sizes = {}
    for key in ("hsdp_shard_size", "zero_hpz_partition_size"):
        if key not in zero:
            continue
        v = zero.pop(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TorchEngineError(f"zero_optimization.{key} must be a whole number >= 1, got {v!r}")
        if world % v:
            raise TorchEngineError(f"zero_optimization.{key} {v} does not divide the {world} ranks: "
                                   f"use a divisor of {world} (the ranks of one node)")
        sizes[key] = v if 1 < v < world else None   # 1 or N: no hierarchy (k = N is plain ZeRO-3)
    if sizes.get("hsdp_shard_size") and sizes.get("zero_hpz_partition_size"):
        raise TorchEngineError("zero_optimization.hsdp_shard_size and zero_hpz_partition_size together: "
                               "choose one (HSDP shards within a node, hpZ keeps a node-local copy)")
    return {**cfg, "zero_optimization": zero}, sizes.get("hsdp_shard_size"), sizes.get("zero_hpz_partition_size")


class TorchEngine:
    """DeepSpeed's engine API (the part minizero's trainer calls) over DDP or FSDP2."""

    def __init__(self, model: torch.nn.Module, param_groups: list[dict], cfg: dict):
        world = dist.get_world_size() if dist.is_initialized() else 1
        cfg, self.hsdp_shard_size, self.hpz_partition_size = hierarchy(cfg, world)
        self.cfg = load_config(cfg, world)
        z = self.cfg.zero
        self.stage = z.stage
        if (self.hsdp_shard_size or self.hpz_partition_size) and self.stage not in (2, 3):
            raise TorchEngineError("hsdp_shard_size / zero_hpz_partition_size shard parameters: use --stage 3 "
                                   "(or 2 for HSDP), not stage 0 (DDP)")
        if self.hpz_partition_size and self.stage != 3:
            raise TorchEngineError("zero_hpz_partition_size is a ZeRO-3 setting (a second copy for backward's "
                                   "gather; stage 2 keeps the gathered parameters anyway): use --stage 3")
        self.dtype = "bf16" if self.cfg.bf16.enabled else "fp16" if self.cfg.fp16.enabled else "fp32"
        if self.dtype == "fp16":
            raise TorchEngineError("the PyTorch reference runs fp32 and bf16; fp16 needs DeepSpeed's loss scaler "
                                   "(FSDP2 and DDP have none): use --dtype bf16 or fp32")
        if self.stage == 1:
            raise TorchEngineError("FSDP2 has no ZeRO-1 setting (optimizer state sharded, parameters and gradients "
                                   "whole): use --stage 0 (DDP), 2 or 3 (FSDP2)")
        if z.offload_optimizer is not None or z.offload_param is not None:
            raise TorchEngineError("the PyTorch reference does not offload: drop offload_optimizer / offload_param")
        self.device = next(model.parameters()).device
        names = {id(p): n for n, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in param_groups]
        self.module = model
        self.autocast = False
        if self.stage == 0:
            self.wrapped = self._ddp(model)
        else:
            self.wrapped = self._fsdp(model, reshard_after_forward=self.stage == 3)
        # fully_shard replaced every parameter by a DTensor one: rebuild the groups by name.
        now = dict(model.named_parameters())
        groups = [{**g, "params": [now[n] for n in ns]} for g, ns in zip(param_groups, group_names)]
        self.optimizer = build_optimizer(groups, self.cfg.optimizer)
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._norm = None

    # ------------------------------------------------------------------ wrapping
    def _ddp(self, model):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        if self.dtype == "bf16":
            self.autocast = True
        ddp = DistributedDataParallel(model, device_ids=None if self.device.type == "cpu" else [self.device],
                                      bucket_cap_mb=self.cfg.zero.reduce_bucket_size * 4 / 2**20)
        # The stock hook (divide by N, all_reduce): what DDP's C++ default does, but through
        # torch.distributed.all_reduce, so the bytes are counted.
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp

    def _fsdp(self, model, reshard_after_forward: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy()
        if self.dtype == "bf16":
            # DeepSpeed (and minizero) cast the module to bf16 and copy the fp32 master up from
            # it: the master starts at the bf16-rounded initial weights. FSDP2 would keep the
            # fp32 initial weights as its master (forward the same: it casts at gather time;
            # the first update then starts from other values). Round them as DeepSpeed does.
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        mesh = self._mesh()
        if self.hpz_partition_size and reshard_after_forward:
            reshard_after_forward = self.hpz_partition_size   # FSDP2's hpZ: reshard to k ranks after forward
        for block in model.blocks:   # one unit per block, as minizero's ZeRO-3 and DeepSpeed's
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        # The root gathers what is left (tok_emb, pos_emb, ln_f, head). FSDP2 never reshards
        # the root after forward (backward needs it at once) whatever the flag says.
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        return model

    def _mesh(self):
        """HSDP's 2-D mesh (replicas, shard): row r is ranks r*S .. r*S+S-1, one node; None
        (FSDP2's default 1-D mesh over every rank) without hsdp_shard_size."""
        if not self.hsdp_shard_size:
            return None
        from torch.distributed.device_mesh import init_device_mesh
        S = self.hsdp_shard_size
        return init_device_mesh(self.device.type, (dist.get_world_size() // S, S),
                                mesh_dim_names=("replicate", "shard"))

    # ------------------------------------------------------------------ DeepSpeed's API
    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.wrapped(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """loss / gradient_accumulation_steps, then backward (DeepSpeed's engine.backward)."""
        (loss.float() / self.gradient_accumulation_steps()).backward()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def step(self) -> None:
        """At the boundary: clip (DeepSpeed's default 1.0), AdamW on the shards, zero grads."""
        if self.is_gradient_accumulation_boundary():
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            clip = self.cfg.gradient_clipping
            # clip_grad_norm_ with max_norm inf measures without scaling (scale min(1, inf) = 1)
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            self._norm = norm.full_tensor() if is_sharded(norm) else norm
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * (dist.get_world_size()
                                                                         if dist.is_initialized() else 1)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return self._norm

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.cfg.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.cfg.train_batch_size

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """DeepSpeed's method, as torchtitan saves: every rank writes its shards into one DCP
        folder, `<save_dir>/<tag>`, and `latest` names it (reference/torch_checkpoint.py).
        Call at a gradient-accumulation boundary. Returns the tag's folder."""
        from reference.torch_checkpoint import save
        return save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True, **_):
        """DeepSpeed's method: (tag folder, client_state), or (None, None) without `latest`.
        Any DCP folder of this model: FSDP2's or DDP's at any world size, minizero's
        (`python -m minizero.export_dcp` converts minizero's and DeepSpeed's own folders)."""
        from reference.torch_checkpoint import load
        return load(self, load_dir, tag, load_optimizer_states)

    # ------------------------------------------------------------------ what it holds and sends
    def full_fp32_state_dict(self) -> dict:
        """Every parameter's full fp32 value (a collective for FSDP2: call on every rank)."""
        out = {}
        for n, p in self.module.named_parameters():
            t = p.full_tensor() if is_sharded(p) else p
            out[n] = t.detach().float().clone()
        return out

    def comm_stats(self) -> dict:
        return COUNTER.snapshot()


def held_bytes(engine: TorchEngine) -> dict:
    """What this rank holds right now, by minizero's categories (memory.held_bytes's shape):
    params = the module's parameters (FSDP2: this rank's padded fp32 shard storage; DDP: the
    whole model), grads = .grad of each parameter, master_params = 0 (FSDP2's fp32 shard *is*
    what the optimizer steps: at bf16 it is counted under params, where DeepSpeed's would be
    under master_params), optimizer_states = Adam's moments. Each storage once.

    Gathered (unsharded) parameters are not walked: at the two moments the trainer reads
    (end of backward, after the step) FSDP2 has resharded every group, the root included
    (measured: params equal the shard storage at both, tests/agreement/test_agreement_torch.py)."""
    from minizero.memory import CATEGORIES, placed
    where = dict.fromkeys(CATEGORIES, 0)
    seen: set[int] = set()

    def claim(category, tensors):
        for t in tensors:
            if t is None:
                continue
            t = t._local_tensor if is_sharded(t) else t
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            where[category] += s.nbytes()

    params = list(engine.module.parameters())
    claim("params", params)
    claim("grads", [p.grad for p in params])
    claim("optimizer_states", [v for st in engine.optimizer.state.values() for v in st.values()
                               if torch.is_tensor(v) and v.dim() > 0])
    return placed(where, dict.fromkeys(CATEGORIES, 0))


def _fsdp2_groups(engine: TorchEngine) -> list:
    """Every FSDPParamGroup of the engine's model (none under DDP)."""
    groups = []
    for m in engine.module.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is not None:
            groups.extend(get()._fsdp_param_groups)
    return groups


def peak_reading(engine: TorchEngine, extra=()) -> dict:
    """What an FSDP2 engine holds right now, in runlog.PhasePeaks' shape. Its own buffers,
    each storage once (torch 2.14, torch/distributed/fsdp/_fully_shard/_fsdp_param.py):

        params:sharded parameters    each FSDPParam's padded local shard (the fp32 master too:
                                     FSDP2 steps it; bf16 has no other copy between steps)
        params:gathered parameters   all_gather_outputs, while a group is unsharded
        grads:unsharded gradients    the gathered parameters' .grad, as autograd leaves them,
                                     and unsharded_accumulated_grad
        grads:sharded gradients      the sharded parameters' .grad (the reduce-scatter's output)
        optimizer_states             Adam's moments
        buffers:<name>               `extra`: (name, tensor) pairs handed in by the caller (the
                                     reduce-scatter's input, which nothing else points at)

    Everything is on the device (the reference does not offload)."""
    cats = dict.fromkeys(("params", "grads", "master_params", "optimizer_states", "buffers"), 0)
    detail: dict = {}
    seen: set = set()

    def claim(category, name, t):
        if t is None:
            return
        t = t._local_tensor if is_sharded(t) else t
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        cats[category] += storage.nbytes()
        key = f"{category}:{name}"
        detail[key] = detail.get(key, 0) + storage.nbytes()

    groups = _fsdp2_groups(engine)
    fsdp_params = [fp for g in groups for fp in g.fsdp_params]
    for fp in fsdp_params:
        claim("params", "sharded parameters", fp.sharded_param)
    for fp in fsdp_params:
        for t in fp.all_gather_outputs:
            claim("params", "gathered parameters", t)
    if not groups:   # DDP: the module's parameters
        for p in engine.module.parameters():
            claim("params", "module parameters", p)
    for fp in fsdp_params:
        unsharded = getattr(fp, "_unsharded_param", None)
        claim("grads", "unsharded gradients", None if unsharded is None else unsharded.grad)
        claim("grads", "unsharded gradients", fp.unsharded_accumulated_grad)
    for p in engine.module.parameters():
        claim("grads", "sharded gradients" if groups else "module gradients", p.grad)
    for st in engine.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                claim("optimizer_states", "Adam moments", v)
    for name, t in extra:
        claim("buffers", name, t)
    return {"total": sum(cats.values()), "by_category": cats, "host": 0, "detail": detail}


def track_peaks(engine: TorchEngine):
    """A runlog.PhasePeaks of an FSDP2 engine: its backward and step as phases, and a reading
    (`peak_reading`) after each group's wait_for_unshard (gathered) and pre_backward, before
    its reshard, before and after its post_backward (the unsharded gradients, then the
    reduce-scatter), at each collective before it runs (reference.comm_counter's listeners:
    the reduce-scatter's input buffer counted there, the one moment it can be seen), and
    before and after the optimizer's step. DDP (stage 0) is not read: its reducer's bucket
    buffers live in C++, out of reach. arm() before the step to read, result() after it."""
    from minizero.train.runlog import PhasePeaks, wrap_phase, wrap_sample

    extra: list = []
    peaks = PhasePeaks(lambda: peak_reading(engine, extra))
    wrap_phase(engine, "backward", peaks, "backward")
    wrap_phase(engine, "step", peaks, "step")
    wrap_sample(engine.optimizer, "step", peaks, "optimizer.step")
    for g in _fsdp2_groups(engine):
        fqn = g._module_fqn or "root"
        wrap_sample(g, "wait_for_unshard", peaks, f"{fqn} gathered", before=False)
        wrap_sample(g, "pre_backward", peaks, f"{fqn} pre_backward", before=False)
        wrap_sample(g, "reshard", peaks, f"{fqn} reshard", after=False)
        wrap_sample(g, "post_backward", peaks, f"{fqn} post_backward")

    def before_collective(op, args, kwargs):
        if op == "reduce_scatter":
            inp = kwargs.get("input") if "input" in kwargs else (args[1] if len(args) > 1 else None)
            extra[:] = [("reduce-scatter input", inp)] if torch.is_tensor(inp) else []
        peaks.sample(f"{op} (before)")
        extra.clear()
    COUNTER.listeners.append(before_collective)
    return peaks


def run_torch(model_fn, config: dict, batches, steps: int, *, capture_memory: bool = False, seed: int = 0,
              weight_decay=None, return_final_state: bool = True, drive=None) -> dict:
    """Train `steps` optimizer steps with DDP/FSDP2 on this rank: reference/ds_run.py's
    run_deepspeed for PyTorch (same model, param groups, batches and loop: ds_run.train_steps),
    the same result keys, plus `comm`: this engine's collectives during the steps, by op
    (the loop's own fp64 loss all-reduce, one 8-byte tensor per step, taken out). `drive`:
    as run_deepspeed's (an object the loop calls instead of the engine; its result() joins)."""
    from reference.ds_run import build_model, prepare_ds_config, train_steps
    cfg = prepare_ds_config(config)
    model, groups = build_model(model_fn, cfg, seed, weight_decay)
    engine = TorchEngine(model, list(groups), cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    memory = {"after_backward": [], "after_step": []} if capture_memory else None
    before = COUNTER.snapshot()
    driven = drive(engine) if drive is not None else engine
    peaks = track_peaks(engine) if capture_memory and engine.stage != 0 else None
    out = train_steps(driven, batches, steps, lambda e: 1.0, lambda e: held_bytes(engine), memory, peaks)
    if peaks is not None:
        COUNTER.listeners.clear()
    after = COUNTER.snapshot()
    if driven is not engine:
        out.update(driven.result())
    moved = {op: {k: after[op][k] - before[op][k] for k in after[op]} for op in after}
    if world > 1:   # train_steps' rank-averaged loss: one fp64 scalar all_reduce per step
        moved["all_reduce"]["calls"] -= steps
        moved["all_reduce"]["bytes"] -= 8 * steps
        moved["all_reduce"]["wire_bytes"] -= steps * (2 * 8 * (world - 1) // world)
        if COUNTER._crosses(tuple(range(world))):   # this rank sends that all-reduce to another node
            moved["all_reduce"]["inter_node_bytes"] -= steps * (2 * 8 * (world - 1) // world)
    out.update(comm=moved, rank=dist.get_rank() if dist.is_initialized() else 0, world_size=world,
               zero_stage=engine.stage, config=cfg)
    if return_final_state:
        out["final_state"] = engine.full_fp32_state_dict()
    if memory is not None:
        out["memory"] = memory
    return out
