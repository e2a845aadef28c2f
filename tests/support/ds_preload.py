"""Imported once by the test forkserver so every forked rank starts with DeepSpeed loaded,
and without the shared-memory inference op DeepSpeed would otherwise compile on its first
CPU run (a minute; training never calls it: reference/ds_run.py's skip_inference_shm_op).

DS_ACCELERATOR=cpu must be set before the first import of deepspeed."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402,F401

from reference.ds_run import skip_inference_shm_op  # noqa: E402

skip_inference_shm_op()
