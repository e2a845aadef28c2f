"""Process-group setup: one rank's place in the job, from whatever launched it.

torchrun and DeepSpeed's launcher export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; `srun` without torchrun exports SLURM_* only (mapped here); nothing at all
means one process, and then no torch.distributed call is ever made, so the same training
code runs on a laptop. Every rank's tensors live on `get_device()`: the CPU under gloo,
this rank's GPU under NCCL. `destroy()` tears the group down so that gloo's threads stop
before the interpreter does.

Besides the setup: the control traffic between ranks (`barrier`, `broadcast_object`,
`all_gather_object`: Python objects, never counted as data). The collectives themselves are
comm.py's; it re-exports these names, so callers write `comm.get_rank()`,
`comm.init_distributed()`, `comm.all_gather_object(...)`.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys

import torch
import torch.distributed as dist

from .launcher_env import launcher_rank


ONE_RANK_ENV = "MINIZERO_ONE_RANK_COLLECTIVES"   # "backend": at world size 1, still through the backend (comm.py)
one_rank_through_backend = False                # read from ONE_RANK_ENV when the group starts
ring_crosses_node: dict = {}                    # comm.sends_across_nodes' answers, per group, for this group
group_timeout_s: float | None = None            # the main group's collective timeout, when minizero knows it
made_groups: list = []                          # this rank's groups from new_groups: they follow set_timeout


class LaunchError(RuntimeError):
    """The launcher's environment cannot start a correct job; the message says what to do."""


def init_distributed(backend: str | None = None, timeout_s: float = 1800) -> None:
    """Start the default process group from the launcher's environment, if not already up.

    torchrun (and DeepSpeed's launcher) export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
    and MASTER_PORT. `srun python ...` without torchrun exports only SLURM_* variables:
    those of its step are mapped (see _from_slurm), or N processes would silently train N separate
    models into one folder. Without any of them we run as one process and never touch
    torch.distributed: every wrapper below then degenerates to a copy or a no-op, so the
    same code path trains on a laptop.

    Backend: NCCL when CUDA is available (collectives on GPU tensors), gloo otherwise.
    The rank's GPU is made current whenever NCCL is in use, also when the group was
    started by someone else (a user's own init_process_group): object collectives,
    barriers and the CUDA RNG state follow the *current* device, which is GPU 0 unless
    set, so every local rank would otherwise use GPU 0 (NCCL's duplicate-GPU error or a hang).
    """
    global one_rank_through_backend, group_timeout_s
    one_rank_through_backend = os.environ.get(ONE_RANK_ENV) == "backend"
    ring_crosses_node.clear()   # a new engine: a new topology, maybe (MINIZERO_RANKS_PER_NODE)
    if dist.is_available() and dist.is_initialized():
        if get_device().type == "cuda":
            torch.cuda.set_device(get_device())
        return
    _from_slurm()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # single process
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if backend == "nccl":
        # Pick our GPU *before* the group starts so NCCL binds to the right device, and
        # tell the group which one it is (eager NCCL init, no guessing from rank).
        device = torch.device("cuda", _cuda_index())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    # This module's functions take `group=group.WORLD` as a default argument, so importing it
    # after init (torch.optim's constructor does, through torch._dynamo) would hold the group
    # forever and destroy() could not stop its threads. Imported now, the defaults are None.
    import torch.distributed.nn.functional as _  # noqa: F401  (binds no local `torch`)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    group_timeout_s = float(timeout_s)


def launched_ranks() -> int:
    """The ranks the launcher started (its WORLD_SIZE, a bare srun's step mapped by _from_slurm
    first); 1 without a launcher. Read before any process group exists (the preflight asks)."""
    _from_slurm()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"])


def _from_slurm() -> None:
    """`srun python -m minizero.train` (no torchrun): take rank, world size and local rank
    from SLURM. The rendezvous address cannot be guessed safely from inside one task, so
    without MASTER_ADDR the job is refused with what to export.

    The ranks are the tasks of the *srun step* (SLURM_STEP_NUM_TASKS), not of the allocation:
    inside `sbatch --nodes=2 --ntasks-per-node=1` the batch script itself sees SLURM_NTASKS=2
    and SLURM_PROCID=0, and a plain `python -m minizero.train` there (or a check that
    gpu_check starts) is one process, not rank 0 of a job whose rank 1 never comes. The batch
    script is no srun step: it has no SLURM_STEP_NUM_TASKS."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    ntasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if ntasks <= 1:
        return   # one task, or no srun step at all: a single process, as without SLURM
    if "MASTER_ADDR" not in os.environ:
        raise LaunchError(f"srun started {ntasks} tasks without torchrun, and MASTER_ADDR is not set: export "
                          f"MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) and "
                          f"MASTER_PORT before srun, or launch with torchrun (launch/slurm_minizero.sbatch)")
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=str(ntasks),
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 10000))


def _cuda_index() -> int:
    """This rank's GPU among the visible ones. One visible GPU (srun --gpus-per-task=1,
    CUDA_VISIBLE_DEVICES per rank) is cuda:0 whatever LOCAL_RANK says; otherwise LOCAL_RANK."""
    n, local = torch.cuda.device_count(), get_local_rank()
    if n == 1:
        return 0
    if local >= n:
        raise LaunchError(f"LOCAL_RANK {local} but only {n} GPUs are visible on this node: start at most {n} "
                          f"ranks per node (--nproc-per-node), or give each rank one GPU")
    return local


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """The global rank; before the group starts, the launcher's (so only rank 0 reports early errors)."""
    if is_distributed():
        return dist.get_rank()
    return launcher_rank()


def get_world_size(group=None) -> int:
    """Ranks in `group` (default: all); 1 with no process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


RANKS_PER_NODE_ENV = "MINIZERO_RANKS_PER_NODE"   # pretend a topology: k consecutive ranks per "node"
HOST_ENV = "MINIZERO_HOST"   # pretend this process runs on the host of that name (a rehearsal on one machine)
# Where each launcher says how many of its ranks share a node, in the order they are believed:
# torchrun's count of the workers it started on this node, then srun's of its step's tasks
# (set also when srun chose the placement itself: `srun -N2 -n8`), then the job's request.
PER_NODE_VARS = (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


def ranks_per_node() -> int:
    """How many consecutive ranks share a node. MINIZERO_RANKS_PER_NODE says so explicitly
    (to rehearse a multi-node layout on one machine, as DeepSpeed's tests do); else the
    launcher's count of ranks on this node (PER_NODE_VARS); else all ranks are on one node.
    torchrun and srun (its default block distribution) number ranks node by node, so node n
    holds ranks [n*k, (n+1)*k). These are what the launcher says; what the hosts say is
    hosts_of_ranks(), and check_node_groups compares the two where it matters. A count that
    differs between nodes (SLURM_STEP_TASKS_PER_NODE=4,3) is refused: nodes are blocks of one size."""
    world = get_world_size()
    if world == 1:
        return 1   # one rank is one node, whatever a batch script's SLURM_NTASKS_PER_NODE asks for
    for var in PER_NODE_VARS:
        value = os.environ.get(var)
        if value:
            counts = per_node_counts(var, value)
            k = counts[0]
            if len(set(counts)) > 1:
                raise LaunchError(f"{var}={value}: the nodes hold different numbers of ranks ({counts}); minizero's "
                                  f"nodes are blocks of one size: start as many ranks on every node (srun "
                                  f"--ntasks-per-node, torchrun --nproc-per-node)")
            if k < 1 or world % k:
                raise LaunchError(f"{var}={value}: {world} ranks do not split into nodes of {k}; give a "
                                  f"divisor of the world size")
            return k
    return world


def per_node_counts(var: str, value: str) -> list[int]:
    """The ranks per node a launcher variable lists: "4" -> [4]; SLURM's "4(x2),3" -> [4, 4, 3]."""
    counts = []
    for part in value.split(","):
        n, _, times = part.strip().partition("(x")
        try:
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            raise LaunchError(f"{var}={value!r}: expected a whole number of ranks per node") from None
    return counts


def host_id() -> str:
    """This process's host, as the machine itself says: its name and boot id ("name#boot"),
    so that two machines of one name (cloned images) still differ and two processes of one
    machine never do. MINIZERO_HOST replaces it: a rehearsal of several nodes on one machine
    (tests/tools/test_preflight.py) gives each pretended node its own name. Never for a real job."""
    pretend = os.environ.get(HOST_ENV)
    if pretend:
        return pretend
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:   # not Linux: the name alone
        boot = ""
    return f"{socket.gethostname()}#{boot}" if boot else socket.gethostname()


def host_name(host: str) -> str:
    """A host_id as a reader knows the machine: its name."""
    return host.split("#")[0]


def hosts_of_ranks() -> list[str]:
    """Collective: every rank's host_id, by global rank (one all_gather_object)."""
    hosts = [None] * get_world_size()
    if is_distributed():
        dist.all_gather_object(hosts, host_id())
    else:
        hosts = [host_id()]
    return hosts


def groups_spanning_hosts(hosts: list[str], size: int) -> list[list[int]]:
    """The blocks of `size` consecutive ranks whose ranks run on more than one host."""
    groups = [list(range(i, i + size)) for i in range(0, len(hosts), size)]
    return [g for g in groups if len({hosts[r] for r in g}) > 1]


def node_groups_problem(hosts: list[str], size: int, key: str, declared: int | None = None) -> str | None:
    """The one line to say when blocks of `size` consecutive ranks (hpZ's k, HSDP's S: meant to
    be nodes) are not the nodes `hosts` (each rank's host_id) make; None when they are.
    `declared`: the launcher's ranks per node (ranks_per_node), named when the hosts disagree."""
    where: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        where.setdefault(h, []).append(r)
    counts = [len(r) for r in where.values()]
    per_host = counts[0] if len(set(counts)) == 1 else None
    said = f" ({declared} per node, the launcher says)" if declared and declared != per_host else ""
    layout = (f"{len(where)} host(s) of {per_host} ranks" if per_host else
              f"{len(where)} hosts of {'/'.join(map(str, counts))} ranks") + said
    fix = f"set {key} to the ranks of one node" + (f" ({per_host})" if per_host else "")
    if per_host and size > per_host:
        fix += f", or start {size} ranks on each node"
    spanning = groups_spanning_hosts(hosts, size)
    if spanning:
        g = spanning[0]
        names = sorted({host_name(hosts[r]) for r in g})
        more = f" (and {len(spanning) - 1} more group(s))" if len(spanning) > 1 else ""
        crosses = {"zero_hpz_partition_size": "backward's all-gathers",
                   "hsdp_shard_size": "all-gathers and reduce-scatters"}.get(key, "collectives")
        placed = "" if all(where[h] == list(range(where[h][0], where[h][0] + len(where[h]))) for h in where) else             "; the ranks are not placed node by node (srun --distribution=block)"
        return (f"{key} {size}: ranks {g[0]}-{g[-1]}, one node group, run on {len(names)} hosts "
                f"({', '.join(names[:3])}){more}, on {layout}: its {crosses} cross nodes every step, the same "
                f"numbers only slower; {fix}{placed}")
    if per_host and size != per_host:
        return (f"{key} {size} on {layout}: {per_host // size} groups share each node; {fix} to shard over "
                f"the whole node")
    return None


def check_node_groups(size: int, key: str) -> str | None:
    """Collective, where node groups are made (sharding.for_config): warn in one line (rank 0,
    the "minizero" logger) when blocks of `size` consecutive ranks would span hosts or differ
    from the ranks per host, read from the hosts themselves (hosts_of_ranks). A warning, not a
    refusal: a group across hosts computes the same numbers, only its collectives cross the
    slow link (and the ledger's inter-node bytes, which assume blocks, are then off). Under
    MINIZERO_RANKS_PER_NODE alone the nodes are the pretended ones, and nothing is gathered.
    Returns the line (None: nothing to say)."""
    world = get_world_size()
    if size <= 1 or world == 1:
        return None
    if os.environ.get(RANKS_PER_NODE_ENV) and not os.environ.get(HOST_ENV):
        k = ranks_per_node()
        hosts = [f"pretended node {r // k}" for r in range(world)]
    else:
        hosts = hosts_of_ranks()
    line = node_groups_problem(hosts, size, key, ranks_per_node())
    if line and get_rank() == 0:
        logging.getLogger("minizero").warning(line)
    return line


def main_group_timeout() -> float | None:
    """The main group's collective timeout in seconds: the one minizero gave it (init_distributed,
    set_timeout), else what the group says (a group the user started), else None (torch's default)."""
    if group_timeout_s is not None or not is_distributed():
        return group_timeout_s
    main = dist.group.WORLD
    try:   # no public getter in torch: the backend's options hold it
        return main._get_backend(get_device()).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def new_groups(ranks_per_group: list[list[int]]):
    """Process groups of the given ranks, made on every rank in the same order (a collective),
    this rank's returned. Collectives on it run among its ranks only, in their order. Each gets
    the main group's timeout (torch would give a new group its backend's default: 10 minutes
    under NCCL, whose watchdog would then end a hang in a node group with its own text before
    minizero's named one), and follows set_timeout from then on."""
    timeout = main_group_timeout()
    kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
    mine, _ = dist.new_subgroups_by_enumeration(ranks_per_group, **kwargs)
    if mine is not None:
        made_groups.append(mine)
    return mine


def set_timeout(seconds: float) -> None:
    """Every collective of the main group and of every group new_groups made, from now on, times
    out after `seconds` (gloo raises; NCCL's watchdog aborts). torch.distributed.set_timeout is
    the public call from torch 2.14 on; before it the same thing is distributed_c10d._set_pg_timeout,
    which sets each of a group's backends' timeout (2.14 keeps it as a deprecated alias).
    Under gloo the new timeout reaches the collectives from torch 2.10 on."""
    global group_timeout_s
    timeout = datetime.timedelta(seconds=seconds)
    if hasattr(dist, "set_timeout"):
        setter = dist.set_timeout
    else:
        from torch.distributed import distributed_c10d
        setter = distributed_c10d._set_pg_timeout
    for group in [None, *made_groups]:
        setter(timeout, group)
    group_timeout_s = float(seconds)


def node_of(rank: int) -> int:
    """The node a global rank runs on (ranks_per_node: consecutive ranks per node)."""
    return rank // ranks_per_node()


def get_device() -> torch.device:
    """Where this rank's tensors live, and every tensor handed to a collective with them.

    It follows the backend actually in use: a gloo group (a CPU run, even on a machine with
    GPUs) keeps everything on the CPU; NCCL, or one process on a GPU
    machine, uses this rank's GPU among the visible ones."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if is_distributed() and dist.get_backend() != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", _cuda_index())


def free_port() -> int:
    """A TCP port free on this host right now, for MASTER_PORT of a single-host launch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_object(obj, src: int = 0):
    """A picklable Python object from `src` to every rank (not counted: it is control, not data)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's picklable `obj`, in rank order (control traffic, not counted)."""
    if get_world_size() == 1:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def destroy() -> None:
    """Tear the group down and stop its threads; on a clean exit, every rank together.

    Why (without it, a crash at exit in about one launch in 30): gloo runs each collective on a
    worker thread, which lets go of the collective's tensors a moment *after* the caller
    has its result. If the tensors' Python objects are gone by then, letting go needs the
    GIL, and during interpreter shutdown CPython ends the thread inside that C++ destructor:
    SIGABRT, "terminate called without an active exception", after a run that wrote its files.

    - Freeing the group joins those threads here, while Python is whole (torch releases the
      GIL in that destructor, so a worker waiting for it finishes). It is freed only if
      nothing else holds it: see the import in init_distributed. DeepSpeed keeps references
      of its own, so under the reference run the threads live on.
    - The barrier: no rank tears the group down while another still uses it, and every rank
      sleeps with the GIL released after all its earlier collectives, which lets workers
      whose group is still held elsewhere finish too (the barrier's own tensor is made in C++).
      Skipped while an exception propagates (or is handled): another rank may be gone or
      stuck in a collective, and waiting for it would hang this one.

    launch/stress_exit.sh counts clean exits over many launches.
    """
    global group_timeout_s
    if not is_distributed():
        return
    if sys.exc_info()[0] is None:
        dist.barrier()
    dist.destroy_process_group()
    ring_crosses_node.clear()
    made_groups.clear()
    group_timeout_s = None


def single_host_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would export to rank `rank` of a one-host job, for processes
    a script spawns itself (runtime/spawn.py)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
