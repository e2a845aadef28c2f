"""DeepSpeed's hpZ (ZeRO++'s hierarchical partitioning, arXiv 2306.10209, section 3.2), as 0.19.8 runs it.

    "zero_optimization": {"stage": 3, "zero_hpz_partition_size": k}

ZeRO-3 all-gathers every parameter twice per step over all N ranks, so on several nodes most
of those bytes cross the slow inter-node link. hpZ keeps a second copy of the parameters,
sharded over the k ranks of a node, and backward all-gathers from it: inside the node.

What "a node" is. No topology is detected: deepspeed/utils/groups.py,
_create_zero_param_parallel_group(k), cuts the world into blocks of k consecutive ranks,
[0..k-1], [k..2k-1], ... (k must divide N), and each rank joins its block's group (the
"intra" group). k = ranks per node gives nodes when the launcher numbers ranks node by node, as
torchrun does (node r holds ranks r*L .. r*L+L-1). To pretend a topology on one machine, set k
to the pretended ranks per node: nothing else reads it. (DeepSpeed's tests used an NDEV_PER_NODE
variable for MiCS, whose code and keys are removed in 0.19.8: mics_shard_size and
mics_hierarchical_params_gather raise DeepSpeedConfigError.)

The secondary partition. partition_parameters.py, _partition_param_sec: when a gathered
parameter is released (partition()) and has no secondary yet, it gets
ds_secondary_tensor = elements [j*s, (j+1)*s) of its full value, s = padded/k, j = the rank's
index in its node, padded = numel rounded up to a multiple of N (_aligned_size; the primary
ds_tensor is padded/N), in the parameter's own (low-precision) dtype. So the secondary costs
each rank Σ padded/k elements, N/k times its primary partition: 2Ψ/k bytes in bf16 for a
Ψ-element model, where the primary is 2Ψ/N.

When it is refreshed. stage3.py, _post_step: after every optimizer step
invalidate_secondary_tensor() drops every secondary (set to None, freed), as does
checkpoint_event_epilogue after a checkpoint; the next release of each parameter, at the end of
its forward use, builds it again from the updated full value. So it lives from forward's
release to the step, and holds this step's parameters.

Which all-gather uses it. partition_parameters.py, _all_gather_coalesced (and
partitioned_param_coordinator.py, __all_gather_params_): a gather uses the secondary, over the
intra group, whenever the parameter has one; otherwise the primary over all N ranks. Hence:
    backward's gathers             always intra-node (forward's release built the secondary)
    forward's gathers              over all N ranks -- except in the FIRST step: the release
                                   at initialization (zero.Init / the optimizer's partitioning
                                   of gathered parameters) already built a secondary, so step
                                   0's forward gathers inside the node too
    gradient reduce-scatter        over all N ranks, unchanged (hpZ is about parameters; qgZ
                                   and qwZ, the quantizing parts of ZeRO++, are other keys)
The values are the same either way, so hpZ changes no number: losses and weights are
plain ZeRO-3's bit for bit (tests/agreement/test_hpz_references.py).

Measured (tests/agreement/test_hpz_references.py, tests/support/two_nodes.py: minizero's
"tiny" GPT, Ψ = 108,801 in 37 tensors, N = 4 gloo ranks, k = 2, bf16, the agreement tests'
ZeRO-3 settings: persistence, prefetch and reuse 0), per rank:
    primary partition        Σ padded/4 = 27,213 elements (54,426 bytes)
    secondary partition      Σ padded/2 = 54,426 elements (108,852 bytes), from forward's
                             release to the step, under "params" in reference/ds_memory.py
    per step after the first forward  20 all-gathers over ranks 0-3, 217,704 B gathered
                             backward 20 all-gathers over the rank's node, 217,704 B
                             reduce-scatter 7 calls over ranks 0-3, 217,704 B
    plain ZeRO-3 instead     both gathers over ranks 0-3: twice hpZ's inter-node gathers
The collectives come from reference/comm_counter.py's per-group record (CommCounter.by_group;
node_split sorts a run's groups into intra- and inter-node).

PyTorch's counterpart is fully_shard(reshard_after_forward=k): after forward each module keeps
its parameters sharded over k ranks and backward gathers from that copy; it is built by each
forward (no copy at initialization, so even step 0's backward is the only intra-node gather)
and freed after backward (reference/torch_engine.py reads zero_hpz_partition_size this way).
"""
from __future__ import annotations

import math


def node_groups(world_size: int, k: int) -> list[tuple[int, ...]]:
    """DeepSpeed's hpZ groups: blocks of k consecutive ranks (k divides world_size)."""
    if world_size % k:
        raise ValueError(f"zero_hpz_partition_size {k} does not divide the world of {world_size}")
    return [tuple(range(i, i + k)) for i in range(0, world_size, k)]


def secondary_elements(numels, world_size: int, k: int) -> int:
    """Elements of one rank's secondary partition: Σ over parameters of numel padded to a
    multiple of world_size, divided by k."""
    return sum(math.ceil(n / world_size) * world_size // k for n in numels)
