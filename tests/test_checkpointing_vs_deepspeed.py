"""minizero.checkpointing against deepspeed.checkpointing on the same GPT, single process.

DeepSpeed's `configure` calls `dist.get_rank()`, so a 1-rank gloo group is started for
this module (reference.activation_bytes.ds_init_single_process). DeepSpeed's checkpoint
state is module-global; every test configures both libraries explicitly.
"""
import copy
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import minizero.checkpointing as ck  # noqa: E402
from minizero.checkpointing import count_saved_bytes  # noqa: E402
from minizero.model import GPT, get_preset  # noqa: E402
from reference.activation_bytes import ds_ctx_inputs_counted, ds_init_single_process  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def process_group():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    ds_init_single_process()
    yield
    deepspeed.checkpointing.configure(None, deepspeed_config={"train_batch_size": 1})
    ck._cfg, ck._configured = ck.CheckpointConfig(), False
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def _configure_both(section):
    cfg = {"train_batch_size": 1, "activation_checkpointing": section}
    deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
    ck.configure(None, deepspeed_config=cfg)


def _tiny(pdrop=0.3):
    torch.manual_seed(0)
    cfg = get_preset("tiny", embd_pdrop=pdrop, resid_pdrop=pdrop, attn_pdrop=pdrop)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    return model, idx, targets


def _step(model, idx, targets, ckpt_fn, dtype=None):
    m = copy.deepcopy(model).train()
    if dtype is not None:
        m = m.to(dtype)
    m.checkpoint_fn = ckpt_fn
    torch.manual_seed(42)
    logits, loss = m(idx, targets)
    loss.backward()
    return logits.detach(), loss.detach(), [(n, p.grad) for n, p in m.named_parameters()], torch.rand(4)


# DeepSpeed's cpu_checkpointing *alone* crashes on its CPU accelerator: the "CPU copy" of a
# CPU input is the input itself, which get_cpu_activations_for_backward then empties
# (arg.data = torch.empty([])), so the recompute sees a 0-d tensor. It works combined with
# partition_activations (whose copy is a real clone). So that combination is compared.
SECTIONS = {
    "defaults": {},
    "partition": {"partition_activations": True},
    "partition+cpu": {"partition_activations": True, "cpu_checkpointing": True},
    "partition+contiguous": {"partition_activations": True, "contiguous_memory_optimization": True,
                             "number_checkpoints": 2},
    "sync+profile": {"synchronize_checkpoint_boundary": True, "profile": True},
}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_same_outputs_grads_and_rng_as_deepspeed_with_dropout(name):
    _configure_both(SECTIONS[name])
    model, idx, targets = _tiny()
    plain = _step(model, idx, targets, None)
    mz = _step(model, idx, targets, ck.checkpoint)
    ds = _step(model, idx, targets, deepspeed.checkpointing.checkpoint)
    for other in (mz, plain):
        assert torch.equal(ds[0], other[0]) and torch.equal(ds[1], other[1])
        for (n, a), (_, b) in zip(ds[2], other[2]):
            assert torch.equal(a, b), n
        assert torch.equal(ds[3], other[3])  # both leave the RNG stream as no checkpointing does


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_same_as_deepspeed_in_low_precision(dtype):
    _configure_both({})
    model, idx, targets = _tiny()
    mz = _step(model, idx, targets, ck.checkpoint, dtype=dtype)
    ds = _step(model, idx, targets, deepspeed.checkpointing.checkpoint, dtype=dtype)
    assert torch.equal(ds[1], mz[1])
    for (n, a), (_, b) in zip(ds[2], mz[2]):
        assert a.dtype == dtype and torch.equal(a, b), n


def test_deepspeed_cpu_checkpointing_alone_is_broken_on_cpu_and_ours_is_not():
    """Documents the DeepSpeed bug named above, so we notice when it is fixed."""
    _configure_both({"cpu_checkpointing": True})
    model, idx, targets = _tiny()
    with pytest.raises((RuntimeError, ValueError)):
        _step(model, idx, targets, deepspeed.checkpointing.checkpoint)
    plain = _step(model, idx, targets, None)
    mz = _step(model, idx, targets, ck.checkpoint)
    assert torch.equal(plain[1], mz[1])


def _bytes(model, idx, targets, ckpt_fn, count_ds_ctx=False):
    m = copy.deepcopy(model).train()
    m.checkpoint_fn = ckpt_fn
    torch.manual_seed(1)
    with count_saved_bytes(exclude=m.parameters()) as c:
        with ds_ctx_inputs_counted(c) if count_ds_ctx else _null():
            _, loss = m(idx, targets)
    return c.bytes


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["defaults", "partition"])
def test_minizero_holds_no_more_bytes_for_backward_than_deepspeed(name):
    _configure_both(SECTIONS[name])
    model, idx, targets = _tiny()
    L, T, C = model.config.n_layer, idx.shape[1], model.config.n_embd
    block_inputs = L * idx.shape[0] * T * C * 4

    plain = _bytes(model, idx, targets, None)
    mz = _bytes(model, idx, targets, ck.checkpoint)
    ds_hooks = _bytes(model, idx, targets, deepspeed.checkpointing.checkpoint)
    ds = _bytes(model, idx, targets, deepspeed.checkpointing.checkpoint, count_ds_ctx=True)

    # With partition_activations DeepSpeed also keeps each input's shape as an int64 tensor
    # (get_partitioned_activations_for_backward: torch.tensor(arg.size())), 3 dims x 8 bytes.
    shapes = L * 3 * 8 if name == "partition" else 0
    # saved_tensors_hooks alone miss exactly what DeepSpeed keeps on ctx ...
    assert ds - ds_hooks == block_inputs + shapes
    # ... counted by hand, DeepSpeed holds what minizero holds, both far below no checkpointing
    assert mz <= ds
    assert mz + shapes == ds
    assert mz < plain
