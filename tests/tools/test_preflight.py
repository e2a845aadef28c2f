"""The preflight (minizero/preflight/, docs/operations.md): two "nodes" rehearsed on one
machine as two torchruns over 127.0.0.1, each torchrun its own pretended host
(MINIZERO_HOST), and each fault injected the way it shows on a cluster:

- a clean run of the job's own torchrun line with `-m minizero.preflight`: every line ok,
  the report within a minute;
- one run with three faults at once, under `python -m minizero.preflight torchrun ...`: a save
  folder that is not one folder (each node's --save-dir its own), data on one node only, and
  hpZ's k larger than the ranks per node; each its one FAIL line, nothing else printed;
- a wrong rendezvous endpoint (the two nodes name different ports): each node's one line,
  within the preflight's --timeout, not torchrun's 600 s;
- the checks' arithmetic and wording without processes: the endpoint checks, the README's
  literal `--nnodes 2` line, the hosts and GPUs from ranks' facts, the checkpoint size.

Each node's first process (torchrun, or the preflight that runs torchrun) runs as
`python -m` runs it, on a process forked from the tests' preloaded forkserver
(tests/support/python_m.py), so it does not pay a fresh interpreter's import of torch. In the
clean run what torchrun starts are fresh interpreters, as on a cluster: its ranks import
torch, minizero and the preflight from nothing, and the report's "within a minute" is timed
from their start (this run is also where tests/tools/test_two_nodes.py's fresh ranks under two
torchruns are held). Elsewhere the `python -m` processes a launcher starts (the preflight's
own torchrun, torchrun's ranks) are forked too (python_m.forked_interpreters): what those
tests check is the preflight's handling of torchrun (its lines passed through, its
rendezvous' timeout, torchrun's store), the same whichever interpreter runs the rank.

Cost, measured on one core of a 2-core machine: the clean run (2 launchers, 4 fresh ranks)
about 20 s of CPU; the faults run and the wrong endpoint a few seconds each; the rest under
a second.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from minizero.comm import free_port
from minizero.preflight import checks, command, launch, rendezvous
from tests.support import python_m
from tests.support.command_runs import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CIFAR = "cifar-10-batches-py"
TIMEOUT = 300


def env_for(host: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINIZERO_HOST": host,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "MINIZERO_RANKS_PER_NODE"):
        env.pop(k, None)
    return env


def torchrun(port: int, nproc: int, rdzv_id: str) -> list[str]:
    return ["torchrun", "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id]


def forked(lines: list[list[str]], hosts: str, fresh: bool = False) -> tuple[list[int], list[str], float]:
    """Run the command lines `python -m MODULE ARGS` side by side, line i as host hosts[i]
    (MINIZERO_HOST), each on a process forked from the preloaded forkserver
    (tests/support/python_m.py); (exit statuses, each one's stdout and stderr, seconds).
    The `python -m` processes they start (torchrun's ranks, the preflight's torchrun) are
    forked too (python_m.forked_interpreters), or fresh interpreters where `fresh`."""
    assert all(argv[:2] == [sys.executable, "-m"] for argv in lines), lines
    common = {k: v for k, v in env_for("").items() if os.environ.get(k) != v and k != "MINIZERO_HOST"}
    t0 = time.monotonic()
    with contextlib.nullcontext({}) if fresh else python_m.forked_interpreters() as interpreters:
        rank_env = [{**common, **interpreters, python_m.INDEX_ENV: str(i), "MINIZERO_HOST": host}
                    for i, host in enumerate(hosts)]
        p = run_command("tests.support.python_m", [json.dumps([argv[2:] for argv in lines])], len(lines),
                        launcher=False, rank_env=rank_env, timeout=TIMEOUT)
    outs = [out + err for out, err in zip(p.rank_stdout, p.rank_stderr)]
    return p.rank_returncodes, outs, time.monotonic() - t0


def two_nodes(lines: list[list[str]], folder, fresh: bool = False) -> tuple[list[int], list[str], float]:
    """Start one command per pretended node (nodeA, nodeB) at once; (exit statuses, outputs, seconds).
    Each node's output is also left in folder/node{A,B}.log, as a launcher's log would be."""
    rcs, outs, seconds = forked(lines, ["nodeA", "nodeB"], fresh)
    for n, text in zip("AB", outs):
        (folder / f"node{n}.log").write_text(text)
    return rcs, outs, seconds


def said(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("preflight:")]


def report_first(outputs: list[str]) -> tuple[str, str, str, str]:
    """(the report's node output, the other's, the report node's name, the other's name): the
    c10d rendezvous gives rank 0 to either torchrun."""
    i = next(i for i, text in enumerate(outputs) if " FAIL in " in text)
    return outputs[i], outputs[1 - i], f"node{'AB'[i]}", f"node{'AB'[1 - i]}"


def fake_cifar(folder) -> str:
    os.makedirs(folder / CIFAR)
    for name in command.CIFAR_FILES:
        (folder / CIFAR / name).write_text("x")
    return str(folder)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preflight-clean")
    program = [sys.executable, "-m", "torch.distributed.run", *torchrun(free_port(), 2, "clean")[1:], "-m",
               "minizero.preflight", "--stage", "3", "--hpz", "2", "--dataset", "cifar10",
               "--data-dir", fake_cifar(folder / "data"), "--save-dir", str(folder / "runs" / "job")]
    return (*two_nodes([program, program], folder, fresh=True), folder)


def test_the_jobs_own_torchrun_line_reports_every_check_in_a_minute(clean):
    """`torchrun ... -m minizero.preflight` on 2 pretended nodes x 2 ranks, hpZ k = 2 (its two
    collectives in flight at once on two groups) and the data on the (shared) folder: rank 0's
    node prints one ok line per check and the summary; the other node one line saying where
    the report is."""
    rcs, out, seconds, folder = clean
    a, b, first, other = report_first(out)
    lines = said(a)
    assert rcs == [0, 0], (a[-3000:], b[-3000:])
    assert all(ln.startswith("preflight: ok ") for ln in lines[:-1]), "\n".join(lines)
    heads = [re.match(r"preflight: ok +(\w[\w ]*?):", ln).group(1) for ln in lines[:-1]]
    assert heads == ["ranks", "hosts", "config", "collectives", "node groups", "bandwidth", "save folder", "data",
                     "disk"], heads
    text = "\n".join(lines)
    assert "ranks: 4 of 4 joined" in text and "torchrun's rendezvous" in text
    assert f"hosts: 2 host(s) of 2 ranks ({first}: ranks 0-1; {other}: ranks 2-3); zero_hpz_partition_size 2: " \
           "each node group is one host" in text
    assert "all_reduce, all_gather and reduce_scatter over 4 ranks on gloo: right numbers" in text
    assert "node groups: zero_hpz_partition_size 2: hpZ's all-gather in the node beside a reduce-scatter over all " \
           "ranks, both in flight on gloo: right numbers" in text
    assert re.search(r"inside a node [\d.]+ [kMG]B/s \(2 ranks\); between nodes [\d.]+ [kMG]B/s \(2 ranks\)", text)
    assert "one folder on all 2 host(s), writable" in text and "CIFAR-10 in" in text and "on all 2 host(s)" in text
    assert re.search(r"disk: [\d.]+ [kMGT]B free in .*; a checkpoint of tiny \([\d,]+ parameters, ZeRO-3 fp32 over 4 "
                     r"ranks\) is [\d.]+ MB", text), text
    took = float(re.search(r"0 FAIL in ([\d.]+) s: start the job", lines[-1]).group(1))
    assert took < 60, lines[-1]          # the ranks' own clock, from their start to the summary
    assert said(b) == [f"preflight: ok   this node ({other}, ranks 2-3) took part; rank 0 prints the report on "
                       f"{first}: 0 FAIL"], b[-2000:]
    assert sorted(os.listdir(folder)) == ["data", "nodeA.log", "nodeB.log"]   # no save folder made, no probe left


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """One rank per node; node A: its own save folder and the data; node B: another save folder
    (as a node-local disk of the same path is), no data; hpZ's k = 2 over nodes of 1 rank.
    --fs-wait 0.5: each node waits that long for the other's file, which is in another folder
    and never comes, so the wait decides nothing here but the time."""
    folder = tmp_path_factory.mktemp("preflight-faults")
    port = free_port()
    lines = []
    for n in "AB":
        data = fake_cifar(folder / "dataA") if n == "A" else str(folder / "dataB")
        os.makedirs(folder / f"save{n}")
        os.makedirs(data, exist_ok=True)
        lines.append([sys.executable, "-m", "minizero.preflight", "--timeout", "60", *torchrun(port, 1, "faults"), "-m",
                      "minizero.train", "--stage", "3", "--dataset", "cifar10", "--data-dir", data, "--save-dir",
                      str(folder / f"save{n}"), "--hpz", "2", "--fs-wait", "0.5"])
    return two_nodes(lines, folder)


def test_each_injected_fault_is_one_line(faults):
    """Under `python -m minizero.preflight torchrun ...` only the report reaches the terminal
    (torchrun's own traceback goes to its log): rank 0's node says each fault in one FAIL line
    naming what to change, the other node where the report is; both exit 1."""
    rcs, out, _ = faults
    a, b, first, other = report_first(out)
    assert rcs == [1, 1], (a[-3000:], b[-3000:])
    assert a.splitlines() == said(a) and b.splitlines() == said(b), (a, b)   # nothing but the report
    fails = [ln for ln in said(a) if ln.startswith("preflight: FAIL")]
    assert len(fails) == 3, "\n".join(said(a))
    hosts, save, data = fails
    assert hosts.startswith(f"preflight: FAIL hosts: {first}: ranks 0; {other}: ranks 1; zero_hpz_partition_size 2: "
                            "ranks 0-1, one node group, run on 2 hosts (nodeA, nodeB)"), hosts
    assert "set zero_hpz_partition_size to the ranks of one node (1), or start 2 ranks on each node" in hosts
    assert save.startswith(f"preflight: FAIL save folder: host {first} does not see in ") and \
        f"the file host {other} wrote" in save and "a file system every node mounts" in save, save
    assert data.startswith("preflight: FAIL data: CIFAR-10 is missing from") and "on host(s) nodeB (there on nodeA)" \
        in data and "one folder every node mounts" in data, data
    assert said(a)[-1].startswith("preflight: 5 ok, 0 warn, 3 FAIL in "), said(a)[-1]
    assert said(b) == [f"preflight: FAIL this node ({other}, ranks 1) took part; rank 0 prints the report on "
                       f"{first}: 3 FAIL"], b


def test_a_wrong_rendezvous_endpoint_ends_in_one_line_within_the_timeout(tmp_path):
    """Node B names another port than node A (each then hosts a rendezvous of its own, as a
    wrong --rdzv-endpoint does on a cluster): each node prints one line naming what to make
    the same on every node, within --timeout 1 s and torchrun's start, not its 600 s."""
    timeout = 1
    lines = [[sys.executable, "-m", "minizero.preflight", "--timeout", str(timeout), *torchrun(free_port(), 1, "wrong"),
              "-m", "minizero.train", "--save-dir", str(tmp_path / "save")] for _ in "AB"]
    rcs, out, seconds = two_nodes(lines, tmp_path)
    assert rcs == [1, 1], out
    for text, line in zip(out, lines):
        port = line[line.index("--rdzv-endpoint") + 1]
        assert len(text.splitlines()) == 1, text
        assert text.startswith(f"preflight: FAIL rendezvous: the 2 nodes did not all join at {port} (--rdzv-id wrong) "
                               f"within {timeout} s: run this same line on every node, with the same "
                               f"--rdzv-endpoint"), text
    assert seconds < timeout + launch.START_GRACE_S, seconds


# ----------------------------------------------------------------------------- without processes

def test_one_rank_under_torchrun_meets_at_torchruns_store(tmp_path):
    """`torchrun --standalone --nproc-per-node 1 -m minizero.preflight` (the GPU lease's form):
    one rank meets at torchrun's own store, not a store of its own it then waits on (before,
    it made up a MASTER_PORT nobody served, and ended in a traceback)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
            "minizero.preflight", "--dataset", "synthetic", "--save-dir", str(tmp_path / "s"), "--timeout", "20"]
    (rc,), (out,), _ = forked([argv], ["node0"])
    lines = said(out)
    assert rc == 0 and "ranks: 1 of 1 joined" in lines[0] and "torchrun's rendezvous" in lines[0], out[-4000:]
    assert " 0 FAIL " in lines[-1], lines


def test_the_endpoint_checks_name_the_fix():
    line = rendezvous.check_endpoint("no-such-host.invalid", 29500, 1, "--rdzv-endpoint", "give the first node's name")
    assert line.startswith("rendezvous: --rdzv-endpoint no-such-host.invalid does not resolve on this node"), line
    t0 = time.monotonic()
    line = rendezvous.check_endpoint("127.0.0.1", free_port(), 1, "MASTER_ADDR:MASTER_PORT", "export MASTER_PORT")
    assert line.startswith("rendezvous: nothing answers at 127.0.0.1:") and "(Connection refused)" in line, line
    assert time.monotonic() - t0 < 5
    assert rendezvous.ranks_text([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_the_readme_literal_two_node_line_is_refused_at_once(capsys):
    """`torchrun --nnodes 2 --nproc-per-node 4 -m minizero.train` has no rendezvous flags: each
    node's torchrun would wait on its own localhost. The preflight says so before starting it."""
    assert launch.main(["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "-m", "minizero.train", "--stage",
                        "3"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("preflight: FAIL rendezvous: --nnodes 2 without --rdzv-endpoint or --master-addr") and \
        "--rdzv-backend c10d --rdzv-endpoint HEAD:29500" in out and out.count("\n") == 1, out


def test_the_line_it_runs_is_the_jobs_with_the_preflight_in_place_of_the_program():
    argv = ["--timeout", "45", "torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "h:29500", "--rdzv-id", "x", "--rdzv-conf", "read_timeout=90", "-m", "minizero.train",
            "--stage", "3"]
    from torch.distributed.run import get_args_parser
    line = argv[3:]
    tr = get_args_parser().parse_args(line)
    flags = line[:len(line) - 1 - len(tr.training_script_args)]
    cmd = launch.rebuilt(flags, tr, 45, tr.training_script_args, argv[:2])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "h:29500", "--rdzv-id", "x", "--rdzv-conf",
                       "read_timeout=90,join_timeout=45", "-m", "minizero.preflight", "--timeout", "45", "--stage", "3"]
    assert launch.wraps(argv) and not launch.wraps(["--stage", "3"])


def facts(host: str, local: int, gpu=None, **env) -> dict:
    f = {"host": host, "local_rank": local, "vars": env, "gpus": 4 if gpu is not None else 0, "address": "10.0.0.1"}
    if gpu is not None:
        f["gpu"] = {"index": gpu, "name": "H200", "uuid": f"{host}-{gpu}"}
    return f


def test_hosts_and_gpus_are_judged_from_the_ranks_own_facts():
    two_by_two = [facts(h, i, i, LOCAL_WORLD_SIZE="2") for h in ("a#1", "b#2") for i in (0, 1)]
    assert checks.hosts(two_by_two, ("hsdp_shard_size", 2))[0] == checks.OK
    assert checks.gpus(two_by_two, "nccl") == (checks.OK, "GPUs: one per rank, 4 in all (H200)")
    status, line = checks.hosts(two_by_two, ("hsdp_shard_size", 4))
    assert status == checks.FAIL and "hsdp_shard_size 4: ranks 0-3, one node group, run on 2 hosts (a, b)" in line
    # two torchruns started on one node: 4 ranks on host a, where torchrun said 2 per node, and GPUs shared
    one_box = [facts("a#1", i % 2, i % 2, LOCAL_WORLD_SIZE="2") for i in range(4)]
    status, line = checks.hosts(one_box, None)
    assert status == checks.WARN and "LOCAL_WORLD_SIZE=2 says 2 per node" in line and "MINIZERO_HOST" in line, line
    status, line = checks.gpus(one_box, "nccl")
    assert status == checks.FAIL and line.startswith("GPUs: ranks 0 and 2 would share GPU 0 of host a: start one "
                                                     "torchrun per node"), line
    assert checks.gpus(one_box, "gloo") is None
    cyclic = [facts(h, i // 2) for i, h in enumerate(["a#1", "b#2"] * 2)]
    status, line = checks.hosts(cyclic, None)
    assert status == checks.WARN and "not placed node by node" in line and "--distribution=block" in line, line


def _checkpoint_of(flags: list, folder: str) -> int:
    """The trainer's engine for `flags` (its model and config, as train.py builds them) saves
    one checkpoint into `folder`; the bytes of the tag folder (rank 0 counts)."""
    import minizero
    from minizero import comm
    from minizero.gpt.model import GPT
    from minizero.train import train_args
    parser, args = command.parse(flags)
    train_args.fill_defaults(parser, args)
    model = GPT(train_args.model_config(args))
    engine = minizero.initialize(model=model, config=train_args.build_config(args, comm.get_world_size()),
                                 model_parameters=model.configure_param_groups(0.1))[0]
    tag = engine.save_checkpoint(folder, tag="size")
    return sum(os.path.getsize(os.path.join(tag, f)) for f in os.listdir(tag))


@pytest.mark.parametrize("stage, dtype", [(3, "bf16"), (1, "fp32")])
def test_the_checkpoint_size_bounds_a_real_checkpoint(tmp_path, stage, dtype):
    """command.checkpoint_bytes, from the layout plans alone, against the folder the trainer's
    engine writes on 2 ranks: never below it, and within 10% of it."""
    from tests.support.launcher import run_ranks
    flags = ["--stage", str(stage), "--dtype", dtype, "--max-steps", "1"]
    written = run_ranks(_checkpoint_of, 2, args=(flags, str(tmp_path)))[0]
    parser, args = command.parse(flags)
    plan = command.plan(parser, args, 2)
    assert (plan.params, plan.checkpoints) == (108_801, 1)
    assert written <= plan.checkpoint_bytes <= 1.1 * written, (written, plan.checkpoint_bytes)


def test_the_watchdog_ends_a_stuck_wait_in_its_one_line():
    """A call that never returns (a backend connecting, a collective) with the watchdog armed:
    the process prints the line the watchdog was given and exits 1 when the time is up, from
    the node's first rank only (the others exit quietly)."""
    code = ("import sys, time; from minizero.preflight.rendezvous import Watchdog; "
            "dog = Watchdog(speak=sys.argv[1] == '1'); dog.arm(0.5, lambda: 'backend: stuck, set X'); time.sleep(30)")
    for speak, out in (("1", "preflight: backend: stuck, set X\n"), ("0", "")):
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", code, speak], capture_output=True, text=True, timeout=60,
                           env=env_for("nodeA"))
        assert (p.returncode, p.stdout) == (1, out) and time.monotonic() - t0 < 20, (p.stdout, p.stderr)
