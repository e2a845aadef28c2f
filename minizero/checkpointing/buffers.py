"""Where a checkpoint keeps its block's inputs until backward.

The recompute (checkpointing.py) needs only the block's inputs; three
`activation_checkpointing` keys decide where they wait for backward:

- as they are (the default);
- cpu_checkpointing: a copy in pinned CPU memory, copied back to the device in backward;
- contiguous_memory_optimization: a slot of one preallocated [number_checkpoints, numel]
  buffer per input position (pinned host memory with cpu_checkpointing of a GPU tensor).
- partition_activations splits across the model-parallel group, which has one rank under
  pure data parallelism: the "partition" is the whole tensor, nothing to do here.

This module is pure: the buffers and their next free slots are module state of
`minizero.checkpointing` (DeepSpeed: contiguous_data_buffers / data_offsets, module
globals too), passed in here as the `buffers` / `offsets` lists.
"""
from __future__ import annotations

import torch

from ..config import ActivationCheckpointingConfig

__all__ = ["stash", "offload_events", "restore_to_device", "offload_to_cpu", "into_contiguous_slot"]


def offload_to_cpu(t: torch.Tensor) -> torch.Tensor:
    """cpu_checkpointing: a CPU copy of a saved input (a CPU tensor stays as it is).

    From a GPU: one asynchronous copy straight into pinned (page-locked) host memory, which
    the GPU writes directly. (`.to("cpu")` copies into pageable memory and blocks, and
    pinning that afterwards copies it all again.) The copy is queued on the current stream,
    after the ops that made `t`; backward waits for it (offload_events) before copying back.
    """
    t = t.detach()
    if not t.is_cuda:
        return t
    host = torch.empty_like(t, device="cpu", pin_memory=True)  # same strides: the recompute sees the same layout
    return host.copy_(t, non_blocking=True)


def offload_events(tensors, saved) -> list:
    """(device, CUDA event) after the device-to-host copies of this checkpoint's offloaded
    inputs, on the stream that queued them."""
    out = []
    for dev in sorted({t.device.index for t, s in zip(tensors, saved) if t.is_cuda and not s.is_cuda}):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        out.append((dev, ev))
    return out


def restore_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The saved input back on its device. Pinned host -> GPU is asynchronous, queued on the
    current stream, which the recompute then uses: it reads the copy only once it is done."""
    return t if t.device == device else t.to(device, non_blocking=True)


def into_contiguous_slot(position: int, t: torch.Tensor, n: int, buffers: list, offsets: list,
                         to_host: bool = False) -> torch.Tensor:
    """Copy t into the next slot of the preallocated buffer for this input position
    (`buffers[position]`, `n` = number_checkpoints slots; `offsets[position]` is the next free one).

    DeepSpeed (partition_activations() in checkpointing.py) allocates `number_checkpoints`
    partitions per input position at the first checkpoint and copies each layer's input into
    the next one, so the caching allocator sees one big up-front allocation instead of many
    interleaved ones. Here the buffer is literally one tensor [number_checkpoints, numel].
    to_host (cpu_checkpointing of a GPU tensor): the buffer is pinned host memory and the
    slot is filled by one asynchronous copy from the GPU, as in offload_to_cpu.
    """
    device = torch.device("cpu") if to_host else t.device
    while len(buffers) <= position:
        buffers.append(None)
        offsets.append(0)
    buf = buffers[position]
    if buf is None:
        buf = torch.empty((n, t.numel()), dtype=t.dtype, device=device, pin_memory=to_host)
        buffers[position], offsets[position] = buf, 0
    if buf.shape[1] != t.numel() or buf.dtype != t.dtype or buf.device != device:
        raise RuntimeError("contiguous_memory_optimization needs every checkpoint's input at position "
                           f"{position} to have the same size/dtype/device (got {tuple(t.shape)} {t.dtype})")
    if offsets[position] >= n:
        raise RuntimeError(f"contiguous_memory_optimization: more than number_checkpoints={n} checkpoints before "
                           "a backward; raise number_checkpoints or call minizero.checkpointing.reset()")
    # The slot aliases the buffer's memory but is *not* a view of it (set_ gives it its own
    # autograd version counter): with buf[i] views, filling slot i+1 would bump the version
    # of slot i, which save_for_backward then rightly reports as an in-place modification.
    n_el = t.numel()
    slot = torch.empty(0, dtype=buf.dtype, device=buf.device).set_(
        buf.untyped_storage(), offsets[position] * n_el, (n_el,), (1,))
    offsets[position] += 1
    return slot.copy_(t.detach().reshape(-1), non_blocking=to_host).view(t.shape)


def _is_activation(t) -> bool:
    # DeepSpeed only partitions / offloads floating-point tensors (is_activation_to_checkpoint).
    return torch.is_tensor(t) and t.is_floating_point()


def stash(position: int, t: torch.Tensor, cfg: ActivationCheckpointingConfig, buffers: list, offsets: list
          ) -> torch.Tensor:
    """What we keep of one tensor input until backward."""
    if not _is_activation(t):
        return t
    # partition_activations: with one model-parallel rank the "partition" is the whole tensor.
    if cfg.contiguous_memory_optimization:  # (a CPU tensor stays on the CPU either way)
        return into_contiguous_slot(position, t, cfg.number_checkpoints, buffers, offsets,
                                    to_host=cfg.cpu_checkpointing and t.is_cuda)
    if cfg.cpu_checkpointing:
        return offload_to_cpu(t)
    return t
