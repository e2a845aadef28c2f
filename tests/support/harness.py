"""One harness that trains minizero or DeepSpeed on the same inputs, for every test that
compares runs (tests/support/engine_runs.py, tests/support/agreement.py, tests/agreement/test_reference_harness.py).

The same inputs means four things, each built here once:

- the config: `make_config`, one DeepSpeed JSON dict, handed to either library;
- the model: `make_model` (a GPT preset, or `GPTWithUnused`), built through
  reference/ds_run.py's `build_model` (seed, then the model, then minGPT's decay/no-decay
  param groups), so both libraries start from the same weights and the same groups;
- the batches: reference/ds_run.py's convention, a picklable callable
  `batches(step, micro, rank, world_size) -> (x, y)`: `SyntheticBatches` (random tokens)
  or `PatternBatches` (learnable rows cut from one global batch per step);
- the comparison: `max_abs_diff` of two state dicts, `max_list_diff` of two lists.

`run(lib, ...)` trains either library on one rank with the same loop
(reference/ds_run.py's `train_steps`) and returns the same keys. Run it on N gloo ranks
with tests/support/launcher.py's `run_ranks`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from minizero.config import ActivationCheckpointingConfig
from reference.ds_run import (SyntheticBatches, build_model, get_batch,  # noqa: F401
                              prepare_ds_config, run_deepspeed, train_steps)
from tests.support import probes

LIBS = ("minizero", "deepspeed")
NO_DROPOUT = dict(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
CKPT_SECTION = dict(ActivationCheckpointingConfig().to_dict(), partition_activations=True)


# ----------------------------------------------------------------------------- config

def make_config(stage: int, dtype: str = "fp32", *, micro_batch: int, lr: float, gas: int = 1,
                optimizer: str = "AdamW", eps: Optional[float] = None, torch_adam: Optional[bool] = True,
                zero=(), fp16=(), clip: Optional[float] = None, ckpt: bool = False,
                steps_per_print: Optional[int] = None) -> Dict[str, Any]:
    """One DeepSpeed config for both libraries.

    zero: extra zero_optimization keys; fp16: extra fp16 keys (loss scaler settings);
    clip: gradient_clipping (absent: DeepSpeed's default, 1.0); ckpt: add CKPT_SECTION as
    activation_checkpointing; torch_adam None leaves it out (reference/ds_run.py's
    prepare_ds_config puts it inside optimizer.params)."""
    params: Dict[str, Any] = {"lr": lr}
    if eps is not None:
        params["eps"] = eps
    if torch_adam is not None:
        params["torch_adam"] = torch_adam
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, **dict(zero)},
    }
    if steps_per_print is not None:
        cfg["steps_per_print"] = steps_per_print
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **dict(fp16)}
    elif dtype != "fp32":
        raise ValueError(f"dtype {dtype!r}: use fp32, bf16 or fp16")
    if ckpt:
        cfg["activation_checkpointing"] = dict(CKPT_SECTION)
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


# ----------------------------------------------------------------------------- model

def checkpoint_blocks(model: nn.Module, cfg: Dict[str, Any]) -> None:
    """What a user's model does to checkpoint its blocks under minizero (as under DeepSpeed, the
    engine configures minizero.checkpointing and leaves the blocks to the model): the GPT's
    checkpoint_fn, when the config has an activation_checkpointing section."""
    if "activation_checkpointing" in cfg and hasattr(model, "checkpoint_fn"):
        import minizero.checkpointing
        model.checkpoint_fn = minizero.checkpointing.checkpoint


def param_groups(model: nn.Module, wd: float) -> List[Dict[str, Any]]:
    """minGPT's split for any model: Linear weights decay, everything else does not;
    parameters in named_parameters() order (GPT.configure_param_groups' groups exactly)."""
    decay = {f"{mn}.{pn}" if mn else pn for mn, m in model.named_modules()
             for pn, _ in m.named_parameters(recurse=False)
             if isinstance(m, nn.Linear) and pn == "weight"}
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": wd},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


class TanhBlock(nn.Module):
    """A 3-wide linear layer and tanh: the smallest block that is a ZeRO-3 unit of its own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class TwoBlockNet(nn.Module):
    """Two TanhBlocks and a head, a scalar out: three ZeRO-3 units (the blocks and the root)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TanhBlock(), TanhBlock()])
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


class GPTWithUnused(nn.Module):
    """The GPT plus parameters that get no gradient:

    - `extra` (its own ZeRO-3 unit, an nn.ModuleList child) is never called;
    - `side` (in the root unit) is used on even optimizer steps only (set `use_side`),
      so on odd steps it has momentum but no gradient: the case where DeepSpeed's ZeRO-3
      reapplies a stale gradient (README.md, "How minizero and DeepSpeed differ"). Missing
      must mean zero.
    """

    def __init__(self, cfg):
        super().__init__()
        from minizero.gpt.model import GPT
        self.gpt = GPT(cfg)
        self.extra = nn.ModuleList([nn.Linear(cfg.n_embd, cfg.n_embd)])
        self.side = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.use_side = True

    def forward(self, idx, targets):
        logits, loss = self.gpt(idx, targets)
        if self.use_side:
            e = self.gpt.tok_emb(idx)
            loss = loss + self.side(e).float().pow(2).mean()
        return logits, loss

    def configure_param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        return param_groups(self, weight_decay)


def make_model(preset: str, kind: str = "gpt", **overrides) -> nn.Module:
    """A GPT of this preset (`kind` "gpt") or GPTWithUnused around one ("unused").
    Bind the arguments with functools.partial to get a picklable model_fn."""
    from minizero.gpt.model import GPT, get_preset
    cfg = get_preset(preset, **overrides)
    return GPT(cfg) if kind == "gpt" else GPTWithUnused(cfg)


NO_DROPOUT = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}


def micro_engine(cfg: Dict[str, Any], kind: str = "gpt", **overrides):
    """(engine, model): the micro GPT (`make_model`'s kind and overrides), built after
    torch.manual_seed(0), under minizero with `cfg` and minGPT's two param groups (weight
    decay 0.1). Call it inside a rank."""
    import minizero
    torch.manual_seed(0)
    model = make_model("micro", kind, **overrides)
    engine, *_ = minizero.initialize(model=model, config=cfg, model_parameters=model.configure_param_groups(0.1))
    checkpoint_blocks(model, cfg)
    return engine, model


def train_step(engine, batches, step: int, gas: int) -> List[float]:
    """One optimizer step: `gas` micro-steps of this rank's rows of `batches`; their losses."""
    from minizero import comm
    losses = []
    for micro in range(gas):
        x, y = batches(step, micro, comm.get_rank(), comm.get_world_size())
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses



def mean_losses(engine, batches, start: int, steps: int) -> List[float]:
    """Optimizer steps [start, start + steps) of one micro-step each (rows of `batches`): the
    loss of each, averaged over the ranks in fp64 (as reference/ds_run.py's loop reports it)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(start, start + steps):
        x, y = batches(step, 0, rank, world)
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        t = torch.tensor([float(loss.detach().float().item())], dtype=torch.float64)
        dist.all_reduce(t)
        out.append(float(t.item()) / world)
    return out

# ----------------------------------------------------------------------------- batches

class PatternBatches:
    """Picklable learnable batches: each optimizer step has one global batch of
    `global_batch` rows of `seq` tokens, token_t = (a + b*t) mod V per row, so the loss
    really falls. It is cut into `gas` micro-batches of global_batch // gas rows; on
    micro-step m rank r takes rows [r*mb, (r+1)*mb) of micro-batch m, so one process sees
    the same rows per optimizer step as N ranks do. With `perm`, rank r takes the rows of
    rank perm[r] (the same rows per step, handed to the ranks in another order)."""

    def __init__(self, vocab_size: int, seq: int, global_batch: int, gas: int = 1, perm=()):
        self.vocab_size, self.seq, self.global_batch, self.gas = vocab_size, seq, global_batch, gas
        self.perm = tuple(perm)

    def step_batch(self, step: int):
        """(x, y) of the whole optimizer step."""
        g = torch.Generator().manual_seed(1000 + step)
        B, T, V = self.global_batch, self.seq, self.vocab_size
        a = torch.randint(0, V, (B, 1), generator=g)
        b = torch.randint(1, 4, (B, 1), generator=g)
        seq = (a + b * torch.arange(T + 1)) % V
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def rows(self, micro: int, rank: int, world_size: int):
        rows = self.global_batch // self.gas
        mb = rows // world_size
        if self.perm:
            rank = self.perm[rank]
        lo = micro * rows + rank * mb
        return lo, lo + mb

    def __call__(self, step: int, micro: int, rank: int, world_size: int):
        x, y = self.step_batch(step)
        lo, hi = self.rows(micro, rank, world_size)
        return x[lo:hi], y[lo:hi]


# ----------------------------------------------------------------------------- the run

def run_minizero(model_fn: Callable[[], torch.nn.Module], config: Dict[str, Any], batches, steps: int, *,
                 capture_memory: bool = False, seed: int = 0, weight_decay: Optional[float] = None,
                 return_final_state: bool = True, variant: str = "minizero",
                 drive: Optional[Callable] = None) -> Dict[str, Any]:
    """Train `steps` optimizer steps with minizero on this rank; the same keys as run_deepspeed
    (losses, local_losses, loss_scales, grad_norms, lrs, skipped_steps, global_steps,
    final_state, memory, init_seconds, step_seconds, rank, world_size, zero_stage, config)
    plus `comm` (the ledger's by_label since initialize, before the final-state gather) and
    `layout` (one dict per FlatParam).

    `variant` (test harness only; the patches are in tests/support/probes.py): "minizero", the
    engine as it is; "ds_norm", the clip factor from DeepSpeed's norm arithmetic for this
    stage (`patch_clip`; `ds_grad_norms` holds the norms); "jitter<k>", minizero's clip
    factor moved by a random whole number of fp32 ulps in [-3, 3] on every step that clips
    (seed k); "ds_stage0", stage 0 with DeepSpeed's stage-0 bf16/fp16 arithmetic, quirks
    included (`ds_stage0_arithmetic`); "ds_grown_scale", fp16 gradients unscaled by the
    loss scale as updated by this step (`unscale_by_updated_scale`). `drive`: as run_deepspeed's
    (engine -> the object the loop calls; its `result()` joins the returned dict)."""
    import minizero
    from minizero import comm

    cfg = prepare_ds_config(config)
    model, model_parameters = build_model(model_fn, cfg, seed, weight_decay)

    # An empty ledger before the engine is made, as in a fresh process: engine.comm_stats() (the
    # run's `ledger`) counts from what the ledger held then, and an earlier run in this process
    # (run_many, one launch of many runs) would otherwise leave its counts in that baseline.
    comm.ledger.reset()
    t0 = time.perf_counter()
    engine, _, _, _ = minizero.initialize(model=model, model_parameters=model_parameters, config=cfg)
    init_seconds = time.perf_counter() - t0
    checkpoint_blocks(model, cfg)
    ds_norms = probes.apply_variant(engine, variant)
    comm.ledger.reset()

    rank, world = comm.get_rank(), comm.get_world_size()
    memory = None
    if capture_memory:
        memory = {"after_init": engine.memory_breakdown(), "after_backward": [], "after_step": []}
    driven = drive(engine) if drive is not None else engine
    from minizero.train.runlog import MinizeroPeaks
    out = train_steps(driven, batches, steps, lambda e: float(e.loss_scale),
                      lambda e: e.memory_breakdown(), memory, MinizeroPeaks(engine) if capture_memory else None)
    if driven is not engine:
        out.update(driven.result())
    out["ledger"] = engine.comm_stats()
    out.update({
        "skipped_steps": int(engine.skipped_steps), "global_steps": int(engine.global_steps),
        "init_seconds": init_seconds, "rank": rank, "world_size": world,
        "zero_stage": int(engine.zero_optimization_stage()), "config": cfg,
        "comm": {k: dict(v) for k, v in comm.ledger.by_label.items()},
        "layout": probes.flat_layout(engine),
        "n_blocks": len(getattr(model, "blocks", [])),
    })
    if ds_norms is not None:
        out["ds_grad_norms"] = ds_norms
    if return_final_state:
        out["final_state"] = {k: v.detach().cpu().clone() for k, v in engine.full_fp32_state_dict().items()}
    if memory is not None:
        out["memory"] = memory
    return out


def run(lib: str, model_fn, config: Dict[str, Any], batches, steps: int, **kw) -> Dict[str, Any]:
    """Train `lib` ("minizero" or "deepspeed") on this rank: run_minizero or
    reference/ds_run.py's run_deepspeed, same arguments, same result keys."""
    if lib not in LIBS:
        raise ValueError(f"lib {lib!r}: use one of {', '.join(LIBS)}")
    fn = run_minizero if lib == "minizero" else run_deepspeed
    return fn(model_fn, config, batches, steps, **kw)


def run_many(jobs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Several `run(**job)` in the same rank processes (one fork for many configs). Only
    for minizero: it patches nothing process-wide, every run builds a fresh model and the
    comm ledger is reset after each initialize. (DeepSpeed runs each get their own
    processes: ZeRO-3 patches torch process-wide.)"""
    assert all(job.get("lib", "minizero") == "minizero" for job in jobs), "run_many: minizero jobs only"
    return [run(**{"lib": "minizero", **job}) for job in jobs]


# ----------------------------------------------------------------------------- comparisons

def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over two state dicts with the same keys (in fp64, so exact for
    fp32/bf16/fp16 values)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a),
               default=0.0)


def max_list_diff(a, b) -> float:
    """Largest |a[i] - b[i]| over two lists of numbers of the same length (losses, norms)."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
