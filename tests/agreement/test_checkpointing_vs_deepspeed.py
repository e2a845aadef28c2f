"""minizero.checkpointing against deepspeed.checkpointing on the same GPT, single process.

DeepSpeed's `configure` calls `dist.get_rank()`, so a 1-rank gloo group is started for
this module (reference.activation_bytes.ds_init_single_process). DeepSpeed's checkpoint
state is module-global; every test configures both libraries explicitly.
"""
import collections
import copy
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import minizero.checkpointing as ck  # noqa: E402
from minizero.observe.saved_bytes import count_saved_bytes  # noqa: E402
from minizero.gpt.model import GPT, get_preset  # noqa: E402
from reference.activation_bytes import ds_ctx_inputs_counted, ds_init_single_process  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def process_group():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    ds_init_single_process()
    yield
    deepspeed.checkpointing.configure(None, deepspeed_config={"train_batch_size": 1})
    ck._cfg, ck._configured = ck.ActivationCheckpointingConfig(), False
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


# ----------------------------------------------------------------------------- what checkpoint returns

Pair = collections.namedtuple("Pair", "a b")

# checkpoint(f, x, w) must return what DeepSpeed's returns for the same f: same types, every
# member in its place, tensors bitwise with the same requires_grad, and the same gradients
# (which are also those of f without checkpointing). DeepSpeed's top-level rules
# (CheckpointFunction.forward + checkpoint): a tuple or list comes back as a tuple, and a
# one-member one as that member.
OUTPUT_KINDS = {
    "tensor": lambda x, w: x * w,
    "tuple of tensors": lambda x, w: (x * w, x.sin()),
    "1-tuple is its member": lambda x, w: (x * w,),
    "None/int/float/bool/str members": lambda x, w: (x * w, None, 3, 2.5, True, "s", x.sin()),
    "non-tensors first and last": lambda x, w: (None, "s", x * w, 0, x.sin(), False),
    "only non-tensors": lambda x, w: (1, None, "s"),
    "(None,) is None": lambda x, w: (None,),
    "empty tuple": lambda x, w: (),
    "list is a tuple": lambda x, w: [x * w, None, x.sin()],
    "1-list is its member": lambda x, w: [x * w],
    "namedtuple is a tuple": lambda x, w: Pair(x * w, None),
    "nested non-tensors": lambda x, w: ((1, None), x * w, [2.5, "s"]),
    "a tensor that does not require grad": lambda x, w: (x * w, x.detach() + 1),
    "only a tensor that does not require grad": lambda x, w: x.detach() + 1,
    "integer tensor member": lambda x, w: (x * w, (x > 0).long()),
    "integer tensor alone": lambda x, w: (x > 0).long(),
    "an input returned unchanged": lambda x, w: (x, x * w),
}


def _tensors(out):
    """The tensors in an output, at any depth, in order."""
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


def _call(ckpt_fn, f, grad=True):
    """(output, x.grad, w.grad) of ckpt_fn(f, x, w), or of f(x, w) when ckpt_fn is None."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    with torch.set_grad_enabled(grad):
        out = ckpt_fn(f, x, w) if ckpt_fn else f(x, w)
    loss = sum(((i + 1) * t).sum() for i, t in enumerate(_tensors(out)) if t.requires_grad)
    if grad and torch.is_tensor(loss):
        loss.backward()
    return out, x.grad, w.grad


def _assert_same(a, b, requires_grad=True):
    assert type(a) is type(b), (a, b)
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
        assert not requires_grad or a.requires_grad == b.requires_grad
    elif isinstance(a, (tuple, list, dict)):
        assert len(a) == len(b)
        if isinstance(a, dict):
            assert list(a) == list(b)
            a, b = list(a.values()), list(b.values())
        for x, y in zip(a, b):
            _assert_same(x, y, requires_grad)
    else:
        assert a == b


def _assert_same_grads(a, b):
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", list(OUTPUT_KINDS))
def test_returns_what_deepspeed_returns(kind, grad):
    _configure_both({})
    f = OUTPUT_KINDS[kind]
    ds = _call(deepspeed.checkpointing.checkpoint, f, grad)
    mz = _call(ck.checkpoint, f, grad)
    _assert_same(ds[0], mz[0])
    _assert_same_grads(ds[1:], mz[1:])
    _assert_same_grads(_call(None, f, grad)[1:], mz[1:])


# DeepSpeed bugs not copied (docs/activation_checkpointing.md, "What checkpoint returns").

@pytest.mark.parametrize("f", [lambda x, w: ((x * w, 7), [x.sin(), None], x.cos()),
                               lambda x, w: ((x * w, x.sin()),)], ids=["nested", "nested in a 1-tuple"])
def test_tensors_in_nested_outputs_keep_their_gradient_unlike_deepspeed(f):
    """DeepSpeed returns only the top-level tensors through its autograd.Function; a tensor
    inside a nested tuple/list comes back as computed under no_grad: detached, so its
    gradient is silently lost. minizero returns the same structure and values, connected."""
    _configure_both({})
    ds, mz, plain = _call(deepspeed.checkpointing.checkpoint, f), _call(ck.checkpoint, f), _call(None, f)
    _assert_same(ds[0], mz[0], requires_grad=False)
    assert not all(t.requires_grad for t in _tensors(ds[0]))  # DeepSpeed: some come back detached
    assert all(t.requires_grad for t in _tensors(mz[0]))
    _assert_same_grads(plain[1:], mz[1:])
    assert ds[1] is None or not torch.equal(plain[1], ds[1])  # DeepSpeed's x.grad misses their part


def test_dict_output_comes_back_as_the_dict_unlike_deepspeed_which_returns_its_keys():
    _configure_both({})

    def f(x, w):
        return {"a": x * w, "n": None, "b": x.sin()}

    assert _call(deepspeed.checkpointing.checkpoint, f)[0] == ("a", "n", "b")
    assert _call(deepspeed.checkpointing.checkpoint, lambda x, w: {"a": x * w})[0] == "a"
    mz, plain = _call(ck.checkpoint, f), _call(None, f)
    _assert_same(plain[0], mz[0])
    _assert_same_grads(plain[1:], mz[1:])


@pytest.mark.parametrize("ret", [None, 3, "ab"], ids=["None", "int", "str"])
def test_returning_no_tensor_sequence_or_dict_is_a_clear_error(ret):
    _configure_both({})
    x = torch.randn(2, requires_grad=True)
    if isinstance(ret, str):  # DeepSpeed iterates it: a string comes back as its characters
        assert deepspeed.checkpointing.checkpoint(lambda x: ret, x) == ("a", "b")
    else:
        with pytest.raises(TypeError, match="not iterable"):
            deepspeed.checkpointing.checkpoint(lambda x: ret, x)
    with pytest.raises(TypeError, match="checkpoint: the function must return a tensor"):
        ck.checkpoint(lambda x: ret, x)
