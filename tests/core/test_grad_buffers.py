"""The flat gradient buffer a reduction reads: laid out once, its memory held only while
a reduction or a step needs it.

Every stage keeps the buffer object and its per-parameter views (laid out once, flat_param.py)
but frees its storage once nothing reads it: ZeRO-1/2/3 after each reduce-scatter (the step
reads the reduced slice, a buffer of its own), stage 0 after the step (its all-reduced buffer is
what the step reads). So between steps no rank holds
a flat gradient beside the parameters' own, which is what memory.held_bytes measures and the
layout formulas and DeepSpeed say."""
import pytest
import torch

from minizero.memory import held_bytes
from tests.support.harness import SyntheticBatches, make_config, micro_engine


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_and_zero1_hold_no_gradient_buffer_after_the_step(stage, dtype):
    engine, model = micro_engine(make_config(stage, dtype, micro_batch=2, lr=1e-3))
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    flats = engine.zero.flat_params
    first = None
    for step in range(3):
        x, y = batches(step, 0, 0, 1)
        engine.backward(engine(x, y)[1])
        # the end of backward: every parameter's own gradient, and no flat buffer beside them
        assert held_bytes(engine)["grads"] == sum(p.grad.untyped_storage().nbytes() for f in flats for p in f.params)
        engine.step()
        buffers = [f.grad_buffer for f in flats]
        assert all(b is not None and b.untyped_storage().nbytes() == 0 for b in buffers)   # reduced, then freed
        first = first or buffers
        assert all(a is b for a, b in zip(first, buffers))   # the same buffer objects (and views) every step
        assert held_bytes(engine)["grads"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_zero3_release_the_gradient_buffer_after_each_reduction(stage):
    engine, model = micro_engine(make_config(stage, "fp32", micro_batch=2, lr=1e-3))
    batches = SyntheticBatches(model.config.vocab_size, model.config.block_size, 2)
    flats = engine.zero.flat_params
    for step in range(2):
        x, y = batches(step, 0, 0, 1)
        engine.backward(engine(x, y)[1])
        buffers = [f.grad_buffer for f in flats]
        assert all(b is not None for b in buffers)   # every FlatParam was reduced from its buffer
        assert all(b.untyped_storage().nbytes() == 0 for b in buffers)   # and holds none of it now
        engine.step()
