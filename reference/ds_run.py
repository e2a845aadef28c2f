"""Train a model with real DeepSpeed inside one rank process and report what happened.

This is the DeepSpeed half of minizero's agreement tests (tests/support/harness.py runs either
library through it): the same model (same seed, same initial weights), the same batches
in the same order, the same JSON config, run under `deepspeed.initialize`, so that
per-step losses, final weights and per-rank memory can be compared with minizero's.

Call `run_deepspeed` from inside an already initialised process group, normally through
`tests.support.launcher.run_ranks(run_deepspeed, world_size=2, args=(model_fn, config, batches, steps))`
with `DS_ACCELERATOR=cpu` set before deepspeed is imported.

Batch convention (minizero's side uses the same one)
----------------------------------------------------
`batches` gives, for optimizer step `step` (0-based), gradient-accumulation micro-step
`micro` (0 .. gradient_accumulation_steps-1) and data-parallel rank `rank`, the micro-batch
`(x, y)` of long tensors, shape (micro_batch_size, T). Either

- a callable `batches(step, micro, rank, world_size) -> (x, y)` (see `SyntheticBatches`,
  a picklable one), or
- a nested sequence indexed `batches[step][micro][rank] -> (x, y)`.

`get_batch(batches, step, micro, rank, world_size)` resolves both.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from minizero import comm


def cpu_accelerator_without_a_gpu() -> None:
    """DeepSpeed picks its accelerator once, when first asked: on a machine without a GPU it
    must be told `cpu` before then. Where a GPU is present DeepSpeed's own choice (cuda) is
    the right one, and a `cpu` set here would win whenever this module is imported before
    deepspeed, sending a GPU run through DeepSpeed's CPU accelerator. A DS_ACCELERATOR the
    user (or tests/conftest.py) set is kept either way."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


cpu_accelerator_without_a_gpu()


# ----------------------------------------------------------------------------- data

class SyntheticBatches:
    """Picklable deterministic batches: uniform random token ids, a function of
    (seed, step, micro, rank) only, so both libraries and every rank agree.

    y is x shifted by one position within a sequence of T+1 tokens (language modelling)."""

    def __init__(self, vocab_size: int, block_size: int, micro_batch_size: int, seed: int = 1234):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.micro_batch_size, self.seed = micro_batch_size, seed

    def __call__(self, step: int, micro: int, rank: int, world_size: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + micro * 101 + rank)
        seq = torch.randint(0, self.vocab_size, (self.micro_batch_size, self.block_size + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def get_batch(batches, step: int, micro: int, rank: int, world_size: int):
    """Resolve the batch convention (callable or batches[step][micro][rank])."""
    if callable(batches):
        x, y = batches(step, micro, rank, world_size)
    else:
        x, y = batches[step][micro][rank]
    return x, y


# ----------------------------------------------------------------------------- config

def prepare_ds_config(config: Dict[str, Any], *, zero3_exact: bool = True) -> Dict[str, Any]:
    """A deep copy of `config` with the settings an exact comparison needs.

    - `optimizer.params.torch_adam = True`: DeepSpeed reads `torch_adam` ONLY inside
      `optimizer.params` (engine.py: DeepSpeedEngine._configure_basic_optimizer); beside
      `params` it is silently ignored and DeepSpeed's JIT-built FusedAdam is used. A
      misplaced `torch_adam` is an error here rather than a silent switch of optimizer.
    - stage 3 with `zero3_exact`: `zero_optimization.memory_efficient_linear = False`.
      By default ZeRO-3 replaces `torch.nn.functional.linear` process-wide with
      `LinearFunctionForZeroStage3` (runtime/zero/linear.py), which computes
      `input @ weight.t()` and then `+= bias`; that rounds differently from the fused
      addmm in bf16/fp16 and is the only reason ZeRO-3 differs from ZeRO-2 there
      (docs/deepspeed.md, "ZeRO-3 replaces F.linear (memory_efficient_linear)"). Turning
      it off makes ZeRO-3 use the same F.linear as minizero. (The patch would also leak
      into later models in the same process.)
    """
    cfg = copy.deepcopy(config)
    opt = cfg.get("optimizer")
    if opt is not None:
        if "torch_adam" in opt:
            raise ValueError("'torch_adam' beside optimizer.params is ignored by DeepSpeed; "
                             "put it inside optimizer.params")
        params = opt.setdefault("params", {})
        params.setdefault("torch_adam", True)
    zero = cfg.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) == 3 and zero3_exact:
        cfg.setdefault("zero_optimization", {})["memory_efficient_linear"] = False
    return cfg


def default_weight_decay(cfg: Dict[str, Any]) -> float:
    """The weight decay DeepSpeed's torch_adam optimizer would use for a plain parameter
    list: optimizer.params.weight_decay if given, else torch's default for the class
    engine.py: DeepSpeedEngine.get_optimizer_configuration picks -- torch.optim.AdamW
    (0.01) unless `"type": "Adam"` with `"adam_w_mode": false` (torch.optim.Adam, 0.0)."""
    opt = cfg.get("optimizer") or {}
    params = opt.get("params") or {}
    if "weight_decay" in params:
        return float(params["weight_decay"])
    adamw = str(opt.get("type", "")).lower() == "adamw" or params.get("adam_w_mode", True)
    return 0.01 if adamw else 0.0


def patch_cpu_fp16() -> None:
    """The CPU accelerator claims no fp16 support (accelerator/cpu_accelerator.py:
    CPU_Accelerator.is_fp16_supported / supported_dtypes), so `deepspeed.initialize`
    refuses `fp16.enabled`. Torch's CPU kernels do run fp16, so claim it."""
    import deepspeed

    a = deepspeed.accelerator.get_accelerator()
    a.is_fp16_supported = lambda: True
    a.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]


def skip_inference_shm_op() -> None:
    """Keep DeepSpeed from building its shared-memory all-reduce op on a CPU.

    Every `deepspeed.initialize` on the CPU accelerator loads `deepspeed_shm_comm`
    (comm/torch.py: TorchBackend.__init__ -> build_shm_op), JIT-compiling it with g++ the
    first time per extension folder: about a minute on 2 cores, and a "built successfully"
    line per rank per launch. The op serves only `inference_all_reduce` (tensor-parallel
    inference layers); training's collectives are torch.distributed's, so nothing a run
    computes changes. Call it before the process group of DeepSpeed's comm is set up."""
    import importlib

    # (not `import deepspeed.comm.torch`: deepspeed.comm's attribute `torch` is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


@contextlib.contextmanager
def quiet_loss_scaler():
    """DeepSpeed's loss_scaler module (runtime/fp16/loss_scaler.py), for a while, asking no
    process group for the rank (its update_scale does, and there may be none in this process)
    and logging nothing: to drive its DynamicLossScaler on its own, as minizero's lab grades a
    student's scaler against it."""
    import logging
    import types

    from deepspeed.runtime.fp16 import loss_scaler as module
    saved = module.dist, module.logger
    module.dist, module.logger = types.SimpleNamespace(get_rank=lambda: 0), logging.getLogger("reference.quiet")
    module.logger.disabled = True
    try:
        yield module
    finally:
        module.dist, module.logger = saved


# ----------------------------------------------------------------------------- helpers

def _load_portable(data: bytes) -> "PortableTensorDict":
    import io

    return PortableTensorDict(torch.load(io.BytesIO(data), weights_only=True))


class PortableTensorDict(dict):
    """A dict of CPU tensors that crosses a multiprocessing Queue BY VALUE.

    torch registers reducers on multiprocessing's ForkingPickler that send a CPU tensor as
    a shared-memory file descriptor; the receiver then has to fetch the fd from the sender
    process, which tests/support/launcher.py's rank process no longer is once it has put its result
    and exited (`ConnectionResetError` in `rebuild_storage_fd`). Pickling this dict writes
    the tensors' bytes (torch.save) instead; it unpickles as a PortableTensorDict of
    ordinary tensors. (tests/support/launcher.py now also torch.saves each rank's whole result;
    this keeps final_state safe for any other multiprocessing transport.)"""

    def __reduce__(self):
        import io

        buf = io.BytesIO()
        torch.save(dict(self), buf)
        return (_load_portable, (buf.getvalue(),))


def _loss_scale(engine) -> float:
    """Current loss scale: the ZeRO optimizers' / FP16_Optimizer's `cur_scale`, else 1.0."""
    opt = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        try:
            v = getattr(opt, name)
        except Exception:
            continue
        if v is None or callable(v):
            continue
        try:
            return float(v)
        except Exception:
            pass
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "cur_scale", None) is not None:
        return float(scaler.cur_scale)
    return 1.0


def _fp16_optimizer_masters(opt) -> Dict[int, torch.Tensor]:
    """Stage-0 fp16/bf16 wrappers do not link `_hp_mapping`; map id(param) -> fp32 master.

    runtime/fp16/unfused_optimizer.py: FP16_UnfusedOptimizer (used with torch_adam) keeps
    one fp32 copy per parameter in `fp32_groups`, parallel to `fp16_groups`;
    runtime/fp16/fused_optimizer.py: FP16_Optimizer (used with FusedAdam) one flat fp32
    master per group in `fp32_groups_flat`, in the order of `fp16_groups`."""
    out = {}
    if type(opt).__name__ == "FP16_UnfusedOptimizer":
        for group, masters in zip(opt.fp16_groups, opt.fp32_groups):
            for p, m in zip(group, masters):
                out[id(p)] = m.detach().clone()
        return out
    for group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
        off = 0
        for p in group:
            n = p.numel()
            out[id(p)] = flat.detach()[off:off + n].view_as(p).clone()
            off += n
    return out


def full_fp32_state_dict(engine) -> "PortableTensorDict":
    """The full fp32 state of the trained module, as CPU tensors, on every rank.

    Parameters come from the fp32 MASTER weights wherever DeepSpeed has them, via
    `deepspeed.utils.safe_get_full_fp32_param` (utils/tensor_fragment.py):
    ZeRO-1/2 and BF16_Optimizer all-reduce the per-rank hp fragments (`_hp_mapping`);
    ZeRO-3 all-gathers the fp32 partitions (`get_full_hp_param`). These are collectives:
    every rank calls them for the same parameters in the same order. Stage-0 fp16/bf16
    (FP16_UnfusedOptimizer / FP16_Optimizer) read `fp32_groups` / `fp32_groups_flat`;
    stage-0 fp32 the module parameters
    themselves (they are the master). Non-parameter buffers are copied as they are.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    fp16_masters = None
    if type(engine.optimizer).__name__ in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        fp16_masters = _fp16_optimizer_masters(engine.optimizer)
    cache: Dict[int, torch.Tensor] = {}
    out = PortableTensorDict()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in cache:
            full = safe_get_full_fp32_param(p)
            if full is None and fp16_masters is not None:
                full = fp16_masters.get(id(p))
            if full is None:
                assert not hasattr(p, "ds_id"), "ZeRO-3 parameter without an fp32 master"
                full = p.detach()
            cache[id(p)] = full.detach().float().cpu().clone().view(getattr(p, "ds_shape", p.shape))
        out[name] = cache[id(p)]
    for name, b in module.named_buffers():
        out[name] = b.detach().cpu().clone()
    return out


# ----------------------------------------------------------------------------- the run

def build_model(model_fn, cfg: dict, seed: int, weight_decay=None):
    """The model and its param groups, built identically for either library: seed, then
    `model_fn()`, then minGPT's decay/no-decay groups with DeepSpeed's default weight
    decay for this optimizer config (`default_weight_decay`)."""
    torch.manual_seed(seed)
    model = model_fn()
    if not hasattr(model, "configure_param_groups"):
        return model, model.parameters()
    if weight_decay is None:
        weight_decay = default_weight_decay(cfg)
    return model, model.configure_param_groups(weight_decay)


def train_steps(engine, batches, steps: int, loss_scale, probe=None, memory=None, peaks=None) -> dict:
    """The measured loop, shared by run_deepspeed and tests.support.harness.run_minizero so both
    libraries see the same batches and report losses the same way: `steps` optimizer
    steps of `gradient_accumulation_steps` micro-batches; per step the mean micro-batch
    loss (local, and averaged over ranks in fp64), loss scale (`loss_scale(engine)`),
    global grad norm, lrs and wall time; `probe(engine)` into `memory` after the last
    backward and after each step; `peaks` (a recorder with arm() and result():
    minizero.train.runlog.PhasePeaks, MinizeroPeaks) armed for the last step, its result in
    memory["peaks"]."""
    rank, world = comm.get_rank(), comm.get_world_size()
    gas = engine.gradient_accumulation_steps()
    engine.train()
    losses, local_losses, scales, norms, lrs, step_seconds = [], [], [], [], [], []
    for step in range(steps):
        if peaks is not None and step == steps - 1:
            peaks.arm()
        ts = time.perf_counter()
        acc = 0.0
        for micro in range(gas):
            x, y = get_batch(batches, step, micro, rank, world)
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)[1]
            engine.backward(loss)
            acc += float(loss.detach().float().item())
            if memory is not None and micro == gas - 1:
                memory["after_backward"].append(probe(engine))
            engine.step()
        step_seconds.append(time.perf_counter() - ts)
        local = acc / gas
        # On the engine's device (DeepSpeed's accelerator device, minizero's comm.get_device()):
        # NCCL reduces only GPU tensors; on a CPU run it is the CPU.
        t = torch.tensor([local], dtype=torch.float64, device=engine.device)
        if world > 1:
            dist.all_reduce(t)
        losses.append(float(t.item()) / world)
        local_losses.append(local)
        scales.append(loss_scale(engine))
        gn = engine.get_global_grad_norm()
        norms.append(None if gn is None else float(gn))
        lrs.append([float(v) for v in engine.get_lr()])
        if memory is not None:
            memory["after_step"].append(probe(engine))
    if peaks is not None and memory is not None:
        memory["peaks"] = peaks.result()
    return {"losses": losses, "local_losses": local_losses, "loss_scales": scales, "grad_norms": norms,
            "lrs": lrs, "step_seconds": step_seconds}


def run_deepspeed(model_fn: Callable[[], torch.nn.Module], config: Dict[str, Any], batches, steps: int, *,
                  fp16_cpu_patch: bool = True, capture_memory: bool = False, capture_peaks: Optional[bool] = None,
                  zero3_exact: bool = True,
                  seed: int = 0, weight_decay: Optional[float] = None,
                  return_final_state: bool = True, drive: Optional[Callable] = None) -> Dict[str, Any]:
    """Train `steps` optimizer steps with DeepSpeed on this rank; return plain data.

    model_fn: picklable callable -> nn.Module with forward(idx, targets) -> (logits, loss).
        `torch.manual_seed(seed)` is called right before it, so every rank (and minizero,
        doing the same) starts from identical weights.
    config: a DeepSpeed config dict; adjusted by `prepare_ds_config` (torch_adam inside
        optimizer.params; stage-3 memory_efficient_linear off when zero3_exact).
    batches: see the module docstring: callable (step, micro, rank, world_size) -> (x, y)
        or batches[step][micro][rank].
    weight_decay: for model.configure_param_groups(wd) when the model has it; default
        `default_weight_decay(config)` (what DeepSpeed would apply anyway). A group's own
        weight_decay overrides the optimizer's, so the no-decay group really gets 0.
    capture_memory: record `reference.ds_memory.deepspeed_model_state_bytes` after init,
        after each step's last backward (before engine.step) and after each step.
    capture_peaks: with capture_memory (the default: whenever it is on), also the last step's
        peaks (track_peaks). Off where no one reads them: the recorder reads every buffer at
        each event of the step (at ZeRO-3, every submodule's fetch and release), which can
        cost more than the step itself.
    drive: engine -> the object the loop calls instead of the engine (forward, backward,
        step; everything else passes through), e.g. tests/support/two_nodes.py's PhaseRecorder,
        which notes each phase's collectives; its `result()` joins the returned dict.

    Returns (per rank):
        losses         per step: mean over the accumulation micro-batches, averaged over
                       ranks (all_reduce) -- the number to compare with minizero
        local_losses   per step: this rank's mean micro-batch loss
        loss_scales    engine loss scale after each step (1.0 when not fp16)
        grad_norms     engine.get_global_grad_norm() after each step (None at stage 0 fp32)
        lrs            engine.get_lr() after each step
        skipped_steps, global_steps   the engine's counters at the end
        final_state    full fp32 state dict (see full_fp32_state_dict), unless disabled
        memory         if capture_memory: {"after_init": d, "after_backward": [d per step],
                       "after_step": [d per step], "transient_buckets": {"max_bytes",
                       "calls"}} (ZeRO-1/2 bucket buffers live only during backward),
                       "peaks" (with capture_peaks): the last step's fullest moment in
                       backward and in the step (reference.ds_memory.track_peaks)}
        init_seconds, step_seconds (wall time per optimizer step), rank, world_size,
        optimizer_kind (DeepSpeed's optimizer wrapper class), zero_stage, config (as used)
    """
    import deepspeed

    cfg = prepare_ds_config(config, zero3_exact=zero3_exact)
    if fp16_cpu_patch and (cfg.get("fp16") or {}).get("enabled", False):
        patch_cpu_fp16()

    model, model_parameters = build_model(model_fn, cfg, seed, weight_decay)

    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters, config=cfg)
    init_seconds = time.perf_counter() - t0

    if "activation_checkpointing" in cfg:
        # deepspeed.initialize parses this section but never applies it
        # (docs/deepspeed.md, "activation_checkpointing is parsed, not applied"); configure
        # the module-level checkpointing state ourselves.
        # After initialize: configure() calls deepspeed.comm.get_rank(), which asserts
        # that DeepSpeed's comm backend exists (initialize creates it).
        deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
        engine.module.checkpoint_fn = deepspeed.checkpointing.checkpoint

    rank, world = comm.get_rank(), comm.get_world_size()
    probe = None
    memory = None
    if capture_memory:
        from reference.ds_memory import deepspeed_model_state_bytes as probe
        from reference.ds_memory import track_transient_buckets

        from reference.ds_memory import track_peaks
        memory = {"after_init": probe(engine), "after_backward": [], "after_step": [],
                  "transient_buckets": track_transient_buckets(engine)}

    driven = drive(engine) if drive is not None else engine
    if capture_peaks is None:
        capture_peaks = capture_memory
    out = train_steps(driven, batches, steps, _loss_scale, probe, memory,
                      track_peaks(engine) if capture_memory and capture_peaks else None)
    if driven is not engine:
        out.update(driven.result())
    out.update({
        "skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "init_seconds": init_seconds,
        "rank": rank,
        "world_size": world,
        "optimizer_kind": type(engine.optimizer).__name__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "config": cfg,
    })
    if return_final_state:
        out["final_state"] = full_fp32_state_dict(engine)
    if memory is not None:
        out["memory"] = memory
    return out
