"""The GPT: parameter counts the docs quote, causality, the param-group split ZeRO relies on,
and the activation-checkpointing hook."""
import pytest
import torch
import torch.nn as nn

from minizero.gpt.model import (GPT, PRESETS, GPTConfig, ModelConfigError, SequenceTooLongError,
                            UnknownPresetError, get_preset, sample)


def group_sizes(model):
    return [sum(p.numel() for p in g["params"]) for g in model.configure_param_groups(0.1)]


def test_tutorial_preset_has_the_tutorials_parameter_count():
    # minGPT's play_image notebook logs "number of parameters: 1.000166e+07".
    assert GPT(get_preset("tutorial")).num_params() == 10_001_664


def test_tutorial_24_preset_is_the_tutorial_gpt_at_24_layers_without_dropout():
    """Step 5's model: the tutorial GPT with n_layer 24 and its GPTConfig's dropouts of 0.0.
    Each extra block is 12 E^2 + 13 E = 789,760 parameters at E = 256, so the count is the
    12-layer one plus 12 such blocks."""
    cfg, base = get_preset("tutorial-24"), get_preset("tutorial")
    assert (cfg.vocab_size, cfg.block_size, cfg.n_head, cfg.n_embd) == (base.vocab_size, base.block_size,
                                                                        base.n_head, base.n_embd)
    assert cfg.n_layer == 24 and (cfg.embd_pdrop, cfg.resid_pdrop, cfg.attn_pdrop) == (0.0, 0.0, 0.0)
    model = GPT(cfg)
    assert model.num_params() == 19_478_784 == 10_001_664 + 12 * (12 * 256 ** 2 + 13 * 256)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert all(blk.attn.attn_pdrop == 0.0 for blk in model.blocks)
    # the 12-layer preset keeps minGPT's default dropout 0.1
    assert (base.embd_pdrop, base.resid_pdrop, base.attn_pdrop) == (0.1, 0.1, 0.1)


@pytest.mark.parametrize("name,total,decay,no_decay", [
    ("tiny", 108_801, 99_162, 9_639),
    ("micro", 15_099, 11_886, 3_213),
])
def test_test_presets_have_odd_counts_that_need_zero_padding(name, total, decay, no_decay):
    model = GPT(get_preset(name))
    assert model.num_params() == total
    assert group_sizes(model) == [decay, no_decay]
    assert total % 2 == 1  # never splits evenly over 2 or 4 ranks
    assert decay % 4 != 0 and no_decay % 4 != 0  # nor does either param group over 4


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    cfg = get_preset("micro")
    model = GPT(cfg).eval()
    idx = torch.randint(cfg.vocab_size, (3, cfg.block_size))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # Small init: predictions start near uniform, loss ~ ln(vocab). With logits of standard
    # deviation s (init std 0.02 times the LayerNorm'd input's norm, sqrt(n_embd) = 4.6:
    # s ~ 0.1) the expected loss is ln(vocab) + s^2/2 ~ ln(vocab) + 0.005; 0.2 is a sanity
    # margin for a 3-row sample, not a rounding tolerance (rounding moves it by ~1e-6).
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.2
    assert model(idx[:, :5])[1] is None


def test_loss_is_float32_even_for_bf16_logits():
    model = GPT(get_preset("micro")).to(torch.bfloat16).eval()
    idx = torch.randint(62, (2, 10))
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_too_long_sequence_is_a_clear_error():
    model = GPT(get_preset("micro"))
    with pytest.raises(SequenceTooLongError, match="block_size 63"):
        model(torch.zeros(1, 64, dtype=torch.long))


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(get_preset("micro")).eval()
    a = torch.randint(62, (1, 63))
    b = a.clone()
    b[0, 40:] = (b[0, 40:] + 1) % 62
    la, lb = model(a)[0], model(b)[0]
    # Bitwise: both calls have the same shapes, so every kernel sums in the same order;
    # each position's linear layers and LayerNorms see only that position, and the causal
    # attention gives future keys weight exp(-inf) = 0 exactly, so their values add 0.
    assert torch.equal(la[:, :40], lb[:, :40])
    assert not torch.equal(la[:, 40:], lb[:, 40:])
    assert not torch.equal(la[:, 40], lb[:, 40])   # the first changed position does change


def test_param_groups_cover_every_param_once_with_mingpt_split():
    model = GPT(get_preset("micro"))
    decay, no_decay = model.configure_param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))

    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in decay["params"]} == linear_weights
    assert id(model.pos_emb) in {id(p) for p in no_decay["params"]}
    assert id(model.tok_emb.weight) in {id(p) for p in no_decay["params"]}

    # Deterministic order: each group follows named_parameters() order.
    order = {id(p): i for i, p in enumerate(model.parameters())}
    for g in (decay, no_decay):
        pos = [order[id(p)] for p in g["params"]]
        assert pos == sorted(pos)


def test_checkpoint_hook_called_once_per_block_in_training_only():
    calls = []

    def fake_checkpoint(block, x):
        calls.append(block)
        return block(x)

    model = GPT(get_preset("micro"))
    model.checkpoint_fn = fake_checkpoint
    idx = torch.randint(62, (2, 63))
    model.train()
    _, loss = model(idx, idx)
    loss.backward()
    assert calls == list(model.blocks)
    calls.clear()
    model.eval()
    model(idx)
    assert calls == []


def test_sample_shape_and_mode_restored():
    torch.manual_seed(0)
    model = GPT(get_preset("micro")).train()
    out = sample(model, torch.zeros(2, 1, dtype=torch.long), steps=70, temperature=1.0, top_k=5)
    assert out.shape == (2, 71)  # 71 > block_size: the context was cropped
    assert out.min() >= 0 and out.max() < 62
    assert model.training


def test_bad_preset_and_config_errors():
    with pytest.raises(UnknownPresetError, match="tiny"):
        get_preset("huge")
    with pytest.raises(ModelConfigError, match="divisible"):
        get_preset("tiny", n_head=4)
    with pytest.raises(ModelConfigError, match="n_embd"):
        get_preset("tiny", n_embed=64)
    assert get_preset("tiny", block_size=255).block_size == 255
    assert PRESETS["tiny"].block_size == 63  # overrides copy, never mutate the preset
    assert isinstance(PRESETS["igpt-s"], GPTConfig)
