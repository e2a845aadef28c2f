"""Activation checkpointing: keep a block's inputs, recompute its insides in backward.

Why: backprop needs, for every op, the tensors its backward formula reads (a Linear's
input, a GELU's input, a dropout mask, a softmax's output, ...). For a transformer these
"activations" grow with layers x batch x sequence, and at long sequences they, not the
model states ZeRO partitions, are what fills memory. Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost" (arXiv:1604.06174), trade compute for memory: run a segment
(here: one transformer block) forward *without* recording its graph, keep only the
segment's inputs, and when backward reaches the segment run its forward again (now
recording) and backprop through that. Memory for activations drops from "everything
inside every block" to "one tensor per block + the insides of the one block being
recomputed", for the price of roughly one extra forward (~33% more compute).

This file is the reentrant variant DeepSpeed uses (`CheckpointFunction` in
deepspeed/runtime/activation_checkpointing/checkpointing.py, itself adapted from
torch.utils.checkpoint): an `autograd.Function` whose forward runs the block under
`no_grad` and whose backward recomputes under `enable_grad` and calls
`torch.autograd.backward` on the recomputed outputs. It is written from scratch here.

Three things must hold for the gradients to be *identical* to not checkpointing:

1. Same randomness. Dropout draws from the global RNG; the recompute must draw the same
   masks. We save the RNG state (CPU, and each CUDA device involved) before the forward,
   set it back for the recompute, and afterwards restore the state backward found, so the
   training RNG stream continues exactly as without checkpointing (DeepSpeed does the
   same: fwd_cpu_rng_state / bwd_cpu_rng_state in CheckpointFunction.backward).
2. Same inputs. We keep them with `ctx.save_for_backward`, so autograd's version counter
   catches an in-place change between forward and backward.
3. Same precision. If the forward ran under autocast, the recompute runs under the same
   autocast (backward usually runs outside it). DeepSpeed does not do this; with a module
   cast to fp16/bf16 (how minizero and DeepSpeed train) there is no autocast and no
   difference.

No model-parallel RNG tracker: DeepSpeed also saves/restores Megatron's
`CudaRNGStatesTracker` (`model_parallel_cuda_manual_seed`) so that tensor-parallel ranks
draw different dropout masks inside sharded layers. minizero is pure data parallelism:
there are no sharded layers, every rank draws from its own default generator, and saving
that generator is all that is needed.

Layout: this file is the mechanism and the one owner of module state (config, contiguous
buffers, timings). The keys are declared once, as `ActivationCheckpointingConfig` in
config/__init__.py; their precedence, checks and meaning under pure data parallelism are in
options.py; where the kept inputs wait for backward (as they are, pinned CPU
copies, contiguous buffer slots) in buffers.py. The tool that measures the
bytes held for backward, with and without checkpointing, watches from outside the core:
minizero/observe/saved_bytes.py.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .. import comm
from ..config import ActivationCheckpointingConfig
from . import buffers
from .options import check, describe, resolve

logger = logging.getLogger(__name__)

__all__ = [
    "configure", "configure_from", "is_configured", "reset", "checkpoint", "CheckpointFunction", "get_config",
    "ActivationCheckpointingConfig", "timings", "in_recompute",
]


# ----------------------------------------------------------------------------- configuration


_cfg = ActivationCheckpointingConfig()
_configured = False
_mpu = None
# contiguous_memory_optimization: one preallocated [number_checkpoints, numel] buffer per
# input position, and the next free slot in each (DeepSpeed: contiguous_data_buffers /
# data_offsets, module globals too).
_buffers: list[torch.Tensor] = []
_offsets: list[int] = []
_timings = {"calls": 0, "forward_s": 0.0, "recompute_s": 0.0, "backward_s": 0.0}
_recompute_depth = 0  # > 0 while a backward recomputes a block and backprops through it


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """Set the activation checkpointing options, with `deepspeed.checkpointing.configure`'s
    signature and precedence: start from the defaults, apply the config's
    `activation_checkpointing` section (a dict or a JSON path), then any explicit keyword.

    `mpu_` is accepted for signature compatibility; a model-parallel size above 1 is an error
    (minizero is data-parallel only).
    """
    configure_from(resolve(deepspeed_config, partition_activations=partition_activations,
                           contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
                           checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize, profile=profile), mpu_)


def configure_from(section: ActivationCheckpointingConfig, mpu_=None) -> None:
    """Set the options from an already parsed section: the engine passes
    `Config.activation_checkpointing`. DeepSpeed's checks apply, as in configure."""
    global _cfg, _configured, _mpu
    mpu = mpu_ if mpu_ is not None else _mpu  # as DeepSpeed: configure(None, ...) keeps an earlier mpu
    check(section, mpu)
    _cfg, _configured, _mpu = section, True, mpu
    reset()
    if comm.get_rank() == 0:
        logger.info(describe(section))


def is_configured() -> bool:
    """True once configure() has been called (as deepspeed.checkpointing.is_configured)."""
    return _configured


def get_config() -> ActivationCheckpointingConfig:
    return _cfg


def reset() -> None:
    """Drop the contiguous-memory buffers. As in DeepSpeed, call it after forwards that are
    not followed by a backward (e.g. evaluation with grad enabled), which would otherwise
    keep filling slots."""
    _buffers.clear()
    _offsets.clear()


def in_recompute() -> bool:
    """True while checkpoint's backward is re-running a block's forward and backprop'ing
    through it. ZeRO-3 (zero3.Unit.pre_forward) and the trace label what a recompute's
    forward does (its all-gathers: `.recompute`), which runs in the middle of backward."""
    return _recompute_depth > 0


def timings() -> dict:
    """Total seconds spent in checkpointed forward / recompute / inner backward (profile=True)."""
    return dict(_timings)


# ----------------------------------------------------------------------------- helpers

# These run once per checkpointed block, forward and recompute, so they ask
# torch.cuda.is_initialized() (a flag) and not torch.cuda.is_available(): on a CUDA build of
# torch without a GPU, every is_available() call tries to dlopen NVML and query the driver
# again (it caches nothing until CUDA initializes), about 0.1 ms each. Until CUDA is
# initialized no tensor lives on a GPU, so there is no stream to synchronize, no current
# device and no CUDA autocast region that could change a recomputed op: the answers are the
# same.

def _synchronize(tensors) -> None:
    # DeepSpeed calls get_accelerator().synchronize(), a no-op on its CPU accelerator.
    if _cfg.synchronize_checkpoint_boundary and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _cuda_devices(tensors) -> list[int]:
    devs = {t.device.index for t in tensors if t.is_cuda}
    if torch.cuda.is_initialized():
        devs.add(torch.cuda.current_device())
    return sorted(d for d in devs if d is not None)


def _get_rng_state(devices):
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)


def _autocast_state():
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_initialized() else [])
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


def _as_deepspeed_returns(outputs):
    """The top level of what checkpoint returns, by DeepSpeed's rules (checkpoint collects
    the members of a tuple/list into a tuple and returns the member itself when there is one).
    A dict stays a dict: DeepSpeed iterates it and returns its keys, a bug not copied."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    if torch.is_tensor(outputs) or isinstance(outputs, dict):
        return outputs
    raise TypeError(f"checkpoint: the function must return a tensor, or a tuple, list or dict (of tensors "
                    f"and other values), got {type(outputs).__name__}")


class _Outputs:
    """Carries the output structure out of Function.forward, which may only return a flat
    tuple of tensors, so checkpoint() can put every other member back in its place.

    The tensors are found at any depth (pytree leaves): DeepSpeed only passes the top-level
    ones through its Function, so a tensor inside a nested tuple comes back detached and its
    gradient is silently lost. Here it stays connected; structure and values are DeepSpeed's."""

    def flatten(self, outputs) -> list:
        leaves, self.treedef = tree_flatten(_as_deepspeed_returns(outputs))
        self.is_tensor = [torch.is_tensor(x) for x in leaves]
        self.others = [x for x in leaves if not torch.is_tensor(x)]
        return [x for x in leaves if torch.is_tensor(x)]

    def rebuild(self, tensors):
        tensors, others = iter(tensors), iter(self.others)
        return tree_unflatten([next(tensors) if t else next(others) for t in self.is_tensor], self.treedef)


# ----------------------------------------------------------------------------- the Function

class CheckpointFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, run_function, out_spec, *args):
        tensors = [a for a in args if torch.is_tensor(a)]
        _synchronize(tensors)
        t0 = time.perf_counter()

        ctx.run_function = run_function  # a module or function: never a parameter's full tensor
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.non_tensors = [a for a in args if not torch.is_tensor(a)]
        ctx.inputs_requires_grad = [t.requires_grad for t in tensors]
        ctx.devices = [t.device for t in tensors]
        ctx.rng_devices = _cuda_devices(tensors)
        ctx.fwd_rng = _get_rng_state(ctx.rng_devices)
        ctx.autocast = _autocast_state()

        with torch.no_grad():  # Function.forward already runs without grad; explicit for the reader
            outputs = run_function(*args)

        # Only the inputs are kept. save_for_backward (not a ctx attribute) so autograd owns
        # them: it checks they were not modified in place and saved_tensors_hooks see them.
        # DeepSpeed keeps them as ctx.deepspeed_saved_tensors instead, invisible to
        # saved_tensors_hooks: count those by hand when comparing bytes held for backward.
        saved = [buffers.stash(i, t, _cfg, _buffers, _offsets) for i, t in enumerate(tensors)]
        ctx.save_for_backward(*saved)
        ctx.offloaded = buffers.offload_events(tensors, saved)

        flat = out_spec.flatten(outputs)
        ctx.mark_non_differentiable(*[o for o in flat if not o.is_floating_point()])

        _synchronize(tensors)
        if _cfg.profile:
            dt = time.perf_counter() - t0
            _timings["calls"] += 1
            _timings["forward_s"] += dt
            if comm.get_rank() == 0:
                logger.info(f"checkpoint forward: {dt * 1e3:.3f} ms")
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint: torch.autograd.grad() is not supported, use .backward()")
        saved = ctx.saved_tensors
        _synchronize(saved)
        t0 = time.perf_counter()
        if _cfg.contiguous_memory_optimization:
            reset()  # as DeepSpeed: forget the buffers; the slots we saved keep theirs alive

        # Backward may run on another stream than forward: the copies back must start after
        # the copies to the host have finished. (Same stream: already in order.)
        for dev, ev in ctx.offloaded:
            torch.cuda.current_stream(dev).wait_event(ev)
        # Fresh leaves on the original device: the recompute builds its own small graph
        # rooted at them, and their .grad is what we hand back to the outer graph.
        leaves = iter([buffers.restore_to_device(t, dev).detach().requires_grad_(rg)
                       for t, dev, rg in zip(saved, ctx.devices, ctx.inputs_requires_grad)])
        non_tensors = iter(ctx.non_tensors)
        inputs = [next(leaves) if is_t else next(non_tensors) for is_t in ctx.is_tensor]

        global _recompute_depth
        _recompute_depth += 1
        try:
            bwd_rng = _get_rng_state(ctx.rng_devices)
            _set_rng_state(ctx.fwd_rng)  # replay the forward's dropout masks
            try:
                with torch.enable_grad(), contextlib.ExitStack() as stack:
                    for kind, enabled, dtype in ctx.autocast:
                        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                    # Under ZeRO-3 this re-fires the modules' forward hooks: parameters are
                    # gathered again for the recompute, exactly as in the first forward.
                    outputs = ctx.run_function(*inputs)
            finally:
                _set_rng_state(bwd_rng)  # training RNG continues as if no recompute happened
            t1 = time.perf_counter()

            outputs = [o for o in tree_leaves(outputs) if torch.is_tensor(o)]  # in forward's order
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            # No pair: no output depends on anything that requires grad. As DeepSpeed, the
            # inputs then get no gradient (torch.utils.checkpoint raises instead).
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            _recompute_depth -= 1

        _synchronize(saved)
        if _cfg.profile:
            t2 = time.perf_counter()
            _timings["recompute_s"] += t1 - t0
            _timings["backward_s"] += t2 - t1
            if comm.get_rank() == 0:
                logger.info(f"checkpoint recompute: {(t1 - t0) * 1e3:.3f} ms, backward: {(t2 - t1) * 1e3:.3f} ms")

        # One gradient per forward() argument: None for run_function, out_spec, non-tensors
        # and tensors that do not require grad (their leaf's .grad stays None).
        return (None, None, *[x.grad if is_t else None for x, is_t in zip(inputs, ctx.is_tensor)])


def checkpoint(function, *args, **kwargs):
    """`function(*args, **kwargs)`, keeping only the inputs for backward.

    Returns what DeepSpeed's checkpoint returns: `function`'s output, except that a tuple or
    list comes back as a tuple, and a one-member one as that member. Non-tensor members
    (None, numbers, strings, nested tuples) come back unchanged in their places. Gradients
    for tensor inputs, for tensors at any depth of the output and for parameters used inside
    `function` are identical to not checkpointing.
    """
    if kwargs:  # keyword tensors take part in autograd like positional ones (as DeepSpeed)
        run, keys, n = function, tuple(kwargs), len(args)

        def function(*all_args):
            return run(*all_args[:n], **dict(zip(keys, all_args[n:])))

        args = args + tuple(kwargs.values())

    if not torch.is_grad_enabled():
        return _as_deepspeed_returns(function(*args))  # no backward will come: nothing to keep or recompute
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        warnings.warn("checkpoint: no input requires grad, so the block's parameters will get no gradient "
                      "(the reentrant checkpoint's output is only connected to the graph through its inputs)")

    spec = _Outputs()
    return spec.rebuild(CheckpointFunction.apply(function, spec, *args))
