"""minizero.checkpointing against no checkpointing (no DeepSpeed here).

"Identical" below means bitwise (torch.equal): the recompute replays the same ops on the
same inputs with the same RNG state, so nothing may differ, not even rounding.
"""
import copy
import json
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minizero.checkpointing.buffers as cb
import minizero.checkpointing as ck
from minizero.checkpointing import checkpoint, configure
from minizero.observe.saved_bytes import count_saved_bytes, saved_bytes_for_backward
from minizero.gpt.model import GPT, get_preset


@pytest.fixture(autouse=True)
def fresh_config():
    """Every test starts (and leaves) with DeepSpeed's defaults, unconfigured."""
    ck._cfg, ck._configured = ck.ActivationCheckpointingConfig(), False
    ck.reset()
    yield
    ck._cfg, ck._configured = ck.ActivationCheckpointingConfig(), False
    ck.reset()


class Block(nn.Module):
    """A small pre-LN MLP block with dropout: enough to need the RNG replay."""

    def __init__(self, d=16, p=0.3):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(self.drop(F.gelu(self.fc1(self.ln(x))))))


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def _assert_all_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x is not None and y is not None
        assert x.dtype == y.dtype and torch.equal(x, y)


def _run_stack(blocks, x0, use_ckpt, seed=1234):
    """Forward a stack of blocks (dropout on), backward, and return everything to compare,
    including the next numbers the global RNG draws after the step."""
    blocks = copy.deepcopy(blocks).train()
    x = x0.clone().requires_grad_()
    torch.manual_seed(seed)
    h = x
    for b in blocks:
        h = checkpoint(b, h) if use_ckpt else b(h)
    h.float().pow(2).mean().backward()
    return h.detach(), x.grad, _grads(blocks), torch.rand(8)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_outputs_grads_and_rng_stream_identical_with_dropout(p):
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(p=p) for _ in range(3)])
    x0 = torch.randn(4, 5, 16)
    ref = _run_stack(blocks, x0, use_ckpt=False)
    out = _run_stack(blocks, x0, use_ckpt=True)
    assert torch.equal(ref[0], out[0])
    assert torch.equal(ref[1], out[1])           # input grad
    _assert_all_equal(ref[2], out[2])            # parameter grads
    # The recompute replayed the forward's RNG state and then restored the one backward
    # found: the training RNG stream continues exactly as without checkpointing.
    assert torch.equal(ref[3], out[3])


def test_dropout_masks_really_are_replayed():
    """Control: recomputing *without* restoring the RNG would give different gradients."""
    torch.manual_seed(0)
    block = Block(p=0.5).train()
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(1)
    y = checkpoint(block, x)
    y.sum().backward()
    g_ckpt = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    block(x).sum().backward()
    assert torch.equal(g_ckpt, x.grad)
    x.grad = None
    torch.manual_seed(2)  # other masks -> other gradient: the test above is not vacuous
    block(x).sum().backward()
    assert not torch.equal(g_ckpt, x.grad)


def test_non_tensor_args_and_multiple_outputs():
    torch.manual_seed(0)
    block = Block(p=0.2).train()
    x0, y0 = torch.randn(3, 16), torch.randn(3, 16)
    mask = torch.tensor([1, 0, 1])

    def run(use_ckpt):
        b = copy.deepcopy(block)

        def f(x, scale, tag, y, mask):  # tensors, a float, a str, an integer tensor
            h = b(x) * scale
            return h, tag, (h * y).sum(-1), torch.argmax(h, -1), mask.sum()

        x = x0.clone().requires_grad_()
        y = y0.clone().requires_grad_()
        torch.manual_seed(7)
        out = checkpoint(f, x, 0.5, "tag", y, mask) if use_ckpt else f(x, 0.5, "tag", y, mask)
        (out[0].sum() + out[2].pow(2).sum()).backward()
        return out, x.grad, y.grad, _grads(b)

    ref, out = run(False), run(True)
    assert isinstance(out[0], tuple) and len(out[0]) == 5
    assert out[0][1] == "tag"                                # non-tensor output passed through
    for a, b in zip(ref[0][:1] + ref[0][2:], out[0][:1] + out[0][2:]):
        assert torch.equal(a.detach(), b.detach())
    assert out[0][3].dtype == torch.int64 and not out[0][3].requires_grad  # non-differentiable
    assert torch.equal(ref[1], out[1]) and torch.equal(ref[2], out[2])
    _assert_all_equal(ref[3], out[3])


def test_input_that_does_not_require_grad_gets_none_and_params_still_get_grads():
    torch.manual_seed(0)
    block = Block().train()
    x = torch.randn(2, 16, requires_grad=True)
    c = torch.randn(2, 16)  # a constant input

    torch.manual_seed(3)
    checkpoint(lambda a, b: block(a + b), x, c).sum().backward()
    gx, gp = x.grad.clone(), _grads(block)
    block.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(3)
    block(x + c).sum().backward()
    assert torch.equal(gx, x.grad) and c.grad is None
    _assert_all_equal(gp, _grads(block))


def test_keyword_arguments():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.randn(2, 4, requires_grad=True)
    checkpoint(lambda a, b=None: lin(a) * b, x, b=y).sum().backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    (lin(x) * y).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gy, y.grad)


def test_no_grad_and_eval_run_the_function_plainly():
    block = Block().train()
    x = torch.randn(2, 16, requires_grad=True)
    with torch.no_grad():
        torch.manual_seed(0)
        y = checkpoint(block, x)
        torch.manual_seed(0)
        assert torch.equal(y, block(x)) and y.grad_fn is None


def test_in_place_change_of_a_saved_input_is_caught():
    """save_for_backward gives us autograd's version-counter check for free (DeepSpeed's
    ctx attribute does not: it would silently recompute from the modified tensor)."""
    block = Block()
    x = torch.randn(2, 16, requires_grad=True)
    h = x * 1.0
    y = checkpoint(block, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_autograd_grad_is_rejected():
    block = Block()
    x = torch.randn(2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.autograd.grad(checkpoint(block, x).sum(), x)


# ----------------------------------------------------------------------------- the GPT

def _gpt_step(model, idx, targets, ckpt_fn, seed=99, dtype=None):
    m = copy.deepcopy(model).train()
    if dtype is not None:
        m = m.to(dtype)
    m.checkpoint_fn = ckpt_fn
    torch.manual_seed(seed)
    logits, loss = m(idx, targets)
    loss.backward()
    return logits.detach(), loss.detach(), [(n, p.grad) for n, p in m.named_parameters()], torch.rand(4)


def _tiny():
    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    return model, idx, targets


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_gpt_identical_with_and_without_checkpointing(dtype):
    model, idx, targets = _tiny()
    ref = _gpt_step(model, idx, targets, None, dtype=dtype)
    out = _gpt_step(model, idx, targets, checkpoint, dtype=dtype)
    assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    for (n, a), (_, b) in zip(ref[2], out[2]):
        assert a.dtype == b.dtype == (dtype or torch.float32), n
        assert torch.equal(a, b), n
    assert torch.equal(ref[3], out[3])  # RNG stream after the step


def test_cpu_checkpointing_moves_inputs_to_cpu_and_back(monkeypatch):
    model, idx, targets = _tiny()
    offloaded, restored = [], []
    real_offload, real_restore = cb.offload_to_cpu, cb.restore_to_device

    def spy_offload(t):
        out = real_offload(t)
        offloaded.append((tuple(t.shape), out.device))
        return out

    def spy_restore(t, device):
        out = real_restore(t, device)
        restored.append((t.device, out.device))
        return out

    monkeypatch.setattr(cb, "offload_to_cpu", spy_offload)
    monkeypatch.setattr(cb, "restore_to_device", spy_restore)
    configure(None, checkpoint_in_cpu=True)
    ref = _gpt_step(model, idx, targets, None)
    out = _gpt_step(model, idx, targets, checkpoint)
    n_layer, C = model.config.n_layer, model.config.n_embd
    # every block input went through the CPU move in forward and came back in backward
    assert offloaded == [((2, idx.shape[1], C), torch.device("cpu"))] * n_layer
    assert restored == [(torch.device("cpu"), torch.device("cpu"))] * n_layer
    assert torch.equal(ref[1], out[1])
    for (n, a), (_, b) in zip(ref[2], out[2]):
        assert torch.equal(a, b), n


def test_partition_and_contiguous_give_identical_grads_and_use_one_buffer():
    model, idx, targets = _tiny()
    n_layer = model.config.n_layer
    configure(None, deepspeed_config={"activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True,
        "contiguous_memory_optimization": True, "number_checkpoints": n_layer}})
    ref = _gpt_step(model, idx, targets, None)

    m = copy.deepcopy(model).train()
    m.checkpoint_fn = checkpoint
    torch.manual_seed(99)
    _, loss = m(idx, targets)
    # all block inputs were copied into the slots of one [n_layer, numel] buffer
    assert len(ck._buffers) == 1 and ck._buffers[0].shape == (n_layer, idx.numel() * model.config.n_embd)
    assert ck._offsets == [n_layer]
    loss.backward()
    assert ck._buffers == []  # dropped at the first backward, as DeepSpeed does
    assert torch.equal(ref[1], loss.detach())
    for (n, a), (_, p) in zip(ref[2], m.named_parameters()):
        assert torch.equal(a, p.grad), n


def test_contiguous_overflow_is_a_clear_error():
    configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    block = Block()
    x = torch.randn(2, 16, requires_grad=True)
    checkpoint(block, x)
    with pytest.raises(RuntimeError, match="number_checkpoints=1"):
        checkpoint(block, x)
    ck.reset()
    checkpoint(block, x)  # reset() frees the slots


# ----------------------------------------------------------------------------- memory

def test_saved_bytes_counter_dedups_storages():
    x = torch.randn(10, 10, requires_grad=True)
    with count_saved_bytes() as c:
        y = x.exp()       # saves its output (400 bytes)
        z = y[:5] * y[5:]  # saves two views of y: same storage, counted once
    assert c.bytes == 400
    del z


def test_gpt_saved_bytes_reduction_is_exactly_the_block_inputs():
    model, idx, targets = _tiny()
    model.train()
    params = list(model.parameters())

    without = saved_bytes_for_backward(lambda: model(idx, targets), exclude=params)
    model.checkpoint_fn = checkpoint
    with_ckpt = saved_bytes_for_backward(lambda: model(idx, targets), exclude=params)
    assert with_ckpt < without

    # Independently: make the blocks save nothing (their work runs under no_grad and is
    # added back with an `add`, which saves nothing), and add up what the rest of the
    # model (embedding dropout, ln_f, head, loss) saves and the blocks' inputs.
    block_inputs = []

    def opaque(block, x):
        block_inputs.append(x.untyped_storage().nbytes())
        with torch.no_grad():
            delta = block(x) - x
        return x + delta

    model.checkpoint_fn = opaque
    rest = saved_bytes_for_backward(lambda: model(idx, targets), exclude=params)
    L, T, C = model.config.n_layer, idx.shape[1], model.config.n_embd
    assert block_inputs == [idx.shape[0] * T * C * 4] * L
    assert with_ckpt == rest + sum(block_inputs)


# ----------------------------------------------------------------------------- configure

def test_configure_from_dict_and_json_and_kwargs_override(tmp_path):
    assert not ck.is_configured()
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}
    configure(None, deepspeed_config={"train_batch_size": 8, "activation_checkpointing": section})
    assert ck.is_configured() and ck.get_config() == ck.ActivationCheckpointingConfig(**section)

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": section}))
    configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False, num_checkpoints=7, profile=False)
    cfg = ck.get_config()
    assert cfg.cpu_checkpointing is False and cfg.number_checkpoints == 7 and cfg.profile is False
    assert cfg.partition_activations is True  # from the file

    configure(None)  # every call starts from the defaults, as DeepSpeed's _configure_defaults
    assert ck.get_config() == ck.ActivationCheckpointingConfig()


def test_configure_from_the_parsed_section():
    """What the engine does: the section load_config parsed, not the raw dict again."""
    from minizero.config import load_config
    section = load_config({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": True}},
                          1).activation_checkpointing
    ck.configure_from(section)
    assert ck.is_configured() and ck.get_config() is section and section.cpu_checkpointing
    with pytest.raises(AssertionError, match="Must specify the number of layers"):
        ck.configure_from(ck.ActivationCheckpointingConfig(partition_activations=True,
                                                           contiguous_memory_optimization=True))


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(ValueError, match="partitioned_activations"):
        configure(None, deepspeed_config={"activation_checkpointing": {"partitioned_activations": True}})
    with pytest.raises(ValueError, match="activation_checkpointing.profile must be true or false"):
        configure(None, deepspeed_config={"activation_checkpointing": {"profile": "yes"}})


def test_contiguous_needs_partition_and_number_checkpoints_as_in_deepspeed():
    with pytest.raises(AssertionError, match="Contiguous Checkpointing is only available with partitioned activations"):
        configure(None, deepspeed_config={"activation_checkpointing": {"contiguous_memory_optimization": True}})
    with pytest.raises(AssertionError, match="Must specify the number of layers"):
        configure(None, partition_activations=True, contiguous_checkpointing=True)


def test_model_parallel_mpu_is_refused():
    class MPU:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(NotImplementedError, match="data-parallel only"):
        configure(MPU())
    configure(None)  # the refused mpu was not kept


def test_configure_explains_options_once_in_the_log_and_profile_times(caplog):
    with caplog.at_level(logging.INFO, logger="minizero.checkpointing"):
        configure(None, partition_activations=True, checkpoint_in_cpu=True, synchronize=True, profile=True)
    text = caplog.text
    assert text.count("activation checkpointing (Chen et al. 2016)") == 1
    assert "model-parallel" in text and "no-op" in text
    caplog.clear()
    block = Block()
    x = torch.randn(2, 16, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="minizero.checkpointing"):
        checkpoint(block, x).sum().backward()
    t = ck.timings()
    assert t["calls"] >= 1 and t["forward_s"] > 0 and t["recompute_s"] > 0 and t["backward_s"] > 0
    assert "checkpoint forward:" in caplog.text and "recompute:" in caplog.text
    assert "(Chen et al. 2016)" not in caplog.text  # the explanation is not repeated per call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("contiguous", [False, True])
def test_cuda_cpu_checkpointing_pins_and_restores(contiguous):
    """On a GPU the saved inputs go to pinned host memory and come back by asynchronous
    copies. No synchronize: stream order alone must make everything identical."""
    n = 3
    configure(None, partition_activations=True, checkpoint_in_cpu=True, contiguous_checkpointing=contiguous,
              num_checkpoints=n if contiguous else None, synchronize=False)
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(d=256) for _ in range(n)]).cuda()
    x0 = torch.randn(512, 256, device="cuda")  # 512 KB per input: copies long enough to race
    ref = _run_stack(blocks, x0, use_ckpt=False)
    out = _run_stack(blocks, x0, use_ckpt=True)
    for a, b in zip(ref[:2], out[:2]):
        assert torch.equal(a, b)
    _assert_all_equal(ref[2], out[2])
    assert torch.equal(ref[3], out[3])

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        checkpoint(blocks[0], x0.clone().requires_grad_())
    assert [(t.device.type, t.is_pinned()) for t in saved] == [("cpu", True)]
    if contiguous:
        buf = ck._buffers[0]
        assert buf.is_pinned() and saved[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_checkpointing_forward_on_a_side_stream():
    """Forward (and its copies to the host) on a side stream, backward called from the
    default one. Autograd runs a node's backward on its forward's stream, so the copies
    back normally follow the copies out on one stream; where they do not, backward waits
    for an event recorded after them. Either way the gradients are identical."""
    configure(None, checkpoint_in_cpu=True, synchronize=False)
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(d=256) for _ in range(3)]).cuda()
    x0 = torch.randn(512, 256, device="cuda")
    ref = _run_stack(blocks, x0, use_ckpt=False)

    blocks = copy.deepcopy(blocks).train()
    x = x0.clone().requires_grad_()
    torch.manual_seed(1234)  # as _run_stack
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        h = x
        for b in blocks:
            h = checkpoint(b, h)
        loss = h.float().pow(2).mean()
    torch.cuda.current_stream().wait_stream(side)
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(ref[1], x.grad)
    _assert_all_equal(ref[2], _grads(blocks))


def test_in_recompute_flag_is_set_only_during_the_recompute():
    seen = []
    block = Block()
    block.register_forward_pre_hook(lambda m, a: seen.append(ck.in_recompute()))
    x = torch.randn(2, 16, requires_grad=True)
    y = checkpoint(block, x)
    assert seen == [False] and not ck.in_recompute()
    y.sum().backward()
    assert seen == [False, True] and not ck.in_recompute()  # the forward hook fired again, in backward


def test_a_checkpointed_step_on_cpu_never_asks_whether_a_gpu_is_available(monkeypatch):
    """The forward, the recompute and the backward run once per block per micro-batch, so they
    ask torch.cuda.is_initialized() (a flag), not torch.cuda.is_available(): on a CUDA build
    without a GPU each is_available() call dlopens NVML and queries the driver again (it
    caches nothing before CUDA initializes). synchronize_checkpoint_boundary is on, so the
    boundary check runs too. The result is still the plain run's, bit for bit."""
    configure(None, synchronize=True)
    assert ck._cfg.synchronize_checkpoint_boundary
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x0 = torch.randn(4, 5, 16)
    plain, ckpt = _run_stack(blocks, x0, use_ckpt=False), _run_stack(blocks, x0, use_ckpt=True)
    assert calls == []
    assert torch.equal(plain[0], ckpt[0]) and torch.equal(plain[1], ckpt[1])   # output, input grad
    _assert_all_equal(plain[2], ckpt[2])                                          # parameter grads
    assert torch.equal(plain[3], ckpt[3])                                         # the RNG stream after
