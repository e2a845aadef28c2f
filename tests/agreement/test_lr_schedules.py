"""minizero.config.lr_schedules (and train/schedule.py's MinGPTSchedule) against deepspeed.runtime.lr_schedules: identical lr, step for step."""
import math

import pytest
import torch

from minizero.config import lr_schedules as mz
from minizero.train.schedule import MinGPTSchedule
from minizero.config import ConfigError, load_config

ds = pytest.importorskip("deepspeed.runtime.lr_schedules")


def _optimizer(lrs=(1e-3,), tensor_lr=False):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(lr) if tensor_lr else lr}
              for lr in lrs]
    return torch.optim.Adam(groups, lr=1e-3)


def _lrs(opt):
    return [g["lr"].item() if torch.is_tensor(g["lr"]) else g["lr"] for g in opt.param_groups]


CASES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-3, 2e-3], "warmup_num_steps": 7}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_max_lr": 6e-4, "warmup_num_steps": 13,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 50, "warmup_min_lr": 1e-4}),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
                        "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}),
]


def _per_group(params):
    return any(isinstance(v, list) for v in params.values())


# One param group, and two with different lrs (per-group lists need two).
TRAJECTORY_CASES = [(n, p, lrs) for n, p in CASES for lrs in [(1e-3,), (1e-3, 5e-4)]
                    if len(lrs) == 2 or not _per_group(p)]


@pytest.mark.parametrize("name,params,lrs", TRAJECTORY_CASES)
def test_trajectory_matches_deepspeed(name, params, lrs):
    opt_ds, opt_mz = _optimizer(lrs), _optimizer(lrs)
    s_ds = getattr(ds, name)(opt_ds, **params)
    s_mz = getattr(mz, name)(opt_mz, **params)
    assert _lrs(opt_mz) == _lrs(opt_ds)            # both set the lr at construction
    for _ in range(50):
        s_ds.step()
        s_mz.step()
        assert _lrs(opt_mz) == _lrs(opt_ds)        # exact float equality
        assert s_mz.get_last_lr() == s_ds.get_last_lr()
        assert s_mz.get_lr() == s_ds.get_lr()
        assert s_mz.state_dict() == s_ds.state_dict()


def test_tensor_lr_matches_deepspeed():
    opt_ds, opt_mz = _optimizer(tensor_lr=True), _optimizer(tensor_lr=True)
    params = {"total_num_steps": 20, "warmup_num_steps": 5}
    s_ds, s_mz = ds.WarmupCosineLR(opt_ds, **params), mz.WarmupCosineLR(opt_mz, **params)
    for _ in range(25):
        s_ds.step()
        s_mz.step()
        assert _lrs(opt_mz) == _lrs(opt_ds)


def test_explicit_last_batch_iteration_matches_deepspeed():
    opt_ds, opt_mz = _optimizer(), _optimizer()
    params = {"total_num_steps": 40, "warmup_num_steps": 10}
    s_ds, s_mz = ds.WarmupDecayLR(opt_ds, **params), mz.WarmupDecayLR(opt_mz, **params)
    for it in (3, 17, 9, 45, 0):
        s_ds.step(it)
        s_mz.step(it)
        assert _lrs(opt_mz) == _lrs(opt_ds)


def test_construction_sets_min_lr():
    opt = _optimizer()
    mz.WarmupLR(opt, warmup_min_lr=1e-5, warmup_max_lr=1e-3)
    assert _lrs(opt) == [1e-5]
    opt = _optimizer()
    mz.WarmupCosineLR(opt, total_num_steps=10)
    assert _lrs(opt) == [0.0]


@pytest.mark.parametrize("name,params", [c for c in CASES if not _per_group(c[1])])
def test_state_dict_round_trip(name, params):
    """Resume = a fresh optimizer (its state dict carries the lr) + load_state_dict."""
    opt_a = _optimizer()
    a = getattr(mz, name)(opt_a, **params)
    for _ in range(20):
        a.step()
    opt_b = _optimizer()
    b = getattr(mz, name)(opt_b, **params)
    opt_b.load_state_dict(opt_a.state_dict())
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"last_batch_iteration": 19}
    for _ in range(30):
        a.step()
        b.step()
        assert _lrs(opt_b) == _lrs(opt_a)


def test_build_scheduler_like_deepspeed_engine():
    cfg = load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 30, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}}}, 1)
    opt_ds, opt_mz = _optimizer(), _optimizer()
    # DeepSpeedEngine._scheduler_from_config: getattr(lr_schedules, name)(optimizer, **params)
    s_ds = getattr(ds, cfg.scheduler.type)(opt_ds, **cfg.scheduler.params)
    s_mz = mz.build_scheduler(opt_mz, cfg.scheduler)
    assert isinstance(s_mz, mz.WarmupDecayLR)
    for _ in range(40):
        s_ds.step()
        s_mz.step()
        assert _lrs(opt_mz) == _lrs(opt_ds)
    assert mz.build_scheduler(opt_mz, None) is None
    warmup = load_config({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {}}}, 1).scheduler
    assert isinstance(mz.build_scheduler(opt_mz, warmup), mz.WarmupLR)
    with pytest.raises(ConfigError, match="Cyclic"):
        load_config({"train_batch_size": 8, "scheduler": {"type": "Cyclic", "params": {}}}, 1)


def test_bad_warmup_args():
    with pytest.raises(ValueError, match="warmup_num_steps"):
        mz.WarmupLR(_optimizer(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type"):
        mz.WarmupLR(_optimizer(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_max_lr"):
        mz.WarmupLR(_optimizer(), warmup_max_lr=[1e-3, 2e-3, 3e-3])


# ----------------------------------------------------------------------------- minGPT

def test_mingpt_schedule_endpoints():
    opt = _optimizer()
    s = MinGPTSchedule(opt, learning_rate=6e-4, warmup_tokens=1000, final_tokens=11000)
    assert _lrs(opt) == [0.0]
    s.step(tokens=500)
    assert _lrs(opt) == [6e-4 * 0.5]
    s.step(tokens=500)                       # end of warmup: the peak
    assert _lrs(opt) == [6e-4]
    s.step(tokens=5000)                      # halfway through the decay: cos(pi/2) = 0
    assert math.isclose(_lrs(opt)[0], 6e-4 * 0.5)
    s.step(tokens=4000)                      # progress 0.9: 0.5*(1+cos(0.9 pi)) < 0.1 -> floor
    assert _lrs(opt) == [6e-4 * 0.1]
    s.step(tokens=10**6)                     # past the end: stays at 10%
    assert _lrs(opt) == [6e-4 * 0.1]


def test_mingpt_schedule_state_dict():
    opt_a, opt_b = _optimizer(), _optimizer()
    a = MinGPTSchedule(opt_a, 3e-3, warmup_tokens=256, final_tokens=4096)
    b = MinGPTSchedule(opt_b, 3e-3, warmup_tokens=256, final_tokens=4096)
    for _ in range(7):
        a.step(tokens=64)
    b.load_state_dict(a.state_dict())
    for _ in range(60):
        a.step(tokens=64)
        b.step(tokens=64)
        assert _lrs(opt_a) == _lrs(opt_b)
    with pytest.raises(ValueError):
        MinGPTSchedule(opt_a, 3e-3, warmup_tokens=10, final_tokens=10)


def test_mingpt_schedule_resumes_with_its_saved_shape():
    """A run resumed with a larger --max-steps builds a schedule for the new length; loading
    the saved state must bring back the old shape (and the lr it had), not jump the lr."""
    opt_a, opt_b = _optimizer(), _optimizer()
    a = MinGPTSchedule(opt_a, 3e-3, warmup_tokens=256, final_tokens=4096)
    for _ in range(70):
        a.step(tokens=64)
    assert _lrs(opt_a) == [3e-3 * 0.1]                       # past the end: the 10% floor
    b = MinGPTSchedule(opt_b, 3e-3, warmup_tokens=512, final_tokens=8192)   # "--max-steps" doubled
    b.load_state_dict(a.state_dict())
    assert (b.warmup_tokens, b.final_tokens) == (256, 4096) and _lrs(opt_b) == _lrs(opt_a)
    a.step(tokens=64)
    b.step(tokens=64)
    assert _lrs(opt_a) == _lrs(opt_b)
