"""minizero: DeepSpeed's ZeRO, loss scaling and activation checkpointing, in plain torch.distributed."""
__version__ = "0.1.0"
