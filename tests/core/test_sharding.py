"""sharding.py as a unit, in one process: what a Sharding decides without a collective.

Which ranks each collective runs among is exercised by every multi-rank test; here: hpZ's
secondary shard is cut at a release from this rank's 1/k of the full buffer, kept where the
shard lives (device, or host memory with offload_param), dropped when the shard changes (the
step's write, a checkpoint's load), never cut for a persistent FlatParam (so the layout counts
none for it), and the defaults of `plain` and `replicated` are this job's ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from minizero import sharding
from minizero.flat_param import FlatParam
from minizero.offload import HostShard
from minizero.sharding import Sharding


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(5))]   # 11 elements, padded to 12


def _flat(s: Sharding, persistent: bool) -> FlatParam:
    return FlatParam(_params(), ["a", "b"], "t", group=0, sharding=s, persistent=persistent)


def _hpz() -> Sharding:
    return Sharding(4, 1, 4, secondary_size=2, secondary_index=1)   # rank 1 of 4, nodes of 2


def test_a_release_cuts_this_ranks_half_of_the_full_buffer_and_a_write_drops_it():
    s = _hpz()
    values = torch.cat([p.detach().reshape(-1) for p in _params()])
    f = _flat(s, persistent=False)
    assert f.padded_numel == 12 and not f.full_is_allocated()
    cut = s.secondary(f)                                 # cut at initialisation's release
    assert cut is not None and not cut.on_host and torch.equal(cut.tensor[:5], values[6:11])
    assert cut.tensor[5] == 0                            # the padding
    assert s.secondary_bytes(f) == 6 * 4
    f.write_shard(f.shard * 2, from_host=False)          # the step changed the shard: stale
    assert s.secondary(f) is None
    f.alloc_full()
    f.full.copy_(torch.arange(12.0))
    f.release_full()                                     # the next release cuts it from the new values
    assert torch.equal(s.secondary(f).tensor, torch.arange(6.0, 12.0))
    f.load_shard(torch.zeros(f.shard_numel))             # a checkpoint's load: stale too
    assert s.secondary(f) is None


def test_a_persistent_flatparam_never_has_a_secondary_and_the_layout_counts_none():
    s = _hpz()
    f = _flat(s, persistent=True)
    assert s.secondary(f) is None and s.secondary_bytes(f) == 0
    assert f.param_bytes() == f.padded_numel * 4          # the gathered buffer, nothing beside it


def test_the_secondary_lives_where_the_shard_lives():
    s = _hpz()
    f = _flat(s, persistent=False)
    f.move_shard(HostShard(f.shard.clone(), pin=False))  # offload_param
    s.changed(f)
    f.alloc_full()
    f.full.copy_(torch.arange(12.0))
    f.release_full()
    assert isinstance(s.secondary(f), HostShard) and s.secondary(f).on_host
    assert torch.equal(s.secondary(f).tensor, torch.arange(6.0, 12.0))


def test_plain_and_replicated_default_to_this_jobs_ranks():
    assert (sharding.plain().num_shards, sharding.plain().shard_index, sharding.plain().ranks) == (1, 0, 1)
    r = sharding.replicated(8)
    assert (r.num_shards, r.shard_index, r.ranks, r.replicas) == (1, 0, 8, None)
    assert "secondary 1/2" in repr(_hpz())
