"""Who this process is, as the launcher said, read before torch exists.

torchrun sets RANK; srun sets SLURM_PROCID (process_group.slurm_to_torchrun maps it to
RANK later). The package logger (minizero/__init__.py), the command-line precheck that runs
before torch is imported (train/train_args.py) and process_group.get_rank before a group
starts all need this one answer, so only rank 0 speaks early. Torch-free on purpose.
"""
import os


def launcher_rank() -> int:
    """This process's global rank as its launcher set it (torchrun's RANK, else srun's
    SLURM_PROCID, else 0 for a plain `python` run)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
