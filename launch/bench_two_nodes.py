"""Step time of ZeRO-3, hpZ and HSDP on 2 "nodes" x 2 ranks, over a fast and a slow link, on one machine.

    python launch/bench_two_nodes.py                                  # needs root and iproute2
    python launch/bench_two_nodes.py --rate 20mbit --max-steps 12 --libs deepspeed torch

One machine has no inter-node link to be slow, so this makes one: each "node" is a Linux
network namespace, the two joined by a veth pair, and for the slow link `tc`'s token bucket
filter (tbf) limits the rate of each end to --rate. The node's ranks talk to each other through
the namespace's own address (the kernel's loopback path: fast), to the other node's ranks
across the veth. Node n runs `torchrun --nnodes 2 --node-rank n --nproc-per-node 2
--master-addr <node 0's veth address>` inside its namespace, gloo bound to the veth
(GLOO_SOCKET_IFNAME), so ranks 0-1 are node 0 and ranks 2-3 node 1, the blocks hpZ and HSDP
group by.

Settings (each with the libraries that have it; minizero's columns run as soon as its config
accepts the key, the others are skipped with a line):
    ZeRO-3  every parameter sharded over all 4 ranks: forward and backward all-gather and the
            gradient reduce-scatter all cross the link
    hpZ     zero_hpz_partition_size 2 (ZeRO++, arXiv 2306.10209): backward all-gathers from a
            node-local secondary copy; DeepSpeed, FSDP2's reshard_after_forward=2
    HSDP    hsdp_shard_size 2 (FSDP, arXiv 2304.11277): shard within a node, replicate across;
            only the gradient shard's all-reduce crosses the link; FSDP2 on a 2-D mesh

ms/step is the median of the per-step wall times after the first two steps (metrics.csv,
one row per step), the slowest node's; link MB is what the veth carried in both directions over
the whole run (/sys/class/net/<veth>/statistics: TCP's bytes, init, test loss and checkpoint
included). Where the machine cannot make namespaces (not root, no iproute2, no tbf), it prints
one line saying why and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NODES, PER_NODE = 2, 2
ADDR = ("10.213.0.1", "10.213.0.2")   # node 0, node 1 (each inside its own namespace)
LINK = "mzlink"                       # the veth end's name inside either namespace
SCRIPTS = {"minizero": ["-m", "minizero.train"], "deepspeed": [str(ROOT / "reference" / "train.py")],
           "torch": [str(ROOT / "reference" / "torch_train.py")]}
SETTINGS = {   # name -> (zero_optimization keys, libraries that have them without minizero)
    "ZeRO-3": ({}, ("minizero", "deepspeed", "torch")),
    "hpZ": ({"zero_hpz_partition_size": PER_NODE}, ("deepspeed", "torch")),
    "HSDP": ({"hsdp_shard_size": PER_NODE}, ("torch",)),
}
# As minizero.compare pins them: DeepSpeed's ZeRO-3 defaults would keep a small model's
# parameters whole (persistence 1e5) and gathered from forward into backward (reuse 1e9).
PINNED = {"memory_efficient_linear": False, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500_000,
          "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"bench_two_nodes: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="python launch/bench_two_nodes.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="20mbit", help="the slow link's rate, in tc's units (default 20mbit)")
    p.add_argument("--libs", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS), metavar="LIB",
                   help="minizero deepspeed torch (default: all)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="S",
                   help="ZeRO-3 hpZ HSDP (default: all)")
    p.add_argument("--model", default="tiny", help="GPT preset (default tiny, 108,801 parameters)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--max-steps", type=int, default=10, help="optimizer steps per run (default 10; >= 4)")
    p.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    args = p.parse_args(argv)
    if args.max_steps < 4:
        p.error("--max-steps must be >= 4 (two warm-up steps, then at least two timed)")
    return args


# ----------------------------------------------------------------------------- the link

def sh(*cmd: str, ns: str | None = None) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    return subprocess.run(full, capture_output=True, text=True)


class TwoNodes:
    """Two namespaces joined by a veth pair (the link), removed on exit."""

    def __init__(self):
        self.ns = (f"mz{os.getpid()}n0", f"mz{os.getpid()}n1")

    def why_not(self) -> str | None:
        """Why this machine cannot make the link, in a few words; None when it can."""
        if sys.platform != "linux":
            return "network namespaces are Linux's"
        if os.geteuid() != 0:
            return "making network namespaces needs root"
        if not (shutil.which("ip") and shutil.which("tc")):
            return "needs iproute2 (ip, tc)"
        return None

    def __enter__(self):
        steps = [("ip", "netns", "add", self.ns[0]), ("ip", "netns", "add", self.ns[1]),
                 ("ip", "link", "add", "mzv0", "netns", self.ns[0], "type", "veth", "peer", "name", "mzv1",
                  "netns", self.ns[1])]
        for n, ns in enumerate(self.ns):
            steps += [("ip", "-n", ns, "link", "set", f"mzv{n}", "name", LINK),
                      ("ip", "-n", ns, "addr", "add", f"{ADDR[n]}/24", "dev", LINK),
                      ("ip", "-n", ns, "link", "set", LINK, "up"), ("ip", "-n", ns, "link", "set", "lo", "up")]
        for cmd in steps:
            r = sh(*cmd)
            if r.returncode:
                self.__exit__()
                raise OSError(f"`{' '.join(cmd)}`: {r.stderr.strip() or r.returncode}")
        return self

    def __exit__(self, *exc):
        for ns in self.ns:   # the veth pair goes with its namespaces
            sh("ip", "netns", "del", ns)

    def limit(self, rate: str | None) -> None:
        """tbf at `rate` on both ends of the link (None: no limit)."""
        for ns in self.ns:
            sh("tc", "qdisc", "del", "dev", LINK, "root", ns=ns)
            if rate:
                r = sh("tc", "qdisc", "add", "dev", LINK, "root", "tbf", "rate", rate, "burst", "32kbit",
                       "latency", "400ms", ns=ns)
                if r.returncode:
                    raise OSError(f"tc tbf at {rate}: {r.stderr.strip()}")

    def link_bytes(self) -> int:
        """Bytes node 0's end of the link has sent and received."""
        total = 0
        for d in ("tx_bytes", "rx_bytes"):
            total += int(sh("cat", f"/sys/class/net/{LINK}/statistics/{d}", ns=self.ns[0]).stdout)
        return total


# ----------------------------------------------------------------------------- one run

def config(zero: dict, dtype: str) -> dict:
    from minizero.train.train_args import DEFAULT_CONFIG
    cfg = json.loads(json.dumps(DEFAULT_CONFIG))
    cfg["zero_optimization"] = {**cfg["zero_optimization"], **PINNED, "stage": 3, **zero}
    cfg["steps_per_print"] = 1          # one metrics.csv row per step: the per-step times
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def step_ms(save_dir: Path) -> float:
    """Median wall time of the steps after the first two, in ms (metrics.csv's elapsed_s)."""
    with open(save_dir / "metrics.csv") as f:
        t = [float(r["elapsed_s"]) for r in csv.DictReader(f)]
    return 1000 * statistics.median(b - a for a, b in zip(t[2:], t[3:]))


def run(nodes: TwoNodes, lib: str, cfg: dict, args, folder: Path, port: int) -> tuple[float, int]:
    """One training run on the two namespaces; (ms/step, link bytes)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": LINK,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    train = ["--config", str(folder / "config.json"), "--stage", "3", "--model", args.model, "--dataset", "synthetic",
             "--image-size", "8", "--synthetic-train", "512", "--synthetic-test", "32", "--max-steps",
             str(args.max_steps), "--eval-every", "0", "--num-samples", "0", "--data-dir", str(folder.parent / "data"),
             "--save-dir", str(folder / "run")] + (["--dtype", "bf16"] if args.dtype == "bf16" else [])
    before = nodes.link_bytes()
    procs = []
    for n, ns in enumerate(nodes.ns):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
               "--node-rank", str(n), "--nproc-per-node", str(PER_NODE), "--master-addr", ADDR[0],
               "--master-port", str(port), *SCRIPTS[lib], *train]
        with open(folder / f"node{n}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    rcs = [p.wait() for p in procs]
    if any(rcs):
        tail = "".join(open(folder / f"node{rcs.index(next(r for r in rcs if r))}.log").readlines()[-8:])
        raise RuntimeError(f"{lib} failed ({rcs}); {folder}:\n{tail}")
    return step_ms(folder / "run"), nodes.link_bytes() - before


def plan(args) -> tuple[list, list]:
    """(the (setting, library, keys) runs, the lines saying which were left out and why)."""
    from minizero.compare.compare import minizero_knows
    runs, left_out = [], []
    for name in args.settings:
        zero, libs = SETTINGS[name]
        for lib in args.libs:
            if lib in libs or lib == "minizero" and all(minizero_knows(k) for k in zero):
                runs.append((name, lib, zero))
            else:
                left_out.append(f"{name} {lib}: " + ("minizero's config has no " + ", ".join(zero) + " yet"
                                                     if lib == "minizero" else f"{lib} has no {name}"))
    return runs, left_out


def main(argv=None) -> None:
    args = parse_args(argv)
    nodes = TwoNodes()
    if why := nodes.why_not():
        print(f"bench_two_nodes: skipped: {why}")
        return
    runs, left_out = plan(args)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_two_nodes-"))
    from minizero.comm import free_port
    results = {}
    try:
        with nodes:
            for link, rate in (("fast", None), ("slow", args.rate)):
                nodes.limit(rate)
                for name, lib, zero in runs:
                    print(f"bench_two_nodes: {name} {lib}, {link} link ...", flush=True)
                    try:
                        results[(name, lib, link)] = run(nodes, lib, config(zero, args.dtype), args,
                                                         out / f"{link}-{name}-{lib}", free_port())
                    except RuntimeError as e:   # e.g. a rank aborting at exit (launch/stress_exit.sh): once more
                        print(f"bench_two_nodes: {name} {lib}, {link} link failed, run again: "
                              f"{str(e).splitlines()[0]}", flush=True)
                        results[(name, lib, link)] = run(nodes, lib, config(zero, args.dtype), args,
                                                         out / f"{link}-{name}-{lib}-again", free_port())
    except OSError as e:
        print(f"bench_two_nodes: skipped: cannot make the link here: {e}")
        return
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\n{NODES} nodes x {PER_NODE} ranks, {args.model} GPT, {args.dtype}, {args.max_steps} steps; slow link: "
          f"tbf {args.rate} each way\n")
    print("| setting | library | fast ms/step | slow ms/step | slow / fast | link MB fast | link MB slow |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, lib, _ in runs:
        (f_ms, f_b), (s_ms, s_b) = results[(name, lib, "fast")], results[(name, lib, "slow")]
        print(f"| {name} | {lib} | {f_ms:.0f} | {s_ms:.0f} | {s_ms / f_ms:.2f}x | {f_b / 1e6:.1f} | {s_b / 1e6:.1f} |")
    for line in left_out:
        print(f"- not run: {line}")


if __name__ == "__main__":
    main()
