"""Sharded checkpoints: bit-exact resume at every stage, consolidation, atomicity, bad input."""
import os

import pytest
import torch

import minizero
from minizero.checkpoint_files.checkpoint_folder import CheckpointError
from tests.support.launcher import run_ranks

MB = 4  # micro-batch per rank


def checkpoint_config(stage, dtype, zero=(), torch_adam=True):
    """The config of these tests; `zero`: more zero_optimization keys (tests/core/test_offload.py
    adds offload), torch_adam False: the Adam minizero picks without it."""
    params = {"lr": 1e-3, **({"torch_adam": True} if torch_adam else {})}
    cfg = {"train_micro_batch_size_per_gpu": MB,
           "optimizer": {"type": "Adam", "params": params},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **dict(zero)}}
    if dtype == "fp16":  # a small window so the scale moves and must be restored too
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def checkpoint_engine(stage, dtype, preset="micro", config=None, **overrides):
    from minizero.gpt.model import GPT, get_preset
    torch.manual_seed(0)
    model = GPT(get_preset(preset, **overrides))
    engine, *_ = minizero.initialize(model=model, model_parameters=model.configure_param_groups(0.1),
                                     config=config or checkpoint_config(stage, dtype))
    return engine


def train_checkpointed(stage, dtype, steps, ckpt_dir, save_at=None, resume=False, config=None):
    """Train `steps` steps (dropout on, so RNG matters); optionally save at `save_at` or
    resume from ckpt_dir first. Returns this rank's per-step losses, the final fp32 weights,
    the loss scale, the global step and each param group's Adam implementation (fused, foreach)."""
    from minizero import comm
    engine = checkpoint_engine(stage, dtype, config=config)
    start = 0
    if resume:
        path, client = engine.load_checkpoint(ckpt_dir)
        start = client["step"]
    losses = []
    for s in range(start, steps):
        g = torch.Generator().manual_seed(1000 + s)   # the data position is the step
        x = torch.randint(0, 62, (MB * comm.get_world_size(), 64), generator=g)
        r = comm.get_rank()
        xb = x[r * MB:(r + 1) * MB]
        loss = engine(xb[:, :-1], xb[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save_at is not None and s + 1 == save_at:
            engine.save_checkpoint(ckpt_dir, client_state={"step": s + 1})
    impl = [(g.get("fused"), g.get("foreach")) for g in engine.optimizer.param_groups]
    return losses, engine.full_fp32_state_dict(), engine.loss_scale, engine.global_steps, impl


# Every stage in fp16 (masters, low-precision shards and the loss scaler all restored),
# plus fp32 and bf16 once each.
RESUMES = [(0, "fp16"), (1, "fp16"), (2, "fp16"), (3, "fp16"), (1, "bf16"), (3, "fp32")]


def _train_each(runs, **kwargs):
    """train_checkpointed(stage, dtype, 6, folder, **kwargs) for each (stage, dtype, folder)
    of `runs`, one after the other on these ranks: each builds its own engine from its own
    seed and data, so each sees what it would see in a launch of its own."""
    return [train_checkpointed(stage, dtype, 6, d, **kwargs) for stage, dtype, d in runs]


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    """{(stage, dtype): (folder, each rank's 6 steps saving at 3, each rank's resume from 3)}.
    Every configuration's full run in one launch and every resume in a second: the resume
    still starts in fresh processes, from the files alone, as after a restart."""
    runs = [(stage, dtype, str(tmp_path_factory.mktemp(f"resume-{stage}-{dtype}"))) for stage, dtype in RESUMES]
    full = run_ranks(_train_each, 2, (runs,), {"save_at": 3})
    resumed = run_ranks(_train_each, 2, (runs,), {"resume": True})
    return {(stage, dtype): (d, [f[i] for f in full], [r[i] for r in resumed])
            for i, (stage, dtype, d) in enumerate(runs)}


@pytest.mark.parametrize("stage,dtype", RESUMES)
def test_resume_is_bit_exact(resumes, stage, dtype):
    d, full, resumed = resumes[(stage, dtype)]
    for r in range(2):
        assert full[r][0][3:] == resumed[r][0], f"rank {r}: losses after resume differ"
        assert full[r][2] == resumed[r][2] and full[r][3] == resumed[r][3] == 6
        for k, v in full[r][1].items():
            assert torch.equal(v, resumed[r][1][k]), k
    files = sorted(os.listdir(os.path.join(d, "global_step3")))
    if stage > 0:  # every rank wrote its own shard
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in files
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in files
    assert open(os.path.join(d, "latest")).read() == "global_step3"


def _consolidate_check(stage, d):
    _, live, *_ = train_checkpointed(stage, "bf16", 3, d, save_at=3)
    return live


@pytest.mark.parametrize("stage", [1, 3])
def test_consolidate_equals_live_weights_and_loads_into_plain_gpt(tmp_path, stage):
    from minizero.gpt.model import GPT, get_preset
    live = run_ranks(_consolidate_check, 2, (stage, str(tmp_path)))[0]
    sd = minizero.consolidate(str(tmp_path))
    assert set(sd) == set(live)
    for k in sd:
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], live[k]), k
    model = GPT(get_preset("micro"))
    model.load_state_dict(sd)  # strict: every parameter present, shapes right
    # and the command-line form writes the same thing
    from minizero.checkpoint_files.zero_to_fp32 import main
    out = tmp_path / "full.pt"
    assert main([str(tmp_path), str(out)]) == 0
    again = torch.load(out)
    assert all(torch.equal(again[k], sd[k]) for k in sd)


def _load_into(stage, d, preset, overrides):
    engine = checkpoint_engine(stage, "fp32", preset, **overrides)
    try:
        engine.load_checkpoint(d)
    except CheckpointError as e:
        return str(e)
    return None


def test_load_into_another_model_is_a_clear_error_another_world_size_loads(tmp_path):
    """Another world size is resharded (tests/tools/test_reshard.py); another model is one line."""
    d = str(tmp_path)
    run_ranks(train_checkpointed, 2, (2, "fp32", 1, d, 1))
    assert run_ranks(_load_into, 1, (2, d, "micro", {}), env={"MINIZERO_FORCE_PG": "1"})[0] is None
    for n in (1, 2):
        msg = run_ranks(_load_into, n, (2, d, "tiny", {}), env={"MINIZERO_FORCE_PG": "1"})[0]
        assert msg is not None and "different model" in msg and msg.count("\n") == 0, msg


def test_no_checkpoint_returns_none(tmp_path):
    engine = checkpoint_engine(0, "fp32")
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        minizero.consolidate(str(tmp_path))


def test_crash_mid_save_keeps_latest_on_the_last_complete_checkpoint(tmp_path, monkeypatch):
    from minizero.checkpoint_files import checkpoint_io as checkpoint
    engine = checkpoint_engine(1, "fp32")
    engine.save_checkpoint(str(tmp_path), tag="good")
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        if "optim_states" in str(f):
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(OSError):
        engine.save_checkpoint(str(tmp_path), tag="bad")
    assert open(tmp_path / "latest").read() == "good"
    assert not (tmp_path / "bad").exists()
    monkeypatch.undo()
    assert engine.load_checkpoint(str(tmp_path))[0].endswith("good")


def test_save_inside_an_accumulation_window_is_refused_and_load_drops_held_grads(tmp_path):
    from minizero.gpt.model import GPT, get_preset
    torch.manual_seed(0)
    model = GPT(get_preset("micro"))
    cfg = dict(checkpoint_config(1, "fp32"), gradient_accumulation_steps=2)
    engine, *_ = minizero.initialize(model=model, config=cfg)
    x = torch.randint(0, 62, (MB, 64), generator=torch.Generator().manual_seed(0))
    engine.save_checkpoint(str(tmp_path))                      # at a boundary: fine
    engine.backward(engine(x[:, :-1], x[:, 1:])[1])
    engine.step()                                              # micro-step 1 of 2
    with pytest.raises(CheckpointError, match="accumulation"):
        engine.save_checkpoint(str(tmp_path), tag="mid")
    assert any(p.grad is not None for p in model.parameters())
    engine.load_checkpoint(str(tmp_path))
    assert all(p.grad is None for p in model.parameters())     # the held gradient is gone


def test_empty_param_group_keeps_its_lr_and_comm_stats_are_per_engine():
    from minizero import comm
    from minizero.gpt.model import GPT, get_preset
    model = GPT(get_preset("micro"))
    groups = [{"params": list(model.parameters()), "lr": 1e-2}, {"params": [], "lr": 5e-3}]
    comm.all_reduce(torch.zeros(3), label="someone-else")      # traffic before the engine exists
    cfg = checkpoint_config(0, "fp32")
    cfg.pop("scheduler")                                       # WarmupLR would start both at 0
    engine, *_ = minizero.initialize(model=model, model_parameters=groups, config=cfg)
    assert engine.get_lr() == [1e-2, 5e-3]
    assert engine.comm_stats()["all_reduce"]["calls"] == 0


def _one_step(engine, s):
    x = torch.randint(0, 62, (MB, 64), generator=torch.Generator().manual_seed(1000 + s))
    engine.backward(engine(x[:, :-1], x[:, 1:])[1])
    engine.step()


class _Killed(BaseException):
    """A kill -9 stand-in: a BaseException, so no `except OSError` fallback in the code
    under test can swallow it."""


def test_resaving_the_tag_latest_names_survives_a_kill_at_every_step(tmp_path, monkeypatch):
    """Save tag "t" (weights A), step (weights B), save "t" again while `latest` names it,
    killed before the k-th rename / delete / link of the publish, for every k: `latest`
    must name a complete checkpoint holding A or B, and the next save must clean up."""
    import shutil
    from minizero.checkpoint_files.checkpoint_folder import complete_tags
    engine, checker = checkpoint_engine(1, "fp32"), checkpoint_engine(1, "fp32")
    base = str(tmp_path / "base")
    for s in range(2):     # WarmupLR: the first two steps have lr 0
        _one_step(engine, s)
    engine.save_checkpoint(base, tag="t")
    old = engine.full_fp32_state_dict()
    _one_step(engine, 2)
    new = engine.full_fp32_state_dict()
    assert any(not torch.equal(old[k], new[k]) for k in old)

    def resumes_to(d):
        checker.load_checkpoint(d)
        got = checker.full_fp32_state_dict()
        same = [name for name, sd in (("old", old), ("new", new)) if all(torch.equal(got[k], sd[k]) for k in sd)]
        assert len(same) == 1, d
        return same[0]

    real = {"replace": os.replace, "rmtree": shutil.rmtree, "link": os.link}
    seen = []
    for k in range(1, 100):
        d = str(tmp_path / f"kill{k}")
        shutil.copytree(base, d)
        calls = [0]

        def dying(name):
            def op(*a, **kw):
                calls[0] += 1
                if calls[0] == k:
                    if name == "rmtree" and os.path.isdir(a[0]):   # killed half-way through a delete
                        for root, _, files in os.walk(a[0]):
                            if files:
                                os.remove(os.path.join(root, files[0]))
                                break
                    raise _Killed(f"{name} #{k}")
                return real[name](*a, **kw)
            return op

        for name, mod in (("replace", os), ("rmtree", shutil), ("link", os)):
            monkeypatch.setattr(mod, name, dying(name))
        try:
            engine.save_checkpoint(d, tag="t")
            finished = True
        except _Killed:
            finished = False
        monkeypatch.undo()
        latest = open(os.path.join(d, "latest")).read()
        assert latest in complete_tags(d), (k, latest, sorted(os.listdir(d)))
        seen.append((latest, resumes_to(d)))   # it loads, and holds A or B
        if finished:
            assert seen[-1] == ("t", "new") and sorted(os.listdir(d)) == ["latest", "t"]
            # cut at every step: before, while `latest` stood on the linked copy, after the swap
            assert {("t", "old"), ("t.prev", "old"), ("t", "new")} <= set(seen), seen
            break
        engine.save_checkpoint(d, tag="t")   # the next save after a crash recovers fully
        assert open(os.path.join(d, "latest")).read() == "t" and resumes_to(d) == "new", k
        assert sorted(os.listdir(d)) == ["latest", "t"], (k, sorted(os.listdir(d)))
    else:
        raise AssertionError("the save never finished")


def _nan_on_rank1(d, where):
    from minizero import comm
    engine = checkpoint_engine(1, "bf16")
    _one_step(engine, comm.get_rank())
    engine.save_checkpoint(d, tag="good")
    if comm.get_rank() == 1:
        t = engine.sharded_optimizer.masters[0] if where == "master" else engine.zero.flat_params[0].shard
        t.view(-1)[3] = float("nan")
    try:
        engine.save_checkpoint(d, tag="bad")
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where", ["master", "shard"])
def test_non_finite_weights_on_one_rank_are_refused_everywhere(tmp_path, where):
    d = str(tmp_path)
    msgs = run_ranks(_nan_on_rank1, 2, (d, where), timeout=120)
    for m in msgs:   # every rank refuses (none waits in the save's barrier)
        assert m is not None and m.count("\n") == 0, m
        assert "checkpoint bad" in m and "non-finite" in m and "on rank 1;" in m, m
        assert "nothing was written" in m and "'latest' still names good" in m, m
    assert sorted(os.listdir(d)) == ["good", "latest"]
    assert open(os.path.join(d, "latest")).read() == "good"


@pytest.mark.parametrize("saved,resumed", [("fp32", "fp16"), ("fp16", "bf16")])
def test_resume_in_another_dtype_says_what_changed(tmp_path, saved, resumed):
    """Allowed (the fp32 masters and Adam state carry over exactly), and said in one warning."""
    import logging
    engine = checkpoint_engine(1, saved)
    for s in range(3):
        _one_step(engine, s)
    engine.save_checkpoint(str(tmp_path))
    live = engine.full_fp32_state_dict()
    other = checkpoint_engine(1, resumed)
    said = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    h = Catch(logging.WARNING)
    logging.getLogger("minizero").addHandler(h)
    try:
        other.load_checkpoint(str(tmp_path))
    finally:
        logging.getLogger("minizero").removeHandler(h)
    assert len(said) == 1 and f"saved in {saved}, this run is {resumed}" in said[0], said
    if resumed == "fp16":
        assert "loss scale starts fresh at 256" in said[0] and other.loss_scale == 2 ** 8
    else:
        assert f"saved loss scale {engine.loss_scale:g} is dropped" in said[0]
    got = other.full_fp32_state_dict()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[resumed]
    for name, p in other.module.named_parameters():
        assert torch.equal(got[name], live[name]), name                # masters: exact
        assert p.dtype == dtype and torch.equal(p, live[name].to(dtype)), name   # weights: rounded masters
    assert other.global_steps == 3
    _one_step(other, 3)
    assert other.skipped_steps == engine.skipped_steps and all(torch.isfinite(v).all() for v in
                                                                 other.full_fp32_state_dict().values())
