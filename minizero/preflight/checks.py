"""The preflight's checks, each returning its one line: (status, text), status "ok", "warn"
or "FAIL". Two kinds:

- from the facts every rank posted at the rendezvous (rendezvous.join), computed on any rank
  without a collective: `hosts`, `gpus`, `config`;
- collectives over the job's ranks, each rank calling the same functions in the same order:
  `collectives` and `bandwidth` on the job's backend, and the file-system probes (`folder_probe`,
  `data`, `disk`), where the first rank of each host works and the others only take part in the
  exchange (all_gather_object on the CPU group).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid

import torch
import torch.distributed as dist

from minizero import process_group
from minizero.checkpoint_files.shared_folder import look_again
from minizero.preflight import command
from minizero.preflight.rendezvous import ranks_text
from minizero.train import rundir

OK, WARN, FAIL = "ok", "warn", "FAIL"


# ----------------------------------------------------------------------------- from the facts

def layout(facts: list[dict]) -> dict[str, list[int]]:
    """host_id -> its ranks, hosts in the order of their first rank."""
    where: dict[str, list[int]] = {}
    for r, f in enumerate(facts):
        where.setdefault(f["host"], []).append(r)
    return where


def hosts_line(where: dict) -> str:
    return "; ".join(f"{process_group.host_name(h)}: ranks {ranks_text(r)}" for h, r in list(where.items())[:4]) + \
        (f"; and {len(where) - 4} more hosts" if len(where) > 4 else "")


FIX = {"LOCAL_WORLD_SIZE": "torchrun --nproc-per-node, one torchrun per node (srun --ntasks-per-node=1)",
       "SLURM_STEP_TASKS_PER_NODE": "srun --ntasks-per-node",
       "SLURM_NTASKS_PER_NODE": "sbatch/srun --ntasks-per-node",
       process_group.RANKS_PER_NODE_ENV: f"unset {process_group.RANKS_PER_NODE_ENV}: it pretends a topology"}


def hosts(facts: list[dict], node_group) -> tuple[str, str]:
    """Which ranks share a host (each rank's own host_id), against what the launcher said
    (process_group.PER_NODE_VARS, as each rank saw them) and hpZ's k or HSDP's S. A node group
    that spans hosts fails (it is what the config asks for, and the job would not get it); the
    launcher's count against the hosts' only warns (minizero's node accounting would be off)."""
    where = layout(facts)
    counts = [len(r) for r in where.values()]
    per_host = counts[0] if len(set(counts)) == 1 else None
    text = hosts_line(where)
    sizes = f"{len(where)} host(s) of {per_host} ranks" if per_host else \
        f"{len(where)} hosts of {'/'.join(map(str, counts))} ranks"
    key, size = node_group if node_group and node_group[1] > 1 else (None, 0)
    if key:
        line = process_group.node_groups_problem([f["host"] for f in facts], size, key, per_host)
        if line:
            spans = process_group.groups_spanning_hosts([f["host"] for f in facts], size)
            return (FAIL if spans else WARN), f"hosts: {text}; {line}"
    if not all(r == list(range(r[0], r[0] + len(r))) for r in where.values()):
        return WARN, (f"hosts: {text}: ranks are not placed node by node, so minizero's nodes (blocks of consecutive "
                      f"ranks) are not the hosts and its inter-node byte counts are off: launch with torchrun "
                      f"(one per node), or srun --distribution=block")
    if per_host is None:
        return WARN, (f"hosts: {text}: the hosts hold different numbers of ranks ({'/'.join(map(str, counts))}); "
                      f"start as many on every node (torchrun --nproc-per-node, srun --ntasks-per-node)")
    for var in process_group.PER_NODE_VARS:
        seen = {f["vars"].get(var) for f in facts} - {None}
        if not seen:
            continue
        said = sorted({c for v in seen for c in process_group.per_node_counts(var, v)})
        if said != [per_host]:
            return WARN, (f"hosts: {text} ({per_host} per host), but {var}={', '.join(sorted(seen))} says "
                          f"{said[0]} per node, and minizero counts inter-node bytes by it: start {per_host} ranks "
                          f"per node as the hosts have them ({FIX[var]}); in a rehearsal on one machine, "
                          f"{process_group.HOST_ENV} names each pretended host")
        break
    group = f"; {key} {size}: each node group is one host" if key else ", as the launcher says"
    return OK, f"hosts: {sizes} ({text}){group}"


def gpus(facts: list[dict], backend: str) -> tuple[str, str] | None:
    """Under NCCL: every rank has a GPU of its own. None on CPUs."""
    if backend != "nccl":
        return None
    where = layout(facts)
    for host, ranks in where.items():
        name = process_group.host_name(host)
        without = [r for r in ranks if "gpu" not in facts[r]]
        if without:
            n = facts[without[0]]["gpus"]
            return FAIL, (f"GPUs: host {name} shows {n} GPU(s) to rank(s) {ranks_text(without)} (LOCAL_RANK "
                          f"{facts[without[0]]['local_rank']}): start at most {n} ranks per node (--nproc-per-node "
                          f"{n}), or give each rank one GPU (CUDA_VISIBLE_DEVICES)")
        seen: dict[str, int] = {}
        for r in ranks:
            uid = facts[r]["gpu"]["uuid"]
            if uid in seen:
                return FAIL, (f"GPUs: ranks {seen[uid]} and {r} would share GPU {facts[r]['gpu']['index']} of host "
                              f"{name}: start one torchrun per node (srun --ntasks-per-node=1) with --nproc-per-node "
                              f"at most the node's GPUs")
            seen[uid] = r
    names = sorted({f["gpu"]["name"] for f in facts})
    return OK, f"GPUs: one per rank, {len(facts)} in all ({', '.join(names)})"


def config(plan) -> tuple[str, str]:
    if plan.config_error:
        return FAIL, f"config: {plan.config_error}"
    group = f", {plan.node_group[0]} {plan.node_group[1]}" if plan.node_group else ""
    return OK, f"config: ZeRO-{plan.stage} {plan.dtype}{group} over {plan.world} ranks; minizero accepts it"


# ----------------------------------------------------------------------------- collectives

def collectives(group, device, backend: str, world: int) -> tuple[str, str]:
    """all_reduce, all_gather and reduce_scatter over every rank on the job's backend, each
    checked against its known answer on every rank; the verdicts gathered."""
    from minizero import comm
    rank = dist.get_rank()
    bad = []
    x = torch.full((8,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)
    if not bool((x == world * (world + 1) / 2).all()):
        bad.append("all_reduce")
    out = torch.empty(4 * world, device=device)
    comm.torch_all_gather()(out, torch.full((4,), float(rank), device=device), group=group)
    if not torch.equal(out.view(world, 4), torch.arange(world, device=device, dtype=out.dtype).repeat_interleave(4)
                       .view(world, 4)):
        bad.append("all_gather")
    full = torch.arange(4 * world, device=device, dtype=torch.float32) + rank
    mine = torch.empty(4, device=device)
    comm.torch_reduce_scatter()(mine, full, group=group)
    want = world * torch.arange(4 * rank, 4 * rank + 4, device=device, dtype=torch.float32) + world * (world - 1) / 2
    if not torch.equal(mine, want):
        bad.append("reduce_scatter")
    if device.type == "cuda":
        torch.cuda.synchronize()
    verdicts = [None] * world
    dist.all_gather_object(verdicts, bad)
    wrong = {r: v for r, v in enumerate(verdicts) if v}
    if wrong:
        r, ops = next(iter(wrong.items()))
        return FAIL, (f"collectives: {', '.join(ops)} over {world} ranks on {backend} gave wrong numbers on rank(s) "
                      f"{ranks_text(sorted(wrong))} (rank {r}): a broken GPU, driver or network path; rerun with "
                      f"NCCL_DEBUG=INFO to see which")
    return OK, f"collectives: all_reduce, all_gather and reduce_scatter over {world} ranks on {backend}: right numbers"


def node_group_collectives(node_group, group, device, backend: str, world: int, timeout_s: float):
    """hpZ's or HSDP's collectives as their engine runs them: two in flight at once on two
    process groups that share ranks, each checked against its known answer. hpZ: a gather
    inside the node (from the secondary shard) beside a reduce-scatter over all ranks; HSDP:
    the reduce-scatter inside the node beside the all-reduce among the replicas of a shard.
    NCCL runs each group on its own stream, so the two overlap on the GPU as in a step; a pair
    that deadlocks ends in the watchdog's line. None without node groups."""
    from minizero import comm
    if not node_group or not 1 < node_group[1] < world or world % node_group[1]:
        return None
    key, k = node_group
    timeout = {"timeout": __import__("datetime").timedelta(seconds=timeout_s)}
    rank = dist.get_rank()
    node, _ = dist.new_subgroups_by_enumeration([list(range(i, i + k)) for i in range(0, world, k)],
                                                backend=backend, **timeout)
    first = rank // k * k
    bad = []
    if key == "hsdp_shard_size":
        replicas, _ = dist.new_subgroups_by_enumeration([list(range(j, world, k)) for j in range(k)],
                                                        backend=backend, **timeout)
        shard = torch.empty(4, device=device)
        a = comm.torch_reduce_scatter()(shard, torch.arange(4 * k, device=device, dtype=torch.float32) + rank,
                                        group=node, async_op=True)
        x = torch.full((8,), float(rank), device=device)
        b = dist.all_reduce(x, group=replicas, async_op=True)
        a.wait()
        b.wait()
        i = rank - first
        if not torch.equal(shard, k * torch.arange(4 * i, 4 * i + 4, device=device, dtype=torch.float32)
                           + sum(range(first, first + k))):
            bad.append("reduce_scatter in the node")
        if not bool((x == sum(range(rank % k, world, k))).all()):
            bad.append("all_reduce among the replicas")
        what = "HSDP's reduce-scatter in the node beside the replicas' all-reduce"
    else:
        gathered = torch.empty(4 * k, device=device)
        a = comm.torch_all_gather()(gathered, torch.full((4,), float(rank), device=device), group=node,
                                    async_op=True)
        mine = torch.empty(4, device=device)
        b = comm.torch_reduce_scatter()(mine, torch.arange(4 * world, device=device, dtype=torch.float32) + rank,
                                        group=group, async_op=True)
        a.wait()
        b.wait()
        if not torch.equal(gathered, torch.arange(first, first + k, device=device, dtype=torch.float32)
                           .repeat_interleave(4)):
            bad.append("all_gather in the node")
        if not torch.equal(mine, world * torch.arange(4 * rank, 4 * rank + 4, device=device, dtype=torch.float32)
                           + world * (world - 1) / 2):
            bad.append("reduce_scatter over all ranks")
        what = "hpZ's all-gather in the node beside a reduce-scatter over all ranks"
    if device.type == "cuda":
        torch.cuda.synchronize()
    wrong = {r: v for r, v in enumerate(exchange(bad)) if v}
    if wrong:
        ops = next(iter(wrong.values()))
        return FAIL, (f"node groups: {key} {k}: {', '.join(ops)} gave wrong numbers on rank(s) "
                      f"{ranks_text(sorted(wrong))} with {what} in flight: rerun with NCCL_DEBUG=INFO")
    return OK, f"node groups: {key} {k}: {what}, both in flight on {backend}: right numbers"


def bandwidth(where: dict, backend: str, device, nbytes: int, timeout_s: float) -> tuple[str, str]:
    """All-reduce bus bandwidth (nccl-tests' busbw: bytes x 2(n-1)/n / time) inside a node (each
    host's ranks together, all hosts at once) and between nodes (the ranks of one local index,
    one per host, all indices at once: every node's links busy, as HSDP's replica all-reduce
    keeps them). The slowest rank's time of the median of a few repetitions counts."""
    hosts = list(where.values())
    inside = [r for r in hosts if len(r) > 1]
    width = max(len(r) for r in hosts)
    across = [[r[i] for r in hosts if i < len(r)] for i in range(width)]
    across = [g for g in across if len(g) > 1]
    timeout = {"timeout": __import__("datetime").timedelta(seconds=timeout_s)}
    parts = []
    for what, groups in (("inside a node", inside), ("between nodes", across)):
        if not groups:
            parts.append(f"{what}: -" + (" (one rank per node)" if what == "inside a node" else " (one node)"))
            continue
        mine, _ = dist.new_subgroups_by_enumeration(groups, backend=backend, **timeout)
        n = max(len(g) for g in groups)
        seconds = time_all_reduce(mine, device, nbytes) if mine is not None else 0.0
        slowest = [0.0] * dist.get_world_size()
        dist.all_gather_object(slowest, seconds)
        t = max(slowest)
        parts.append(f"{what} {command.rate(nbytes * 2 * (n - 1) / n, t)} ({n} ranks)")
    return OK, f"bandwidth: all_reduce of {nbytes / 2 ** 20:g} MiB, bus bandwidth {'; '.join(parts)} on {backend}"


def time_all_reduce(group, device, nbytes: int, reps: int = 3) -> float:
    x = torch.ones(max(nbytes // 4, 1), device=device)
    times = []
    for i in range(reps + 1):   # the first warms the connection up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- files

def probe_folder(path: str) -> str:
    """The folder a probe goes into: `path` if it exists, else its deepest existing parent
    (the job creates the rest)."""
    full = os.path.abspath(path)
    while not os.path.isdir(full) and os.path.dirname(full) != full:
        full = os.path.dirname(full)
    return full


def exchange(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class FolderProbe:
    """Is `path` one folder on every host, and writable there? The first rank of each host
    writes a file named for its host into it (the path as that host's command line and
    working directory make it), then, once all have written,
    looks for every other host's file (re-reading the folder for up to `wait_s`, a shared file
    system's cache: shared_folder.look_again) and reads who wrote it. Two collectives: `write`
    early, `read` late, so a slow file system has the time in between."""

    def __init__(self, path: str, where: dict, wait_s: float):
        self.where, self.wait_s = where, wait_s
        self.rank = dist.get_rank()
        self.host_index = next(i for i, r in enumerate(where.values()) if self.rank in r)
        self.leader = self.rank == list(where.values())[self.host_index][0]
        self.path = path   # as this node's command line names it: the job's ranks will use the same
        self.token = exchange(uuid.uuid4().hex[:12] if self.rank == 0 else None)[0]
        self.written: list = []

    def name(self, host_index: int) -> str:
        return os.path.join(self.path, f".minizero-preflight-{self.token}-{host_index}")

    def write(self) -> None:
        why = None
        if self.leader:
            try:
                with open(self.name(self.host_index), "w") as f:
                    f.write(f"{self.token} {self.host_index}\n")
            except OSError as e:
                why = f"{type(e).__name__}: {e.strerror or e}"
        self.written = exchange((self.host_index, why, self.path) if self.leader else None)

    def read(self) -> dict:
        """{host index: (why it could not write or None, [host indices whose file it saw])}."""
        seen = None
        if self.leader:
            seen = []
            for other, why, _ in (w for w in self.written if w is not None):
                if other == self.host_index or why is not None:
                    continue
                path = self.name(other)
                if look_again(path, os.path.isfile, self.wait_s):
                    try:
                        with open(path) as f:
                            if f.read().split() == [self.token, str(other)]:
                                seen.append(other)
                    except OSError:
                        pass
        result = exchange(seen)
        if self.leader:
            try:
                os.remove(self.name(self.host_index))
            except OSError:
                pass
        wrote = {i: why for i, why, _ in (w for w in self.written if w is not None)}
        return {i: (wrote.get(i), result[r[0]]) for i, r in enumerate(self.where.values())}

    def path_of(self, host_index: int) -> str:
        return next(p for i, _, p in (w for w in self.written if w is not None) if i == host_index)


def save_folder(probe: FolderProbe, seen: dict, save_dir: str, resume: str | None) -> tuple[str, str]:
    names = [process_group.host_name(h) for h in probe.where]
    unwritable = {i: why for i, (why, _) in seen.items() if why}
    if unwritable:
        i, why = next(iter(unwritable.items()))
        return FAIL, (f"save folder: {probe.path} is not writable on host {names[i]} ({why}): pass a --save-dir "
                      f"under a folder this user can write on every node")
    blind = [(i, j) for i, (_, saw) in seen.items() for j in seen if j != i and j not in saw]
    if blind:
        i, j = blind[0]
        theirs = probe.path_of(j)
        into = "its folder of that name" if theirs == probe.path_of(i) else theirs
        return FAIL, (f"save folder: host {names[i]} does not see in {probe.path_of(i)} the file host {names[j]} wrote "
                      f"into {into} (after {probe.wait_s:g} s of re-reading): not one folder on every node (a node-local "
                      f"disk under the same path?); every rank writes its shard into --save-dir, so give it a folder "
                      f"on a file system every node mounts")
    if not resume and rundir.previous_run(save_dir):
        return WARN, (f"save folder: {save_dir} already holds a run: the job would refuse it; pass a new --save-dir, "
                      f"--resume {save_dir}, or --overwrite")
    where = f" (to be created under {probe.path})" if os.path.abspath(save_dir) != probe.path else ""
    return OK, f"save folder: {save_dir}{where}: one folder on all {len(names)} host(s), writable"


def data(dataset: str, data_dir: str, resume: str | None, where: dict) -> list[tuple[str, str]]:
    """On each host (its first rank): is the dataset there, and the checkpoint --resume names?"""
    rank = dist.get_rank()
    leader = any(r[0] == rank for r in where.values())
    mine = None
    if leader:
        cifar = os.path.join(data_dir, "cifar-10-batches-py")
        have = all(os.path.isfile(os.path.join(cifar, f)) and os.path.getsize(os.path.join(cifar, f)) > 0
                   for f in command.CIFAR_FILES)
        tarball = os.path.isfile(os.path.join(data_dir, "cifar-10-python.tar.gz"))
        latest = os.path.isfile(os.path.join(resume, "latest")) if resume else None
        mine = (have or tarball, latest)
    seen = exchange(mine)
    names = [process_group.host_name(h) for h in where]
    per_host = [seen[r[0]] for r in where.values()]
    lines = []
    if dataset == "synthetic":
        lines.append((OK, "data: --dataset synthetic: made in memory on every rank, nothing to read"))
    else:
        have = [n for n, (ok, _) in zip(names, per_host) if ok]
        lacking = [n for n, (ok, _) in zip(names, per_host) if not ok]
        fetch = (f"fetch it once where the network is (a login node) into a folder every node mounts: python -c "
                 f"\"from torchvision.datasets import CIFAR10; CIFAR10('{os.path.abspath(data_dir)}', download=True)\"")
        if not lacking:
            lines.append((OK, f"data: CIFAR-10 in {data_dir} on all {len(names)} host(s)"))
        elif have:
            lines.append((FAIL, f"data: CIFAR-10 is missing from {data_dir} on host(s) {', '.join(lacking[:4])} "
                                f"(there on {', '.join(have[:4])}): every rank reads --data-dir, so it must be one "
                                f"folder every node mounts; {fetch}"))
        else:
            lines.append((WARN, f"data: CIFAR-10 is not in {data_dir} on any host: rank 0 would download it, and "
                                f"compute nodes are often offline; {fetch}, or train with --dataset synthetic"))
    if resume:
        lacking = [n for n, (_, latest) in zip(names, per_host) if not latest]
        if lacking:
            lines.append((FAIL, f"resume: {resume}/latest is missing on host(s) {', '.join(lacking[:4])}: --resume "
                                f"must name a checkpoint folder every node sees (a shared file system)"))
        else:
            lines.append((OK, f"resume: {resume}/latest is there on every host"))
    return lines


def disk(probe: FolderProbe, plan) -> tuple[str, str]:
    """Free space where the checkpoints go (each host's view of the save folder) against the
    bytes the run writes: one checkpoint (command.checkpoint_bytes) times how many it keeps."""
    free = None
    if probe.leader:
        try:
            free = shutil.disk_usage(probe.path).free
        except OSError:
            free = None
    frees = [f for f in exchange(free) if f is not None]
    need = plan.checkpoint_bytes * plan.checkpoints
    what = (f"a checkpoint of {plan.model} ({plan.params:,} parameters, ZeRO-{plan.stage} {plan.dtype} over "
            f"{plan.world} ranks) is {command.human(plan.checkpoint_bytes)}"
            + (f", {plan.checkpoints} of them {command.human(need)}" if plan.checkpoints > 1 else ""))
    if not frees:
        return WARN, f"disk: free space in {probe.path} could not be read; {what}"
    least = min(frees)
    if least < need:
        return FAIL, (f"disk: {command.human(least)} free in {probe.path}, but {what}: free space there, save less "
                      f"often (--save-every), or give --save-dir a larger file system")
    return OK, f"disk: {command.human(least)} free in {probe.path}; {what}"
