"""PyTorch's HSDP, the reference for minizero's, on 2 "nodes" x 2 gloo ranks.

reference/torch_engine.py runs `zero_optimization.hsdp_shard_size` S as fully_shard on
init_device_mesh("cpu", (N/S, S), mesh_dim_names=("replicate", "shard")): each parameter sharded
over a row of S ranks (a node), replicated across the rows. Pinned here:
- what crosses nodes: only the gradient shard's all-reduce between replicas (ranks r and r+S),
  Ψ_S/S elements per rank per step in the reduce dtype (Ψ_S: every parameter's dim 0 padded to
  a multiple of S); every all-gather and reduce-scatter stays inside the node;
- what a rank holds: the fp32 shard over S ranks, not N (Ψ_S/S elements);
- the gradient's order of operations (reference/torch_engine.py: HSDP_GRADIENT): reduce-scatter
  AVG within the node in the reduce dtype, then all-reduce AVG across the nodes in the reduce
  dtype, then the cast to fp32, bit for bit in fp32 and bf16 on a one-layer model.

Runs: HSDP in fp32 and bf16 (tests/support/two_nodes.py, 2 steps; FSDP2's launch, shared with
test_hierarchy.py and test_hpz_references.py) and the one-layer gradient check, both dtypes in
one launch of 4 ranks.
"""
import functools
import math

import pytest
import torch

from tests.support import agreement as A
from tests.support import two_nodes as T
from tests.support.launcher import run_ranks

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.filterwarnings("ignore")

S = T.PER_NODE
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def padded_elements(multiple: int) -> int:
    """Σ over parameters of numel with dim 0 padded to `multiple` (FSDP2's Shard(0) padding)."""
    return sum(math.ceil(p.shape[0] / multiple) * multiple * math.prod(p.shape[1:])
               for p in A.MODEL_FN().parameters())


def shard_group(rank):
    return tuple(range(rank // S * S, rank // S * S + S))


def replicate_group(rank):
    return tuple(range(rank % S, T.N, S))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_only_the_gradient_all_reduce_crosses_nodes(dtype):
    per_step = padded_elements(S) // S * DTYPE_BYTES[dtype]
    for rank, r in enumerate(T.fsdp2_runs(T.HSDP, dtype)):
        split = T.split(r["groups"])
        assert set(split["inter"]) == {"all_reduce"}
        assert split["inter"]["all_reduce"]["bytes"] == T.STEPS * per_step
        assert set(r["groups"]) == {shard_group(rank), replicate_group(rank)}
        assert set(r["groups"][shard_group(rank)]) == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_rank_holds_the_shard_of_its_node(dtype):
    """fp32 parameter shard (the optimizer's master, whatever the compute dtype) and its
    gradient over S = 2 ranks, after backward: Ψ_S/S elements each, twice ZeRO-3's Ψ_N/N."""
    shard = padded_elements(S) // S * 4
    for r in T.fsdp2_runs(T.HSDP, dtype):
        m = r["memory"]["after_backward"][-1]
        assert (m["params"], m["grads"]) == (shard, shard)


def _hsdp_gradient(dtype_name):
    """One Linear(8 -> 6, no bias) under HSDP on a (2, 2) mesh, a different input per rank;
    returns (FSDP2's full fp32 gradient, the prediction from every rank's local gradient)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6, bias=False)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + rank))
    # this rank's own gradient, computed as FSDP2 computes it (weights and input in the param dtype)
    w = layer.weight.detach().to(dtype).requires_grad_()
    (x.to(dtype) @ w.t()).float().pow(2).sum().backward()
    local = torch.zeros(T.N, *w.shape)
    dist.all_gather_into_tensor(local, w.grad.float().unsqueeze(0).contiguous())
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype != torch.float32 else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (T.N // S, S), mesh_dim_names=("replicate", "shard"))
    fully_shard(layer, mesh=mesh, mp_policy=mp)
    layer(x).float().pow(2).sum().backward()
    got = layer.weight.grad.full_tensor().float()
    g = local.to(dtype)
    # HSDP_GRADIENT: AVG within each node's row, in the reduce dtype, then AVG across the rows
    row0, row1 = (g[0] + g[1]) / 2, (g[2] + g[3]) / 2
    predicted = ((row0 + row1) / 2).float()
    return got, predicted


def _hsdp_gradients(dtypes):
    """Each dtype's check in turn, on these ranks: each its own layer, mesh and fully_shard."""
    return {d: _hsdp_gradient(d) for d in dtypes}


@functools.lru_cache(maxsize=None)
def hsdp_gradients():
    """Both dtypes' checks in one launch of 4 ranks (per rank: {dtype: (got, predicted)})."""
    return run_ranks(_hsdp_gradients, world_size=T.N, args=(("fp32", "bf16"),))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_is_two_averages_in_the_reduce_dtype(dtype):
    for rank in hsdp_gradients():
        got, predicted = rank[dtype]
        assert torch.equal(got, predicted)
