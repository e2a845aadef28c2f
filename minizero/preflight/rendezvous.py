"""Before the process group exists: can this rank reach the rendezvous, did every rank come,
and a watchdog for the waits that cannot be polled.

A job's ranks first meet in a key-value store (torch's TCPStore) at MASTER_ADDR:MASTER_PORT:
torchrun's own, which its rendezvous already joined, or, under a bare `srun`, one that rank 0
opens. Then the backend connects every rank to every other (gloo's TCP mesh, NCCL's rings),
each on an interface it picks. Each step can wait in silence: a store nobody opened, a rank
that never came, an interface the other node cannot reach. So here:

- `check_endpoint`: the store's name resolves and something answers there (a rank that opens
  it itself has nothing to ask);
- `join`: every rank writes what it knows about itself (host, launcher variables, GPU) under
  its own key, and waits, polling, until every rank's key is there or the timeout says which
  are missing: the store alone, before any backend connects;
- `Watchdog`: a thread that, when a blocking call (a backend connecting, a collective) has
  not returned in time, prints the one line naming it and ends the process.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

PREFIX = "minizero_preflight"


def say(line: str) -> None:
    print(f"preflight: {line}", flush=True)


def resolve(host: str) -> str | None:
    """The first address `host` resolves to here; None when it does not."""
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (socket.gaierror, UnicodeError, OSError):
        return None


def answers(host: str, port: int, seconds: float) -> str | None:
    """None when a TCP connection to host:port opens within `seconds` (retried: the node
    hosting it may start a moment later); else why not, the last error's words."""
    deadline, why = time.monotonic() + seconds, "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(seconds, 0.1))):
                return None
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.5)


def check_endpoint(host: str, port: int, seconds: float, what: str, fix: str) -> str | None:
    """The one line to say when this node cannot reach the rendezvous at host:port, else None.
    `what` names where the address came from (MASTER_ADDR, --rdzv-endpoint), `fix` what to change."""
    if resolve(host) is None:
        return (f"rendezvous: {what} {host} does not resolve on this node ({socket.gethostname()}): {fix} (a name "
                f"every node resolves, or the first node's address)")
    why = answers(host, port, seconds)
    if why is not None:
        return (f"rendezvous: nothing answers at {host}:{port} ({what}) from {socket.gethostname()} after "
                f"{seconds:g} s ({why}): start the same line on that node first, check that the port is open "
                f"between the nodes, or {fix}")
    return None


class Watchdog:
    """One thread per process. `arm(seconds, line)` before a call that may block for good,
    `disarm()` after it; if the time runs out first, `line()` (a function: it may read what is
    known by then) is printed, on the node's first rank only, and the process exits 1 at once
    (os._exit: a thread stuck in the backend would hold a normal exit forever)."""

    def __init__(self, speak: bool):
        self.speak = speak
        self._deadline, self._line = None, None
        self._cv = threading.Condition()
        threading.Thread(target=self._watch, name="preflight-watchdog", daemon=True).start()

    def arm(self, seconds: float, line) -> None:
        with self._cv:
            self._deadline, self._line = time.monotonic() + seconds, line
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._deadline, self._line = None, None
            self._cv.notify()

    def _watch(self) -> None:
        with self._cv:
            while True:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                if self.speak:
                    try:
                        say(self._line())
                    except Exception as e:   # the line itself failed: still one line, still exit
                        say(f"a wait timed out ({type(e).__name__} while describing it)")
                sys.stdout.flush()
                os._exit(1)


def launcher_facts() -> dict:
    """What this rank's launcher and machine say about it, before any collective."""
    from minizero import process_group
    facts = {"host": process_group.host_id(), "pid": os.getpid(), "local_rank": process_group.get_local_rank(),
             "cwd": os.getcwd(), "vars": {v: os.environ[v] for v in process_group.PER_NODE_VARS if v in os.environ}}
    for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"):
        if v in os.environ:
            facts["vars"][v] = os.environ[v]
    facts["address"] = resolve(socket.gethostname())   # what gloo binds to, unless GLOO_SOCKET_IFNAME says otherwise
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        n = 0
    facts["gpus"] = n
    if n:
        index = 0 if n == 1 else facts["local_rank"]
        if index < n:
            props = torch.cuda.get_device_properties(index)
            facts["gpu"] = {"index": index, "name": props.name, "uuid": str(getattr(props, "uuid", index))}
    return facts


def open_store(rank: int, world: int, seconds: float):
    """The job's rendezvous store at MASTER_ADDR:MASTER_PORT: torchrun's (its agents opened
    it; TORCHELASTIC_USE_AGENT_STORE), else rank 0 opens it (a bare srun, a hand-made launch).
    A client whose store never opens raises after `seconds`."""
    import torch.distributed as dist
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return dist.TCPStore(host, port, world_size=None if agent else world, is_master=rank == 0 and not agent,
                         timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False)


def run_key() -> str:
    """A name for this launch inside a store that may outlive it (torchrun's, across restarts)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID", "local")
    return f"{PREFIX}/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', os.environ.get('SLURM_STEP_ID', '0'))}"


def join(store, rank: int, world: int, facts: dict, seconds: float) -> tuple[list | None, list[int]]:
    """Every rank posts its facts and waits for all; (facts by rank, []) when all came within
    `seconds`, else (None, the missing ranks). Polled, so the answer comes on time."""
    key = run_key()
    store.set(f"{key}/rank{rank}", json.dumps(facts))
    names = [f"{key}/rank{r}" for r in range(world)]
    deadline = time.monotonic() + seconds
    while True:
        missing = [r for r, k in enumerate(names) if not store.check([k])]
        if not missing:
            return [json.loads(store.get(k)) for k in names], []
        if time.monotonic() >= deadline:
            return None, missing
        time.sleep(0.1)


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
