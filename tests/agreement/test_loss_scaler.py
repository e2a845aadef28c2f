"""minizero.fp16 against deepspeed.runtime.fp16.loss_scaler: same scale, step for step."""
import random
import types

import pytest
import torch

from minizero import fp16 as mz
from minizero.config import load_config

ds = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, msg, *a, **k):
        self.lines.append(msg)

    warning = info


@pytest.fixture(autouse=True)
def ds_rank0(monkeypatch):
    """DS's update_scale asks deepspeed.comm for the rank (asserts without a process group)
    and logs through DeepSpeed's logger: stub the first, capture the second (and ours)."""
    monkeypatch.setattr(ds, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    ds_log, mz_log = _Log(), _Log()
    monkeypatch.setattr(ds, "logger", ds_log)
    monkeypatch.setattr(mz, "logger", mz_log)
    return ds_log, mz_log


STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _pair(init_scale=2**16, scale_window=4, min_scale=1, hysteresis=2, consecutive=False, raise_at_min=False):
    d = ds.DynamicLossScaler(init_scale=init_scale, scale_window=scale_window, min_scale=min_scale,
                             delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                             raise_error_at_min_scale=raise_at_min)
    m = mz.DynamicLossScaler(init_scale=init_scale, scale_window=scale_window, min_scale=min_scale,
                             delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                             raise_error_at_min_scale=raise_at_min)
    return d, m


def _run_both(d, m, seq):
    for i, overflow in enumerate(seq):
        d.update_scale(overflow)
        m.update_scale(overflow)
        for a in STATE:
            assert getattr(m, a) == getattr(d, a), (i, a)
        assert m.loss_scale == d.loss_scale


FIXED = {
    "clean": [False] * 40,
    "one_spike": [False] * 5 + [True] + [False] * 20,
    "two_in_a_row": [False] * 3 + [True, True] + [False] * 20,
    "alternating": [True, False] * 20,
    "bursts": ([True] * 3 + [False] * 9) * 5,
    "overflow_first": [True] * 4 + [False] * 30,
    "spaced": ([True] + [False] * 4) * 10,
}


@pytest.mark.parametrize("name", sorted(FIXED))
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 4])
def test_fixed_sequences(name, hysteresis, consecutive, window):
    _run_both(*_pair(scale_window=window, hysteresis=hysteresis, consecutive=consecutive), FIXED[name])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_random_sequences(seed, hysteresis, consecutive):
    rng = random.Random(seed * 10 + hysteresis)
    p = rng.choice([0.05, 0.2, 0.4])
    window = rng.choice([1, 2, 4, 7])
    seq = [rng.random() < p for _ in range(400)]
    # min_scale 1 with raise_at_min False: the scale can bottom out and climb back.
    _run_both(*_pair(init_scale=2**8, scale_window=window, hysteresis=hysteresis, consecutive=consecutive), seq)


def test_min_scale_clamps_without_raise():
    d, m = _pair(init_scale=8, min_scale=2, hysteresis=1, raise_at_min=False)
    _run_both(d, m, [True] * 6)
    assert m.cur_scale == 2


def test_create_loss_scaler_matches_zero_optimizers():
    """ZeRO-1/2/3 build theirs with CreateLossScaler(dtype=half, ...,
    dynamic_loss_args=fp16_config.dynamic_loss_scale_args()); raise_error_at_min_scale stays True."""
    section = {"enabled": True, "initial_scale_power": 3, "loss_scale_window": 4, "hysteresis": 2,
               "min_loss_scale": 1}
    d = ds.CreateLossScaler(dtype=torch.half, static_loss_scale=0, dynamic_scaling=True,
                            dynamic_loss_args=DeepSpeedFP16Config(**section).dynamic_loss_scale_args())
    m = mz.create_loss_scaler(load_config({"train_batch_size": 8, "fp16": section}, 1).fp16)
    assert isinstance(m, mz.DynamicLossScaler) and m.dynamic and d.dynamic
    for a in STATE + ("scale_window", "min_scale", "delayed_shift", "consecutive_hysteresis",
                      "raise_error_at_min_scale", "scale_factor"):
        assert getattr(m, a) == getattr(d, a), a
    assert m.raise_error_at_min_scale is True
    # Overflow forever: the first overflow spends the hysteresis budget (8 stays), and the
    # budget is only refilled when the scale is next *raised*, so 8 -> 4 -> 2 -> 1 takes
    # 4 overflows and the 5th raises.
    seq = [True] * 4
    _run_both(d, m, seq)
    assert m.cur_scale == 1
    with pytest.raises(Exception, match="minimum"):
        d.update_scale(True)
    with pytest.raises(RuntimeError, match="minimum"):
        m.update_scale(True)


def test_create_loss_scaler_defaults():
    def fp16(section):
        return load_config({"train_batch_size": 8, **({"fp16": section} if section is not None else {})}, 1).fp16
    m = mz.create_loss_scaler(fp16({"enabled": True}))
    assert m.cur_scale == 2**16 and m.delayed_shift == 2 and m.scale_window == 1000 and m.min_scale == 1
    assert mz.create_loss_scaler(fp16({"enabled": False})).cur_scale == 1.0
    assert mz.create_loss_scaler(fp16(None)).cur_scale == 1.0


def test_static_scaler():
    for section in ({"enabled": True, "loss_scale": 128}, {"enabled": False}):
        cfg = load_config({"train_batch_size": 8, "fp16": section}, 1).fp16
        m = mz.create_loss_scaler(cfg)
        d = ds.CreateLossScaler(dtype=torch.half if cfg.enabled else torch.float32,
                                static_loss_scale=cfg.loss_scale, dynamic_scaling=False, dynamic_loss_args=None)
        assert not m.dynamic and not d.dynamic and m.cur_scale == d.cur_scale
        for overflow in (True, False, True):
            m.update_scale(overflow)
            d.update_scale(overflow)
            assert m.cur_scale == d.cur_scale
        assert m.loss_scale == (128 if cfg.enabled else 1.0)
        assert float(m.scale_loss(torch.tensor(2.0))) == 2.0 * m.loss_scale
    assert mz.StaticLossScaler is mz.LossScaler
    s = mz.LossScaler(64.0)
    t = mz.LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.cur_scale == 64.0


def test_state_dict_round_trip():
    rng = random.Random(0)
    seq = [rng.random() < 0.3 for _ in range(200)]
    a = mz.DynamicLossScaler(init_scale=2**10, scale_window=3, delayed_shift=2, raise_error_at_min_scale=False)
    for o in seq[:77]:
        a.update_scale(o)
    b = mz.DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    for o in seq[77:]:
        a.update_scale(o)
        b.update_scale(o)
        assert b.state_dict() == a.state_dict()


def test_overflow_log_lines_match_deepspeed(ds_rank0):
    ds_log, mz_log = ds_rank0
    d, m = _pair(init_scale=2**16, hysteresis=2)
    _run_both(d, m, [True, True])
    assert ds_log.lines == [
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. "
        "Reducing hysteresis to 1",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
    ]
    # minizero's logger formatter adds "[minizero] "; the message itself is DeepSpeed's text.
    assert ["[deepspeed] " + line for line in mz_log.lines] == ds_log.lines
    assert mz.overflow_message(65536, 32768.0) == \
        "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    assert mz.overflow_message(4, 2, dtype=torch.bfloat16) == "OVERFLOW! Rank 0 Skipping step."


def test_has_inf_or_nan():
    assert not mz.has_inf_or_nan(torch.randn(100))
    assert not mz.has_inf_or_nan(torch.empty(0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(50, dtype=torch.float16)
        x[17] = bad
        assert mz.has_inf_or_nan(x) is True
    assert mz.has_inf_or_nan(torch.tensor([65504.0], dtype=torch.float16) * 2)   # fp16 overflow


def test_overflow_vote_single_process():
    """The flag is a device tensor (no host sync): 1.0 for an inf/NaN norm, 0.0 otherwise."""
    for norm_sq, want in ((float("inf"), 1.0), (float("nan"), 1.0), (3.0, 0.0), (0.0, 0.0)):
        flag = mz.overflow_vote(torch.tensor(norm_sq))
        assert isinstance(flag, torch.Tensor) and flag.dtype == torch.float32 and flag.shape == (1,)
        assert flag.item() == want


def _doubling_steps(scaler, overflows):
    """The indices of the updates that raised the scale, feeding `overflows` (one bool per step)."""
    out = []
    for i, overflow in enumerate(overflows):
        before = scaler.cur_scale
        scaler.update_scale(overflow)
        if scaler.cur_scale > before:
            out.append(i)
    return out


@pytest.mark.parametrize("window", [1, 4, 1000])
def test_the_scale_doubles_on_the_clean_step_after_window_clean_steps(window):
    """When DeepSpeed's DynamicLossScaler doubles (loss_scaler.py, `update_scale`:
    stable_interval = cur_iter - last_overflow_iter - 1, doubling when it is a positive
    multiple of the window): the update of the (window + 1)-th clean step from the start
    (which counts as an overflow at step -1), then every window-th; after an overflow at step
    o, again at o + window + 1. minizero's scaler does the same, and minizero/fp16.py's
    docstring says so (it used to say "`scale_window` steps in a row -> double")."""
    d, m = _pair(scale_window=window, hysteresis=1)
    clean = [False] * (3 * window + 1)
    assert _doubling_steps(d, clean) == [window, 2 * window, 3 * window]
    o = 2 * window + 5
    seq = [False] * o + [True] + [False] * (2 * window + 1)
    d, m = _pair(scale_window=window, hysteresis=1)
    want = [k * window for k in range(1, o + 1) if k * window < o] + [o + window + 1, o + 2 * window + 1]
    assert _doubling_steps(d, seq) == want
    d, m = _pair(scale_window=window, hysteresis=1)
    assert _doubling_steps(m, seq) == want
    doc = " ".join(mz.__doc__.split())
    assert "the first doubling ends the (`scale_window` + 1)-th clean step" in doc
    assert "`scale_window` steps in a row without overflow -> double S" not in doc
