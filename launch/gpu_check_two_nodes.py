"""The GPU check's two-node checks (launch/gpu_check.py), first in its plan and runnable alone:

    bash launch/gpu_check.sh --only '2node-*'

Two torchruns on one machine, half of its GPUs each, joined as the README's cluster command
joins two nodes: `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID`.
NCCL then runs one world whose ranks do not all see the same devices (each torchrun has its
own CUDA_VISIBLE_DEVICES). What the checks hold to the path a user's job takes:

- full size (the tutorial GPT on 32x32 images, --quick or not): a model whose FlatParams are
  partitioned, with `stage3_param_persistence_threshold: 0` (launch/gpu_check_configs/
  two_nodes_*.json): at the default threshold a small model's parameters are all persistent,
  and hpZ would pass without ever cutting or reading a secondary shard;
- hpZ's k and HSDP's S equal to the GPUs of one "node" (4 on the README's 2 x 4 cluster);
- deterministic kernels (so hpZ can equal plain ZeRO-3 bit for bit) and nothing else: no
  TORCH_DISTRIBUTED_DEBUG=DETAIL, which blocks the host before each collective and would hide
  the stream races these checks are for;
- a hang is reported when no command of the step has printed anything for STALL_S, and both
  nodes are stopped then, rather than after the run's whole time limit.

The first check is the preflight itself (minizero/preflight/) under the same two torchruns.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_run import TORCHRUN, Check, Ctx, Proc, Result, read_json  # noqa: E402
from gpu_check_training import (CONFIGS, DETERMINISTIC_ENV, FULL, TRAIN, Size, data_flags,  # noqa: E402
                                judge_resume, judge_same_losses)

STALL_S = 90         # no output from either node for this long: hung (well inside two minutes)
NODE_SIZES = (2, 4, 8)   # the node sizes the configs carry: two_nodes_hpz<k>.json, two_nodes_hsdp<k>.json


def node_launcher(nproc: int) -> list:
    """One of the two torchruns that together make a 2-node job on this box, with the c10d
    rendezvous flags the README gives for a cluster (node ranks come from the rendezvous)."""
    return [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "gpu-check"]


def checks(n_gpus: int, size: Size, t_train: int) -> list:
    """The two-node checks, in the order they run; `size` gives only the step counts: the model
    is FULL's whatever `size` is."""
    half = max(n_gpus // 2, 1)
    gpus = [",".join(str(i) for i in range(r * half, (r + 1) * half)) for r in (0, 1)]
    flags = [*data_flags(FULL), "--stage", "3", "--dtype", "bf16", "--max-steps", str(size.steps)]
    k = half if half in NODE_SIZES else None

    def two_nodes(program, log):
        return [Proc([*node_launcher(half), *program], f"{log}.node{r}.log",
                     {**DETERMINISTIC_ENV, "CUDA_VISIBLE_DEVICES": gpus[r], "MINIZERO_HOST": f"node{r}"}, t_train,
                     stall=STALL_S) for r in (0, 1)]

    checks = [Check(
        "2node-preflight", f"the preflight under the same two torchruns (2 nodes x {half} GPU(s), "
                           "`-m minizero.preflight --hpz <GPUs per node>`): every rank joins, the hosts are as "
                           "pretended, NCCL's collectives give the right numbers, also hpZ's gather in the node beside "
                           "a reduce-scatter over all ranks, both in flight; the save folder is one folder; no line "
                           "FAILs",
        min_gpus=2, steps=[two_nodes(["-m", "minizero.preflight", *flags, "--save-dir", "{dir}/run",
                                      "--config", f"{CONFIGS}/two_nodes_zero3.json", "--timeout", "60",
                                      *(["--hpz", str(half)] if half > 1 else [])], "2node-preflight")],
        judge=judge_preflight("2node-preflight.node0.log", "2node-preflight.node1.log"))]
    zero3 = ["--config", f"{CONFIGS}/two_nodes_zero3.json"]
    straight = "{out}/2node-straight/run"
    checks.append(Check(
        "2node-straight", f"2 nodes x {half} GPU(s) (two torchruns, c10d rendezvous), ZeRO-3 bf16 on the tutorial GPT "
                          "with stage3_param_persistence_threshold 0 (every FlatParam partitioned): one world of "
                          f"{2 * half} ranks, whose ranks do not all see the same devices, trains and saves",
        min_gpus=2, steps=[two_nodes([*TRAIN, *flags, *zero3, "--save-every", str(size.save_every), "--save-dir",
                                      "{dir}/run"], "2node-straight")],
        judge=judge_two_node_straight("{dir}/run", 2 * half)))
    checks.append(Check(
        "2node-resume", "both nodes resume from that folder: == the straight 2-node run, bit for bit",
        min_gpus=2, after=("2node-straight",),
        steps=[two_nodes([*TRAIN, *flags, *zero3, "--resume", straight, "--tag", f"global_step{size.save_every}",
                          "--save-dir", "{dir}/resumed"], "2node-resume")],
        judge=judge_resume(straight, "{dir}/resumed", size.save_every)))
    # hpZ changes no number, so its losses are the straight run's bit for bit; HSDP reduces in
    # another order (within the node, then across), so it trains and saves.
    hpz = Check(
        "2node-hpz", f"the same 2 nodes with hpZ, zero_hpz_partition_size {k or half} = the GPUs of one node "
                     "(backward's all-gathers stay in the node, from secondary shards cut at every release): "
                     "losses == the straight 2-node run's, bit for bit",
        min_gpus=4, after=("2node-straight",),
        steps=[two_nodes([*TRAIN, *flags, "--config", f"{CONFIGS}/two_nodes_hpz{k}.json", "--save-dir", "{dir}/run"],
                         "2node-hpz")],
        judge=judge_same_losses(straight, "{dir}/run"))
    hsdp = Check(
        "2node-hsdp", f"the same 2 nodes with HSDP, hsdp_shard_size {k or half} = the GPUs of one node (sharded in "
                      "the node, replicated across): one world trains and saves",
        min_gpus=4, steps=[two_nodes([*TRAIN, *flags, "--config", f"{CONFIGS}/two_nodes_hsdp{k}.json", "--save-dir",
                                      "{dir}/run"], "2node-hsdp")],
        judge=judge_two_node_straight("{dir}/run", 2 * half))
    for c in (hpz, hsdp):
        if k is None and n_gpus >= 4:
            c.skip = f"nodes of {half} GPUs: the configs carry k = S = {', '.join(map(str, NODE_SIZES))}"
    return checks + [hpz, hsdp]


def judge_two_node_straight(run: str, world: int):
    def judge(ctx: Ctx) -> Result:
        s = read_json(ctx.path(run) / "summary.json")
        numbers = f"world {s['world_size']}; {s['steps']} steps; final loss {s['final_loss']:.4f}" + \
            (f"; {s['samples_per_s']:.0f} samples/s" if s.get("samples_per_s") else "")
        if s["status"] != "completed" or s["world_size"] != world:
            return Result("FAIL", f"status {s['status']!r}, world size {s['world_size']} (want {world})", numbers)
        return Result("PASS", "", numbers)
    return judge


def preflight_verdict(node0: str, node1: str) -> Result:
    """Both nodes' logs: rank 0's report ends in "0 FAIL", the other node says it took part."""
    lines = [ln for ln in (node0 + node1).splitlines() if ln.startswith("preflight:")]
    report = next((ln for ln in lines if " ok, " in ln and " FAIL in " in ln), None)
    fails = [ln for ln in lines if ln.startswith("preflight: FAIL")]
    bandwidth = next((ln.split("bus bandwidth ")[1] for ln in lines if "bus bandwidth" in ln), "")
    if fails or report is None or " 0 FAIL in " not in report:
        return Result("FAIL", fails[0][len("preflight: FAIL "):][:200] if fails else "no report line", bandwidth)
    return Result("PASS", "", bandwidth)


def judge_preflight(log0: str, log1: str):
    def judge(ctx: Ctx) -> Result:
        read = lambda name: (ctx.out / "logs" / name).read_text(errors="replace")
        return preflight_verdict(read(log0), read(log1))
    return judge
