"""Partitioning arithmetic: pure functions, no processes, no communication.

ZeRO (Rajbhandari et al., SC'20, section 5) splits a flat buffer of Ψ elements into N
equal, contiguous pieces, one per data-parallel rank. Which buffer: the paper draws one
buffer of all Ψ parameters, so rank r would own [r·Ψ/N, (r+1)·Ψ/N) of the model. minizero
cuts each gradient bucket (stages 1-2) or ZeRO-3 unit on its own: rank r owns slice r of
*every* one, so each collective moves one bucket or unit and every rank takes part in each.
Same bytes per rank, up to padding. The libraries differ here: PyTorch FSDP1 cuts each flat
unit as minizero does; DeepSpeed's ZeRO-1/2 cut each param group's flat buffer; DeepSpeed's
ZeRO-3 and FSDP2 cut each parameter on its own (ceil(n/N) elements per rank). Collectives
such as `all_gather_into_tensor` and `reduce_scatter_tensor` need every rank's piece to
have the same size, so the buffer is first padded with zeros up to a multiple of N.
Everything about "who owns which elements" follows from the three numbers (numel, N,
rank); these helpers compute it so it can be checked without starting a single process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of `world_size` that is >= `numel` (the padded flat length)."""
    return math.ceil(numel / world_size) * world_size


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds of a buffer of `numel` elements: ceil(numel / N)."""
    return padded_numel(numel, world_size) // world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's shard in the *padded* flat buffer. May extend into padding."""
    n = shard_numel(numel, world_size)
    return rank * n, (rank + 1) * n


def unflatten(flat, names: Sequence[str], shapes: Sequence) -> dict:
    """Cut a flat buffer (parameters laid end to end, then padding) back into named
    tensors of their shapes: views into `flat`, no copy. The inverse of the layout in
    flat_param.py; used for the live fp32 state and for a checkpoint's saved shards."""
    assert len(set(names)) == len(names), "unflatten: names must be unique"
    out, off = {}, 0
    for name, shape in zip(names, shapes):
        n = math.prod(shape)
        out[name] = flat[off:off + n].view(shape)
        off += n
    return out


def bucketize(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Greedy, order-preserving split of tensors into buckets of at most `bucket_numel`
    elements (a tensor larger than a bucket gets a bucket of its own).

    ZeRO-2 reduce-scatters gradients one bucket at a time while backward is still running
    (DeepSpeed's `reduce_bucket_size`): small buckets free full gradients sooner and
    overlap with compute, large buckets mean fewer, more efficient collectives.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_numel}")
    buckets, cur, cur_n = [], [], 0
    for i, n in enumerate(numels):
        if cur and cur_n + n > bucket_numel:
            buckets.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        buckets.append(cur)
    return buckets


@dataclass(frozen=True)
class FlatPlan:
    """One FlatParam before it exists: which parameters (by name, in buffer order) it
    flattens, its param group, and whether ZeRO-3 keeps it gathered (`persistent`).

    Every stage decides its layout as a list of these (buckets.bucket_plan,
    zero3.unit_plan) and then builds its FlatParams from the list. The plan depends on the
    model and the config only, never on the world size, so memory_table.py can lay out a
    model on the meta device for N = 1024 without a single process group."""
    label: str
    group: int
    names: tuple
    numels: tuple
    persistent: bool = True

    @property
    def numel(self) -> int:
        return sum(self.numels)


# ----------------------------------------------------------------------------- resharding

def param_offsets(numels: Sequence[int]) -> list[int]:
    """Where each parameter starts in a flat buffer that lays them end to end."""
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off += n
    return offsets


def shards_holding(start: int, stop: int, shard_numel: int) -> list[tuple[int, int, int]]:
    """Which shards hold elements [start, stop) of a flat buffer cut into shards of
    `shard_numel` elements (rank r holds [r * shard_numel, (r + 1) * shard_numel)):
    (rank, lo, hi) in rank order, lo and hi counted inside that rank's shard.

    This is how a saved checkpoint is read back at another world size: a parameter's
    elements lie at [offset, offset + numel) of its flat buffer, in one shard or spread
    over several consecutive ones."""
    if not 0 <= start <= stop:
        raise ValueError(f"shards_holding: need 0 <= start <= stop, got [{start}, {stop})")
    if shard_numel <= 0:
        if start == stop:
            return []
        raise ValueError(f"shards_holding: shard_numel must be positive, got {shard_numel}")
    pieces = []
    pos = start
    while pos < stop:
        rank = pos // shard_numel
        end = min(stop, (rank + 1) * shard_numel)
        pieces.append((rank, pos - rank * shard_numel, end - rank * shard_numel))
        pos = end
    return pieces


def params_in_range(numels: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The parameter pieces inside elements [start, stop) of a flat buffer (parameters laid
    end to end in `numels` order, then padding): (param index, lo, hi, at), meaning
    elements [lo, hi) of that parameter (flattened) sit at `at` counted from `start`.
    Padding holds no parameter, so it appears in no piece.

    This is how a rank's new shard is filled when resharding: its range [start, stop) of
    the new padded buffer is cut into the parameter slices it holds."""
    pieces = []
    for i, (off, n) in enumerate(zip(param_offsets(numels), numels)):
        lo, hi = max(start, off), min(stop, off + n)
        if lo < hi:
            pieces.append((i, lo - off, hi - off, lo - start))
    return pieces
