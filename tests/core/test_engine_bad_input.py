"""minizero.initialize on bad input: one clear, one-line error of a specific type that names
the offending key or number. Single process, no process group (world size 1)."""
import os

import pytest
import torch

import minizero
from minizero.config import ConfigError
from minizero.gpt.model import GPT, get_preset

pytestmark = pytest.mark.skipif("RANK" in os.environ, reason="needs a single process with no torchrun env")

OPT = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _model():
    torch.manual_seed(0)
    return GPT(get_preset("micro"))


def _init(cfg, **kw):
    return minizero.initialize(model=_model(), config=cfg, **kw)


def _one_line_error(exc_type, cfg, *needles, **kw):
    with pytest.raises(exc_type) as ei:
        _init(cfg, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def test_unknown_top_level_key_is_named():
    _one_line_error(ConfigError, {"train_batch_size": 4, "gradient_cliping": 1.0, "optimizer": OPT},
                    "'gradient_cliping'", "gradient_clipping")   # names it and lists the accepted one


def test_unknown_nested_key_is_named_with_its_path():
    _one_line_error(ConfigError, {"train_batch_size": 4, "optimizer": OPT,
                                  "zero_optimization": {"stage": 2, "reduce_bucket": 10}},
                    "zero_optimization.reduce_bucket")


@pytest.mark.parametrize("stage", [4, -1, 7])
def test_stage_outside_0_to_3(stage):
    _one_line_error(ConfigError, {"train_batch_size": 4, "optimizer": OPT, "zero_optimization": {"stage": stage}},
                    "zero_optimization.stage", str(stage))


def test_fp16_and_bf16_both_enabled():
    _one_line_error(ConfigError, {"train_batch_size": 4, "optimizer": OPT,
                                  "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16", "bf16")


def test_micro_batch_not_dividing_train_batch():
    _one_line_error(ConfigError, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4, "optimizer": OPT},
                    "train_batch_size 6", "train_micro_batch_size_per_gpu 4")


def test_inconsistent_batch_triple():
    _one_line_error(ConfigError, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": 3, "optimizer": OPT},
                    "train_batch_size 8", "gradient_accumulation_steps 3")


def test_missing_optimizer_section():
    msg = _one_line_error(ValueError, {"train_batch_size": 4}, "optimizer")
    assert "\"optimizer\"" in msg


def test_unknown_optimizer_type_is_named():
    _one_line_error(ConfigError, {"train_batch_size": 4, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}},
                    "'Lamb'")


def test_foreign_tensor_in_model_parameters():
    stranger = torch.nn.Parameter(torch.zeros(3))
    _one_line_error(ValueError, {"train_batch_size": 4, "optimizer": OPT}, "not a parameter of the model",
                    model_parameters=[stranger])


def test_non_scalar_loss_to_backward_names_the_shape():
    engine, *_ = _init({"train_batch_size": 2, "optimizer": OPT})
    x = torch.randint(0, 62, (2, 9))
    logits, _ = engine(x[:, :-1], x[:, 1:])
    with pytest.raises(ValueError, match=r"scalar loss.*\(2, 8, 62\)"):
        engine.backward(logits)


def test_unknown_key_with_none_near_lists_the_accepted_ones_on_the_same_line():
    # A typo gets "did you mean" alone (above); a key like no accepted one gets the list, so
    # the line still says what to write instead.
    _one_line_error(ConfigError, {"train_batch_size": 4, "zzz_widget": 1, "optimizer": OPT},
                    "'zzz_widget'", "accepted keys at the top level:", "gradient_clipping", "zero_optimization")


# ----------------------------------------------------------------------------- hpZ and HSDP keys

def _zero3(**zero):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": OPT, "zero_optimization": {"stage": 3, **zero}}


@pytest.mark.parametrize("zero, needles", [
    ({"stage": 2, "zero_hpz_partition_size": 2}, ["zero_hpz_partition_size", "needs stage 3"]),
    ({"stage": 1, "hsdp_shard_size": 2}, ["hsdp_shard_size", "needs stage 3"]),
    ({"zero_hpz_partition_size": 2, "hsdp_shard_size": 2}, ["zero_hpz_partition_size and hsdp_shard_size"]),
    ({"mics_shard_size": 1, "hsdp_shard_size": 1}, ["two spellings of one setting"]),
])
def test_node_aware_zero3_keys_refused_in_one_line(zero, needles):
    _one_line_error(ConfigError, _zero3(**zero), *needles)


def test_mics_shard_size_is_read_as_hsdp_shard_size_and_says_so(caplog):
    """DeepSpeed 0.19.8 removed MiCS (its keys raise there); minizero reads mics_shard_size as
    hsdp_shard_size, and rank 0 logs one line that names the key to write instead."""
    import logging
    with caplog.at_level(logging.INFO, logger="minizero"):
        engine, *_ = _init(_zero3(mics_shard_size=1))
    assert engine.config.zero.hsdp_shard_size == 1
    lines = [r.getMessage() for r in caplog.records if "mics_shard_size" in r.getMessage()]
    assert len(lines) == 1 and "hsdp_shard_size" in lines[0] and "\n" not in lines[0], lines
