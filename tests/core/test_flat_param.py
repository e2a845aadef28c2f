"""flat_param.py as a unit: one FlatParam at world size 1 (no process group: every collective
is a local copy), its layout, its storage, its gradients.

What a FlatParam promises: the parameters are views into one padded buffer; a partitioned
one keeps only its shard and frees the full buffer, leaving each parameter an empty
placeholder; all_gather brings the buffer back with the views intact; a flat gradient is
laid out exactly as the buffer, padding zeroed, pre-divided; reduce_scatter_grad accumulates
micro-steps; write_shard rounds where the values live.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minizero import comm
from minizero.flat_param import DeviceShard, FlatParam
from minizero.sharding import Sharding


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 2, dtype=dtype)), nn.Parameter(torch.randn(5, dtype=dtype))]


def _flat(params, persistent=True, num_shards=1, shard_index=0):
    return FlatParam(params, ["a", "b"], "t", group=0, sharding=Sharding(num_shards, shard_index, num_shards),
                     persistent=persistent)


def test_parameters_are_views_into_one_padded_buffer():
    ps = _params()
    values = [p.detach().clone() for p in ps]
    f = _flat(ps, num_shards=4, shard_index=1)   # the layout for rank 1 of 4 (no collective needed to build it)
    assert (f.numel, f.padded_numel, f.shard_numel, f.shard_start) == (11, 12, 3, 3)
    assert all(torch.equal(p, v) for p, v in zip(ps, values))
    f.full[0] = 42.0
    assert ps[0].view(-1)[0] == 42.0                       # a view, not a copy
    assert f.full[11] == 0                                 # the padding
    assert f.shard.data_ptr() == f.full[3:6].data_ptr()    # persistent: the shard is a slice of full


def test_a_partitioned_shard_is_its_own_and_the_full_buffer_is_freed():
    ps = _params()
    values = torch.cat([p.detach().reshape(-1) for p in ps])
    f = _flat(ps, persistent=False)
    assert not f.full_is_allocated() and isinstance(f.storage, DeviceShard)
    assert torch.equal(f.shard, values)
    assert all(p.numel() == 0 for p in ps)                  # placeholders: a stray read fails
    with pytest.raises(RuntimeError):
        ps[0] @ torch.ones(2)
    assert f.param_bytes() == f.shard_numel * 4


def test_all_gather_brings_the_views_back_and_release_full_lets_them_go():
    ps = _params()
    f = _flat(ps, persistent=False)
    f.all_gather()
    assert f.full_is_allocated() and ps[0].shape == (3, 2)
    view = ps[0].data
    f.release_full()
    f.all_gather()
    assert view.untyped_storage().data_ptr() == f.full.untyped_storage().data_ptr()   # the same storage, resized


def test_flat_grad_lays_gradients_out_as_the_buffer_padding_zero_divided():
    ps = _params()
    f = _flat(ps, num_shards=3, shard_index=0)
    ps[0].grad = torch.full((3, 2), 6.0)                    # ps[1] got no gradient
    g = f.flat_grad(divide_by=3)
    assert g.numel() == f.padded_numel == 12
    assert torch.equal(g, torch.tensor([2.0] * 6 + [0.0] * 6))


def test_reduce_scatter_accumulates_micro_steps_and_drops_the_param_grads():
    ps = _params()
    f = _flat(ps, persistent=False)
    f.all_gather()                                          # ZeRO-3: backward runs on gathered parameters
    for value in (1.0, 2.0):
        for p in ps:
            p.grad = torch.full_like(p, value)
        f.reduce_scatter_grad()
        assert all(p.grad is None for p in ps)
    assert torch.equal(f.grad_shard, torch.full((11,), 3.0))   # world size 1: the sum of the two
    f.zero_grad()
    assert f.grad_shard is None


def test_all_reduce_grad_replaces_and_zero_grad_frees_the_buffer_it_reuses():
    ps = _params()
    f = _flat(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    f.all_reduce_grad()
    first = f.grad_shard
    assert first is f.grad_buffer   # stage 0: the all-reduced buffer is the gradient the step reads
    f.zero_grad()
    assert f.grad_shard is None and first.untyped_storage().nbytes() == 0
    for p in ps:
        p.grad = torch.full_like(p, 2.0)
    f.all_reduce_grad()
    assert f.grad_shard is first and torch.equal(first, torch.full((11,), 2.0))   # its memory back


def test_asynchronous_reduction_completes_at_wait():
    ps = _params()
    f = _flat(ps, persistent=False)
    f.all_gather()
    for p in ps:
        p.grad = torch.ones_like(p)
    pending = f.reduce_scatter_grad(async_op=True)
    assert f.grad_shard is None
    pending.wait()
    assert torch.equal(f.grad_shard, torch.ones(11))


def test_write_shard_rounds_into_the_low_precision_shard_and_counts_a_host_copy():
    ps = _params(torch.bfloat16)
    f = _flat(ps, persistent=False)
    master = torch.linspace(0, 1, 11, dtype=torch.float32)
    f.write_shard(master, from_host=False)
    assert torch.equal(f.shard, master.to(torch.bfloat16))
    before = comm.ledger.snapshot()["h2d"]["bytes"]
    f.write_shard(master * 2, from_host=True)              # an offloaded master: staged and copied over
    assert torch.equal(f.shard, (master * 2).to(torch.bfloat16))
    assert comm.ledger.snapshot()["h2d"]["bytes"] - before == 11 * 2


def test_a_persistent_shard_cannot_be_moved():
    f = _flat(_params())
    with pytest.raises(AssertionError, match="persistent"):
        f.move_shard(DeviceShard(torch.zeros(11)))
