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
