"""Bytes held for backward: a measuring tool, not part of the checkpointing mechanism.

Used to compare what minizero.checkpointing keeps for backward with no checkpointing and
with DeepSpeed (tests/core/test_checkpointing*.py, reference/activation_bytes.py). It counts the
distinct storages autograd saves, via torch.autograd.graph.saved_tensors_hooks; DeepSpeed
keeps its checkpoint inputs on ctx.deepspeed_saved_tensors, which the hooks never see, so
those are counted by hand there.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["SavedBytes", "count_saved_bytes", "saved_bytes_for_backward"]


class SavedBytes:
    """Bytes of the distinct storages autograd holds for backward.

    Deduplicated by (device, untyped_storage().data_ptr()): a view and its base, or one
    tensor saved by two ops, are held once. `exclude` storages (pass model.parameters())
    are not counted: parameters live anyway, they are not activations.
    """

    def __init__(self, exclude=()):
        self.storages: dict[tuple, int] = {}
        self._exclude = {self._key(p) for p in exclude}
        # While counting we keep every counted storage alive: if a saved tensor's graph died
        # mid-forward, the allocator could hand its address to a later tensor, which the
        # data_ptr dedup would then wrongly merge with it. (Such a tensor is still counted.)
        self._alive: list = []

    @staticmethod
    def _key(t):
        return (str(t.device), t.untyped_storage().data_ptr())

    def add(self, t) -> None:
        if not torch.is_tensor(t) or t.is_meta or t.layout != torch.strided:
            return
        k = self._key(t)
        if k not in self._exclude and k not in self.storages:
            self.storages[k] = t.untyped_storage().nbytes()
            self._alive.append(t.untyped_storage())

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def count_saved_bytes(exclude=()):
    """Count what is saved for backward inside the block, via saved_tensors_hooks:

        with count_saved_bytes(exclude=model.parameters()) as c:
            loss = model(x, y)[1]
        c.bytes
    """
    counter = SavedBytes(exclude)

    def pack(t):
        counter.add(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counter
    finally:
        counter._alive.clear()


def saved_bytes_for_backward(model_fn, exclude=()) -> int:
    """Bytes held for backward by the graph `model_fn()` builds (see count_saved_bytes)."""
    with count_saved_bytes(exclude) as c:
        out = model_fn()
    del out
    return c.bytes
