"""The launcher's environment, as a GPU cluster presents it, checked on a CPU.

- `srun python -m minizero.train` (no torchrun) sets only SLURM_* variables: they are mapped
  to one job of SLURM_STEP_NUM_TASKS ranks, or refused in one line when no MASTER_ADDR is given.
  (Before: N processes trained N separate models into one folder.) A plain `python` inside a
  multi-task allocation (the batch script: SLURM_NTASKS=2, no srun step) is one process.
- get_device() follows the backend in use: a gloo group stays on the CPU even where CUDA is
  visible (the CPU suite on a GPU box); NCCL uses the rank's GPU among the *visible* ones
  (one visible GPU per rank under `srun --gpus-per-task=1` is cuda:0, not cuda:LOCAL_RANK).
- With NCCL the rank's GPU is made current even when the group already exists, and handed
  to init_process_group as device_id.
CUDA is faked by patching torch.cuda's queries; no tensor is ever put on a GPU.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from minizero import comm
from tests.support.launcher import free_port, run_ranks
from tests.support.command_runs import run_command
from tests.tools.test_train import SMALL


def _fake_cuda(monkeypatch, n: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    # No process group, whatever an earlier test left in this pytest process.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


def _srun(argv, nproc=2, **env):
    """`srun --ntasks 2 python -m minizero.train ARGV`: each task gets SLURM's variables (and
    `env`) and no torchrun's; run as the program's main(argv) on processes forked from the
    tests' preloaded forkserver (tests/support/command_runs.py), not fresh interpreters."""
    rank_env = [dict(SLURM_PROCID=str(r), SLURM_NTASKS=str(nproc), SLURM_STEP_NUM_TASKS=str(nproc),
                     SLURM_LOCALID=str(r), **env) for r in range(nproc)]
    return run_command("minizero.train", argv, nproc, launcher=False, rank_env=rank_env, timeout=240)


def test_srun_without_torchrun_is_one_job(tmp_path):
    port, save = str(free_port()), str(tmp_path / "run")
    p = _srun([*SMALL, "--num-samples", "0", "--save-dir", save], SLURM_JOB_ID="77", MASTER_ADDR="127.0.0.1",
              MASTER_PORT=port)
    assert p.returncode == 0, (p.stdout, p.stderr)
    with open(os.path.join(save, "summary.json")) as f:
        assert json.load(f)["world_size"] == 2


def test_srun_without_torchrun_or_master_addr_is_refused_in_one_line(tmp_path):
    p = _srun([*SMALL, "--num-samples", "0", "--save-dir", str(tmp_path / "r")])
    errs = p.stderr
    assert p.rank_returncodes == [1, 1] and "Traceback" not in errs, errs
    lines = [ln for ln in errs.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "MASTER_ADDR" in lines[0] and "torchrun" in lines[0], errs
    assert not os.path.exists(tmp_path / "r" / "metrics.csv")


def _clear_env(monkeypatch, *names):
    """Unset `names` for this test, and restore them after it even where the code under test
    sets them (monkeypatch restores only what it saw change: set first, then delete)."""
    for k in names:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)


def _slurm_env(monkeypatch, **env):
    _clear_env(monkeypatch, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS")
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_plain_python_inside_a_two_task_allocation_is_one_process(monkeypatch):
    # sbatch --nodes=2 --ntasks-per-node=1: the batch script (and gpu_check's one-GPU children,
    # whose environment drops RANK but keeps SLURM_*) sees the allocation, not an srun step.
    from minizero import process_group
    _slurm_env(monkeypatch, SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_JOB_ID="77",
               MASTER_ADDR="127.0.0.1")
    process_group._from_slurm()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


def test_an_srun_step_of_two_tasks_is_mapped_to_two_ranks(monkeypatch):
    from minizero import process_group
    _slurm_env(monkeypatch, SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID="0",
               SLURM_JOB_ID="77", MASTER_ADDR="10.0.0.1")
    process_group._from_slurm()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "0")


def _device_under_gloo_with_visible_gpu():
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    from minizero import comm
    return str(comm.get_device())


def test_gloo_group_stays_on_cpu_where_cuda_is_visible():
    assert run_ranks(_device_under_gloo_with_visible_gpu, 2) == ["cpu", "cpu"]


@pytest.mark.parametrize("visible, local_rank, expected", [(1, 3, 0), (4, 2, 2), (8, 7, 7)])
def test_device_is_the_ranks_gpu_among_the_visible_ones(monkeypatch, visible, local_rank, expected):
    _fake_cuda(monkeypatch, visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert comm.get_device() == torch.device("cuda", expected)


def test_more_ranks_than_visible_gpus_is_a_clear_error(monkeypatch):
    _fake_cuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(comm.LaunchError, match="only 4 GPUs are visible"):
        comm.get_device()


def test_nccl_sets_the_device_and_passes_device_id(monkeypatch):
    _fake_cuda(monkeypatch, 4)
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", torch.device(d)))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    comm.init_distributed()
    assert calls["init"]["backend"] == "nccl" and calls["init"]["device_id"] == torch.device("cuda", 2)
    assert calls["set_device"] == torch.device("cuda", 2)


def test_existing_nccl_group_still_gets_the_ranks_device(monkeypatch):
    """A user's own init_process_group (or any launcher that starts the group first)."""
    _fake_cuda(monkeypatch, 4)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    comm.init_distributed()
    assert calls == [torch.device("cuda", 3)]


def test_deterministic_mode_alone_sets_the_cublas_workspace(monkeypatch):
    # MINIZERO_DETERMINISTIC=1 without CUBLAS_WORKSPACE_CONFIG crashed at the first matmul on a
    # GPU (torch's deterministic mode requires the setting). A user's own value is kept.
    from minizero.train import train
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append(on))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setenv("MINIZERO_DETERMINISTIC", "1")
    _clear_env(monkeypatch, "CUBLAS_WORKSPACE_CONFIG")
    train.deterministic_from_env()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and calls == [True]
    assert torch.backends.cudnn.benchmark is False
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    train.deterministic_from_env()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_launcher_rank_is_one_torch_free_rule(monkeypatch):
    """RANK wins, then srun's SLURM_PROCID, then 0; the package logger, the pre-torch
    command-line check and process_group.get_rank (before a group exists) all ask the same
    torch-free function, so only rank 0 speaks before the group starts."""
    import subprocess
    import sys

    from minizero import launcher_env, process_group
    from minizero.train import train_args

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for env, want in (({}, 0), ({"SLURM_PROCID": "3"}, 3), ({"RANK": "1", "SLURM_PROCID": "3"}, 1)):
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("SLURM_PROCID", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert launcher_env.launcher_rank() == want
        assert process_group.get_rank() == want
    assert train_args.launcher_rank is launcher_env.launcher_rank
    code = ("import sys, minizero, minizero.launcher_env, minizero.train.train_args; "
            "import logging; print('torch' in sys.modules, logging.getLogger('minizero').level)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, SLURM_PROCID="2"),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", str(__import__("logging").WARNING)]  # torch-free; rank 2 stays quiet


# ----------------------------------------------------------------------------- which ranks share a node

@pytest.mark.parametrize("env, world, want", [
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 8, 4),                        # srun -N2 -n8: no SLURM_NTASKS_PER_NODE
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "8"}, 8, 4),   # the step's placement first
    ({"LOCAL_WORLD_SIZE": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, 4, 2),  # torchrun under srun: torchrun's
    ({"SLURM_NTASKS_PER_NODE": "4"}, 1, 1),        # a plain python in a batch script: one rank, one node
    ({}, 8, 8),
])
def test_ranks_per_node_reads_each_launchers_count(monkeypatch, env, world, want):
    from minizero import process_group
    _clear_env(monkeypatch, *process_group.PER_NODE_VARS)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(process_group, "get_world_size", lambda group=None: world)
    assert process_group.ranks_per_node() == want


def test_ranks_per_node_refuses_nodes_of_different_sizes_in_one_line(monkeypatch):
    from minizero import process_group
    _clear_env(monkeypatch, *process_group.PER_NODE_VARS)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4,3")
    monkeypatch.setattr(process_group, "get_world_size", lambda group=None: 7)
    with pytest.raises(comm.LaunchError, match=r"SLURM_STEP_TASKS_PER_NODE=4,3: the nodes hold different numbers "
                                               r"of ranks \(\[4, 3\]\).*--ntasks-per-node"):
        process_group.ranks_per_node()


def test_node_groups_against_the_hosts():
    """process_group.node_groups_problem, the line check_node_groups says: None when blocks of
    k consecutive ranks are the hosts; one line naming the key, the hosts and the fix when a
    group spans hosts (k larger than a node; srun's cyclic placement) or k differs from the
    ranks per host."""
    from minizero.process_group import node_groups_problem as problem
    blocks = ["a#1"] * 4 + ["b#2"] * 4
    assert problem(blocks, 4, "zero_hpz_partition_size", 4) is None
    line = problem(["a#1"] * 2 + ["b#2"] * 2, 4, "zero_hpz_partition_size", 2)
    assert line.startswith("zero_hpz_partition_size 4: ranks 0-3, one node group, run on 2 hosts (a, b), on 2 "
                           "host(s) of 2 ranks: its backward's all-gathers cross nodes"), line
    assert "set zero_hpz_partition_size to the ranks of one node (2)" in line and "distribution" not in line
    cyclic = problem(["a#1", "b#2"] * 4, 4, "hsdp_shard_size", 4)
    assert "ranks 0-3, one node group, run on 2 hosts (a, b) (and 1 more group(s))" in cyclic, cyclic
    assert "all-gathers and reduce-scatters cross nodes" in cyclic and "srun --distribution=block" in cyclic
    small = problem(blocks, 2, "hsdp_shard_size", 4)
    assert small == ("hsdp_shard_size 2 on 2 host(s) of 4 ranks: 2 groups share each node; set hsdp_shard_size "
                     "to the ranks of one node (4) to shard over the whole node"), small
    one_box = problem(["a#1"] * 8, 4, "hsdp_shard_size", 4)   # two torchruns on one machine
    assert one_box.startswith("hsdp_shard_size 4 on 1 host(s) of 8 ranks (4 per node, the launcher says)"), one_box


def _node_groups_of_an_engine(hosts: list):
    """An HSDP engine (S = 2) on 4 ranks that say they run on `hosts` (MINIZERO_HOST): what the
    "minizero" logger said while sharding.py made the groups."""
    import logging

    import minizero
    from minizero import process_group
    os.environ[process_group.HOST_ENV] = hosts[process_group.get_rank()]
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("minizero").addHandler(handler)
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "hsdp_shard_size": 2}}
    try:
        minizero.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    finally:
        logging.getLogger("minizero").removeHandler(handler)
    return [s for s in said if "hsdp_shard_size" in s]


def _node_groups_of_engines(placements: list):
    """_node_groups_of_an_engine for each of `placements` in turn, in one launch: each engine
    gathers the hosts again where it makes its groups (process_group.check_node_groups)."""
    return [_node_groups_of_an_engine(hosts) for hosts in placements]


def test_an_engine_warns_once_when_its_node_groups_span_hosts():
    """sharding.for_config calls process_group.check_node_groups where it makes HSDP's groups:
    ranks placed round-robin over two hosts (srun --distribution=cyclic) make every group of
    2 consecutive ranks span both, and rank 0 says so in one line; placed node by node, nothing."""
    # node by node first: the cyclic engine after it in the same processes must still warn
    per_rank = run_ranks(_node_groups_of_engines, 4, args=([["a", "a", "b", "b"], ["a", "b", "a", "b"]],), timeout=120)
    blocks, cyclic = ([said[i] for said in per_rank] for i in (0, 1))
    assert len(cyclic[0]) == 1 and cyclic[1:] == [[], [], []], cyclic
    assert cyclic[0][0].startswith("hsdp_shard_size 2: ranks 0-1, one node group, run on 2 hosts (a, b)"), cyclic
    assert blocks == [[]] * 4, blocks
