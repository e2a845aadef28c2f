"""The seed tutorial's three DeepSpeed configs, held in launch/ value for value, and what they
mean: basic is stage 0 fp32, step 4 stage 0 fp16 with activation checkpointing, step 5
ZeRO-3 fp16 with the optimizer and the parameters offloaded to the CPU. None sets
train_batch_size, so the batch is micro x accumulation x ranks on any world size. Each
trains in minizero as it is (issue 4: step 4 and step 5 must train; issue 11: step 5
with its offload sections)."""
import json
import os

import pytest
import torch

from tests.support.launcher import run_ranks

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch")

_CHECKPOINTING = {"partition_activations": True, "cpu_checkpointing": False, "contiguous_memory_optimization": True,
                  "number_checkpoints": 12, "synchronize_checkpoint_boundary": False, "profile": False}

# The tutorial's configs as it prints them; nothing added (no torch_adam, no scheduler,
# no train_batch_size, no steps_per_print).
TUTORIAL = {
    "ds_config_basic.json": {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
    },
    "ds_config_step4.json": {
        "train_micro_batch_size_per_gpu": 128,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
        "gradient_clipping": 1.0,
        "activation_checkpointing": _CHECKPOINTING,
        "fp16": {"enabled": True},
    },
    "ds_config_step5.json": {
        "train_micro_batch_size_per_gpu": 128,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
        "gradient_clipping": 1.0,
        "activation_checkpointing": dict(_CHECKPOINTING, number_checkpoints=24),
        "fp16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e6,
            "reduce_bucket_size": 5e7,
            "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    },
}


@pytest.mark.parametrize("name", list(TUTORIAL))
def test_launch_file_is_the_tutorials_config(name):
    with open(os.path.join(LAUNCH, name)) as f:
        assert json.load(f) == TUTORIAL[name]


SEQ = 15   # tokens per row: any length up to the preset's 63 trains; the config sets only the rows


def _train_two_steps(config_path):
    import minizero
    from minizero import checkpointing, comm
    from minizero.gpt.model import GPT, get_preset
    torch.manual_seed(0)
    model = GPT(get_preset("micro"))
    engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1),
                                     config=config_path)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x = torch.randint(0, 62, (engine.train_micro_batch_size_per_gpu(), SEQ + 1), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    cfg = engine.config
    return {"losses": losses, "steps": engine.global_steps, "stage": engine.zero_optimization_stage(),
            "micro": engine.train_micro_batch_size_per_gpu(), "gas": engine.gradient_accumulation_steps(),
            "batch": engine.train_batch_size(), "dtype": str(engine.dtype),
            "offload": (cfg.zero.offload_optimizer_enabled, cfg.zero.offload_param_enabled),
            "checkpointing": checkpointing.is_configured(), "rank": comm.get_rank()}


# (stage, dtype, micro, gas, activation checkpointing, offload optimizer / parameters)
MEANING = {"ds_config_basic.json": (0, "torch.float32", 8, 1, False, (False, False)),
           "ds_config_step4.json": (0, "torch.float16", 128, 1, True, (False, False)),
           "ds_config_step5.json": (3, "torch.float16", 128, 4, True, (True, True))}


@pytest.mark.parametrize("name", list(MEANING))
def test_tutorial_config_trains(name):
    """The real micro-batches (8 / 128 / 128) on the 15k-parameter micro preset, rows of
    SEQ tokens: fast on a CPU without overriding anything in the config (which sets how many
    rows, not how long; a row's length is the model's and the data's)."""
    stage, dtype, micro, gas, ckpt, offload = MEANING[name]
    out = run_ranks(_train_two_steps, 2, (os.path.join(LAUNCH, name),))
    for r in out:
        assert (r["stage"], r["dtype"], r["micro"], r["gas"]) == (stage, dtype, micro, gas)
        assert r["batch"] == micro * gas * 2                   # no train_batch_size: it follows the world
        assert r["checkpointing"] is ckpt and r["offload"] == offload
        assert r["steps"] == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
