"""Calls and ring wire bytes of torch.distributed's collectives, for the reference runs
(reference/train.py under DeepSpeed, reference/torch_train.py under DDP/FSDP2): neither
library keeps a byte ledger as minizero.comm does. Importing this module installs COUNTER.

The wire bytes a rank sends to another node are counted apart (`inter_node_bytes`), by
minizero's ledger rule, so that `python -m minizero.compare` splits every library's traffic
alike. Every collective is also recorded under the ranks of the group it ran on (`by_group`), so a
run with several groups (DeepSpeed's hpZ: the world and a group per "node"; FSDP2's HSDP: a
shard group and a replicate group) shows which collective crossed which ranks;
`node_split(by_group, ranks_per_node)` then sorts them into intra-node and inter-node.
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class CommCounter:
    """Calls and ring wire bytes of every torch.distributed collective, by minizero's op names.

    Wire bytes use the same ring formulas as minizero.comm's ledger, so the two
    summaries compare like for like (N = group size):
        all_reduce       2 (N-1)/N x tensor bytes
        all_gather       (N-1)/N x gathered (output) bytes
        reduce_scatter   (N-1)/N x full (input) bytes
        broadcast        tensor bytes (N > 1)

    Why wrap both `torch.distributed.X` and `torch.distributed.distributed_c10d.X`:
    DeepSpeed's TorchBackend caches `torch.distributed.all_gather_into_tensor` /
    `reduce_scatter_tensor` when it is built (hence: install before deepspeed starts)
    and calls some functions through distributed_c10d directly (all_gather_coalesced,
    all_gather_base). Torch itself chains them (all_gather_into_tensor ->
    all_gather_single, all_gather_object -> all_gather), so a thread-local depth counter
    counts only the outermost call of a chain: each collective once.
    """

    OPS = {  # torch function -> (op, how its bytes are read from the arguments)
        "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
        "broadcast": "broadcast",
        "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
        "all_gather_single": "all_gather",
        "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    }

    def __init__(self):
        self.stats = {op: {"calls": 0, "bytes": 0, "wire_bytes": 0, "inter_node_bytes": 0}
                      for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")}
        self.by_group: dict = {}   # (global ranks of the group) -> {op: {"calls", "bytes", "wire_bytes"}}
        self._depth = threading.local()
        self._across: dict = {}    # group ranks -> does this rank send to another node on their ring
        # callables (op, args, kwargs) told of each collective before it runs (the outermost call
        # of a chain): reference/torch_engine.py's peak recorder reads memory there
        self.listeners: list = []

    def snapshot(self) -> dict:
        return {op: dict(v) for op, v in self.stats.items()}

    def group_snapshot(self) -> dict:
        """{group ranks (a tuple of global ranks): {op: {"calls", "bytes", "wire_bytes"}}}."""
        return {g: {op: dict(v) for op, v in ops.items()} for g, ops in self.by_group.items()}

    @staticmethod
    def _nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(CommCounter._nbytes(t) for t in x)
        return 0

    def _payload(self, name, args, kwargs) -> int:
        """The buffer the wire formula applies to: all_gather's output, reduce_scatter's input."""
        def arg(i, *names):
            for n in names:
                if n in kwargs:
                    return kwargs[n]
            return args[i] if len(args) > i else None
        if name in ("all_reduce", "broadcast"):
            return self._nbytes(arg(0, "tensor"))
        if name == "all_reduce_coalesced":
            return self._nbytes(arg(0, "tensors"))
        if name == "all_gather":
            return self._nbytes(arg(0, "tensor_list"))
        if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
            return self._nbytes(arg(0, "output_tensor", "output"))
        if name == "reduce_scatter":
            return self._nbytes(arg(1, "input_list"))
        return self._nbytes(arg(1, "input_tensor", "input"))   # reduce_scatter_tensor & co.

    def _crosses(self, ranks: tuple) -> bool:
        """minizero's ledger rule (minizero/comm.py): on the ring over `ranks`, in their order,
        this rank sends all its bytes to the next one; they cross between nodes when that rank
        is on another node (process_group.ranks_per_node: consecutive ranks per node)."""
        if len(ranks) < 2 or not dist.is_initialized():
            return False
        if ranks not in self._across:
            from minizero.process_group import ranks_per_node
            per_node, me = ranks_per_node(), dist.get_rank()
            i = ranks.index(me) if me in ranks else None
            self._across[ranks] = i is not None and ranks[(i + 1) % len(ranks)] // per_node != me // per_node
        return self._across[ranks]

    @staticmethod
    def _group_ranks(group) -> tuple:
        """The global ranks of `group` (None: the world), in the group's rank order."""
        if not dist.is_initialized():
            return (0,)
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def _wrap(self, name, fn):
        op = self.OPS[name]
        try:   # where `group` sits among the arguments: DeepSpeed passes it by keyword, other callers by position
            group_at = list(inspect.signature(fn).parameters).index("group")
        except (ValueError, TypeError):
            group_at = None

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                for listener in self.listeners:
                    listener(op, args, kwargs)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    group = kwargs.get("group")
                    if group is None and group_at is not None and len(args) > group_at:
                        group = args[group_at]
                    ranks = self._group_ranks(group)
                    n = len(ranks)
                    b = self._payload(name, args, kwargs)
                    wire = {"all_reduce": 2 * b * (n - 1) // n, "broadcast": b if n > 1 else 0}.get(op, b * (n - 1) // n)
                    per_group = self.by_group.setdefault(ranks, {})
                    for s in (self.stats[op], per_group.setdefault(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})):
                        s["calls"] += 1
                        s["bytes"] += b
                        s["wire_bytes"] += wire
                    if self._crosses(ranks):
                        self.stats[op]["inter_node_bytes"] += wire
        counted.__wrapped_by_comm_counter__ = True
        return counted

    def install(self) -> "CommCounter":
        for name in self.OPS:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "__wrapped_by_comm_counter__", False):
                    continue
                setattr(mod, name, self._wrap(name, fn))
        return self


def node_split(by_group: dict, ranks_per_node: int) -> dict:
    """Sort `by_group` (CommCounter.group_snapshot(), or the difference of two) into
    {"intra": {op: {...}}, "inter": {op: {...}}}: a group whose ranks all sit on one node
    (global rank // ranks_per_node, torchrun's placement: node r holds ranks r*L .. r*L+L-1)
    is intra-node, a group that spans nodes is inter-node. A spanning group's ring also has
    intra-node edges; which of its bytes cross the slow link is the ledger's ring split
    (minizero's), not this coarse one."""
    out = {"intra": {}, "inter": {}}
    for ranks, ops in by_group.items():
        where = "intra" if len({r // ranks_per_node for r in ranks}) == 1 else "inter"
        for op, v in ops.items():
            acc = out[where].setdefault(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})
            for k in acc:
                acc[k] += v[k]
    return out


def group_delta(after: dict, before: dict) -> dict:
    """by_group after - before (each a CommCounter.group_snapshot()), groups and ops with no call left out."""
    out = {}
    for ranks, ops in after.items():
        for op, v in ops.items():
            b = before.get(ranks, {}).get(op, {"calls": 0, "bytes": 0, "wire_bytes": 0})
            d = {k: v[k] - b[k] for k in v}
            if d["calls"]:
                out.setdefault(ranks, {})[op] = d
    return out


COUNTER = CommCounter().install()   # before `import deepspeed` (see the class docstring)
