"""The machine and the versions a measurement ran on, in one line each: what every benchmark's
results and the comparison's report write beside their numbers."""
from __future__ import annotations

import importlib.metadata
import os
import platform


def machine() -> str:
    """The GPUs, or the CPU's model, cores and the vector flags that decide bf16's speed."""
    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        have = set(next(ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")))
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu} ({os.cpu_count()} cores; {' '.join(flags) or 'no AVX2'}), no GPU"


def versions() -> dict:
    """{"python", "torch", "deepspeed"}: each its version, or "not installed"."""
    def version(p):
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return {"python": platform.python_version(), **{p: version(p) for p in ("torch", "deepspeed")}}
