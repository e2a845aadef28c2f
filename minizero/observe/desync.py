"""Ranks out of step: a desync check before every collective, and timeouts that say which one.

When ranks issue different collectives (a module used on one rank only, a different number
of micro-steps), every rank blocks until the backend's timeout, 30 minutes by default, and
then a backend error names no module. Two guards, in `DesyncCheck`, an observer of comm.py's
collectives (`subscribe`), configured from the engine's config as it starts (docs/debugging.md):

1. *A desync check* (`MINIZERO_DEBUG_COLLECTIVES=1`, or the config's
   `minizero_collectives.check`): before each collective, every rank all-gathers a small
   fixed-size fingerprint (op, label, size, dtype, step). Both ranks of a desync reach *a*
   collective, so both reach the same-shaped check, and all raise `CollectiveMismatch`
   naming each rank's collective and step. Off, it costs nothing: no extra collective.
2. *A named timeout*: a backend error or timeout inside a wrapper is re-raised as
   `CollectiveError` naming the op, label, bytes and step this rank was waiting on. Under
   gloo the backend raises one. Under NCCL a collective returns at once and a hang never
   reaches the wrapper: NCCL's watchdog aborts the process with its own message. So with
   the check on, on a GPU, each collective is waited for on the host (`wait_named`: its
   CUDA event polled until done, or a CollectiveError after the timeout), and the
   watchdog's timeout is set WATCHDOG_MARGIN_S later, so minizero's named error comes first.

The check's own all-gather calls torch.distributed directly: it is no collective of the
step, so it is neither counted in the ledger nor announced to the observers.
"""
from __future__ import annotations

import os
import time
import zlib

import torch
import torch.distributed as dist

from .. import comm, process_group


DEBUG_ENV = "MINIZERO_DEBUG_COLLECTIVES"
# The named timeout when the config sets none: process_group.init_distributed's group timeout.
# Not shorter with the check on: a healthy rank may wait minutes for rank 0 sampling, saving
# or computing the codebook alone, and a timeout ends the run (docs/debugging.md).
DEFAULT_TIMEOUT_S = 1800.0
WATCHDOG_MARGIN_S = 60.0   # NCCL + check: the watchdog fires this long after minizero's named timeout
POLL_S = 0.0005            # how often wait_named asks whether a collective's CUDA event is done


class CollectiveError(RuntimeError):
    """A collective failed or timed out on this rank; the message names which one."""


class CollectiveMismatch(CollectiveError):
    """Ranks issued different collectives; raised on every rank with the same message."""


def debug_env() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _Guard:
    """What the wrappers need to know to check and to name a collective: the switch, and
    where the engine is (set_phase). Module state, like the ledger: one engine per process."""

    def __init__(self):
        self.check = debug_env()   # configure() may turn it on from the config too
        self.phase, self.global_step, self.micro_step = "setup", 0, 0
        self.seq = 0   # collectives issued by this rank since configure(), checked or not
        self.timeout_s = DEFAULT_TIMEOUT_S   # how long wait_named waits (NCCL with the check on)


guard = _Guard()


def configure(check: bool = False, timeout_s: float | None = None) -> None:
    """Switch the desync check on (`check`, or MINIZERO_DEBUG_COLLECTIVES=1) and set the
    collective timeout: `timeout_s`, else the group's own (init_distributed's 1800 s; with
    a group someone else started, its creator's, which minizero assumes is DEFAULT_TIMEOUT_S).

    gloo: the group's timeout is the named one (the backend raises, the check names it).
    NCCL with the check on: minizero waits for each collective itself for the timeout
    (wait_named) and moves NCCL's watchdog WATCHDOG_MARGIN_S later; with the check off the
    watchdog ends a hang after the timeout, with NCCL's message, not minizero's."""
    guard.check = bool(check) or debug_env()
    guard.seq = 0
    guard.timeout_s = float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S
    if guard.check:
        comm.subscribe(agreement, first=True)   # first: it checks before the others time the call
    else:
        comm.unsubscribe(agreement)
    if not (dist.is_available() and dist.is_initialized()):
        return
    if guard.check and dist.get_backend() == "nccl":
        set_group_timeout(guard.timeout_s + WATCHDOG_MARGIN_S)
    elif timeout_s is not None:
        set_group_timeout(float(timeout_s))


def set_group_timeout(seconds: float) -> None:
    """The collective timeout of the main group and of every group minizero made (hpZ's and
    HSDP's node groups: process_group.new_groups), from now on: gloo raises after it, NCCL's
    watchdog aborts after it (process_group.set_timeout). A node group keeping torch's
    default (10 minutes under NCCL) would end a hang there with NCCL's text, not the named line."""
    process_group.set_timeout(seconds)


def set_phase(phase: str, global_step: int, micro_step: int) -> None:
    """The engine says where it is (forward/backward/step of which step), for the messages."""
    guard.phase, guard.global_step, guard.micro_step = phase, global_step, micro_step


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.int8, torch.bool]


def where() -> str:
    return f"{guard.phase} of global step {guard.global_step}, micro-step {guard.micro_step}"


def describe(op: str, label: str | None, numel: int, dtype: torch.dtype) -> str:
    return f"{op} '{label or '-'}' ({numel} x {str(dtype).replace('torch.', '')})"


def check_agreement(op: str, label: str | None, t: torch.Tensor, group=None) -> None:
    """The ranks of `group` (default: all) all-gather (op, crc32(label), numel, dtype, steps,
    seq): 8 int64 per rank, the same shape whatever collective each rank is about to issue,
    so ranks that disagree still meet here. On disagreement the labels are exchanged (every
    rank knows, so every rank makes that call too) and every rank raises the same
    CollectiveMismatch, naming global ranks. The fingerprint goes where `t` is: a
    collective's tensor is on the rank's device. A node group's collective (hpZ, HSDP) is
    checked among that group's ranks, the only ones that issue it."""
    numel, dtype = t.numel(), t.dtype
    dt = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor([zlib.crc32(op.encode()), zlib.crc32((label or "").encode()), numel, dt,
                         guard.global_step, guard.micro_step, guard.seq, 0], dtype=torch.int64)
    n = dist.get_world_size(group)
    everyone = torch.empty(n * mine.numel(), dtype=torch.int64, device=t.device)
    comm.torch_all_gather()(everyone, mine.to(t.device), group=group)
    wait_named(t, op, label, t.numel() * t.element_size())   # a rank left alone times out here, named
    rows = everyone.view(n, -1)[:, :4].cpu()
    if bool((rows == rows[0]).all()):
        return
    infos = [None] * n
    dist.all_gather_object(infos, (dist.get_rank(), describe(op, label, numel, dtype), where(), guard.seq), group=group)
    lines = "; ".join(f"rank {r}: {d} in {w} (collective #{s} of this rank)" for r, d, w, s in infos)
    raise CollectiveMismatch(f"ranks issued different collectives: {lines}. Every rank must run the same "
                             f"modules and the same number of micro-steps (docs/debugging.md)")


class DesyncCheck:
    """comm.py's observer, always on: where the engine is (for the messages), and a backend
    error or timeout named. Copies and world size 1 are no collectives between ranks."""

    def engine_starts(self, engine) -> None:   # before the engine's first collective
        configure(engine.config.collectives.check, engine.config.collectives.timeout_s)
        set_phase("setup", 0, 0)

    def phase_begins(self, name: str, engine) -> None:
        set_phase(name, engine.global_steps, engine.micro_steps)

    def failed(self, e: RuntimeError, op: str, label: str | None, t: torch.Tensor, nbytes: int):
        if op in comm.COPIES or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return _named(e, op, label, t, nbytes)


class AgreementCheck:
    """comm.py's observer while the desync check is on (configure subscribes it): the check
    before each collective, among the ranks of the collective's group (all of them, or a node
    group's), and under NCCL each collective waited for on the host, named. Off, a
    collective pays nothing for it."""

    def begin(self, op: str, label: str | None, t: torch.Tensor, nbytes: int, group):
        if op in comm.COPIES or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return None
        try:
            check_agreement(op, label, t, group)   # a rank left alone times out here
        except CollectiveMismatch:
            raise
        except RuntimeError as e:   # gloo's timeout and connection errors; DistBackendError is one
            raise _named(e, op, label, t, nbytes) from e
        guard.seq += 1
        return (t, group)

    def end(self, token, op: str, label: str | None, nbytes: int, wire_bytes: int, msg_bytes: int) -> None:
        """A synchronous collective has returned, or an asynchronous one's wait() has: under
        NCCL + the check, block until it has really run (wait_named)."""
        if token is not None:
            wait_named(token[0], op, label, nbytes)


def wait_named(t: torch.Tensor, op: str, label: str | None, nbytes: int) -> None:
    """With the check on and `t` on a GPU: block the host until everything queued on the
    current stream so far (the collective just issued, or waited for) has run, polling a CUDA
    event, and raise a CollectiveError naming the collective after guard.timeout_s. A
    host sync per collective: debugging only. Otherwise nothing (gloo blocks and raises
    by itself; NCCL without the check leaves a hang to its watchdog)."""
    if not (guard.check and t.is_cuda):
        return
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + guard.timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise _named(RuntimeError(f"not done after {guard.timeout_s:g} s (minizero's timeout; the NCCL "
                                      f"watchdog's is {WATCHDOG_MARGIN_S:g} s later)"), op, label, t, nbytes)
        time.sleep(POLL_S)


check = DesyncCheck()
agreement = AgreementCheck()


def subscribe() -> None:
    """Watch every collective of this process (once; minizero.initialize calls it)."""
    if check not in comm.observers:
        comm.subscribe(check, first=True)   # first: the check runs before the others time the call


def _named(e: RuntimeError, op: str, label: str | None, t: torch.Tensor, nbytes: int) -> CollectiveError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    why = ("another rank issued no collective (it left the loop, or died)" if guard.check else
           f"another rank issued a different collective or none; rerun with {DEBUG_ENV}=1 to name it")
    return CollectiveError(f"rank {dist.get_rank()}: {describe(op, label, t.numel(), t.dtype)}, {nbytes} bytes, "
                           f"in {where()} did not complete: {first}. {why[0].upper()}{why[1:]} "
                           f"(docs/debugging.md)")
