"""Communication: the four collectives ZeRO is built from (process-group setup: process_group.py).

Every collective minizero issues goes through a wrapper in this file, for two reasons:

1. *A ledger* (ledger.py). Each wrapper records how many calls were made and how many bytes were
   handed to the collective and sent on the wire, so `engine.comm_stats()` can show a
   student that ZeRO-3 sends 1.5x the wire bytes of plain data parallelism (ZeRO paper,
   Rajbhandari et al., SC'20, section 7: all-reduce = reduce-scatter + all-gather = 2Ψ;
   ZeRO-3 adds one more all-gather of the parameters, 3Ψ). By payload (the first count
   below) it is 3x: an all-reduce's buffer is counted once, though it crosses the wire twice.
2. *Profiler labels.* Each call runs inside `torch.profiler.record_function("minizero::<op>")`
   so a trace names every collective.

Two byte counts are kept per op:

- ``bytes``: the payload the caller gave the collective. all_reduce / broadcast: the
  tensor; all_gather: the gathered (output) tensor; reduce_scatter: the input tensor
  (the full, unreduced buffer).
- ``wire_bytes``: what one rank sends on a ring (the bandwidth-optimal algorithm NCCL and
  the paper assume): all_gather and reduce_scatter send (N-1)/N of the full buffer,
  all_reduce (= reduce-scatter + all-gather) sends 2(N-1)/N, broadcast sends the tensor
  once (counted on every rank: a pipelined ring broadcast forwards it once per rank).
  This is the number the paper's communication-volume analysis is about.
- ``inter_node_bytes``: the part of ``wire_bytes`` that crosses from one node to another.
  On a ring every rank sends all its bytes to the next rank of the collective's group, so
  a rank's wire bytes are inter-node exactly when that next rank is on another node
  (process_group.node_of); with nodes of consecutive ranks, one rank per node sends across
  (the node's last rank of the ring), each link between nodes carrying (N-1)/N of an
  all-gather's buffer. The rest, wire_bytes - inter_node_bytes, stays on the node.

Offload (offload/host.py) adds a second kind of traffic, between the rank's device and its host
memory: `copy_to_host` ("d2h") and `copy_to_device` ("h2d") are labelled and counted the
same way (``bytes`` copied; ``wire_bytes`` 0, nothing crosses the network). The NVMe tier
(offload/nvme.py) adds "nvme_read" and "nvme_write", file to host memory and back, once a run swaps.

Each collective and copy runs through `_issue`, which also announces it to the *observers*
(`observers`, below): tools in minizero/observe/ (the desync check, the timeline trace,
DeepSpeed's comms logger) subscribe there; this file imports none of them, and with none
subscribed a collective costs one empty-list check.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler
from torch.profiler import record_function

# The setup lives in process_group.py; its names are re-exported so that code which moves
# data says comm.get_rank(), comm.barrier(), ... from one module.
from . import process_group as _pg
from .ledger import COPIES, OPS, CommLedger, ledger  # noqa: F401  (comm.ledger: every byte moved)
from .process_group import (ONE_RANK_ENV, LaunchError, all_gather_object, barrier, broadcast_object,  # noqa: F401
                            destroy, free_port, get_device, get_local_rank, get_rank, get_world_size,
                            init_distributed, is_distributed, new_groups, node_of, ranks_per_node, single_host_env)

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single. The old names still work, through a wrapper that raises a
# FutureWarning on every call: tens of microseconds of host time per collective, which a
# ZeRO-3 step pays dozens of times. So the wrappers below keep the names the ZeRO literature
# and DeepSpeed use, and call torch's current name where this torch has it (looked up at
# each call, so a tool that wraps torch.distributed's functions still sees them).
_SINGLE_NAMES = hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated")


def torch_all_gather():
    """torch.distributed's all-gather into one tensor, under this torch's current name."""
    return dist.all_gather_single if _SINGLE_NAMES else dist.all_gather_into_tensor


def torch_reduce_scatter():
    """torch.distributed's reduce-scatter of one tensor, under this torch's current name."""
    return dist.reduce_scatter_single if _SINGLE_NAMES else dist.reduce_scatter_tensor





def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_NO_RANGE = contextlib.nullcontext()


def profiled(name: str):
    """A profiler range `name` while a torch profiler is recording, else nothing: a range
    costs microseconds of Python each time, and a step opens dozens."""
    return record_function(name) if _profiler._is_profiler_enabled else _NO_RANGE


def _label(op: str, label: str | None):
    return profiled(f"minizero::{op}" + (f"::{label}" if label else "")) if _profiler._is_profiler_enabled \
        else _NO_RANGE


# ----------------------------------------------------------------------------- the observer hook
# The one seam between the core and the tools that watch it (minizero/observe/). The engine
# announces its phases, the wrappers below each collective and copy; an observer implements
# the events it cares about, each optional:
#   engine_starts(engine)           the engine has its config, before its first collective
#   engine_ready(engine)            the engine is built
#   phase_begins(name, engine)      "forward", "backward", "step" (the accumulation boundary's),
#                                   and the step's parts: "reduce_gradients", "grad_norm",
#                                   "optimizer", "after_step"
#   phase_ends(name, engine)
#   unit_begins(engine, unit, kind) a unit (unit.find_units: a block, or the root) starts its
#   unit_ends(engine, unit, kind)   "forward", "recompute" or "backward" / has finished it; announced
#                                   only while a tool watches the engine (observe/unit_marks.py)
#   begin(op, label, tensor, nbytes, group) -> token   a collective or copy is about to be issued
#   blocking(token)                 an asynchronous one's wait() is about to block on it
#   end(token, op, label, nbytes, wire_bytes, msg_bytes)   it is done
#   failed(error, op, label, tensor, nbytes) -> Exception | None   the backend raised: a better error
#   log_summary(show_straggler, return_dict)   deepspeed.comm.log_summary (the comms logger's)
# A tool joins with subscribe(observer) and leaves with unsubscribe(observer).
observers: list = []
_watchers: tuple = ()   # the observers with begin/end/blocking: what each collective announces to


def subscribe(observer, first: bool = False) -> None:
    """Watch the engines of this process (idempotent); `first`: before those already here."""
    global _watchers
    if observer not in observers:
        observers.insert(0, observer) if first else observers.append(observer)
    _watchers = tuple(o for o in observers if any(hasattr(o, e) for e in ("begin", "end", "blocking")))


def unsubscribe(observer) -> None:
    global _watchers
    if observer in observers:
        observers.remove(observer)
    _watchers = tuple(o for o in observers if any(hasattr(o, e) for e in ("begin", "end", "blocking")))


def announce(event: str, *args) -> None:
    """Tell every observer that has a method `event`."""
    for o in list(observers):
        method = getattr(o, event, None)
        if method is not None:
            method(*args)


def observed(phase: str):
    """Decorates an engine method: a profiler range `minizero::<phase>` around it, and
    phase_begins/phase_ends(phase, engine) for the observers. A phase that raises does not
    announce its end: an observer may issue a collective there (the trace, at a step's end),
    which the other ranks, not failing, would never join."""
    def decorate(method):
        @functools.wraps(method)
        def run(engine, *args, **kwargs):
            with profiled(f"minizero::{phase}"):
                if not observers:
                    return method(engine, *args, **kwargs)
                announce("phase_begins", phase, engine)
                out = method(engine, *args, **kwargs)
                announce("phase_ends", phase, engine)
                return out
        return run
    return decorate


class phase:
    """A part of an engine method, `with comm.phase(name, engine): ...`: a profiler range
    `minizero::<name>`, and phase_begins/ends for the observers (the end only when the part
    returns, as in `observed`). A class, not a generator: it runs every step."""

    def __init__(self, name: str, engine):
        self.name, self.engine = name, engine
        self.range = profiled(f"minizero::{name}") if _profiler._is_profiler_enabled else _NO_RANGE

    def __enter__(self):
        self.range.__enter__()
        if observers:
            announce("phase_begins", self.name, self.engine)

    def __exit__(self, kind, value, tb):
        if kind is None and observers:
            announce("phase_ends", self.name, self.engine)
        return self.range.__exit__(kind, value, tb)


def listening(event: str) -> bool:
    """Does some observer implement `event`? (An announcement nobody hears can be skipped.)"""
    return any(hasattr(o, event) for o in observers)


def _failure(e: RuntimeError, op: str, label: str | None, tensor: torch.Tensor, nbytes: int) -> Exception | None:
    """The first observer's better error for a backend error (the desync check names the
    collective and the step), or None."""
    for o in list(observers):
        method = getattr(o, "failed", None)
        named = method(e, op, label, tensor, nbytes) if method is not None else None
        if named is not None:
            return named
    return None


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """deepspeed.comm.log_summary: rank 0 prints the comms logger's table (DeepSpeed's format);
    with return_dict, every rank gets {"summary": ..., "straggler_analysis": ..., "metadata":
    ...} as DeepSpeed returns it. The comms logger (observe/comms_logger.py) answers; a
    collective when show_straggler is set."""
    for o in list(observers):
        if hasattr(o, "log_summary"):
            return o.log_summary(show_straggler, return_dict)
    raise RuntimeError("minizero: the comms logger is off; enable it with the config section "
                       "\"comms_logger\": {\"enabled\": true}")


def _issue(op: str, label: str | None, call, nbytes: int, wire_bytes: int, msg_bytes: int | None = None,
           async_op: bool = False, check: tuple = (), group=None) -> "Pending | None":
    """Run one collective or copy (`call`) inside its profiler range, announce it, count it.

    nbytes / wire_bytes: the ledger's two counts (module docstring). msg_bytes: the size
    DeepSpeed's comms logger records, the tensor its wrapper reads (all_gather: the input
    shard; the others: `tensor`), default nbytes. async_op: `call` returned the backend's work
    handle; the collective is counted now and finishes (for the observers too) at Pending.wait().
    check: (tensor, keep): the tensor that names the collective (on a timeout, for the desync
    check), and for Pending what to keep alive."""
    tensor = check[0] if check else None
    watching = _watchers
    with _label(op, label):
        tokens = [w.begin(op, label, tensor, nbytes, group) if hasattr(w, "begin") else None
                  for w in watching] if watching else ()
        try:
            work = call()
        except RuntimeError as e:   # gloo's timeout and connection errors; DistBackendError is one
            named = _failure(e, op, label, tensor, nbytes) if observers else None
            if named is None:
                raise
            raise named from e
    ledger.record(op, nbytes, wire_bytes, label, wire_bytes > 0 and sends_across_nodes(group))
    if not watching:   # nobody times or checks collectives: nothing to tell at the end
        return Pending(op, label, work, None, nbytes, *check) if async_op else None
    msg = nbytes if msg_bytes is None else msg_bytes

    def finish() -> None:
        for w, token in zip(watching, tokens):
            if hasattr(w, "end"):
                w.end(token, op, label, nbytes, wire_bytes, msg)

    def blocking() -> None:
        for w, token in zip(watching, tokens):
            if hasattr(w, "blocking"):
                w.blocking(token)
    if not async_op:
        finish()
        return None
    return Pending(op, label, work, finish, nbytes, *check, blocking=blocking)


class Pending:
    """A collective issued with async_op=True and not yet waited for.

    Until wait() returns, its output must not be read and none of its tensors may be freed,
    resized or reused: gloo's worker thread, or NCCL's own CUDA stream, may still be reading
    or writing them. `keep` holds every such tensor, so no Python reference going away can
    free one early; wait() (work.wait(): on CUDA the *current stream* waits for NCCL's,
    the host does not block) releases them. Callers still must not resize_(0) a kept
    buffer's storage before wait (unit.Unit.reshard waits for its gathers first).
    """

    def __init__(self, op: str, label: str | None, work, finish, nbytes: int, tensor: torch.Tensor, keep: tuple,
                 blocking=None):
        """finish / blocking: what to tell the observers at the wait (None: nobody listens)."""
        self.op, self.label, self.work, self._finish, self._blocking = op, label, work, finish, blocking
        self.nbytes, self.tensor, self.keep = nbytes, tensor, keep
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        with _label(f"wait::{self.op}", self.label):
            if self._blocking is not None:
                self._blocking()   # the observers note when this rank starts to wait on it
            if self.work is not None:
                try:
                    self.work.wait()
                except RuntimeError as e:
                    named = _failure(e, self.op, self.label, self.tensor, self.nbytes)
                    if named is None:
                        raise
                    raise named from e
            if self._finish is not None:
                self._finish()
        self.done, self.work, self.keep, self.tensor = True, None, (), None


# ----------------------------------------------------------------------------- collectives
# Each takes an optional `label` (e.g. "block3.params") that goes into the profiler range
# name and the ledger's per-label breakdown, and async_op: False (the default) returns when
# the collective is done; True returns a Pending to wait() on before touching the tensors.

def sends_across_nodes(group=None) -> bool:
    """On the ring of `group` (default: all ranks), in its rank order, is the rank this rank
    sends to on another node? Worked out once per group (process_group.py forgets the answers
    when a process group starts or ends)."""
    crosses = _pg.ring_crosses_node
    if group not in crosses:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(get_world_size()))
        me = ranks.index(get_rank())
        crosses[group] = node_of(ranks[(me + 1) % len(ranks)]) != node_of(get_rank())
    return crosses[group]


def local_at_one_rank(n: int) -> bool:
    """A group of one rank: each collective is a local copy, unless MINIZERO_ONE_RANK_COLLECTIVES
    was "backend" when the process group started (torchrun --nproc-per-node 1): then it goes
    through the backend like any other, which is how one GPU exercises NCCL's path (streams,
    waits, buffers) at all. The numbers are the same either way: a sum over one rank is its
    tensor."""
    return n == 1 and not (_pg.one_rank_through_backend and is_distributed())


def _done(_) -> None:
    """One rank: the collective was a local copy, done already; no work handle."""
    return None


def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, label: str | None = None,
                           group=None, async_op: bool = False):
    """output (N*n elements) <- concatenation of every rank's `shard` (n elements), rank order."""
    n = get_world_size(group)
    assert output.numel() == shard.numel() * n, (output.numel(), shard.numel(), n)
    if local_at_one_rank(n):
        call = lambda: _done(output.copy_(shard.view_as(output)))
    else:
        gather = torch_all_gather()
        call = lambda: gather(output, shard, group=group, async_op=async_op)
    pending = _issue("all_gather", label, call, _nbytes(output), _nbytes(output) * (n - 1) // n,
                     msg_bytes=_nbytes(shard), async_op=async_op, check=(shard, (output, shard)), group=group)
    return pending if async_op else output


def reduce_scatter_tensor(output: torch.Tensor, full: torch.Tensor, label: str | None = None,
                          group=None, async_op: bool = False):
    """output (n elements) <- SUM over ranks of chunk `rank` of `full` (N*n elements)."""
    n = get_world_size(group)
    assert full.numel() == output.numel() * n, (full.numel(), output.numel(), n)
    if local_at_one_rank(n):
        call = lambda: _done(output.copy_(full.view_as(output)))
    else:
        scatter = torch_reduce_scatter()
        call = lambda: scatter(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    pending = _issue("reduce_scatter", label, call, _nbytes(full), _nbytes(full) * (n - 1) // n,
                     msg_bytes=_nbytes(full), async_op=async_op, check=(full, (output, full)), group=group)
    return pending if async_op else output


def all_reduce(tensor: torch.Tensor, op: str = "sum", label: str | None = None,
               group=None, async_op: bool = False):
    """In place. `op` is "sum" or "max" (the fp16 overflow vote uses max)."""
    n = get_world_size(group)
    call = lambda: None
    if not local_at_one_rank(n):
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        call = lambda: dist.all_reduce(tensor, op=red, group=group, async_op=async_op)
    pending = _issue("all_reduce", label, call, _nbytes(tensor), 2 * _nbytes(tensor) * (n - 1) // n,
                     async_op=async_op, check=(tensor, (tensor,)), group=group)
    return pending if async_op else tensor


def broadcast(tensor: torch.Tensor, src: int = 0, label: str | None = None, group=None) -> torch.Tensor:
    """In place: every rank's `tensor` becomes rank `src`'s."""
    n = get_world_size(group)
    call = lambda: None
    if not local_at_one_rank(n):
        call = lambda: dist.broadcast(tensor, src=src, group=group)
    _issue("broadcast", label, call, _nbytes(tensor), _nbytes(tensor) if n > 1 else 0, check=(tensor, ()), group=group)
    return tensor


# ----------------------------------------------------------------------------- host <-> device
# Offload's copies. non_blocking: on a GPU the copy is queued on the current stream like the
# collectives around it, so everything after it on that stream sees the data; the host side
# must be pinned for the copy to really run asynchronously (offload.host_empty). A CPU reading
# a d2h result must wait for the stream first (offload/host.py does, once per step).

def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer; pinned (page-locked) when asked, so device copies run asynchronously.
    torch caches pinned blocks, so a staging buffer made every step is not a new
    cudaHostAlloc every step."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def wait_for_device(device: torch.device) -> None:
    """Block the CPU until the device-to-host copies queued on the current stream are done
    (non_blocking copies into pinned memory return before the data is there)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_side_streams: dict = {}


def side_stream(device: torch.device, purpose: str):
    """A CUDA stream of its own for `purpose` on `device` (made on first use: "offload_copy",
    offload_param's prefetched copies; "replicas", HSDP's all-reduce across the replicas); None
    on a CPU, where there are no streams."""
    if device.type != "cuda":
        return None
    key = (device, purpose)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device)
    return _side_streams[key]


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, label: str | None = None) -> torch.Tensor:
    """dst (host memory) <- src (this rank's device)."""
    _issue("d2h", label, lambda: dst.copy_(src, non_blocking=True), _nbytes(src), 0)
    return dst


def copy_to_device(dst: torch.Tensor, src: torch.Tensor, label: str | None = None) -> torch.Tensor:
    """dst (this rank's device) <- src (host memory)."""
    _issue("h2d", label, lambda: dst.copy_(src, non_blocking=True), _nbytes(src), 0)
    return dst


def raise_if_any_rank_failed(err: str | None, error_type: type, label: str) -> None:
    """Collective: every rank passes its own error message (None: this rank is fine). If any
    rank failed, every rank raises `error_type` with the first failing rank's message (rank 0's
    if it failed), so rank 0, which prints, names the failure even when it happened on another
    rank, and no rank goes on into a collective a failed rank will never join. The usual case
    costs one labelled 1-element all-reduce; the messages travel only after a failure."""
    flag = torch.tensor([0.0 if err is None else 1.0], device=get_device())
    all_reduce(flag, op="max", label=label)
    if flag.item() > 0:
        raise error_type(next(e for e in all_gather_object(err) if e is not None))
