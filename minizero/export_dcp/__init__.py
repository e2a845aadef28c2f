"""`python -m minizero.export_dcp SRC DST [--tag TAG]`: any checkpoint written as a PyTorch
Distributed Checkpoint (DCP), the folder FSDP2 and torchtitan load (the command: command.py;
the format: minizero/checkpoint_files/dcp_checkpoint.py)."""

from .command import export, main  # noqa: E402,F401  (python -m minizero.export_dcp; the test harness calls main)
