"""Imported once by the test forkserver so every forked rank starts with DeepSpeed loaded.

DS_ACCELERATOR=cpu must be set before the first import of deepspeed."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402,F401
