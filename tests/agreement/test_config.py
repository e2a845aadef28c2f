"""minizero.config against DeepSpeed 0.19.8's own config parser (runtime/config.py)."""
import json
import types
from pathlib import Path

import pytest
import torch

from minizero.config import (ActivationCheckpointingConfig, ConfigError, OffloadOptimizerConfig, OffloadParamConfig,
                             ZeroConfig, ignored_knobs, ignored_knobs_note, load_config, resolve_batch_size)
from minizero.adam import ChunkedAdam, ChunkedAdamW, build_optimizer

deepspeed = pytest.importorskip("deepspeed")
import deepspeed.runtime.config as ds_config_mod  # noqa: E402
from deepspeed.runtime import constants as ds_const  # noqa: E402
from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,  # noqa: E402
                                                   DeepSpeedZeroOffloadParamConfig)

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
LAUNCH_CONFIGS = ["ds_config_basic.json", "ds_config_step4.json", "ds_config_step5.json"]


@pytest.fixture
def ds_parse(monkeypatch):
    """DeepSpeedConfig(config) as if in a world of `world_size` ranks, with no process group:
    DeepSpeedConfig asks deepspeed.comm for rank and world size, so stub those two."""
    def parse(config, world_size):
        monkeypatch.setattr(ds_config_mod, "dist", types.SimpleNamespace(
            get_rank=lambda: 0, get_world_size=lambda *a, **k: world_size))
        return ds_config_mod.DeepSpeedConfig(config)
    return parse


# ----------------------------------------------------------------------------- defaults

def test_defaults_match_deepspeed(ds_parse):
    raw = {"train_batch_size": 8}
    ours, ds = load_config(raw, world_size=1), ds_parse(raw, 1)
    assert ours.gradient_clipping == ds_const.GRADIENT_CLIPPING_DEFAULT == ds.gradient_clipping == 1.0
    assert ours.steps_per_print == ds.steps_per_print  # None in 0.19.8
    assert ours.wall_clock_breakdown == ds.wall_clock_breakdown is False

    fp16 = DeepSpeedFP16Config()
    for name in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale", "auto_cast"):
        assert getattr(ours.fp16, name) == getattr(fp16, name), name
    assert 2 ** ours.fp16.initial_scale_power == fp16.initial_dynamic_scale() == 2 ** 16
    assert ours.fp16.hysteresis == ds_const.FP16_HYSTERESIS_DEFAULT == 2
    assert ours.bf16.enabled is False and ds.bfloat16_config.enabled is False

    zero = DeepSpeedZeroConfig()
    pairs = {"stage": "stage", "contiguous_gradients": "contiguous_gradients", "reduce_scatter": "reduce_scatter",
             "reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
             "overlap_comm": "overlap_comm", "stage3_prefetch_bucket_size": "prefetch_bucket_size",
             "stage3_param_persistence_threshold": "param_persistence_threshold",
             "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
             "memory_efficient_linear": "memory_efficient_linear", "sub_group_size": "sub_group_size"}
    for ours_name, ds_name in pairs.items():
        assert getattr(ours.zero, ours_name) == getattr(zero, ds_name), ours_name
    assert ours.zero.stage == 0 and ours.zero.reduce_bucket_size == 500_000_000
    assert ours.zero.stage3_param_persistence_threshold == 100_000

    act = DeepSpeedActivationCheckpointingConfig({})
    assert ours.activation_checkpointing is None   # no section: the engine checkpoints nothing
    ours_act = load_config({"train_batch_size": 8, "activation_checkpointing": {}}, 1).activation_checkpointing
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        assert getattr(ours_act, name) == getattr(act, name) == getattr(ActivationCheckpointingConfig(), name), name
    assert ours.optimizer is None and ours.scheduler is None
    assert ours.dtype == torch.float32
    assert ours.raw is raw


def test_overlap_comm_default_depends_on_stage(ds_parse):
    for stage in range(4):
        raw = {"train_batch_size": 8, "zero_optimization": {"stage": stage}}
        assert load_config(raw, 1).zero.overlap_comm == ds_parse(raw, 1).zero_config.overlap_comm == (stage == 3)


def test_dtype_and_bfloat16_alias(ds_parse):
    assert load_config({"train_batch_size": 8, "fp16": {"enabled": True}}, 1).dtype == torch.float16
    assert load_config({"train_batch_size": 8, "bf16": {"enabled": True}}, 1).dtype == torch.bfloat16
    raw = {"train_batch_size": 8, "bfloat16": {"enabled": True}}
    assert load_config(raw, 1).dtype == torch.bfloat16 and ds_parse(raw, 1).bfloat16_config.enabled
    with pytest.raises(ConfigError, match="bfloat16"):
        load_config({"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, 1)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("raw,path", [
    ({"train_batch_size": 8, "gradient_cliping": 1.0}, "gradient_cliping"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_foo": 1}}, "zero_optimization.stage3_foo"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "scale": 2}}, "fp16.scale"),
    ({"train_batch_size": 8, "activation_checkpointing": {"partition": True}}, "activation_checkpointing.partition"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "momentum": 0.9}}},
     "optimizer.params.momentum"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 5}}},
     "scheduler.params.warmup_steps"),
    ({"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "none", "buffer_cnt": 4}}},
     "zero_optimization.offload_param.buffer_cnt"),
])
def test_unknown_key_is_named(raw, path):
    with pytest.raises(ConfigError) as e:
        load_config(raw, 1)
    msg = str(e.value)
    # One line that says what to write instead: a near key (a typo) is suggested alone, else
    # the accepted keys are listed; never both (the list would bury the suggestion).
    assert f"'{path}'" in msg and "\n" not in msg
    assert ("did you mean" in msg) != ("ccepted keys" in msg), msg


def test_unknown_key_lists_accepted_keys():
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshold"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage3_foo": 1}}, 1)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("raw,needle", [
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "'bf16' and 'bfloat16' are two spellings"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}},
     "keep only 'stage3_prefetch_bucket_size'"),
])
def test_a_key_and_its_alias_together_are_refused(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config({"train_batch_size": 8, **raw}, 1)


def test_ignored_knobs_are_those_given_that_minizero_does_not_act_on():
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "overlap_comm": True, "reduce_bucket_size": 10, "prefetch_bucket_size": 5,
        "memory_efficient_linear": False, "allgather_partitions": True}}, 1)
    assert ignored_knobs(cfg) == ["memory_efficient_linear"]   # overlap and prefetch act (buckets.py, prefetch.py)
    assert "memory_efficient_linear: accepted for DeepSpeed" in ignored_knobs_note(cfg)
    assert ignored_knobs_note(load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}}, 1)) is None
    # the engine acts on the other keys: a new ZeroConfig key must say which it is
    acting = {f for f, row in ZeroConfig.rows().items() if row.metadata["acts"]}
    assert {"stage", "reduce_bucket_size", "stage3_param_persistence_threshold", "overlap_comm",
            "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance"} <= acting


@pytest.mark.parametrize("raw,needle", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"allgather_bucket_size": -5}}, "zero_optimization.allgather_bucket_size"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type 'SGD' is not implemented"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type 'OneCycle'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps"),
])
def test_bad_values(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_config({"train_batch_size": 8, **raw}, 1)


def test_offload_none_and_harmless_keys_accepted(ds_parse):
    raw = {"train_batch_size": 8, "zero_allow_untested_optimizer": True, "prescale_gradients": False,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "offload_param": None,
                                 "allgather_partitions": True, "reduce_bucket_size": 2e8,
                                 "prefetch_bucket_size": 123}}
    ours, ds = load_config(raw, 1), ds_parse(raw, 1)
    assert ours.zero.offload_optimizer.device == ds.zero_config.offload_optimizer.device == "none"
    assert ours.zero.offload_param is None and ds.zero_config.offload_param is None
    assert not ours.zero.offload_optimizer_enabled and not ours.zero.offload_param_enabled
    # the section's defaults are DeepSpeed's (pin_memory True, in runtime/zero/offload_config.py)
    assert ours.zero.offload_optimizer.pin_memory == ds.zero_config.offload_optimizer.pin_memory is True
    assert ours.zero.reduce_bucket_size == ds.zero_config.reduce_bucket_size == 200_000_000
    assert ours.zero.stage3_prefetch_bucket_size == ds.zero_config.prefetch_bucket_size == 123
    # device "none" is no offload: accepted at any stage, offload_param below 3 included
    for stage in range(4):
        zero = {"stage": stage, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
        assert not load_config({"train_batch_size": 8, "zero_optimization": zero}, 1).zero.offload_param_enabled


def test_load_from_path_and_duplicate_keys(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate"):
        load_config(p, 1)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json", 1)


@pytest.mark.parametrize("text,needle", [("{'a': 1}", "is not valid JSON"), ("[1, 2]", "must hold a JSON object"),
                                         ('{"train_batch_size": 8, // x\n}', "no comments")])
def test_read_json_one_line_errors(tmp_path, text, needle):
    """The one JSON reader (load_config, train.py's --config, checkpointing.configure)."""
    from minizero.config import read_json
    from minizero.train.train_args import UserError, read_config_file
    p = tmp_path / "c.json"
    p.write_text(text)
    for read, error in ((read_json, ConfigError), (read_config_file, UserError)):
        with pytest.raises(error, match=needle) as e:
            read(str(p))
        assert "\n" not in str(e.value) and str(p) in str(e.value)
    with pytest.raises(UserError, match=r"^--config .* is a directory"):
        read_config_file(str(tmp_path))


# ----------------------------------------------------------------------------- offload

OFFLOAD_SECTIONS = [("offload_optimizer", OffloadOptimizerConfig, DeepSpeedZeroOffloadOptimizerConfig),
                    ("offload_param", OffloadParamConfig, DeepSpeedZeroOffloadParamConfig)]
# Every key at a value other than its default (stage 3 allows all of them).
OFFLOAD_ALL_KEYS = {
    "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 8, "pin_memory": False,
                          "pipeline_read": True, "pipeline_write": True, "fast_init": True, "ratio": 0.5,
                          "super_offload": True, "cpuadam_cores_perc": 0.5},
    "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 7, "buffer_size": 1e7,
                      "max_in_cpu": 1e8, "pin_memory": False},
}


def _same_offload(ours, ds):
    """Field by field, as DeepSpeed's model has them; nvme_path is a pathlib.Path there."""
    assert (ours is None) == (ds is None)
    if ours is not None:
        for name in type(ds).model_fields:
            theirs = getattr(ds, name)
            assert getattr(ours, name) == (str(theirs) if name == "nvme_path" and theirs is not None else theirs), name


@pytest.mark.parametrize("section,ours_cls,ds_cls", OFFLOAD_SECTIONS)
def test_offload_sections_have_deepspeeds_keys_and_defaults(section, ours_cls, ds_cls):
    assert set(ours_cls.rows()) == set(ds_cls.model_fields), section
    _same_offload(ours_cls(), ds_cls())
    ours = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, section: {"device": "cpu"}}}, 1)
    _same_offload(getattr(ours.zero, section), ds_cls(device="cpu"))
    assert getattr(ours.zero, section).pin_memory is True


def test_offload_every_key_parses_as_deepspeed_parses_it(ds_parse):
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **OFFLOAD_ALL_KEYS}}
    ours, ds = load_config(raw, 2), ds_parse(raw, 2)
    for section, _, _ in OFFLOAD_SECTIONS:
        _same_offload(getattr(ours.zero, section), getattr(ds.zero_config, section))
    assert ours.zero.offload_optimizer_enabled and ours.zero.offload_param_enabled


@pytest.mark.parametrize("zero", [{"stage": 2, "cpu_offload": True}, {"stage": 1, "cpu_offload": False},
                                  {"stage": 3, "cpu_offload_param": True},
                                  {"stage": 3, "cpu_offload": True, "cpu_offload_param": True},
                                  {"stage": 3, "cpu_offload_param": False, "offload_optimizer": {"device": "cpu"}}])
def test_deprecated_cpu_offload_booleans_as_deepspeed_reads_them(ds_parse, zero):
    """DeepSpeedZeroConfig's deprecated fields: true is {"device": "cpu"}, false no section."""
    raw = {"train_batch_size": 8, "zero_optimization": zero}
    ours, ds = load_config(raw, 1), ds_parse(raw, 1)
    for section, _, _ in OFFLOAD_SECTIONS:
        _same_offload(getattr(ours.zero, section), getattr(ds.zero_config, section))
    spelled = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    new = {spelled.get(k, k): ({"device": "cpu"} if v is True else None if v is False else v) for k, v in zero.items()}
    plain = load_config({"train_batch_size": 8, "zero_optimization": new}, 1)
    assert (plain.zero.offload_optimizer, plain.zero.offload_param) == (ours.zero.offload_optimizer,
                                                                       ours.zero.offload_param)


@pytest.mark.parametrize("old,new", [("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")])
def test_deprecated_and_new_offload_spelling_together_are_refused(ds_parse, old, new):
    raw = {"train_batch_size": 8, "zero_optimization": {"stage": 3, old: True, new: {"device": "cpu"}}}
    with pytest.raises(ConfigError, match=f"'zero_optimization.{old}' and 'zero_optimization.{new}' are two "
                                          f"spellings of one key; keep only '{new}'"):
        load_config(raw, 1)
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter"):
        ds_parse(raw, 1)


@pytest.mark.parametrize("zero,needle,deepspeed_refuses", [
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "needs zero_optimization.offload_optimizer.nvme_path", False),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "needs zero_optimization.offload_param.nvme_path", False),
    ({"stage": 3, "offload_param": {"device": "gpu"}}, "must be \"none\", \"cpu\" or \"nvme\"", True),
    ({"stage": 0, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3", False),
    ({"stage": 1, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3", False),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param needs stage 3", False),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer needs stage 1, 2 or 3", False),
    ({"stage": 0, "cpu_offload": True}, "offload_optimizer needs stage 1, 2 or 3", False),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "partial offload is a stage-3 option", True),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio must be between 0 and 1", True),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 1.2}},
     "cpuadam_cores_perc must be between 0 and 1", True),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": -1}}, "buffer_count must be >= 0", True),
])
def test_offload_bad_values(ds_parse, zero, needle, deepspeed_refuses):
    """One line each. Where DeepSpeed accepts the config (nvme without nvme_path: DeepSpeed
    fails only when it builds the swapper;
    offload_param below stage 3 and offload_optimizer at stage 0: DeepSpeed ignores them
    silently), minizero refuses it rather than train without the offload asked for."""
    raw = {"train_batch_size": 8, "zero_optimization": zero}
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")) as e:
        load_config(raw, 1)
    assert "\n" not in str(e.value)
    if deepspeed_refuses:
        with pytest.raises((AssertionError, ValueError)):   # pydantic's ValidationError is a ValueError
            ds_parse(raw, 1)
    else:
        ds_parse(raw, 1)


def test_ignored_knobs_lists_offload_keys_minizero_does_not_act_on():
    zero = {"stage": 3, "cpu_offload_use_pin_memory": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 4, "fast_init": True,
                                  "ratio": 0.9},
            "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 5}}
    cfg = load_config({"train_batch_size": 8, "zero_optimization": zero}, 1)
    knobs = ["cpu_offload_use_pin_memory", "offload_optimizer.buffer_count", "offload_optimizer.fast_init",
             "offload_optimizer.ratio", "offload_param.max_in_cpu"]
    assert ignored_knobs(cfg) == knobs
    assert f"zero_optimization {', '.join(knobs)}: accepted for DeepSpeed compatibility" in ignored_knobs_note(cfg)
    # minizero acts on device and pin_memory: never listed
    acting = {f"{section}.{k}" for section, cls, _ in OFFLOAD_SECTIONS
              for k, row in cls.rows().items() if row.metadata["acts"]}
    assert acting == {"offload_optimizer.device", "offload_optimizer.pin_memory", "offload_optimizer.nvme_path",
                      "offload_param.device", "offload_param.pin_memory", "offload_param.nvme_path",
                      "offload_param.buffer_count"}   # nvme: the swap folder; shards read ahead (offload/nvme.py)
    plain = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
             "offload_param": {"device": "cpu"}}
    assert ignored_knobs(load_config({"train_batch_size": 8, "zero_optimization": plain}, 1)) == []


# ----------------------------------------------------------------------------- batch sizes

BATCH_CASES = [  # (train_batch_size, micro, gas, world_size)
    (64, 16, 2, 2), (64, 16, 4, 2), (64, 16, None, 2), (64, None, 2, 2), (None, 16, 2, 2),
    (64, None, None, 2), (None, 16, None, 2), (30, 4, None, 2), (30, None, 4, 2), (7, None, None, 2),
    (None, None, 4, 2), (None, None, None, 1), (12, 3, None, 1), (24, 3, None, 4), (64, 16, None, 3),
    (48, None, 3, 4), (1, None, None, 2),
]


@pytest.mark.parametrize("t,m,g,n", BATCH_CASES)
def test_batch_resolution_matches_deepspeed(ds_parse, t, m, g, n):
    raw = {k: v for k, v in (("train_batch_size", t), ("train_micro_batch_size_per_gpu", m),
                             ("gradient_accumulation_steps", g)) if v is not None}
    try:
        ds = ds_parse(raw, n)
        expected = (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    except AssertionError:
        expected = None
    if expected is None:
        with pytest.raises(ConfigError):
            load_config(raw, n)
    else:
        c = load_config(raw, n)
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_batch_error_messages():
    with pytest.raises(ConfigError, match=r"train_batch_size 30 is not divisible by "
                                          r"train_micro_batch_size_per_gpu 4 x world size 2"):
        resolve_batch_size(30, 4, None, 2)
    with pytest.raises(ConfigError, match=r"train_batch_size 64 != train_micro_batch_size_per_gpu 16 x "
                                          r"gradient_accumulation_steps 4 x world size 2"):
        resolve_batch_size(64, 16, 4, 2)
    with pytest.raises(ConfigError, match="either train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch_size(None, None, 2, 2)
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config({"train_batch_size": "64"}, 1)


# ----------------------------------------------------------------------------- launch configs

@pytest.mark.parametrize("name", LAUNCH_CONFIGS)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_launch_configs_load_in_both(ds_parse, name, world_size):
    path = LAUNCH / name
    ours, ds = load_config(path, world_size), ds_parse(str(path), world_size)
    assert ours.raw == json.loads(path.read_text())
    assert (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps) == \
        (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    assert ours.zero.stage == ds.zero_optimization_stage
    assert ours.zero.reduce_bucket_size == ds.zero_config.reduce_bucket_size
    assert ours.zero.overlap_comm == ds.zero_config.overlap_comm
    assert ours.zero.stage3_param_persistence_threshold == ds.zero_config.param_persistence_threshold
    assert ours.zero.stage3_prefetch_bucket_size == ds.zero_config.prefetch_bucket_size
    assert ours.zero.stage3_max_live_parameters == ds.zero_config.max_live_parameters
    assert ours.zero.stage3_max_reuse_distance == ds.zero_config.max_reuse_distance
    for section in ("offload_optimizer", "offload_param"):
        o, d = getattr(ours.zero, section), getattr(ds.zero_config, section)
        assert (o is None) == (d is None), section
        if o is not None:
            assert o.to_dict() == {k: getattr(d, k) for k in o.to_dict()}, section
    assert ours.fp16.enabled == ds.float16_config.enabled
    assert ours.fp16.hysteresis == ds.float16_config.hysteresis
    assert ours.gradient_clipping == ds.gradient_clipping
    assert ours.steps_per_print == ds.steps_per_print
    assert ours.optimizer.type.lower() == ds.optimizer_name
    # the params given, plus the two build_optimizer reads (DeepSpeed pops them the same way)
    assert ours.optimizer.params == dict(ds.optimizer_params, torch_adam=False, adam_w_mode=True)
    assert ours.scheduler is None and ds.scheduler_name is None     # the tutorial sets none
    act = ds.activation_checkpointing_config
    ours_act = ours.activation_checkpointing or ActivationCheckpointingConfig()   # None: no section
    assert (ours.activation_checkpointing is None) == ("activation_checkpointing" not in ours.raw)
    for f in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
              "number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        assert getattr(ours_act, f) == getattr(act, f), f


def test_launch_config_steps():
    """What the tutorial's three steps are: basic stage-0 fp32; step 4 stage-0 fp16 (where
    DeepSpeed never scales the loss: docs/deepspeed.md, "Stage 0 fp16 never scales the
    loss") with activation checkpointing; step 5 ZeRO-3 fp16 with both offloads. None sets
    train_batch_size: the batch is micro x accumulation x ranks at any world size."""
    basic, step4, step5 = (load_config(LAUNCH / n, 2) for n in LAUNCH_CONFIGS)
    assert [c.zero.stage for c in (basic, step4, step5)] == [0, 0, 3]
    assert [c.dtype for c in (basic, step4, step5)] == [torch.float32, torch.float16, torch.float16]
    assert [(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size)
            for c in (basic, step4, step5)] == [(8, 1, 16), (128, 1, 256), (128, 4, 1024)]
    assert [c.optimizer.params["lr"] for c in (basic, step4, step5)] == [3e-3, 3e-4, 3e-4]
    assert "torch_adam" not in basic.raw["optimizer"]["params"] and basic.scheduler is None
    assert basic.activation_checkpointing is None
    assert [c.activation_checkpointing.number_checkpoints for c in (step4, step5)] == [12, 24]
    assert step4.activation_checkpointing.contiguous_memory_optimization
    assert not (step4.zero.offload_optimizer_enabled or step4.zero.offload_param_enabled)
    assert step5.zero.offload_optimizer_enabled and step5.zero.offload_param_enabled
    assert (step5.zero.stage3_max_reuse_distance, step5.zero.stage3_param_persistence_threshold,
            step5.zero.reduce_bucket_size) == (10_000_000, 1_000_000, 50_000_000)


# ----------------------------------------------------------------------------- optimizer

def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def _opt(section):
    return load_config({"train_batch_size": 8, "optimizer": section}, 1).optimizer


def test_build_optimizer_mapping():
    # torch's AdamW/Adam classes, stepped in slices on a CPU (bit-identical to torch's own
    # step: tests/core/test_adam.py); the subclass is what DeepSpeed's torch_adam builds
    assert issubclass(ChunkedAdamW, torch.optim.AdamW) and issubclass(ChunkedAdam, torch.optim.Adam)

    def build(params):
        return build_optimizer(_params(), _opt({"type": "Adam", "params": params}))
    opt = build({"lr": 1e-3, "torch_adam": True})
    assert type(opt) is ChunkedAdamW and opt.defaults["weight_decay"] == 0.01   # torch AdamW default
    opt = build({"lr": 1e-3, "torch_adam": True, "adam_w_mode": False})
    assert type(opt) is ChunkedAdam and opt.defaults["weight_decay"] == 0
    opt = build_optimizer(_params(), _opt({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True,
                                                                       "adam_w_mode": False}}))
    assert type(opt) is ChunkedAdamW        # "AdamW" forces adam_w_mode
    opt = build_optimizer(_params(), _opt({"type": "adamw", "params": {"lr": 2e-3, "betas": [0.9, 0.95],
                                                                       "weight_decay": 0.1, "torch_adam": True}}))
    assert type(opt) is ChunkedAdamW
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1
    # Without torch_adam DS builds FusedAdam, whose weight_decay default is 0.0: keep that.
    opt = build({"lr": 1e-3})
    assert type(opt) is ChunkedAdamW and opt.defaults["weight_decay"] == 0.0
    from deepspeed.ops.adam import FusedAdam
    import inspect
    assert inspect.signature(FusedAdam.__init__).parameters["weight_decay"].default == 0.0


def test_build_optimizer_from_config_and_unknown_params():
    cfg = load_config(LAUNCH / "ds_config_basic.json", 2)
    opt = build_optimizer(_params(), cfg.optimizer)
    assert type(opt) is ChunkedAdamW and opt.defaults["lr"] == 3e-3
    with pytest.raises(ConfigError, match="momentum"):
        _opt({"type": "Adam", "params": {"momentum": 0.9}})
