"""The Engine: one training step, read top to bottom.

    engine(x, y)           forward of the wrapped module (ZeRO-3: each block gathered on the way)
    engine.backward(loss)  loss / grad_accum, x loss scale (fp16), backward; ZeRO-2/3 reduce
                           gradient buckets from hooks while backward runs
    engine.step()          every micro-batch; at the accumulation boundary, `_take_model_step`:
                             1. reduce gradients        (stage 0 all-reduce, ZeRO-1 reduce-scatter)
                             2. global gradient norm    (sum of shard norms, one scalar all-reduce)
                             3. skip or step            (fp16 overflow vote; non-finite bf16/fp32)
                             4. unscale + clip + Adam   on this rank's fp32 master shard
                             5. share new parameters    (ZeRO-1/2 all-gather; ZeRO-3 gathers on use)
                             6. LR schedule, counters

Two objects do the work: `self.zero`, the stage (zero0-3.py: where parameters and
gradients live, which collective moves them, and when), and `self.sharded_optimizer`
(sharded_optimizer.py: the step on this rank's shard, the same at every stage). With
ZeRO-Offload a third, `self.offload` (offload/host.py), says what lives in host memory.

The names and semantics of the public members follow DeepSpeed's `DeepSpeedEngine`, so
one script runs under either library; where they differ (a bug not copied, a more useful
return value), docs/deepspeed.md says so (what each method returns: docs/deepspeed.md,
"What the engine's methods return").
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch

from . import checkpointing, comm
from .config import ignored_knobs_note, load_config, renamed_keys_note
from .fp16 import create_loss_scaler, overflow_vote
from .config.lr_schedules import build_scheduler
from .memory import CATEGORIES, placed
from .adam import build_optimizer
from .offload import Offload
from .sharded_optimizer import ShardedOptimizer
from .zero0 import Zero0
from .zero1 import Zero1
from .zero2 import Zero2
from .zero3 import Zero3

logger = logging.getLogger("minizero")

STAGES = {0: Zero0, 1: Zero1, 2: Zero2, 3: Zero3}


class Engine(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, model_parameters=None, config=None, lr_scheduler=None,
                 checkpoint_io=None):
        """checkpoint_io: what save_checkpoint / load_checkpoint call (minizero.initialize passes
        checkpoint_files.checkpoint_io): the core owns the state, not the files."""
        super().__init__()
        self.checkpoint_io = checkpoint_io
        comm.init_distributed()
        self._comm_start = comm.ledger.snapshot()   # comm_stats() counts this engine's traffic only
        self.world_size, self.global_rank = comm.get_world_size(), comm.get_rank()
        self.local_rank, self.device = comm.get_local_rank(), comm.get_device()
        self.config = load_config(config, self.world_size)
        self.dtype = self.config.dtype
        comm.announce("engine_starts", self)   # tools the config switches on, before the first collective
        if self.config.optimizer is None:
            raise ValueError("minizero: the config has no \"optimizer\" section; add e.g. "
                             "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}}")

        model.to(device=self.device, dtype=self.dtype)  # bf16/fp16: the module computes in low precision
        self.module = model
        groups = param_groups_of(model, model_parameters)
        self.zero = STAGES[self.config.zero.stage](model, groups, self.config.zero)
        self.offload = Offload.from_config(self.config, self.device)   # None: all on the device
        states = self.offload.optimizer_states() if self.offload is not None else None   # None: on the device
        self.sharded_optimizer = ShardedOptimizer(self.zero.flat_params, groups,
                                                  lambda gs: build_optimizer(gs, self.config.optimizer, states is not None),
                                                  states=states)
        self.optimizer = self.sharded_optimizer.optimizer   # torch's Adam(W), on the fp32 master shards
        if self.offload is not None:
            self.offload.place_params(self.zero.flat_params)   # offload_param: ZeRO-3's shards to the host
            self.offload.start_nvme(self.zero.flat_params, self.sharded_optimizer)   # "nvme": on to their files
            if self.global_rank == 0:
                logger.info(self.offload.describe(self.zero.flat_params))

        if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
            lr_scheduler = lr_scheduler(self.optimizer)  # a factory of the optimizer
        self.lr_scheduler = lr_scheduler if lr_scheduler is not None else \
            build_scheduler(self.optimizer, self.config.scheduler)
        self.loss_scaler = create_loss_scaler(self.config.fp16) if self.config.fp16.enabled else None

        self.global_steps = 0     # optimizer steps, skipped ones included
        self.skipped_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self._global_grad_norm = None
        self._configure_activation_checkpointing()
        self._log_config_notes()
        comm.announce("engine_ready", self)

    # ------------------------------------------------------------------ config accessors
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.cur_scale) if self.loss_scaler is not None else 1.0

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    # ------------------------------------------------------------------ forward / backward
    # @comm.observed: a profiler range, and the phase announced to the tools that watch
    # (comm.py's observer hook); none of them runs in these methods.
    @comm.observed("forward")
    def forward(self, *args, **kwargs):
        cast = lambda t: t.to(self.device, self.dtype) if torch.is_tensor(t) and t.is_floating_point() \
            else (t.to(self.device) if torch.is_tensor(t) else t)
        return self.module(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    @comm.observed("backward")
    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """loss / gradient_accumulation_steps, times the loss scale (fp16), then backward.

        The order of DeepSpeed's `engine.backward` + ZeRO's `scale_if_loss`. The scale is
        applied at every stage (DeepSpeed's stage 0 differs: docs/deepspeed.md, "Stage 0
        fp16 never scales the loss")."""
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}")
        scaled = loss.float() / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.cur_scale
        self.zero.prepare_backward(self.is_gradient_accumulation_boundary())
        scaled.backward()
        self.zero.finish_backward()
        return loss

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self._take_model_step()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size

    @comm.observed("step")
    def _take_model_step(self) -> None:
        opt, phase = self.sharded_optimizer, comm.phase
        with phase("reduce_gradients", self):
            self.zero.reduce_gradients()                                   # 1
        # The scale this step's backward used: unscale by it even after the scaler updates
        # below (DeepSpeed reads the updated one: docs/deepspeed.md, "The step on which the
        # loss scale grows").
        scale = self.loss_scale
        with phase("grad_norm", self):
            norm_sq = opt.grad_norm_sq()                                    # 2
            # fp16: every rank votes on overflow (a MAX all-reduce), on the device, before the sync
            vote = overflow_vote(norm_sq) if self.loss_scaler is not None else None
            # The one host sync of a step: skipping needs a yes/no on the host (DeepSpeed syncs
            # here too). Everything below that needs the norm (or the vote) on the host uses this.
            norm_sq_host, voted = read_on_host(norm_sq, vote)
        if self._must_skip(norm_sq_host, voted):                            # 3
            opt.zero_grad()
            self.skipped_steps += 1
            self._global_grad_norm = float("inf")
        else:
            with phase("optimizer", self):
                opt.step(norm_sq, scale, self.config.gradient_clipping)     # 4
            with phase("after_step", self):
                self.zero.after_step()                                     # 5
            opt.zero_grad()
            # == float(norm) / scale, bit for bit, without a second sync: sqrt is correctly
            # rounded in fp64 on every device, and the fp32 rounding is done on the host.
            self._global_grad_norm = float(torch.tensor(math.sqrt(norm_sq_host), dtype=torch.float32)) / scale
            if self.lr_scheduler is not None:                           # 6
                self.lr_scheduler.step()
        self.global_steps += 1
        spp = self.config.steps_per_print
        if spp and self.global_rank == 0 and self.global_steps % spp == 0:
            logger.info(f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                        f"loss_scale={self.loss_scale}")

    def _must_skip(self, norm_sq: float, voted: float | None = None) -> bool:
        """Skip this step? fp16: every rank has voted (`voted`: the all-reduce MAX of "I
        overflowed", fp16.overflow_vote), so all ranks skip together by construction, and
        the loss scale updates. bf16 (with bf16.check_grad_overflow) and fp32: skip when
        the norm is inf/NaN rather than write NaN into every weight (docs/deepspeed.md, "A
        non-finite gradient norm skips the step in every dtype"); the norm is the same on
        every rank, so no vote is needed."""
        finite = math.isfinite(norm_sq)
        if self.loss_scaler is not None:
            overflow = voted > 0
            self.loss_scaler.update_scale(overflow)   # logs DeepSpeed's "OVERFLOW! ... Skipping step" line
            return overflow
        skip = not finite and (self.dtype == torch.float32 or self.config.bf16.check_grad_overflow)
        if skip and self.global_rank == 0:
            logger.warning(f"step {self.global_steps + 1}: the gradient norm is {math.sqrt(norm_sq)}; skipping "
                           f"the step (weights and optimizer state unchanged)")
        return skip

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(self) -> dict:
        """This rank's persistent model-state bytes (memory.py has the paper's formulas):
        {"params", "grads", "master_params", "optimizer_states"}, each the total, plus
        "device" and "host": the same four split by where they live (offload/host.py).

        grads: what a rank holds at the end of backward, before the step: stage 0/1 the
        full low-precision gradient, ZeRO-2/3 only its reduced shard."""
        opt = self.sharded_optimizer
        where = {"device": dict.fromkeys(CATEGORIES, 0), "host": dict.fromkeys(CATEGORIES, 0)}
        for f in self.zero.flat_params:
            where["host" if f.storage.on_host else "device"]["params"] += f.param_bytes()
        where["device"]["grads"] = self.zero.grad_bytes()
        opt_place = "host" if opt.on_host else "device"
        where[opt_place]["master_params"] = opt.master_bytes()
        where[opt_place]["optimizer_states"] = opt.state_bytes()
        nvme = self.offload.nvme_places(where) if self.offload is not None and self.offload.tier is not None else None
        for f in self.zero.flat_params:   # hpZ: from forward to the step, where the shard is (never a file)
            where["host" if f.storage.on_host else "device"]["params"] += f.sharding.secondary_bytes(f)
        return placed(where["device"], where["host"], nvme)

    def comm_stats(self) -> dict:
        """Calls, payload bytes and ring wire bytes per collective since this engine was
        created (its initial broadcast of the weights included). At world size 1 calls are
        still counted; wire_bytes are 0."""
        now = comm.ledger.snapshot()
        start = self._comm_start
        return {op: {k: now[op][k] - start.get(op, {}).get(k, 0) for k in now[op]} for op in now}

    def full_fp32_state_dict(self) -> dict:
        """Every parameter's full fp32 (master) value; a collective: call on every rank."""
        with self._states_in_memory():
            return self.sharded_optimizer.full_fp32_state()

    def destroy(self) -> None:
        """Let go of what outlives a step (DeepSpeed's engine.destroy()): "device": "nvme"'s
        swap files and folder, after the writes in flight. Also done at interpreter exit."""
        if self.offload is not None:
            self.offload.close()

    def _states_in_memory(self):
        """"device": "nvme": swapped states back in host memory for the block (offload/host.py);
        a checkpoint then holds what it holds with "device": "cpu"."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.resident(self.zero.flat_params, self.sharded_optimizer)

    # ------------------------------------------------------------------ state and checkpoints
    def layout(self) -> list[dict]:
        """The FlatParams this rank's state is cut along, in buffer order: label, names,
        shapes, numel, padded_numel, persistent, group. A checkpoint saved with the same
        layout (and the same world size and stage) loads file for file; any other is
        resharded into this one (checkpoint_files/)."""
        return [{"label": f.label, "names": f.names, "shapes": [tuple(s) for s in f.shapes], "numel": f.numel,
                 "padded_numel": f.padded_numel, "persistent": f.persistent, "group": f.group}
                for f in self.zero.flat_params]

    @property
    def partition(self) -> tuple[int, int]:
        """(shards each parameter is cut into, this rank's shard): (1, 0) at stage 0, (N, rank)
        at ZeRO-1/2/3, (S, rank mod S) with HSDP's shard groups of S (sharding.py)."""
        s = self.zero.flat_params[0].sharding
        return s.num_shards, s.shard_index

    def state_dict(self) -> dict:
        """This rank's share of everything a resume needs, as host tensors: no collective, so
        each rank saves its own (DeepSpeed's and FSDP's sharded state dict). Take it at a
        gradient-accumulation boundary, where no partial gradient exists: gradients are not
        part of it.

            stage, world_size, rank, dtype, config   what wrote it
            partition_count, shard_index             engine.partition: ranks holding the same
                                                     shard (stage 0, HSDP's replicas) hold the same state
            layout, param_names                      the FlatParams; the parameters in model order
            masters, shards                          this rank's fp32 masters and low-precision shards
            optimizer                                torch's Adam state over the masters
            lr_scheduler, loss_scaler                their state_dicts (None when there is none)
            counters                                 global_steps, skipped_steps, micro_steps, global_samples
        """
        opt, flats = self.sharded_optimizer, self.zero.flat_params
        trained = {n for f in flats for n in f.names}
        with self._states_in_memory():
            return {
                "stage": self.zero_optimization_stage(), "world_size": self.world_size, "rank": self.global_rank,
                "partition_count": self.partition[0], "shard_index": self.partition[1],
                "dtype": str(self.dtype), "config": self.config.raw,
                "layout": self.layout(), "param_names": [n for n, _ in self.module.named_parameters() if n in trained],
                "masters": [m.detach().cpu().clone() for m in opt.masters],
                "shards": [f.shard.detach().cpu().clone() for f in flats],
                "optimizer": _on_host(opt.optimizer.state_dict()),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                "counters": {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                             "micro_steps": self.micro_steps, "global_samples": self.global_samples},
            }

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> None:
        """Put a state_dict of this engine's layout back (a collective: persistent parameters
        are all-gathered). `shards` may be None: the low-precision weights are then the masters
        rounded, as every step makes them (a resume in another dtype, or a resharded one).
        `optimizer`, `lr_scheduler`, `loss_scaler` may be None: left as they are."""
        opt = self.sharded_optimizer
        shards = state.get("shards") or [None] * len(opt.masters)
        with self._states_in_memory():
            opt.zero_grad()   # a resumed step starts with no gradient, as the saved one did
            with torch.no_grad():
                for f, m, saved_m, saved_s in zip(opt.flat_params, opt.masters, state["masters"], shards):
                    m.copy_(saved_m)
                    f.load_shard(saved_s if saved_s is not None else m)
                    if f.persistent and f.num_shards > 1:   # ZeRO-1/2 and persistent ZeRO-3: the full buffer
                        f.all_gather(label="load")
            if load_optimizer_states and state.get("optimizer") is not None:
                opt.load_optimizer_state(state["optimizer"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        c = state["counters"]
        self.global_steps, self.skipped_steps = c["global_steps"], c["skipped_steps"]
        self.micro_steps, self.global_samples = c["micro_steps"], c["global_samples"]

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, format: str = "minizero") -> str:
        """DeepSpeed's method: every rank writes its state_dict() into one tag folder, and a
        `latest` file names the tag. The folder and its files are the checkpoint room's
        (checkpoint_files/checkpoint_io.py, handed to the engine by minizero.initialize).
        format "dcp": the folder is PyTorch's Distributed Checkpoint (FSDP2's, torchtitan's).
        Call at a gradient-accumulation boundary. Returns the tag's folder."""
        return self._checkpoints().save(self, save_dir, tag, client_state, save_latest, format=format)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True):
        """DeepSpeed's method: returns (the tag's folder, client_state), or (None, None) when
        `load_dir` holds no checkpoint. A folder of another world size or stage, or DeepSpeed's,
        is resharded as it loads (checkpoint_files/)."""
        return self._checkpoints().load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states)

    def _checkpoints(self):
        if self.checkpoint_io is None:
            raise RuntimeError("minizero: this engine has no checkpoint format; build it with minizero.initialize, "
                               "or save engine.state_dict() yourself")
        return self.checkpoint_io

    # ------------------------------------------------------------------ setup helpers
    def _configure_activation_checkpointing(self) -> None:
        """Configure `minizero.checkpointing` from the `activation_checkpointing` section, so a
        model that calls `minizero.checkpointing.checkpoint(block, x)` gets the config's options
        (DeepSpeed parses the section but leaves even this to the user: docs/deepspeed.md,
        "activation_checkpointing is parsed, not applied"). Which blocks to checkpoint is the
        model's choice, as in DeepSpeed: the engine never writes onto the user's module."""
        if self.config.activation_checkpointing is not None:
            checkpointing.configure_from(self.config.activation_checkpointing)

    def _log_config_notes(self) -> None:
        for note in (ignored_knobs_note(self.config),   # DeepSpeed's buffer, copy and libaio knobs: accepted, no effect
                     renamed_keys_note(self.config)):   # a removed DeepSpeed key read under minizero's name
            if note and self.global_rank == 0:
                logger.info(note)


def read_on_host(norm_sq: torch.Tensor, vote: torch.Tensor | None) -> tuple[float, float | None]:
    """The step's one host sync: the squared gradient norm (and fp16's overflow vote) as
    Python floats, in one device-to-host copy."""
    if vote is None:
        return float(norm_sq), None
    norm_sq_host, voted = torch.cat([norm_sq.reshape(1), vote.double()]).tolist()
    return norm_sq_host, voted


def _on_host(obj):
    """`obj` with every tensor in it copied to host memory: a state_dict stays valid after the
    call, whatever the engine does next (NVMe swaps the live states out of memory)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def param_groups_of(model: torch.nn.Module, model_parameters) -> list[dict]:
    """`model_parameters`: None (all of model.parameters()), an iterable of parameters, or an
    iterable of param-group dicts. Frozen parameters are left out."""
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in items]
    else:
        groups = [{"params": [p for p in items if p.requires_grad]}]
    if not any(g["params"] for g in groups):
        raise ValueError("minizero: the model has no trainable parameters (requires_grad=True) to optimize")
    seen, owned = set(), {id(p) for p in model.parameters()}
    for g in groups:
        for p in g["params"]:
            if id(p) in seen:
                raise ValueError("minizero: a parameter appears in more than one param group")
            if id(p) not in owned:
                raise ValueError("minizero: model_parameters holds a tensor that is not a parameter of the model")
            seen.add(id(p))
    return groups
