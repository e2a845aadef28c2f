"""unit.py as a unit: a ZeRO-3 Unit's state and gathers, the units of a model, the backward
signal, and the announcements of each unit's phases, at world size 1 (no process group)."""
from __future__ import annotations

import torch

from minizero import comm
from minizero.flat_param import FlatParam
from minizero.sharding import replicated
from minizero.unit import ShardState, Unit, find_units, on_backward
from tests.support.harness import TanhBlock, TwoBlockNet


def _unit():
    torch.manual_seed(0)
    b = TanhBlock()
    flat = FlatParam(list(b.parameters()), ["fc.weight", "fc.bias"], "u.g0", group=0, sharding=replicated(1),
                     persistent=False)
    return Unit("u", b, [flat]), b


def test_find_units_is_each_block_then_the_root():
    net = TwoBlockNet()
    assert [n for n, _ in find_units(net)] == ["blocks.0", "blocks.1", "root"]
    assert find_units(net)[-1][1] is net


def test_a_unit_is_sharded_gathered_and_freed_and_its_state_follows():
    u, b = _unit()
    assert u.state is ShardState.SHARDED and u.partitioned_numel == 12
    u.unshard("fwd")
    assert u.state is ShardState.UNSHARDED and b.fc.weight.shape == (3, 3)
    u.reshard()
    assert u.state is ShardState.SHARDED and b.fc.weight.numel() == 0


def test_an_asynchronous_unshard_is_in_flight_until_waited_and_reshard_waits_first():
    u, b = _unit()
    u.unshard("fwd.prefetch", async_op=True)
    assert u.state is ShardState.UNSHARDING and len(u.gathers) == 1
    u.wait_unshard()
    assert u.state is ShardState.UNSHARDED and u.gathers == []
    u.unshard("fwd.prefetch", async_op=True)
    u.reshard()                                 # waits for the gather, then frees
    assert u.state is ShardState.SHARDED and u.gathers == [] and not u.in_use


def test_on_backward_calls_back_once_when_the_gradient_arrives_and_passes_it_on():
    calls = []
    x = torch.ones(3, requires_grad=True)
    a, b = on_backward((x * 2, x * 3), lambda: calls.append(1))
    assert calls == []
    (a.sum() + b.sum()).backward()
    assert calls == [1] and torch.equal(x.grad, torch.full((3,), 5.0))
