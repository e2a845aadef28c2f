"""The seed tutorial's three configs load and train in minizero as they are (issue 4: the
step-4 and step-5 configs, with activation checkpointing, must train)."""
import os

import pytest
import torch

from tests.launcher import run_ranks

LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch")


def _train_two_steps(config_path):
    import minizero
    from minizero import checkpointing, comm
    from minizero.model import GPT, get_preset
    torch.manual_seed(0)
    model = GPT(get_preset("micro"))
    engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1),
                                     config=config_path)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x = torch.randint(0, 62, (engine.train_micro_batch_size_per_gpu(), 64), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "steps": engine.global_steps, "stage": engine.zero_optimization_stage(),
            "gas": engine.gradient_accumulation_steps(), "dtype": str(engine.dtype),
            "checkpointing": model.checkpoint_fn is checkpointing.checkpoint, "rank": comm.get_rank()}


@pytest.mark.parametrize("name,stage,ckpt", [("ds_config_basic.json", 1, False),
                                             ("ds_config_step4.json", 1, True),
                                             ("ds_config_step5.json", 3, True)])
def test_tutorial_config_trains(name, stage, ckpt):
    out = run_ranks(_train_two_steps, 2, (os.path.join(LAUNCH, name),))
    for r in out:
        assert r["stage"] == stage and r["checkpointing"] is ckpt
        assert r["dtype"] == "torch.float16" and r["gas"] == 2   # 64 = 16 x 2 x world 2
        assert r["steps"] == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
