"""One rank of the preflight: the checks in the order they can run, and the report.

Order, each step bounded by --timeout:
1. the rendezvous store answers (rendezvous.check_endpoint), every rank joins through it
   (rendezvous.join), each with its facts: from these alone, before any backend connects,
   `hosts`, `GPUs` and `config` are judged, so two ranks on one GPU are named before NCCL
   would fail on them;
2. a gloo group over every rank (the CPU side: the exchanges below), watched: a gloo that
   cannot connect the nodes ends in a line naming GLOO_SOCKET_IFNAME;
3. the save-folder probe is written, then the job's backend (NCCL on GPUs) is tried with
   each collective, with hpZ's or HSDP's pair of collectives in flight at once on two groups,
   and timed, watched: an NCCL that cannot connect ends in a line naming NCCL_SOCKET_IFNAME
   and NCCL_DEBUG=INFO;
4. the probe is read back on every host, the data looked for, the disk measured.

Rank 0 prints each line as soon as it is known (a later hang still leaves the earlier lines),
then one summary; every rank exits 1 if any line FAILed. A watchdog line comes from the first
rank of each node: a node's own log then says what its node waited for.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time

from minizero.preflight import command
from minizero.preflight.launch import STARTED_ENV
from minizero.preflight.rendezvous import Watchdog, check_endpoint, join, launcher_facts, open_store, ranks_text, \
    run_key, say

SILENT_PAUSE_S = 3.0   # a rank that fails quietly waits this long, so that its node's first rank is heard first


class Report:
    """The lines, printed by rank 0 as they come, and the verdict."""

    def __init__(self, speak: bool):
        self.speak, self.lines = speak, []

    def add(self, status: str, text: str) -> None:
        self.lines.append((status, text))
        if self.speak:
            say(f"{status:<4} {text}")

    def extend(self, lines) -> None:
        for line in lines:
            if line is not None:
                self.add(*line)

    def failed(self) -> bool:
        return any(s == "FAIL" for s, _ in self.lines)

    def summary(self, seconds: float) -> None:
        n = {s: sum(x == s for x, _ in self.lines) for s in ("ok", "warn", "FAIL")}
        counts = f"{n['ok']} ok, {n['warn']} warn, {n['FAIL']} FAIL in {seconds:.1f} s"
        if self.speak:
            say(f"{counts}: fix the FAIL lines, then run the preflight again" if n["FAIL"] else
                f"{counts}: start the job (the same line with -m minizero.train)")


def endpoint_fix(agent: bool) -> str:
    return ("give every node's torchrun the same --rdzv-endpoint" if agent else
            "export MASTER_ADDR (the first node's name as every node resolves it) and MASTER_PORT before srun")


def gloo_stuck(facts: list, seconds: float) -> str:
    loop = sorted({f["address"] for f in facts if (f.get("address") or "").startswith("127.")})
    hint = (f"; this host's name resolves to {loop[0]} (/etc/hosts), where no other node can reach it"
            if loop and len({f['host'] for f in facts}) > 1 else "")
    return (f"backend: gloo did not connect the {len(facts)} ranks within {seconds:g} s (they did meet in the "
            f"rendezvous store){hint}: set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on "
            f"(ip -br addr), the same on every node")


def nccl_stuck(what: str, facts: list, seconds: float) -> str:
    hosts = sorted({f["host"].split("#")[0] for f in facts})
    return (f"collectives: {what} on nccl did not finish within {seconds:g} s over {len(facts)} ranks on "
            f"{len(hosts)} host(s): NCCL could not connect them; set NCCL_SOCKET_IFNAME to the interface the "
            f"nodes reach each other on (ip -br addr), and rerun with NCCL_DEBUG=INFO to see where it stops")


def pair_stuck(node_group, backend: str, world: int, seconds: float) -> str:
    return (f"node groups: {node_group[0]} {node_group[1]}: its two collectives in flight at once on {backend} did not "
            f"finish within {seconds:g} s over {world} ranks, though each kind finished alone just before: the job "
            f"would hang the same way in its first step; rerun with NCCL_DEBUG=INFO to see which waits, and run "
            f"plain ZeRO-3 (no {node_group[0]}) meanwhile")


def main(argv=None) -> int:
    t0 = time.monotonic()
    if os.environ.get(STARTED_ENV):   # launch.py watches for it: torchrun's rendezvous is over
        open(os.environ[STARTED_ENV], "a").close()
    parser, args = command.parse(argv)
    from minizero import process_group
    try:
        world = process_group.launched_ranks()
    except process_group.LaunchError as e:
        say(f"FAIL rendezvous: {e}")
        return 1
    rank = int(os.environ.get("RANK", "0"))
    first_of_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    report = Report(rank == 0)
    dog = Watchdog(first_of_node)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if world == 1 and "MASTER_ADDR" not in os.environ:   # no launcher: one rank, its own group, the same checks
        # (under torchrun --nproc-per-node 1 its store is the one to meet at, as for any world size)
        os.environ.update(process_group.single_host_env(0, 1, process_group.free_port()))
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if world > 1 and (rank != 0 or agent):
        line = check_endpoint(host, port, args.timeout, "torchrun's store" if agent else "MASTER_ADDR:MASTER_PORT",
                              endpoint_fix(agent))
        if line:
            if first_of_node:
                say(f"FAIL {line}")
            else:
                time.sleep(SILENT_PAUSE_S)
            return 1

    import torch
    import torch.distributed as dist
    plan = command.plan(parser, args, world)
    facts = launcher_facts()
    dog.arm(args.timeout + 10, lambda: f"rendezvous: the store at {host}:{port} did not open within "
                                       f"{args.timeout:g} s: {endpoint_fix(agent)}")
    store = open_store(rank, world, args.timeout)
    dog.disarm()
    everyone, missing = join(store, rank, world, facts, args.timeout)
    if missing:
        if first_of_node:
            say(f"FAIL ranks: {world - len(missing)} of {world} ranks joined at {host}:{port} within "
                f"{args.timeout:g} s; rank(s) {ranks_text(missing)} did not (still starting, crashed at start: their "
                f"node's log says; or started with another MASTER_ADDR/MASTER_PORT, --nnodes or --nproc-per-node)")
        return 1
    from minizero.preflight import checks
    where = checks.layout(everyone)
    how = "torchrun's rendezvous" if agent else "the store rank 0 opened" if world > 1 else "no launcher: one rank"
    report.add(checks.OK, f"ranks: {world} of {world} joined, {time.monotonic() - t0:.1f} s after starting ({how}, "
                          f"{host}:{port})")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    report.extend([checks.hosts(everyone, plan.node_group), checks.gpus(everyone, backend), checks.config(plan)])
    gpus_ok = not any(s == "FAIL" and t.startswith("GPUs") for s, t in report.lines)

    dog.arm(args.timeout + 10, lambda: gloo_stuck(everyone, args.timeout))
    dist.init_process_group("gloo", store=dist.PrefixStore(run_key() + "/pg", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    dog.disarm()
    try:
        probe = checks.FolderProbe(checks.probe_folder(plan.save_dir), where, args.fs_wait)
        probe.write()
        if backend == "nccl" and not gpus_ok:
            report.add(checks.FAIL, "collectives: not tried on nccl: the GPUs line above must pass first")
        else:
            group, device = None, torch.device("cpu")
            if backend == "nccl":
                device = torch.device("cuda", everyone[rank]["gpu"]["index"])
                torch.cuda.set_device(device)
                dog.arm(args.timeout, lambda: nccl_stuck("its first all_reduce", everyone, args.timeout))
                group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=args.timeout))
            dog.arm(args.timeout, lambda: (nccl_stuck if backend == "nccl" else lambda w, f, s: gloo_stuck(f, s))(
                "all_reduce, all_gather and reduce_scatter", everyone, args.timeout))
            report.add(*checks.collectives(group, device, backend, world))
            dog.arm(args.timeout, lambda: pair_stuck(plan.node_group, backend, len(everyone), args.timeout))
            report.extend([checks.node_group_collectives(plan.node_group, group, device, backend, world,
                                                         args.timeout)])
            mib = args.message_mib or (64 if backend == "nccl" else 4)
            dog.arm(args.timeout, lambda: (nccl_stuck if backend == "nccl" else lambda w, f, s: gloo_stuck(f, s))(
                "the bandwidth test's all_reduce", everyone, args.timeout))
            report.add(*checks.bandwidth(where, backend, device, int(mib * 2 ** 20), args.timeout))
            dog.disarm()
        dog.arm(args.fs_wait + args.timeout, lambda: f"files: the save folder, data and disk checks did not finish "
                                                     f"within {args.fs_wait + args.timeout:g} s on "
                                                     f"{socket.gethostname()} (a file system that hangs?)")
        report.add(*checks.save_folder(probe, probe.read(), plan.save_dir, plan.resume))
        report.extend(checks.data(plan.dataset, plan.data_dir, plan.resume, where))
        report.add(*checks.disk(probe, plan))
        dog.disarm()
        fails = checks.exchange(sum(s == checks.FAIL for s, _ in report.lines) if rank == 0 else None)[0]
        report.summary(time.monotonic() - t0)
        if first_of_node and rank != 0:
            mine = next(r for r in where.values() if rank in r)
            say(f"{'FAIL' if fails else 'ok  '} this node ({everyone[rank]['host'].split('#')[0]}, ranks {ranks_text(mine)}) took "
                f"part; rank 0 prints the report on {everyone[0]['host'].split('#')[0]}: {fails} FAIL")
        sys.stdout.flush()
        dist.barrier()
    finally:
        dog.disarm()
    dist.destroy_process_group()
    return 1 if fails else 0
