"""DeepSpeed's checkpoints into minizero and back (minizero/checkpoint_files/deepspeed_checkpoint.py,
minizero/checkpoint_files/export_deepspeed.py), against DeepSpeed 0.19.8 itself.

2 gloo ranks, bf16, ZeRO-1 and ZeRO-3, a GPT of 2 layers and width 12 without dropout
(DeepSpeed saves no RNG state, so a resumed run must not draw random numbers), AdamW with
WarmupLR. One pair of processes per stage runs everything:

  1. DeepSpeed trains 3 steps and saves (folder `ds`); its own view of the state is kept:
     the masters through get_fp32_state_dict_from_zero_checkpoint, Adam's moments through
     safe_get_full_optimizer_state.
  2. A fresh DeepSpeed engine loads `ds` and trains steps 3-5; a fresh minizero engine loads
     `ds` and trains steps 3-5.
  3. minizero trains 3 steps and saves (`mz`); rank 0 exports it (`mz_as_ds`); a fresh
     DeepSpeed engine loads `mz_as_ds` and a fresh minizero engine loads `mz`, each trains
     steps 3-5.

3 steps each side of the save: WarmupLR's first step has lr 0, so the saved masters have
moved over two steps and the moments over three; the first resumed step reads every saved
number (masters, moments, Adam's step, the schedule's position) and the second reads what the
first wrote. More steps repeat the same arithmetic (the loop's steps were 5 and 5; the
loops were about 60% of the launches' CPU).

Tolerance 0 for the losses: minizero and DeepSpeed agree bitwise at stages 1-3 in bf16 on
these settings (tests/agreement/test_agreement_loss.py::test_low_precision_loss_and_weights_bitwise,
the agreement tolerance), and a checkpoint carries every number a step reads (fp32 masters,
moments, Adam's step, the lr schedule), so the resumed runs are the same arithmetic again.
"""
import functools
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")
deepspeed = pytest.importorskip("deepspeed")

from minizero.checkpoint_files.checkpoint_folder import CheckpointError  # noqa: E402
from minizero.checkpoint_files.deepspeed_checkpoint import (assign_groups, open_source, zero3_partition_numel,  # noqa: E402
                                           zero12_offsets, zero12_partition_numel, zero12_tail_padding)
from reference.ds_run import SyntheticBatches, build_model, prepare_ds_config  # noqa: E402
from tests.support import harness  # noqa: E402
from tests.support.command_runs import run_command  # noqa: E402  (a command line on forked ranks: no 5-10 s of imports)
from tests.support.launcher import run_ranks  # noqa: E402

N = 2
STEPS = 3
ENV = {"DS_ACCELERATOR": "cpu"}
MODEL_FN = functools.partial(harness.make_model, "tiny", n_layer=2, n_embd=12,
                             embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)


def make_config(stage: int) -> dict:
    cfg = harness.make_config(stage, "bf16", micro_batch=2, optimizer="Adam", lr=1e-3,
                              zero={"reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0},
                              torch_adam=True, steps_per_print=10 ** 9)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-3}}
    return prepare_ds_config(cfg)


# ----------------------------------------------------------------------------- the arithmetic, no processes

def test_zero12_partitions_pad_the_group_to_a_multiple_of_2n():
    # 2N alignment: 1679 elements on 2 ranks -> 1680, 840 each; the tail padding is on the last rank
    assert zero12_partition_numel(1679, 2) == 840
    assert [zero12_tail_padding(1679, 2, r) for r in range(2)] == [0, 1]
    # a group smaller than a partition: later ranks hold padding only
    assert zero12_partition_numel(5, 4) == 2 and [zero12_tail_padding(5, 4, r) for r in range(4)] == [0, 0, 1, 2]
    assert zero12_offsets([3, 4, 5], [1, 0, 0]) == [0, 4, 8]


def test_zero3_pads_each_parameter_to_ceil_n_over_world_size():
    assert [zero3_partition_numel(n, 4) for n in (1, 4, 5, 12)] == [1, 1, 2, 3]


def test_stage0_groups_are_found_from_shapes_in_module_order():
    shapes = {"a": (2, 2), "b": (2,), "c": (2, 2), "d": (2,)}
    assert assign_groups(list(shapes), shapes, [[(2, 2), (2, 2)], [(2,), (2,)]]) == [["a", "c"], ["b", "d"]]
    # two groups of the same shapes: ambiguous, so refused rather than guessed
    assert assign_groups(list(shapes), shapes, [[(2, 2), (2,)], [(2, 2), (2,)]]) is None


# ----------------------------------------------------------------------------- the runs

def _loop(engine, batches, start: int, steps: int) -> list[float]:
    """Steps [start, start + steps): the rank-averaged loss per step (as reference/ds_run.py)."""
    engine.train()
    return harness.mean_losses(engine, batches, start, steps)


def _ds_engine(cfg):
    model, params = build_model(MODEL_FN, cfg, 0)
    return deepspeed.initialize(model=model, model_parameters=params, config=cfg)[0]


def _mz_engine(cfg):
    import minizero

    model, params = build_model(MODEL_FN, cfg, 0)
    return minizero.initialize(model=model, model_parameters=params, config=cfg)[0]


def _unlinked(engine) -> list[str]:
    """Parameters some rank holds a piece of but has linked to no Adam state, so that
    safe_get_full_optimizer_state raises ValueError there (on that rank only, before its
    all-reduce: calling it would hang the other ranks). Collective."""
    import torch.distributed as dist

    mine = [name for name, p in engine.module.named_parameters()
            if getattr(p, "_hp_mapping", None) is not None and "exp_avg" not in (p._hp_mapping.optim_fragment or {})]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({n for names in every for n in names})


def _ds_moments(engine) -> dict:
    """DeepSpeed's own full fp32 Adam moments per parameter (collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link the parameters to their pieces of Adam's state once, right after
        # stepping the first param group, before the later groups have any state (see
        # test_zero12_links_adam_state_of_the_first_param_group_only): link again.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        shape = getattr(p, "ds_shape", p.shape)
        out[name] = {k: safe_get_full_optimizer_state(p, k).detach().float().cpu().clone().view(shape)
                     for k in ("exp_avg", "exp_avg_sq")}
    return out


def _both_ways(stage: int, root: str) -> dict:
    import torch.distributed as dist

    from minizero.checkpoint_files.export_deepspeed import export, open_checkpoint

    cfg = make_config(stage)
    batches = SyntheticBatches(62, 63, 2, seed=5)
    rank = dist.get_rank()
    out = {}
    ds_dir, mz_dir, export_dir = (os.path.join(root, d) for d in ("ds", "mz", "mz_as_ds"))

    # 1. DeepSpeed trains and saves; what DeepSpeed itself says the state is
    engine = _ds_engine(cfg)
    out["ds_first"] = _loop(engine, batches, 0, STEPS)
    engine.save_checkpoint(ds_dir)
    out["ds_unlinked"] = _unlinked(engine)
    out["ds_moments"] = _ds_moments(engine)
    del engine

    # 2. both libraries continue from DeepSpeed's folder
    engine = _ds_engine(cfg)
    engine.load_checkpoint(ds_dir)
    out["ds_from_ds"] = _loop(engine, batches, STEPS, STEPS)
    del engine
    engine = _mz_engine(cfg)
    engine.load_checkpoint(ds_dir)
    out["mz_from_ds_counters"] = (engine.global_steps, engine.global_samples, engine.get_lr())
    out["mz_from_ds"] = _loop(engine, batches, STEPS, STEPS)
    del engine

    # 3. minizero trains and saves; exported, both continue
    engine = _mz_engine(cfg)
    out["mz_first"] = _loop(engine, batches, 0, STEPS)
    engine.save_checkpoint(mz_dir)
    del engine
    if rank == 0:
        export(open_checkpoint(mz_dir), export_dir)
    dist.barrier()
    engine = _ds_engine(cfg)
    path, client = engine.load_checkpoint(export_dir)
    out["ds_loaded"] = (path is not None, engine.global_steps)
    out["ds_from_mz"] = _loop(engine, batches, STEPS, STEPS)
    del engine
    engine = _mz_engine(cfg)
    engine.load_checkpoint(mz_dir)
    out["mz_from_mz"] = _loop(engine, batches, STEPS, STEPS)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for stage in (1, 3):
        root = tmp_path_factory.mktemp(f"stage{stage}")
        out[stage] = (root, run_ranks(_both_ways, world_size=N, args=(stage, str(root)), env=ENV, timeout=600)[0])
    return out


def _tag(root) -> str:
    return open(os.path.join(root, "latest")).read().strip()


@pytest.mark.parametrize("stage", [1, 3])
def test_open_source_gives_deepspeeds_masters_and_moments_bitwise(runs, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, res = runs[stage]
    ds_dir = os.path.join(root, "ds")
    src = open_source(os.path.join(ds_dir, _tag(ds_dir)))
    masters = get_fp32_state_dict_from_zero_checkpoint(ds_dir)
    assert (src.library, src.zero_stage, src.world_size, src.dtype) == ("deepspeed", stage, N, "bf16")
    assert sorted(src.names) == sorted(masters) and src.names == list(res["ds_moments"])   # model order
    for name in src.names:
        assert torch.equal(src.read("master", name).view(src.shapes[name]), masters[name]), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(src.read(kind, name).view(src.shapes[name]), res["ds_moments"][name][kind]), name
    assert src.counters == {"global_steps": STEPS, "skipped_steps": 0, "global_samples": STEPS * 2 * N,
                            "micro_steps": STEPS}
    assert [g["step"] for g in src.groups] == [STEPS, STEPS]    # Adam's step: in each state entry
    assert src.lr_scheduler == {"last_batch_iteration": STEPS - 1} and src.loss_scaler is None
    # DeepSpeed fact: its optimizer files pickle DeepSpeed classes (the loss scaler, ZeroStageEnum,
    # fragment_address), so torch's safe loader refuses them and a plain torch.load imports deepspeed
    import pickle
    optim = os.path.join(src.folder, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(optim, weights_only=True)
    scaler = torch.load(optim, weights_only=False)["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler).__module__ == "deepspeed.runtime.fp16.loss_scaler"


@pytest.mark.parametrize("stage", [1, 3])
def test_zero12_links_adam_state_of_the_first_param_group_only(runs, stage):
    """DeepSpeed fact: ZeRO-1/2's step links each parameter's `_hp_mapping` to Adam's state
    in `_optimizer_step(group)` -> `_lazy_init_hp_params_optimizer_state`, once, right after
    the FIRST group steps; torch's Adam has no state yet for the later groups, so their
    parameters are linked to none, and `safe_get_full_optimizer_state` raises ValueError
    (on the ranks holding a piece, before its all-reduce) for every parameter outside param
    group 0 for the rest of the run. ZeRO-3 keeps no such links (its parameters have no
    `_hp_mapping`); its safe_get_full_optimizer_state works, as _ds_moments shows."""
    root, res = runs[stage]
    src = open_source(str(root / "ds" / _tag(root / "ds")))
    later_groups = sorted(n for g in src.groups[1:] for n in g["names"])
    assert sorted(res["ds_unlinked"]) == (later_groups if stage == 1 else [])


def test_reading_deepspeed_checkpoints_does_not_import_deepspeed(runs, monkeypatch):
    """open_source and read, of a ZeRO-1 and a ZeRO-3 folder, in this process with DeepSpeed
    taken out of sys.modules and a finder ahead of Python's that notes and refuses every
    import of it: none is even tried (a reader that caught the refusal and went on would
    still be caught by the note), and none is in sys.modules after. What a fresh
    interpreter's sys.modules showed, without its 2 s of CPU importing torch."""
    import importlib.abc

    tried = []

    class RefuseDeepSpeed(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "deepspeed" or name.startswith("deepspeed."):
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (refused by this test)")
            return None

    def deepspeed_modules():
        return [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]
    for m in deepspeed_modules():
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setattr(sys, "meta_path", [RefuseDeepSpeed(), *sys.meta_path])
    for stage in (1, 3):
        root = runs[stage][0]
        s = open_source(str(root / "ds" / _tag(root / "ds")))
        [s.read(k, n) for n in s.names for k in ("master", "exp_avg")]
    assert tried == [] and deepspeed_modules() == [], (tried, deepspeed_modules())


@pytest.mark.parametrize("stage", [1, 3])
def test_minizero_continues_deepspeeds_checkpoint_as_deepspeed_does(runs, stage):
    res = runs[stage][1]
    assert res["mz_from_ds_counters"][:2] == (STEPS, STEPS * 2 * N)
    assert res["ds_from_ds"][0] != res["ds_first"][-1]                  # the runs do move
    assert res["mz_from_ds"] == res["ds_from_ds"]                        # tolerance 0 (module docstring)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_continues_an_exported_minizero_checkpoint_as_minizero_does(runs, stage):
    res = runs[stage][1]
    assert res["ds_loaded"] == (True, STEPS)
    assert res["mz_first"] == res["ds_first"]                            # the same first STEPS steps, too
    assert res["ds_from_mz"] == res["mz_from_mz"]


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeeds_zero_to_fp32_on_an_export_equals_minizero_consolidate(runs, stage):
    import minizero
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = runs[stage][0]
    ours = minizero.consolidate(str(root / "mz"))
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(root / "mz_as_ds"))
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert theirs[name].dtype == torch.float32 and torch.equal(theirs[name], t), name
    # the folder is DeepSpeed's own: its recovery scripts beside `latest`
    assert {"latest", "zero_to_fp32.py"} <= set(os.listdir(root / "mz_as_ds"))


# ----------------------------------------------------------------------------- refusals

def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_foreign_deepspeed_folders_are_one_line(runs, tmp_path):
    root = runs[1][0]
    tag = _tag(root / "ds")
    folder = root / "ds" / tag
    pp = _copy(folder, tmp_path / "pp")
    (pp / "layer_01-model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        open_source(str(pp))
    assert "pipeline parallelism" in _one_line(e)
    tp = _copy(folder, tmp_path / "tp")
    (tp / "mp_rank_01_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        open_source(str(tp))
    assert "tensor/model parallelism" in _one_line(e)
    nvme = _copy(folder, tmp_path / "nvme")
    (nvme / "offloaded_tensors").mkdir()
    with pytest.raises(CheckpointError) as e:
        open_source(str(nvme))
    assert "NVMe" in _one_line(e)
    damaged = _copy(folder, tmp_path / "damaged")
    victim = next(p for p in damaged.iterdir() if "rank_1" in p.name and "optim" in p.name)
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CheckpointError) as e:
        src = open_source(str(damaged))
        [src.read("master", n) for n in src.names]
    assert "damaged or incomplete" in _one_line(e) and victim.name in str(e.value)


def _load_other_model(ds_dir: str):
    import minizero

    cfg = make_config(1)
    model, params = build_model(functools.partial(harness.make_model, "tiny", n_layer=1, n_embd=12), cfg, 0)
    engine = minizero.initialize(model=model, model_parameters=params, config=cfg)[0]
    try:
        engine.load_checkpoint(ds_dir)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_deepspeed_checkpoint_of_another_model_is_one_line(runs):
    msg = run_ranks(_load_other_model, world_size=N, args=(str(runs[1][0] / "ds"),), env=ENV)[0]
    assert msg is not None and "\n" not in msg and "different model" in msg


# ----------------------------------------------------------------------------- stage 0 and fp16, DeepSpeed to DeepSpeed

def _config_dtype(stage: int, dtype: str) -> dict:
    cfg = make_config(stage)
    cfg.pop("bf16")
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _stage0_and_fp16(root: str) -> dict:
    """DeepSpeed saves at stage 0 (bf16) and ZeRO-2 (fp16); rank 0 rewrites each folder
    through open_source + export; fresh DeepSpeed engines load the original and the
    rewritten folder and take 2 more steps."""
    import torch.distributed as dist

    from minizero.checkpoint_files.export_deepspeed import export
    from reference.ds_run import patch_cpu_fp16

    patch_cpu_fp16()
    batches = SyntheticBatches(62, 63, 2, seed=7)
    out = {}
    for stage, dtype in ((0, "bf16"), (2, "fp16")):
        cfg = _config_dtype(stage, dtype)
        orig, rewritten = os.path.join(root, f"s{stage}"), os.path.join(root, f"s{stage}_rewritten")
        engine = _ds_engine(cfg)
        _loop(engine, batches, 0, 3)
        engine.save_checkpoint(orig)
        del engine
        if dist.get_rank() == 0:
            export(open_source(os.path.join(orig, _tag(orig))), rewritten)
        dist.barrier()
        for name, folder in (("orig", orig), ("rewritten", rewritten)):
            engine = _ds_engine(cfg)
            engine.load_checkpoint(folder)
            scaler = engine.optimizer.loss_scaler if stage else None
            out[(stage, name)] = {"losses": _loop(engine, batches, 3, 2), "global_steps": engine.global_steps,
                                  "scaler": None if scaler is None else {k: getattr(scaler, k) for k in (
                                      "cur_scale", "cur_iter", "cur_hysteresis", "dynamic")}}
            del engine
    return out


@pytest.fixture(scope="module")
def ds_to_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_to_ds")
    return root, run_ranks(_stage0_and_fp16, world_size=N, args=(str(root),), env=ENV, timeout=600)[0]


def test_stage0_bf16_is_read_and_rewritten_as_deepspeed_saved_it(ds_to_ds):
    root, res = ds_to_ds
    src = open_source(str(root / "s0" / _tag(root / "s0")))
    assert (src.zero_stage, src.dtype, src.world_size) == (0, "bf16", N)
    # stage 0 saves no names with the optimizer: found from the groups' shapes (module order)
    assert src.groups[0]["names"] == [n for n in src.names if n.endswith(".weight") and
                                      not n.startswith(("tok_emb", "ln", "blocks.0.ln", "blocks.1.ln"))]
    # FP16_UnfusedOptimizer stepped Adam once at init: its step is one ahead of global_steps
    # (docs/deepspeed.md, "Stage 0 in bf16/fp16 starts Adam one step ahead")
    assert [g["step"] for g in src.groups] == [4, 4] and src.counters["global_steps"] == 3
    module = torch.load(str(root / "s0" / _tag(root / "s0") / "mp_rank_00_model_states.pt"),
                        map_location="cpu", weights_only=False)["module"]
    for n in src.names:   # the bf16 weights are the fp32 masters rounded
        assert torch.equal(src.read("master", n).view(src.shapes[n]).to(torch.bfloat16), module[n]), n
    assert res[(0, "rewritten")] == res[(0, "orig")]


def test_fp16_loss_scaler_carries_through_a_rewritten_folder(ds_to_ds):
    root, res = ds_to_ds
    src = open_source(str(root / "s2" / _tag(root / "s2")))
    assert (src.zero_stage, src.dtype) == (2, "fp16")
    assert src.loss_scaler["cur_scale"] == 2.0 ** 16 and src.loss_scaler["cur_iter"] == 3
    assert src.loss_scaler["delayed_shift"] == 2    # DeepSpeed's hysteresis default
    orig, rewritten = res[(2, "orig")], res[(2, "rewritten")]
    assert orig["scaler"]["dynamic"] and rewritten == orig


# ----------------------------------------------------------------------------- the command line

def test_export_command_line(runs, tmp_path, capsys):
    from minizero.checkpoint_files.export_deepspeed import main

    mz = str(runs[1][0] / "mz")
    assert main([mz, str(tmp_path / "out"), "--stage", "3", "--world-size", "4"]) == 0
    assert "ZeRO stage 3, 4 ranks" in capsys.readouterr().out
    src = open_source(str(tmp_path / "out" / _tag(tmp_path / "out")))
    assert (src.zero_stage, src.world_size) == (3, 4)
    import minizero
    ours = minizero.consolidate(mz)
    assert sorted(src.names) == sorted(ours)
    assert all(torch.equal(src.read("master", n).view(src.shapes[n]), ours[n]) for n in ours)
    # bad input: one line on stderr, exit 2
    for argv in ([str(tmp_path / "nowhere"), str(tmp_path / "x")],
                 [mz, str(tmp_path / "out")],                       # the tag exists there already
                 [mz, str(tmp_path / "y"), "--world-size", "0"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python -m minizero.export_deepspeed: error:"), err


# ----------------------------------------------------------------------------- the trainer

def test_train_resumes_a_deepspeed_run_with_deepspeeds_losses(tmp_path):
    """reference/train.py (DeepSpeed) saves at step 2 of 4; `python -m minizero.train --resume`
    continues that folder; its summary's losses are DeepSpeed's uninterrupted ones. 256
    synthetic training images (4 steps of 8 stay in one epoch), 16 test images and no sample
    grid: the defaults' 10,000 and 1,000 images and 32 samples, none of which this checks,
    were most of the test's time where bf16 is slow (14 of 19 s with AVX2 kernels)."""
    import json

    common = ["--stage", "1", "--dtype", "bf16", "--max-steps", "4", "--synthetic-train", "256",
              "--synthetic-test", "16", "--num-samples", "0"]
    saved = run_command("reference/train.py", [*common, "--save-every", "2", "--save-dir", str(tmp_path / "ds")])
    assert saved.returncode == 0, saved.stderr[-2000:]
    done = run_command("minizero.train", [*common, "--resume", str(tmp_path / "ds"), "--tag", "global_step2",
                                          "--save-dir", str(tmp_path / "mz")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DeepSpeed checkpoint of 1 rank at ZeRO stage 1" in done.stdout + done.stderr
    ds, mz = (json.loads((tmp_path / d / "summary.json").read_text())["losses"] for d in ("ds", "mz"))
    assert len(ds) == 4 and mz == ds


# ----------------------------------------------------------------------------- DeepSpeed at another world size

def _continue_at_one_rank(converted: str, original: str) -> dict:
    """One rank, ZeRO-1: DeepSpeed continues the rewritten folder, minizero the original
    2-rank ZeRO-3 one (resharded as it loads)."""
    cfg = make_config(1)
    batches = SyntheticBatches(62, 63, 2, seed=5)
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    from reference.ds_run import full_fp32_state_dict

    engine = _ds_engine(make_config(3))
    try:                        # DeepSpeed's own answer to its 2-rank folder on 1 rank
        engine.load_checkpoint(original)
        refused = None
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    del engine
    # ... without the optimizer states it loads: the masters copied up from the bf16 weights
    engine = _ds_engine(make_config(3))
    engine.load_checkpoint(original, load_optimizer_states=False)
    weights_only = dict(full_fp32_state_dict(engine))
    del engine
    # ... and its supported route: a universal checkpoint, loaded with checkpoint.load_universal
    tag = _tag(original)
    universal = os.path.join(os.path.dirname(converted), "universal")
    ds_to_universal.main(Namespace(input_folder=os.path.join(original, tag), output_folder=os.path.join(universal, tag),
                                   num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                   inject_missing_state=False))
    with open(os.path.join(universal, "latest"), "w") as f:
        f.write(tag)
    engine = _ds_engine({**make_config(3), "checkpoint": {"load_universal": True}})
    engine.load_checkpoint(universal)
    from_universal = {"masters": dict(full_fp32_state_dict(engine)), "moments": _ds_moments(engine)}
    del engine
    engine = _ds_engine(cfg)
    engine.load_checkpoint(converted)
    ds = _loop(engine, batches, STEPS, STEPS)
    del engine
    engine = _mz_engine(cfg)
    engine.load_checkpoint(original)
    return {"ds": ds, "mz": _loop(engine, batches, STEPS, STEPS), "ds_refused": refused,
            "ds_weights_only": weights_only, "ds_universal": from_universal}


def test_a_deepspeed_checkpoint_rewritten_for_another_world_size_and_stage(runs, tmp_path):
    """DeepSpeed cannot load its checkpoint at another world size with its optimizer states
    ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is
    not currently supported"), loads it without them (masters rounded to bf16), and loads
    its universal conversion whole; export_deepspeed rewrites it: 2 ranks at ZeRO-3 -> 1
    rank at ZeRO-1, state bit for bit, and DeepSpeed continues it as minizero continues the
    original."""
    from minizero.checkpoint_files.export_deepspeed import main

    original = runs[3][0] / "ds"
    assert main([str(original), str(tmp_path / "one"), "--stage", "1", "--world-size", "1"]) == 0
    src, out = open_source(str(original / _tag(original))), open_source(str(tmp_path / "one" / _tag(original)))
    assert (out.zero_stage, out.world_size) == (1, 1)
    for n in src.names:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(src.read(kind, n), out.read(kind, n)), (n, kind)
    res = run_ranks(_continue_at_one_rank, world_size=1, args=(str(tmp_path / "one"), str(original)),
                    env={**ENV, "MINIZERO_FORCE_PG": "1"})[0]
    assert res["ds"] == res["mz"]
    # DeepSpeed fact (docs/deepspeed.md, "DeepSpeed refuses its own ZeRO checkpoint at another
    # world size"): engine.load_checkpoint refuses a ZeRO folder saved at another world size,
    # with load_optimizer_states=True (the default) and universal checkpoints off ...
    assert res["ds_refused"].startswith("ZeRORuntimeException") and \
        "Automatic adjustment of ZeRO's optimizer state partitioning" in res["ds_refused"]
    # ... with load_optimizer_states=False it loads, the fp32 masters rounded to the bf16 weights ...
    saved = {n: {k: src.read(k, n).view(src.shapes[n]) for k in ("master", "exp_avg", "exp_avg_sq")} for n in src.names}
    for n in src.names:
        assert torch.equal(res["ds_weights_only"][n], saved[n]["master"].bfloat16().float()), n
    assert any(not torch.equal(res["ds_weights_only"][n], saved[n]["master"]) for n in src.names)
    # ... and a universal checkpoint (ds_to_universal, then checkpoint.load_universal) loads
    # at the new world size with every master and moment as saved
    for n in src.names:
        assert torch.equal(res["ds_universal"]["masters"][n], saved[n]["master"]), n
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(res["ds_universal"]["moments"][n][kind], saved[n][kind]), (n, kind)


# ----------------------------------------------------------------------------- loading never runs code

def _globals(path) -> set:
    """Every global a torch file's pickle names (torch.save writes protocol 2: GLOBAL opcodes only)."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def _beyond_torch(folder) -> set:
    """The globals of a tag folder's files that are not torch's own (its tensors, storages,
    dtypes, torch.Size) nor OrderedDict: what the reader must allow beyond weights_only."""
    return {g for f in os.listdir(folder) if f.endswith(".pt") for g in _globals(os.path.join(folder, f))
            if not g.startswith("torch.") and g != "collections.OrderedDict"}


def test_deepspeeds_folders_pickle_exactly_the_classes_the_reader_allows(runs, ds_to_ds):
    """DeepSpeed fact: beyond torch's own types, a DeepSpeed 0.19.8 folder pickles four classes:
    LossScaler (ZeRO-1/3 bf16), DynamicLossScaler (fp16), ZeroStageEnum and ZeRO-1/2's
    fragment_address; stage 0 none. safe_load.DEEPSPEED_GLOBALS is that list, and the folders
    minizero writes for DeepSpeed name nothing else (before, its exports also named
    copyreg._reconstructor and builtins.object)."""
    from minizero.checkpoint_files.safe_load import DEEPSPEED_GLOBALS

    root = ds_to_ds[0]
    saved = {"ZeRO-1 bf16": runs[1][0] / "ds", "ZeRO-3 bf16": runs[3][0] / "ds", "stage 0 bf16": root / "s0",
             "ZeRO-2 fp16": root / "s2"}
    found = {name: _beyond_torch(d / _tag(d)) for name, d in saved.items()}
    assert found["stage 0 bf16"] == set(), found
    assert set().union(*found.values()) == set(DEEPSPEED_GLOBALS), found
    for d in (runs[1][0] / "mz_as_ds", runs[3][0] / "mz_as_ds", root / "s0_rewritten", root / "s2_rewritten"):
        assert _beyond_torch(d / _tag(d)) <= set(DEEPSPEED_GLOBALS), d


def _load_planted(ds_dir: str):
    engine = _mz_engine(make_config(1))
    try:
        engine.load_checkpoint(ds_dir)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_planted_deepspeed_file_is_refused_by_every_reader(runs, tmp_path, capsys):
    """A DeepSpeed folder with an os.system object planted in rank 1's optimizer file: open_source,
    engine.load_checkpoint on both ranks, reshard, export_deepspeed, and DeepSpeed's own trainer
    resuming it (reference/train.py --resume) each refuse it in one line naming the file and
    the global; the marker never appears, nothing is written. Before, minizero's unpickler handed
    every module that is not DeepSpeed's to Python's own, and DeepSpeed loads weights_only=False."""
    from minizero.checkpoint_files import export_deepspeed, reshard
    from tests.tools.test_checkpoint_safe_load import SMALL, plant, refused_line

    planted, marker = _copy(runs[1][0] / "ds", tmp_path / "ds"), tmp_path / "marker"
    tag = _tag(planted)
    victim = planted / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    plant(victim, marker)
    line = refused_line(victim)
    with pytest.raises(CheckpointError) as e:
        src = open_source(str(planted / tag))
        [src.read("master", n) for n in src.names]
    assert _one_line(e).startswith(line)
    said = run_ranks(_load_planted, world_size=N, args=(str(planted),), env=ENV)
    assert said[0] == said[1] and said[0].startswith(line) and "\n" not in said[0], said
    for prog, main, extra in (("minizero.reshard", reshard.main, ["--world-size", "1"]),
                              ("minizero.export_deepspeed", export_deepspeed.main, [])):
        assert main([str(planted), str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"python -m {prog}: error: {line}"), err
        assert not (tmp_path / "out").exists()
    p = run_command("reference/train.py", ["--stage", "1", "--dtype", "bf16", "--max-steps", "6", "--resume",
                                           str(planted), "--save-dir", str(tmp_path / "resumed"), *SMALL])
    errors = [ln for ln in p.stderr.splitlines() if ": error:" in ln]
    assert p.returncode != 0 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert errors[0].startswith(f"reference/train.py: error: {line}"), errors
    assert not (tmp_path / "resumed").exists() and not marker.exists()
