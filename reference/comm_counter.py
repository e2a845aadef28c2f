"""Calls and ring wire bytes of torch.distributed's collectives, for the reference runs
(reference/train.py under DeepSpeed, reference/torch_train.py under DDP/FSDP2): neither
library keeps a byte ledger as minizero.comm does. Importing this module installs COUNTER.
"""
from __future__ import annotations

import functools
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
        self.stats = {op: {"calls": 0, "bytes": 0, "wire_bytes": 0} for op in ("all_gather", "reduce_scatter",
                                                                                 "all_reduce", "broadcast")}
        self._depth = threading.local()

    def snapshot(self) -> dict:
        return {op: dict(v) for op, v in self.stats.items()}

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

    def _wrap(self, name, fn):
        op = self.OPS[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    n = dist.get_world_size(kwargs.get("group")) if dist.is_initialized() else 1
                    b = self._payload(name, args, kwargs)
                    wire = {"all_reduce": 2 * b * (n - 1) // n, "broadcast": b if n > 1 else 0}.get(op, b * (n - 1) // n)
                    s = self.stats[op]
                    s["calls"] += 1
                    s["bytes"] += b
                    s["wire_bytes"] += wire
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


COUNTER = CommCounter().install()   # before `import deepspeed` (see the class docstring)
