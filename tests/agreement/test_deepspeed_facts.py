"""The DeepSpeed 0.19.8 facts of docs/deepspeed.md that no agreement test notices.

Each test here fails when DeepSpeed stops doing what its section says; the section's
"Pinned by:" line names the test. A new DeepSpeed release: run this file first.

Cheap checks run in the test process (DeepSpeed's config parser, its loss-scale update,
its CPU accelerator). The rest needs live engines: ONE pair of gloo ranks
(tests/launcher.run_ranks) builds them all in a row and reports what it saw, so the
~10 s DeepSpeed takes to set up its first ZeRO optimizer (its ZeRO optimizer check
imports the Muon module, which calls torch.compile) is paid once. Stage 3 comes
last because it replaces F.linear for the rest of the process. Every observation is
caught separately, so a change breaks the test of its own fact, not the whole file.

The ZeRO engines train a 3-layer nn.Linear model (Ψ = 216) with torch.optim.SGD (lr 0.5,
no momentum, no weight decay, no clipping): a parameter that gets a zero gradient does
not move, and one that gets gradient g moves by exactly -0.5 g, so a stale gradient is
visible in the weights.
"""
import functools
import os
import traceback
import types

import pytest
import torch
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import deepspeed.runtime.config as ds_config_mod  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_scaler  # noqa: E402
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # noqa: E402

from tests.support.launcher import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

N = 2
PSI = 3 * (8 * 8 + 8)       # the model's parameter count; a multiple of 2N, so no padding
LR = 0.5
ENV = {"DS_ACCELERATOR": "cpu"}
SAVE_DIRS = ("stage2", "stage3")


@pytest.fixture
def ds_parse(monkeypatch):
    """DeepSpeedConfig(config) on one rank with no process group (as tests/agreement/test_config.py):
    DeepSpeedConfig asks deepspeed.comm for rank and world size, so stub those two."""
    def parse(config, world_size=1):
        monkeypatch.setattr(ds_config_mod, "dist", types.SimpleNamespace(
            get_rank=lambda: 0, get_world_size=lambda *a, **k: world_size))
        return ds_config_mod.DeepSpeedConfig(config)
    return parse


# ----------------------------------------------------------------------------- in this process

def test_deepspeed_ignores_unknown_top_level_keys_but_not_in_zero_optimization(ds_parse):
    typo = ds_parse({"train_batch_size": 8, "gradient_cliping": 0.5, "no_such_section": {"x": 1}})
    assert typo.gradient_clipping == 1.0, "the misspelt key was read"
    # activation_checkpointing is read key by key too: an unknown key in it passes
    ds_parse({"train_batch_size": 8, "activation_checkpointing": {"partition_activation": True}})
    # the pydantic sections refuse extras
    with pytest.raises(Exception, match="stage3_max_live_params"):
        ds_parse({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_max_live_params": 0}})


def test_deepspeed_refuses_the_top_level_keys_of_removed_features(ds_parse):
    """Not every unknown key is ignored: DeepSpeedConfig.__init__ calls
    _reject_removed_config_keys (runtime/config.py), which raises DeepSpeedConfigError for
    each key of _REMOVED_TOP_LEVEL_CONFIG_KEYS (and a few zero_optimization keys). The
    section of docs/deepspeed.md names every one of them."""
    import re
    from pathlib import Path

    removed = sorted(ds_config_mod._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert "amp" in removed and "elasticity" in removed
    for key in removed:
        with pytest.raises(ds_config_mod.DeepSpeedConfigError):
            ds_parse({"train_batch_size": 8, key: {}})
    for key in sorted(ds_config_mod._REMOVED_ZERO_CONFIG_KEYS):
        with pytest.raises(ds_config_mod.DeepSpeedConfigError):
            ds_parse({"train_batch_size": 8, "zero_optimization": {"stage": 3, key: 1}})
    page = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md").read_text()
    section = page.split("\n## Unknown top-level config keys are ignored", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", section))
    assert set(removed) <= named, sorted(set(removed) - named)
    assert set(ds_config_mod._REMOVED_ZERO_CONFIG_KEYS) <= named


def test_comms_logger_is_on_whenever_the_section_is_present(ds_parse, monkeypatch):
    import deepspeed.comm.comm as ds_comm
    logger = ds_comm.comms_logger
    for attr in ("enabled", "verbose", "debug", "prof_ops", "prof_all"):   # restored after the test
        monkeypatch.setattr(logger, attr, getattr(logger, attr))
    cfg = ds_parse({"train_batch_size": 8, "comms_logger": {"enabled": False}})
    ds_comm._configure_using_config_file(cfg.comms_config)
    assert logger.enabled is True, "comms_logger.enabled: false now switches the logger off"
    assert cfg.comms_config.comms_logger.enabled is False       # the key was read, and not used


def test_comms_logger_bandwidths_and_reduce_scatter_message_size(monkeypatch):
    """minizero's calc_bw is DeepSpeed's calc_bw_log for every op minizero issues, and the
    message size DeepSpeed logs for reduce_scatter_tensor is its whole input."""
    import inspect

    import deepspeed.comm as ds_dist
    import deepspeed.comm.comm as ds_comm
    from deepspeed.comm.utils import get_msg_size_from_args
    from deepspeed.utils.comms_logging import calc_bw_log

    from minizero.observe.comms_logger import OP_NAMES, calc_bw
    for n in (2, 4, 8):
        monkeypatch.setattr(ds_dist, "get_world_size", lambda *a, _n=n, **k: _n)
        for op in OP_NAMES.values():
            for size, ms in ((8, 0.01), (4096, 0.5), (12856, 2.93)):
                assert calc_bw(op, size, ms, n) == calc_bw_log(op, size, ms), (op, n)
    n = 4
    full, shard = torch.zeros(n * 10), torch.zeros(10)
    rs = inspect.getclosurevars(ds_comm.reduce_scatter_tensor).nonlocals["func"]
    ag = inspect.getclosurevars(ds_comm.all_gather_into_tensor).nonlocals["func"]
    assert get_msg_size_from_args(rs, shard, full) == full.numel() * 4    # the whole input: N shards
    assert get_msg_size_from_args(ag, full, shard) == shard.numel() * 4   # the input: one shard


def test_cpu_accelerator_claims_fp16_only_where_mkldnn_runs_it(monkeypatch):
    acc = deepspeed.accelerator.get_accelerator()
    assert acc._name == "cpu"
    for mkldnn_fp16 in (False, True):   # either CPU, whichever this one is
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: mkldnn_fp16)
        assert bool(acc.is_fp16_supported()) is mkldnn_fp16
        assert (torch.float16 in acc.supported_dtypes()) is mkldnn_fp16
        assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()


def _stage0_fp16_scale_config(ds_parse, **fp16):
    """The LossScaleConfig DeepSpeedEngine._configure_fp16_optimizer builds for
    FP16_UnfusedOptimizer (torch_adam at stage 0): the UNFUSED profile, with the fp16
    section's dynamic_loss_scale_args (which carry `hysteresis` as DELAYED_SHIFT)."""
    cfg = ds_parse({"train_batch_size": 8, "fp16": {"enabled": True, **fp16}})
    args = cfg.float16_config.dynamic_loss_scale_args()
    conf = ds_scaler.LossScaleConfig(low_precision_dtype=torch.float16, dynamic_loss_scale=True,
                                     static_loss_scale=1.0, dynamic_loss_args=args,
                                     profile=ds_scaler.LossScaleProfile.UNFUSED)
    return conf, args


def test_stage0_fp16_scaler_halves_on_the_first_overflow_and_clamps_at_the_minimum(ds_parse, monkeypatch):
    conf, args = _stage0_fp16_scale_config(ds_parse, min_loss_scale=2 ** 14)
    assert args[ds_scaler.DELAYED_SHIFT] == 2, "the config does ask for hysteresis 2"
    assert not hasattr(conf, "hysteresis") and not hasattr(conf, "cur_hysteresis")
    opt = types.SimpleNamespace(loss_scale_config=conf, verbose=False)   # all _update_scale reads
    assert conf.cur_scale == 2 ** 16
    FP16_UnfusedOptimizer._update_scale(opt, True)
    assert conf.cur_scale == 2 ** 15, "stage 0 halves on the first overflow: no hysteresis"
    for _ in range(3):   # then sits at min_loss_scale without raising
        FP16_UnfusedOptimizer._update_scale(opt, True)
    assert conf.cur_scale == 2 ** 14

    # The ZeRO optimizers' scaler, from the same section, keeps the scale on the first
    # overflow and raises at the minimum. (Its update asks deepspeed.comm for the rank.)
    monkeypatch.setattr(ds_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    zero = ds_scaler.CreateLossScaler(dtype=torch.float16, static_loss_scale=0, dynamic_scaling=True,
                                      dynamic_loss_args=args)
    assert zero.cur_scale == 2 ** 16 and zero.raise_error_at_min_scale
    zero.update_scale(True)
    assert zero.cur_scale == 2 ** 16


def test_memory_efficient_linear_rounds_differently_from_torch_linear_in_bf16():
    """zero3_linear_wrap, what ZeRO-3 installs as F.linear, is matmul then `+= bias` for
    inputs of more than 2 dimensions: two bf16 roundings where torch's linear has one."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 64, generator=g).bfloat16()
    w, b = torch.randn(64, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    ours = torch.nn.functional.linear(x, w, b)
    theirs = zero3_linear_wrap(x, w, b)
    assert torch.equal(theirs, x.matmul(w.t()) + b)
    assert not torch.equal(theirs, ours)
    assert torch.equal(zero3_linear_wrap(x.float(), w.float(), b.float()),
                       x.float().matmul(w.float().t()) + b.float())


# ----------------------------------------------------------------------------- live engines

class ThreeLinear(nn.Module):
    """a and c always run; b only when use_b, so b can go a step without a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b=True):
        y = self.a(x)
        if use_b:
            y = y + self.b(x)
        return self.c(y).pow(2).mean()


class CollectiveLog:
    """Every collective DeepSpeed issues through deepspeed.comm, as (name, numel of each
    tensor argument): wraps the methods of deepspeed.comm's backend object, which every
    deepspeed.comm function calls."""

    NAMES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
             "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast")

    def __init__(self):
        from deepspeed.comm import comm as ds_comm

        self.calls = []
        self.where = "outside"     # set by the wrappers of _observe: which part of DeepSpeed is running
        self.where_counts = {}     # where -> collectives issued there
        self.all_reduce_tensors = None   # a list while set: (input, the same tensor after) of each all_reduce
        for name in self.NAMES:
            setattr(ds_comm.cdb, name, self._wrap(name, getattr(ds_comm.cdb, name)))

    def _wrap(self, name, fn):
        def logged(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            self.calls.append((name, [t.numel() for t in tensors]))
            self.where_counts[self.where] = self.where_counts.get(self.where, 0) + 1
            before = tensors[0].detach().clone() if self.all_reduce_tensors is not None and name == "all_reduce" \
                else None
            out = fn(*args, **kwargs)
            if before is not None:
                self.all_reduce_tensors.append((before, tensors[0].detach().clone()))
            return out
        return logged

    def take(self):
        out, self.calls = self.calls, []
        return out


def _engine(stage, bf16=False, fp16=None, **zero):
    torch.manual_seed(0)
    model = ThreeLinear()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, **zero}}
    if fp16 is not None:
        config["fp16"] = {"enabled": True, **fp16}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    return engine


def _train(engine, log, uses_b):
    """One step per entry of uses_b; per step the collectives of forward, backward and
    step, and the fp32 master of b.weight after the step."""
    rank = torch.distributed.get_rank()
    steps = []
    for i, use_b in enumerate(uses_b):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * i + rank)).to(engine.module.a.weight.dtype)
        log.take()
        loss = engine(x, use_b=use_b)
        fwd = log.take()
        engine.backward(loss)
        bwd = log.take()
        engine.step()
        steps.append({"fwd": fwd, "bwd": bwd, "step": log.take(),
                      "b": _full_fp32(engine.module.b.weight)})
    return steps


def _full_fp32(param):
    """The fp32 master of a ZeRO parameter, or (stage 0 fp32) the parameter itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    return (param if full is None else full).detach().float().clone()


def _storages(tensors):
    return [t.untyped_storage().data_ptr() for t in tensors]


def _checkpoint(engine, save_dir, prefix=""):
    """Save with DeepSpeed's default tag; the folder's files and rank 0's optimizer-state keys."""
    engine.save_checkpoint(save_dir)
    torch.distributed.barrier()
    tag = f"global_step{engine.global_steps}"
    out = {"tag": tag, "top": sorted(os.listdir(save_dir)), "files": sorted(os.listdir(os.path.join(save_dir, tag)))}
    with open(os.path.join(save_dir, "latest")) as f:
        out["latest"] = f.read()
    sd = torch.load(os.path.join(save_dir, tag, f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                    map_location="cpu", weights_only=False)
    out["optim_keys"] = sorted(sd["optimizer_state_dict"])
    out["partition_count"] = sd["optimizer_state_dict"]["partition_count"]
    return out


def _observe(save_root):
    """Build DeepSpeed engines one after another on this rank and record what they do."""
    seen = {}

    def record(name, fn):
        try:
            seen[name] = fn()
        except Exception:
            seen[name] = {"error": traceback.format_exc()}

    logs = []

    def collective_log():
        """One log for the process, made once deepspeed.comm's backend exists (after the
        first initialize)."""
        if not logs:
            logs.append(CollectiveLog())
        return logs[0]

    def fp16_initialize():
        """deepspeed.initialize with fp16 on, as if on a CPU without and with mkldnn fp16."""
        cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        ops, real = torch.ops.mkldnn, torch.ops.mkldnn._is_mkldnn_fp16_supported
        out = {}
        try:
            for mkldnn_fp16 in (False, True):
                ops._is_mkldnn_fp16_supported = lambda: mkldnn_fp16
                torch.manual_seed(0)
                model = ThreeLinear()
                try:
                    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                    out[mkldnn_fp16] = type(engine.optimizer).__name__
                except ValueError as e:
                    out[mkldnn_fp16] = f"ValueError: {e}"
        finally:
            ops._is_mkldnn_fp16_supported = real
        return out

    def activation_checkpointing():
        from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

        torch.manual_seed(0)
        model = ThreeLinear()
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                            "number_checkpoints": 3}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        parsed = engine._config.activation_checkpointing_config

        def module_state():
            return {"configured": ckpt.is_configured(), "partition": ckpt.PARTITION_ACTIVATIONS,
                    "cpu": ckpt.CPU_CHECKPOINT, "num_layers": ckpt.num_layers}

        after_initialize = module_state()
        ckpt.configure(None, deepspeed_config=cfg)   # what the user has to call
        return {"parsed": {"partition": parsed.partition_activations, "cpu": parsed.cpu_checkpointing,
                           "num_layers": parsed.number_checkpoints},
                "after_initialize": after_initialize, "after_configure": module_state()}

    def stage0_unused():
        """Stage 0 fp32 (no ZeRO optimizer): besides the stale-gradient probe, how its
        all-reduce averages (engine.py, allreduce_bucket): the tensor handed to all_reduce
        is this rank's gradient undivided, and the gradient after the epilogue is the sum
        times 1/N (gradient_predivide_factor 1: `postscale_gradients`)."""
        engine = _engine(0)
        log = collective_log()
        grads = {}
        epilogue = engine.allreduce_gradients

        def allreduce_gradients(*a, **k):
            grads["local"] = torch.cat([p.grad.detach().flatten() for p in engine.module.parameters()
                                        if p.grad is not None])
            log.all_reduce_tensors = []
            try:
                return epilogue(*a, **k)
            finally:
                grads["all_reduce"] = log.all_reduce_tensors
                log.all_reduce_tensors = None
                grads["after"] = torch.cat([p.grad.detach().flatten() for p in engine.module.parameters()
                                            if p.grad is not None])
        engine.allreduce_gradients = allreduce_gradients
        steps = _train(engine, log, [True, True, False])
        sent = torch.cat([before for before, _ in grads["all_reduce"]])
        summed = torch.cat([after for _, after in grads["all_reduce"]])
        n = torch.linalg.vector_norm
        return {"steps": steps, "sent_norm": float(n(sent)), "local_norm": float(n(grads["local"])),
                "summed_norm": float(n(summed)), "after_norm": float(n(grads["after"]))}

    def stage0_fp16_scale():
        """Stage 0 fp16 (FP16_UnfusedOptimizer: no ZeRO optimizer), loss_scale_window 4, 20
        steps: the scale after each step, whether it was skipped, and the factor between the
        gradient backward made (module p.grad, fp16) and the fp32 gradient the optimizer
        steps with (wrapping the inner optimizer's step)."""
        from reference.ds_run import patch_cpu_fp16
        patch_cpu_fp16()
        engine = _engine(0, fp16={"loss_scale_window": 4})
        opt = engine.optimizer
        ratios = []
        inner = opt.optimizer.step

        def step(*a, **k):
            made = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for g in opt.fp16_groups for p in g]))
            given = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for g in opt.fp32_groups for p in g]))
            ratios.append(float(made / given))
            return inner(*a, **k)
        opt.optimizer.step = step
        scales, skipped = [], []
        for i in range(20):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * i + torch.distributed.get_rank()))
            engine.backward(engine(x.half()))
            engine.step()
            scales.append(float(opt.loss_scale))
            skipped.append(bool(opt.overflow))
        return {"kind": type(opt).__name__, "scales": scales, "skipped": skipped, "ratios": ratios}

    def zero12():
        """ZeRO-1 and -2 (fp32, a bucket of 100 elements, so the 216 parameters fill several):
        what the steps show, and where backward's reductions run: inside loss.backward (the
        gradient hooks) or after it, in engine._backward_epilogue (ZeRO-1: reduce_gradients),
        and how many gradient elements the rank holds in p.grad when the epilogue starts.
        A third engine: ZeRO-1 with overlap_comm on."""
        out = {}
        log = collective_log()
        for stage, overlap in ((1, False), (2, False), (1, True)):
            engine = _engine(stage, reduce_bucket_size=100, **({"overlap_comm": True} if overlap else {}))
            opt = engine.optimizer
            held = []
            epilogue = engine._backward_epilogue

            def backward_epilogue(*a, _engine=engine, _epilogue=epilogue, _held=held, **k):
                _held.append(sum(p.grad.numel() for p in _engine.module.parameters() if p.grad is not None))
                log.where = "epilogue"
                try:
                    return _epilogue(*a, **k)
                finally:
                    log.where = "outside"
            engine._backward_epilogue = backward_epilogue
            forward = engine.forward

            def hooks_forward(*a, _forward=forward, **k):
                log.where = "forward"
                try:
                    return _forward(*a, **k)
                finally:
                    log.where = "hooks"   # from here to the epilogue: loss.backward's gradient hooks
            engine.forward = hooks_forward
            step = engine.step

            def outside_step(*a, _step=step, **k):
                log.where = "step"
                try:
                    return _step(*a, **k)
                finally:
                    log.where = "outside"
            engine.step = outside_step
            log.where_counts = {}
            steps = _train(engine, log, [True, True, False])
            where = dict(log.where_counts)
            if overlap:
                out["1_overlap"] = {"overlap_comm": opt.overlap_comm, "where": where, "held_at_epilogue": held}
                continue
            out[stage] = {
                "overlap_comm": opt.overlap_comm, "where": where, "held_at_epilogue": held,
                "kind": type(opt).__name__,
                "master_dtypes": [str(t.dtype) for t in opt.single_partition_of_fp32_groups],
                "master_numel": sum(t.numel() for t in opt.single_partition_of_fp32_groups),
                "master_storages": _storages(opt.single_partition_of_fp32_groups),
                "param_storages": _storages(opt.bit16_groups_flat),
                "param_dtypes": [str(t.dtype) for t in opt.bit16_groups_flat],
                "multi_rank_allreduce": opt.use_multi_rank_bucket_allreduce,
                "steps": steps,
            }
            if stage == 2:
                out[stage]["checkpoint"] = _checkpoint(engine, os.path.join(save_root, "stage2"))
        return out

    def zero2_bf16_checkpoint():
        engine = _engine(2, bf16=True)
        _train(engine, collective_log(), [True])
        return _checkpoint(engine, os.path.join(save_root, "stage2_bf16"), prefix="bf16_")

    def zero3():
        linear_before = torch.nn.functional.linear
        out = {}
        for name, knobs in (("defaults", {}),
                            ("knobs0", {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                        "stage3_prefetch_bucket_size": 0})):
            engine = _engine(3, stage3_param_persistence_threshold=0, **knobs)
            opt = engine.optimizer
            res = {"kind": type(opt).__name__,
                   "master_dtypes": [str(t.dtype) for t in opt.fp32_partitioned_groups_flat],
                   "master_numel": sum(t.numel() for t in opt.fp32_partitioned_groups_flat),
                   "master_storages": _storages(opt.fp32_partitioned_groups_flat),
                   "param_storages": _storages(opt.fp16_partitioned_groups_flat),
                   "param_dtypes": [str(t.dtype) for t in opt.fp16_partitioned_groups_flat],
                   "steps": _train(engine, collective_log(), [True, True, True, False])}
            if name == "defaults":
                res["checkpoint"] = _checkpoint(engine, os.path.join(save_root, "stage3"))
                from deepspeed.runtime.zero.linear import zero3_linear_wrap

                res["linear_replaced"] = linear_before is not zero3_linear_wrap and \
                    torch.nn.functional.linear is zero3_linear_wrap
            out[name] = res
        del engine
        out["linear_after_engines"] = torch.nn.functional.linear.__name__
        return out

    record("fp16_initialize", fp16_initialize)
    record("activation_checkpointing", activation_checkpointing)
    record("stage0_unused", stage0_unused)
    record("stage0_fp16_scale", stage0_fp16_scale)
    record("zero12", zero12)
    record("zero2_bf16_checkpoint", zero2_bf16_checkpoint)
    record("zero3", zero3)   # last: it replaces F.linear for the rest of the process
    return seen


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """What rank 0 saw (the ranks agree on everything asserted here), and the save root."""
    root = tmp_path_factory.mktemp("ds_facts")
    ranks = run_ranks(_observe, world_size=N, args=(str(root),), env=ENV)
    return ranks[0], root


def _get(seen, name):
    observed = seen[0][name]
    if isinstance(observed, dict) and "error" in observed:
        pytest.fail(f"{name} raised on rank 0:\n{observed['error']}")
    return observed


def _gathered(calls):
    """Elements all-gathered (output sizes) in a list of collectives."""
    return sum(sizes[0] for name, sizes in calls if name.startswith("all_gather"))


def test_deepspeed_initialize_refuses_fp16_on_a_cpu_without_mkldnn_fp16(seen):
    assert _get(seen, "fp16_initialize") == {False: "ValueError: Type fp16 is not supported on your device.",
                                             True: "FP16_UnfusedOptimizer"}


def test_deepspeed_initialize_parses_activation_checkpointing_but_does_not_apply_it(seen):
    got = _get(seen, "activation_checkpointing")
    assert got["parsed"] == {"partition": True, "cpu": True, "num_layers": 3}
    assert got["after_initialize"] == {"configured": False, "partition": False, "cpu": False, "num_layers": None}
    # the probe can see a configured module: configure() flips all four
    assert got["after_configure"] == {"configured": True, "partition": True, "cpu": True, "num_layers": 3}


def test_fp32_zero_keeps_a_separate_fp32_master(seen):
    zero12, zero3 = _get(seen, "zero12"), _get(seen, "zero3")
    for res in (zero12[1], zero12[2], zero3["defaults"]):
        assert res["master_dtypes"] == res["param_dtypes"] == ["torch.float32"]
        assert res["master_numel"] == PSI // N
        assert not set(res["master_storages"]) & set(res["param_storages"]), \
            f"{res['kind']}: the fp32 master aliases the fp32 parameters"
    assert zero12[2]["kind"] == "DeepSpeedZeroOptimizer"
    assert zero3["defaults"]["kind"] == "DeepSpeedZeroOptimizer_Stage3"


def test_zero12_backward_all_reduces_the_whole_gradient(seen):
    zero12 = _get(seen, "zero12")
    for stage in (1, 2):
        res = zero12[stage]
        assert res["multi_rank_allreduce"] is True
        for step in res["steps"]:
            names = {name for name, _ in step["bwd"]}
            assert names == {"all_reduce"}, f"stage {stage} backward: {step['bwd']}"
        # every rank receives the whole reduced bucket: Ψ elements, not its Ψ/N slice
        assert [sum(s[0] for _, s in step["bwd"]) for step in res["steps"]] == [PSI, PSI, PSI - 72]
        # the step all-gathers the parameters: Ψ elements out
        assert all(_gathered(step["step"]) == PSI for step in res["steps"])


def test_zero1_reduces_after_backward_and_zero2_in_its_hooks(seen):
    """docs/deepspeed.md, "Memory DeepSpeed holds per rank" and fsdp.md's row "reduce while
    backward runs". A gradient hook reduces only `if self.partition_gradients or
    self.overlap_comm` (stage_1_and_2.py, process_gradients), and overlap_comm is off below
    stage 3 by default: ZeRO-1 issues every reduction after loss.backward returns, in
    engine._backward_epilogue -> allreduce_gradients -> optimizer.reduce_gradients, and so
    holds every parameter's gradient (Ψ elements) when that starts; ZeRO-2 reduces from its
    hooks, overlap_comm off as well, and holds less. ZeRO-1 with overlap_comm on reduces in
    its hooks too (the boundary micro-step's). The old text said ZeRO-1 reduces in hooks at
    gradient_accumulation_steps 1."""
    zero12 = _get(seen, "zero12")
    z1, z2, z1_overlap = zero12[1], zero12[2], zero12["1_overlap"]
    assert (z1["overlap_comm"], z2["overlap_comm"], z1_overlap["overlap_comm"]) == (False, False, True)
    steps = 3
    assert "hooks" not in z1["where"] and z1["where"]["epilogue"] >= steps
    assert z1["held_at_epilogue"] == [PSI, PSI, PSI - 72]   # every gradient made, none reduced yet
    assert z2["where"]["hooks"] >= steps                     # buckets reduced while backward runs
    assert all(h < want for h, want in zip(z2["held_at_epilogue"], [PSI, PSI, PSI - 72]))
    assert z1_overlap["where"]["hooks"] >= steps


def test_stage0_sums_the_gradients_then_multiplies_by_one_over_n(seen):
    """docs/deepspeed.md, "fp32 stage 0 and stage 2 are bitwise equal": stage 0's all-reduce
    (engine.py, allreduce_bucket, postscale_gradients with gradient_predivide_factor 1) is
    handed this rank's gradient undivided and multiplies the sum by 1/N after it, (g0 + g1)
    * 1/2, where ZeRO divides first, g0/2 + g1/2. At N = 2 both are exact halvings of
    the same sum. Norms: scaling by a power of two is exact, so the comparisons are `==`."""
    got = _get(seen, "stage0_unused")
    assert got["sent_norm"] == got["local_norm"]           # not divided before the sum
    assert got["after_norm"] == got["summed_norm"] / N     # the sum times 1/N after it
    assert got["summed_norm"] != got["local_norm"]


def test_stage0_fp16_scale_doubles_every_window_and_divides_the_gradients(seen):
    """docs/deepspeed.md, "Stage 0 fp16 never scales the loss". FP16_UnfusedOptimizer.step
    calls `_update_scale(False)` on every clean step (unfused_optimizer.py, step), and since
    the backward is not multiplied by the scale it never overflows: the scale doubles on the
    window rule (the update of step 4, 8, 12, 16 at window 4) without bound, and every step
    divides the gradients by the scale as updated, so the gradient the optimizer gets is the
    backward's divided by 2**16 at first and by 2**20 after 16 steps. (The old text: "the
    scale never moves".) Exact: the factor is a power of two, so the norms divide exactly."""
    got = _get(seen, "stage0_fp16_scale")
    assert got["kind"] == "FP16_UnfusedOptimizer"
    assert got["skipped"] == [False] * 20
    assert got["scales"] == [2.0 ** (16 + k // 4) for k in range(20)]
    assert got["ratios"] == got["scales"]


def test_the_compare_report_says_stage0_fp16_scale_grows():
    """Where a user comparing the libraries looks: `python -m minizero.compare`'s notes, for
    a run with stage 0 in fp16, say that DeepSpeed's scale grows without bound."""
    from minizero.compare.report import note
    args = types.SimpleNamespace(out="/tmp/report", dtype="fp16", stages=[0, 1])
    text = " ".join(note(args, {}).split())
    assert "the scale doubles every `loss_scale_window` clean steps without bound" in text
    assert "never multiplies the loss by the scale" in text


def test_zero3_reapplies_a_stale_gradient_and_stages_0_to_2_do_not(seen):
    zero12 = _get(seen, "zero12")
    for stage, steps in ((0, _get(seen, "stage0_unused")["steps"]), (1, zero12[1]["steps"]), (2, zero12[2]["steps"])):
        assert not torch.equal(steps[1]["b"], steps[0]["b"])
        assert torch.equal(steps[2]["b"], steps[1]["b"]), f"stage {stage} moved b without a gradient"
    z3 = _get(seen, "zero3")["defaults"]["steps"]
    moved_with_gradient = z3[2]["b"] - z3[1]["b"]
    moved_without = z3[3]["b"] - z3[2]["b"]
    assert moved_with_gradient.abs().max() > 1e-3
    # SGD: b moves by -lr * (step 2's gradient) again. lr = 0.5 makes d = lr * g exact in
    # fp32, so each update b' = fl(b - d) rounds once (error <= u|b'|, u = 2^-24) and each
    # difference read here rounds once more (<= u|moved|): elementwise, the two moves differ
    # by at most u (|b2| + |b3| + |moved_with| + |moved_without|). A stale gradient moves b
    # by the same d; no stale gradient would move it by 0, about 1e-3 away.
    u = 2.0 ** -24
    bound = u * (z3[2]["b"].abs() + z3[3]["b"].abs() + moved_with_gradient.abs() + moved_without.abs())
    assert ((moved_without - moved_with_gradient).abs() <= bound).all()


def test_zero3_defaults_gather_once_per_step_and_zero_knobs_twice(seen):
    zero3 = _get(seen, "zero3")
    steady = 2   # step 0 traces the module order, step 1 builds the prefetch plan
    defaults, knobs0 = zero3["defaults"]["steps"][steady], zero3["knobs0"]["steps"][steady]
    assert (_gathered(defaults["fwd"]), _gathered(defaults["bwd"])) == (PSI, 0)
    assert (_gathered(knobs0["fwd"]), _gathered(knobs0["bwd"])) == (PSI, PSI)


def test_zero3_replaces_f_linear_for_the_rest_of_the_process(seen):
    zero3 = _get(seen, "zero3")
    assert zero3["defaults"]["linear_replaced"] is True
    assert zero3["linear_after_engines"] == "zero3_linear_wrap"


def test_checkpoint_folder_layout(seen):
    from minizero.checkpoint_files.checkpoint_folder import complete_tags

    z2, z3 = _get(seen, "zero12")[2]["checkpoint"], _get(seen, "zero3")["defaults"]["checkpoint"]
    z2_bf16 = _get(seen, "zero2_bf16_checkpoint")
    assert (z2["tag"], z3["tag"]) == ("global_step3", "global_step4")   # the default tag: global_step<steps>
    for ck in (z2, z3):
        assert ck["latest"] == ck["tag"]
        # rank 0 also copies DeepSpeed's recovery scripts next to `latest`
        assert ck["top"] == sorted([ck["tag"], "latest", "zero_to_fp32.py", "zero_to_torch.py"])
    optim = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(N)]
    assert z2["files"] == sorted(["mp_rank_00_model_states.pt", *optim])
    assert z3["files"] == sorted([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(N)] + optim)
    assert z2_bf16["files"] == sorted(["mp_rank_00_model_states.pt", *("bf16_" + f for f in optim)])
    # the fp32 flat partition, the torch optimizer's state, partition_count, the loss scaler
    assert {"single_partition_of_fp32_groups", "base_optimizer_state", "partition_count", "loss_scaler"} \
        <= set(z2["optim_keys"]) and z2["partition_count"] == [N]
    assert {"fp32_flat_groups", "optimizer_state_dict", "partition_count", "loss_scaler"} \
        <= set(z3["optim_keys"]) and z3["partition_count"] == N
    # minizero's resume path recognises both DeepSpeed folders as complete
    root = seen[1]
    assert complete_tags(str(root / "stage2")) == [z2["tag"]]
    assert complete_tags(str(root / "stage3")) == [z3["tag"]]
    assert complete_tags(str(root / "stage2_bf16")) == [z2_bf16["tag"]]


# ----------------------------------------------------------------------------- ZeRO-3 offload norm

def _zero3_clipping(lib: str, offload: bool, variant: str = "minizero"):
    """ZeRO-3 bf16 on the micro GPT (dropout off), clipping on every step (clip 0.05), with or
    without offload_optimizer on the CPU; `variant` is run_minizero's (tests/support/probes.py)."""
    import functools
    from reference.ds_run import run_deepspeed
    from tests.support.harness import PatternBatches, make_config, make_model, run_minizero
    zero = {"stage3_param_persistence_threshold": 0, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    cfg = make_config(3, "bf16", micro_batch=2, lr=3e-3, zero=zero, clip=0.05)   # clips on every step
    model_fn = functools.partial(make_model, "micro", "gpt", embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    if lib == "deepspeed":
        return run_deepspeed(model_fn, cfg, PatternBatches(62, 16, 4), 4)
    return run_minizero(model_fn, cfg, PatternBatches(62, 16, 4), 4, variant=variant)


@functools.lru_cache(maxsize=None)
def _zero3_clipping_runs(lib: str, offload: bool, variant: str = "minizero") -> list:
    """Every rank's result, one launch per (lib, offload, variant) for the module (read only)."""
    return run_ranks(_zero3_clipping, world_size=N, args=(lib, offload, variant), env=ENV)


def test_zero3_offload_sums_the_gradient_norm_in_fp32():
    """docs/deepspeed.md, "ZeRO-3 with offload_optimizer sums the gradient norm in fp32": the
    same run with and without offload_optimizer, clipping on every step. The first forward and
    backward are the same; the norms offload reports are fp32 numbers (without offload: fp64
    ones), and once the clip factor is computed from them the weights part.

    The first step's norms are of the same gradients, so they differ by offload's fp32
    roundings alone (tests/support/probes.py, `_offload_norm`), bounded, with u = 2**-24 and
    the fp64 norm taken as exact: per parameter group, each rank's fp64 sum of squares rounded
    to fp32 and the two added in fp32 (2u on the sum), the fp32 square root (half of that,
    plus u: 2u); the group norms squared (5u), added (6u) and square-rooted in fp32 (4u).
    5u leaves room for the second-order terms. Later steps start from weights that have
    parted, so only their precision is pinned: the bound holds on any CPU kernels, where a
    bound measured over all steps did not (scalar kernels moved the later norms by 1e-4)."""
    off, on = (_zero3_clipping_runs("deepspeed", o)[0] for o in (False, True))
    assert on["losses"][0] == off["losses"][0]
    as_fp32 = lambda x: float(torch.tensor(x, dtype=torch.float32))
    assert all(n == as_fp32(n) for n in on["grad_norms"])
    assert any(n != as_fp32(n) for n in off["grad_norms"])
    assert abs(on["grad_norms"][0] - off["grad_norms"][0]) <= 5 * 2 ** -24 * off["grad_norms"][0]
    assert any(not torch.equal(on["final_state"][k], off["final_state"][k]) for k in on["final_state"])


def test_zero3_offload_norm_is_the_whole_clipping_difference():
    """With offload_optimizer and clipping on every step, minizero's weights and DeepSpeed's part
    (minizero keeps its fp64 norm, offload or not). Given DeepSpeed's offload norm arithmetic
    (tests/support/probes.py: `_offload_norm`, the fp32 sum across ranks above) and nothing
    else, minizero equals DeepSpeed bit for bit: the norms DeepSpeed reports, the losses and
    the final weights, on every rank. So that one rounding is the whole difference, and
    minizero's offload step (unscale by the clip factor, torch AdamW on the host master)
    does what DeepSpeed's does."""
    ds = _zero3_clipping_runs("deepspeed", True)
    mz = _zero3_clipping_runs("minizero", True, "ds_norm")
    own = _zero3_clipping_runs("minizero", True)
    for r in range(N):
        assert mz[r]["ds_grad_norms"] == ds[r]["grad_norms"]
        assert mz[r]["losses"] == ds[r]["losses"]
        assert all(torch.equal(mz[r]["final_state"][k], ds[r]["final_state"][k].float()) for k in ds[r]["final_state"])
    # without the harness the norms differ in their rounding and the weights part: the patch matters
    assert own[0]["grad_norms"] != ds[0]["grad_norms"]
    assert any(not torch.equal(own[0]["final_state"][k], ds[0]["final_state"][k].float()) for k in own[0]["final_state"])

