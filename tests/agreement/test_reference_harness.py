"""Self-test of the DeepSpeed reference harness (reference/ds_run.py, reference/ds_memory.py).

The agreement tests trust this harness, so it is checked against facts that do not
depend on minizero at all:
- two identical DeepSpeed runs are bitwise equal (losses and final fp32 weights);
- fp32 stage 0 and stage 2 are bitwise equal (docs/deepspeed.md, "fp32 stage 0 and
  stage 2 are bitwise equal"), so the harness feeds
  the same data and reads the right master weights at both stages;
- bf16 ZeRO-3 with memory_efficient_linear off equals bf16 ZeRO-2 bitwise;
- the memory probe's byte counts equal DeepSpeed's padding arithmetic exactly.
"""
import functools
import io
import math
import multiprocessing.reduction
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from minizero.gpt.model import get_preset  # noqa: E402
from reference.ds_run import (PortableTensorDict, SyntheticBatches, default_weight_decay,  # noqa: E402
                              get_batch, prepare_ds_config, run_deepspeed)
from tests.support.harness import NO_DROPOUT, make_config, make_model, max_abs_diff  # noqa: E402
from tests.support.launcher import run_ranks  # noqa: E402

N = 2
STEPS = 3
MICRO_BS = 4
ENV = {"DS_ACCELERATOR": "cpu"}


MODEL_FN = functools.partial(make_model, "micro", **NO_DROPOUT)
BATCHES = SyntheticBatches(get_preset("micro").vocab_size, get_preset("micro").block_size, MICRO_BS, seed=7)


def ds_config(stage, dtype="fp32", **zero):
    """torch_adam left out: prepare_ds_config's job, which these tests check."""
    return make_config(stage, dtype, micro_batch=MICRO_BS, optimizer="Adam", lr=1e-3, torch_adam=None,
                       zero=zero, steps_per_print=10**9)


def _run(cfg, **kw):
    return run_ranks(run_deepspeed, world_size=N, args=(MODEL_FN, cfg, BATCHES, STEPS), kwargs=kw, env=ENV)


def _group_numels():
    torch.manual_seed(0)
    m = MODEL_FN()
    return [sum(p.numel() for p in g["params"]) for g in m.configure_param_groups(0.1)], \
        [p.numel() for p in m.parameters()]


def _states_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- no processes

def test_prepare_ds_config_pins_optimizer_and_zero3_linear():
    cfg = prepare_ds_config(ds_config(3))
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["zero_optimization"]["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in prepare_ds_config(ds_config(2))["zero_optimization"]
    assert "memory_efficient_linear" not in prepare_ds_config(ds_config(3), zero3_exact=False)["zero_optimization"]
    bad = ds_config(1)
    bad["optimizer"]["torch_adam"] = True  # beside params: DeepSpeed would silently ignore it
    with pytest.raises(ValueError, match="inside optimizer.params"):
        prepare_ds_config(bad)
    assert default_weight_decay(cfg) == 0.01  # "Adam" + torch_adam is torch.optim.AdamW
    cfg["optimizer"]["params"]["adam_w_mode"] = False
    assert default_weight_decay(cfg) == 0.0
    cfg["optimizer"]["params"]["weight_decay"] = 0.1
    assert default_weight_decay(cfg) == 0.1
    src = ds_config(2)
    prepare_ds_config(src)
    assert "torch_adam" not in src["optimizer"]["params"], "the caller's config must not be mutated"


def test_batch_conventions_agree():
    x, y = BATCHES(1, 0, 1, N)
    x2, y2 = BATCHES(1, 0, 1, N)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (MICRO_BS, get_preset("micro").block_size) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, BATCHES(1, 0, 0, N)[0]), "ranks must see different data"
    nested = [[[BATCHES(s, m, r, N) for r in range(N)] for m in range(1)] for s in range(2)]
    assert torch.equal(get_batch(nested, 1, 0, 1, N)[0], x)


def test_deepspeed_estimators_are_the_documented_formulas():
    from reference.ds_estimates import deepspeed_estimates

    est = deepspeed_estimates(MODEL_FN(), N)
    psi = est["total_params"]
    assert psi == 15_099 and est["largest_layer_params"] == 1_848  # 21 -> 84 Linear + bias
    assert est["zero2"] == 2 * psi + int(18 * psi / N)
    assert est["zero3"] == 4 * 1_848 + int(18 * psi / N)


def test_portable_state_dict_crosses_process_by_value():
    d = PortableTensorDict(a=torch.arange(5.0), b=torch.ones(2, 3))
    buf = io.BytesIO()
    multiprocessing.reduction.ForkingPickler(buf).dump(d)  # torch's fd-sharing reducers are active
    back = multiprocessing.reduction.ForkingPickler.loads(buf.getvalue())
    assert isinstance(back, PortableTensorDict) and _states_equal(back, d)


# ----------------------------------------------------------------------------- DeepSpeed runs

def test_fp32_deterministic_and_stage0_equals_stage2():
    a = _run(ds_config(0))
    b = _run(ds_config(0))
    c = _run(ds_config(2))
    torch.manual_seed(0)
    init = {k: v.float() for k, v in MODEL_FN().state_dict().items()}
    for res in (a, b, c):
        for r in res:
            assert len(r["losses"]) == STEPS and all(math.isfinite(v) for v in r["losses"])
            assert r["global_steps"] == STEPS and r["skipped_steps"] == 0
            assert r["loss_scales"] == [1.0] * STEPS
        # `losses` is the rank average: identical on every rank; local losses differ (different data)
        assert res[0]["losses"] == res[1]["losses"]
        assert res[0]["local_losses"] != res[1]["local_losses"]
        assert res[0]["losses"][0] == pytest.approx(sum(r["local_losses"][0] for r in res) / N, abs=1e-12)
        assert _states_equal(res[0]["final_state"], res[1]["final_state"])
        fs = res[0]["final_state"]
        assert fs.keys() == init.keys()
        assert max_abs_diff(fs, init) > 1e-4, "weights did not train"
    assert a[0]["optimizer_kind"] == "AdamW" and c[0]["optimizer_kind"] == "DeepSpeedZeroOptimizer"
    # determinism: bitwise equal repeated runs
    assert a[0]["losses"] == b[0]["losses"] and a[0]["local_losses"] == b[0]["local_losses"]
    assert _states_equal(a[0]["final_state"], b[0]["final_state"])
    # fp32 stage 0 == stage 2, bitwise (docs/deepspeed.md, "fp32 stage 0 and stage 2 are bitwise equal")
    assert a[0]["losses"] == c[0]["losses"]
    assert _states_equal(a[0]["final_state"], c[0]["final_state"])


def test_bf16_memory_probe_matches_padding_arithmetic_and_zero3_equals_zero2():
    group_numels, param_numels = _group_numels()
    psi = sum(param_numels)
    assert psi == 15_099 and group_numels == [11_886, 3_213]
    # ZeRO-1/2: each group's flat buffer padded to a multiple of 2N, split in N slices
    padded = sum(math.ceil(n / (2 * N)) * 2 * N for n in group_numels)
    assert padded == 15_104
    # ZeRO-3: ceil(n/N) elements of every parameter on every rank
    part3 = sum(math.ceil(n / N) for n in param_numels)

    z2 = _run(ds_config(2, "bf16", reduce_bucket_size=20_000), capture_memory=True)
    z3 = _run(ds_config(3, "bf16", reduce_bucket_size=20_000, stage3_param_persistence_threshold=0),
              capture_memory=True)
    for r in z2:
        mem = r["memory"]
        for d in mem["after_backward"] + mem["after_step"]:
            assert d["kind"] == "DeepSpeedZeroOptimizer"
            assert d["params"] == 2 * padded  # full bf16 flat params
            assert d["master_params"] == 4 * padded // N  # fp32 slice
            assert all(v <= 8 for v in d["unclaimed"].values()), d["unclaimed"]
        for d in mem["after_step"]:
            assert d["optimizer_states"] == 8 * padded // N and d["grads"] == 0 and d["buffers"] == 0
        for d in mem["after_backward"]:
            # bf16 gradient partition: whole params that straddle the slice boundary, so
            # a little more than the slice, much less than the full gradient
            assert 2 * padded // N <= d["grads"] < 2 * psi
        assert mem["after_backward"][0]["optimizer_states"] == 0  # Adam state is lazy
        assert mem["transient_buckets"]["max_bytes"] == 20_000 * 2  # bf16 bucket, freed after backward
    for r in z3:
        mem = r["memory"]
        assert mem["after_backward"][0]["optimizer_states"] == 0  # Adam state is lazy
        for d in mem["after_backward"][1:] + mem["after_step"]:
            assert d["kind"] == "DeepSpeedZeroOptimizer_Stage3"
            # grads too: grad_partitions_flat_buffer is allocated at init and never freed
            assert (d["params"], d["master_params"], d["optimizer_states"], d["grads"]) == \
                (2 * part3, 4 * part3, 8 * part3, 2 * part3)
            assert d["buffers"] == 20_000 * 2  # persistent ipg bucket
            assert d["model_states"] == 16 * part3
    # memory_efficient_linear off: ZeRO-3 bf16 is bitwise ZeRO-2 bf16
    assert z2[0]["losses"] == z3[0]["losses"]
    assert _states_equal(z2[0]["final_state"], z3[0]["final_state"])
    assert _states_equal(z3[0]["final_state"], z3[1]["final_state"])


def _shm_op_after_initialize():
    """One tiny DeepSpeed engine in a test rank: the shm op its comm backend holds, and the losses."""
    import deepspeed.comm.comm as ds_comm
    out = run_deepspeed(MODEL_FN, ds_config(0), BATCHES, 1, return_final_state=False)
    return ds_comm.cdb.shm_comm_op, out["losses"]


def test_test_ranks_skip_deepspeeds_inference_shm_op():
    """tests/support/ds_preload.py skips the op (reference/ds_run.py's skip_inference_shm_op): DeepSpeed's
    backend then holds none, and still trains; its constructor still calls the function
    the skip replaces (if DeepSpeed renames it, the skip silently does nothing: this fails)."""
    import inspect

    from deepspeed.comm.torch import TorchBackend
    assert "build_shm_op()" in inspect.getsource(TorchBackend.__init__)
    for op, losses in run_ranks(_shm_op_after_initialize, N, env=ENV):
        assert op is None and len(losses) == 1 and math.isfinite(losses[0])
