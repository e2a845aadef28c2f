"""Stage 0 and ZeRO-1 on a CPU reduce every step from the same flat gradient buffer.

A fresh buffer per step is an mmap of the whole bucket (glibc maps blocks over 32 MB) that
the kernel zeroes page by page: flat_param.py keeps it instead (keep_grad_buffer). ZeRO-2/3
must not hold a full gradient between reductions: they keep the buffer's layout (its views)
but release its storage as soon as each reduction has read it."""
import pytest
import torch

from tests.support.harness import SyntheticBatches, make_config, micro_engine


def reduced_buffers(stage: int, dtype: str, steps: int = 3) -> list[list[torch.Tensor]]:
    """Per step, the flat gradient buffers the reduction read (held here, so a new
    allocation could not land at a freed one's address)."""
    engine, model = micro_engine(make_config(stage, dtype, micro_batch=2, lr=1e-3))
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    seen: list[list[torch.Tensor]] = []
    flats = engine.stage.flat_params
    for f in flats:
        grad = f.flat_grad
        f.flat_grad = lambda *a, _grad=grad, **k: seen[-1].append(_grad(*a, **k)) or seen[-1][-1]
    for step in range(steps):
        seen.append([])
        x, y = batches(step, 0, 0, 1)
        engine.backward(engine(x, y)[1])
        engine.step()
    return seen


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_and_zero1_reuse_one_gradient_buffer(stage, dtype):
    seen = reduced_buffers(stage, dtype)
    assert all(len(s) == len(seen[0]) > 0 for s in seen)
    for later in seen[1:]:
        for a, b in zip(seen[0], later):
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_zero3_release_the_gradient_buffer_after_each_reduction(stage):
    engine, model = micro_engine(make_config(stage, "fp32", micro_batch=2, lr=1e-3))
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    flats = engine.stage.flat_params
    for step in range(2):
        x, y = batches(step, 0, 0, 1)
        engine.backward(engine(x, y)[1])
        buffers = [f._grad_buffer for f in flats]
        assert all(b is not None for b in buffers)   # every FlatParam was reduced from its buffer
        assert all(b.untyped_storage().nbytes() == 0 for b in buffers)   # and holds none of it now
        engine.step()
