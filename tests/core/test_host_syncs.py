"""One host sync per optimizer step, and none per evaluation batch.

On a GPU every read of a device value into Python (`.item()`, `float(t)`, `.tolist()`,
`bool(t)`) and every `torch.tensor(x, device=...)` (a blocking copy from pageable host
memory) stops the CPU until the GPU catches up, so the CPU can no longer queue work ahead.
The engine's step has one such sync by design: the gradient norm (and, in fp16, the
overflow vote) read on the host to decide whether to skip the step (engine._take_model_step).

On a CPU nothing syncs, but the calls that would are the same calls: a TorchFunctionMode
counts them during engine.step() and during evaluation. Tensors that live on the host on a
GPU too are not counted: ones made here from Python numbers without a device, and Adam's
`step` counters (a CPU scalar for torch's non-fused Adam, read by its own code) and their
copies (adam.py steps each slice with a copy of its master's counter).
On a GPU, launch/gpu_check.py's `sync-debug` check runs a step under
torch.cuda.set_sync_debug_mode("error") to confirm.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support.harness import SyntheticBatches, make_config, micro_engine

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__,
         torch.Tensor.__int__}
UPLOADS = {torch.tensor, torch.as_tensor}


def _in_torch_optim() -> bool:
    """Called from torch's own Adam? Its foreach path on host tensors makes a host scalar
    (`torch.tensor(1.0, device="cpu")`) to step its counters: no sync on any machine, and on a
    GPU, where the masters live on the device, that path is not taken."""
    import sys
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/optim/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


class HostSyncs(TorchFunctionMode):
    """Counts reads of device values and uploads from Python numbers (see the module docstring)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.reads, self.uploads = [], []
        self.host = {id(t): t for t in host_tensors}   # kept alive here, so ids stay theirs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in UPLOADS:
            if kwargs.get("device") is not None and not _in_torch_optim():
                self.uploads.append(func.__name__)
            elif torch.is_tensor(out):
                self.host[id(out)] = out
        elif func in READS and self.host.get(id(args[0])) is not args[0]:
            self.reads.append(func.__name__)
        elif func is torch.Tensor.clone and self.host.get(id(args[0])) is args[0]:
            self.host[id(out)] = out   # a copy of a host counter (Adam's step, per slice) is one too
        return out


def _step_under_count(dtype: str):
    cfg = make_config(1, dtype, micro_batch=2, lr=1e-3, clip=1.0)
    engine, model = micro_engine(cfg)
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    counts = []
    for step in range(2):   # the second step: Adam's state exists, as in every later step
        x, y = batches(step, 0, 0, 1)
        _, loss = engine(x, y)
        engine.backward(loss)
        steps = [st["step"] for st in engine.optimizer.state.values() if "step" in st]
        with HostSyncs(steps) as seen:
            engine.step()
        counts.append((seen.reads, seen.uploads))
    return counts


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_step_reads_the_host_once(dtype):
    # Before: bf16/fp32 also uploaded the loss scale (torch.tensor(scale, device=...)); fp16
    # uploaded the overflow flag too and read the vote with a second .item().
    for reads, uploads in _step_under_count(dtype):
        assert len(reads) == 1 and uploads == [], (reads, uploads)


def test_evaluation_reads_the_host_once_not_per_batch():
    from minizero.train import runlog
    cfg = make_config(0, "fp32", micro_batch=2, lr=1e-3)
    engine, model = micro_engine(cfg)
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    loader = [batches(i, 0, 0, 1) for i in range(4)]
    with HostSyncs() as seen:
        runlog.evaluate(engine, loader, torch.device("cpu"))
    assert len(seen.reads) == 1 and seen.uploads == [], (seen.reads, seen.uploads)
