"""Resuming at another world size and stage: the slicing arithmetic (no processes), the
load-time reshard (every stage, across stages, N=2 -> 1, 2, 4), the offline form
(`python -m minizero.reshard`), the trainer's --resume, and one line for a bad folder."""
import logging
import math
import os
import random
import shutil
import sys

import pytest
import torch

import minizero
from minizero.checkpoint_files.checkpoint_folder import CheckpointError, complete_tags, optim_file
from minizero.checkpoint_files.zero_to_fp32 import consolidate
from minizero.partition import padded_numel, param_offsets, params_in_range, shard_range, shards_holding
from tests.support.launcher import run_ranks
from tests.tools.test_checkpoint_io import _one_step, checkpoint_config, checkpoint_engine, train_checkpointed

KINDS = ("master", "exp_avg", "exp_avg_sq")
DTYPE = "fp16"   # the loss scaler moves (window 2) and must carry over; masters != low-precision weights


# ----------------------------------------------------------------------------- arithmetic, no processes

def test_shards_holding_cases():
    # a buffer of 20 in shards of 10 (N = 2): [3, 13) is 7 elements of rank 0 and 3 of rank 1
    assert shards_holding(3, 13, 10) == [(0, 3, 10), (1, 0, 3)]
    # the same elements in shards of 5 (N = 4): ranks 0, 1, 2
    assert shards_holding(3, 13, 5) == [(0, 3, 5), (1, 0, 5), (2, 0, 3)]
    assert shards_holding(10, 20, 10) == [(1, 0, 10)]          # exactly one shard
    assert shards_holding(4, 4, 10) == [] and shards_holding(0, 0, 0) == []
    assert shards_holding(0, 3, 1) == [(0, 0, 1), (1, 0, 1), (2, 0, 1)]
    with pytest.raises(ValueError):
        shards_holding(5, 4, 10)


def test_params_in_range_cases():
    numels = [3, 10, 6]          # offsets 0, 3, 13; 19 elements, padded to 20 at N = 2 or 4
    assert param_offsets(numels) == [0, 3, 13]
    assert params_in_range(numels, 0, 10) == [(0, 0, 3, 0), (1, 0, 7, 3)]      # rank 0 of 2
    assert params_in_range(numels, 10, 20) == [(1, 7, 10, 0), (2, 0, 6, 3)]    # rank 1 of 2: 1 padding element
    assert params_in_range(numels, 15, 20) == [(2, 2, 6, 0)]                   # rank 3 of 4
    assert params_in_range(numels, 19, 20) == []                               # padding only
    assert params_in_range([0, 4], 0, 4) == [(1, 0, 4, 0)]                     # an empty parameter holds nothing


def _reshard_by_arithmetic(tensors, n, m):
    """Shards of the padded flat buffer at N ranks -> rank r's shard at M ranks, built only
    from params_in_range and shards_holding, as checkpoint_state does."""
    numels = [t.numel() for t in tensors]
    total = sum(numels)
    flat = torch.zeros(padded_numel(total, n))
    flat[:total] = torch.cat([t.reshape(-1) for t in tensors])
    old = [flat[slice(*shard_range(total, n, r))].clone() for r in range(n)]
    old_shard = padded_numel(total, n) // n
    new = []
    for r in range(m):
        start, stop = shard_range(total, m, r)
        out = torch.zeros(stop - start)
        for i, lo, hi, at in params_in_range(numels, start, stop):
            off = param_offsets(numels)[i]
            piece = torch.cat([old[q][a:b] for q, a, b in shards_holding(off + lo, off + hi, old_shard)])
            out[at:at + hi - lo] = piece
        new.append(out)
    return flat, new


def test_resharding_by_slices_gives_every_layout_exactly():
    rng = random.Random(0)
    cases = [[(3,), (10,), (6,)], [(1,)], [(2, 3), (0,), (5,)]]
    cases += [[tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
              for _ in range(30)]
    for shapes in cases:
        tensors = [torch.randn(s) for s in shapes]
        total = sum(t.numel() for t in tensors)
        for n in range(1, 6):
            for m in range(1, 6):
                flat, new = _reshard_by_arithmetic(tensors, n, m)
                want = torch.zeros(padded_numel(total, m))
                want[:total] = flat[:total]
                assert torch.equal(torch.cat(new), want), (shapes, n, m)   # padding zero, data in place


# ----------------------------------------------------------------------------- helpers on ranks

def _full_state(engine) -> dict:
    """{kind: {name: full fp32 tensor}} of the live engine: masters and both Adam moments,
    gathered over the ranks each FlatParam is cut over (all of them; under HSDP its shard
    group): a collective."""
    from minizero import comm
    from minizero.partition import unflatten
    opt = engine.sharded_optimizer
    out = {k: {} for k in KINDS}
    for f, m in zip(opt.flat_params, opt.masters):
        st = opt.optimizer.state[m]
        for kind, t in (("master", m), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            full = torch.empty(f.padded_numel)
            if f.num_shards > 1:
                comm.all_gather_into_tensor(full, t.detach().float().cpu().contiguous(), label="test",
                                            group=f.sharding.group)
            else:
                full.copy_(t.detach())
            out[kind].update({n: v.clone() for n, v in unflatten(full, f.names, f.shapes).items()})
    return out


def _carried(engine) -> dict:
    opt = engine.optimizer
    return {"steps": [int(opt.state[g["params"][0]]["step"]) for g in opt.param_groups if g["params"]],
            "lr": engine.get_lr(), "sched": engine.lr_scheduler.state_dict(),
            "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "counters": (engine.global_steps, engine.skipped_steps, engine.micro_steps, engine.global_samples)}


def _set_from_consolidated(engine, full: dict, saved: dict) -> None:
    """An independent way to start an engine from a consolidated state: lay each FlatParam's
    parameters end to end, pad, and copy this rank's [shard_start, shard_end) into its
    master and moments; then Adam's step, lr, schedule, loss scale, counters."""
    opt = engine.sharded_optimizer
    with torch.no_grad():
        for f, m in zip(opt.flat_params, opt.masters):
            st = opt.optimizer.state[m]
            for kind, t in (("master", m), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                buf = torch.zeros(f.padded_numel)
                buf[:f.numel] = torch.cat([full[kind][n].reshape(-1) for n in f.names])
                t.copy_(buf[f.shard_start:f.shard_end])
            st["step"].fill_(saved["steps"][0])
            f.shard.copy_(m)
            if f.persistent and f.num_shards > 1:
                f.all_gather(label="test")
    for g, lr in zip(engine.optimizer.param_groups, saved["lr"]):
        g["lr"] = lr
    engine.lr_scheduler.load_state_dict(saved["sched"])
    if saved["scaler"] is not None:
        engine.loss_scaler.load_state_dict(saved["scaler"])
    engine.global_steps, engine.skipped_steps, engine.micro_steps, engine.global_samples = saved["counters"]


def _continue(engine, steps=2) -> list[float]:
    """A few more steps, with the same dropout RNG for any two engines compared."""
    from minizero import comm
    torch.manual_seed(100 + comm.get_rank())
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(2000 + s)
        x = torch.randint(0, 62, (4 * comm.get_world_size(), 64), generator=g)
        xb = x[comm.get_rank() * 4:(comm.get_rank() + 1) * 4]
        loss = engine(xb[:, :-1], xb[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _load(engine, d):
    said = _Said()
    logging.getLogger("minizero").addHandler(said)
    try:
        engine.load_checkpoint(d)
    finally:
        logging.getLogger("minizero").removeHandler(said)
    return said.lines


def _load_and_continue(stage, d, full, saved):
    """Load at this world size and stage; return what was loaded, the one line said, and the
    next losses of the loaded engine and of a reference started from the consolidated state."""
    engine = checkpoint_engine(stage, DTYPE)
    said = _load(engine, d)
    got, carried = _full_state(engine), _carried(engine)
    ref = checkpoint_engine(stage, DTYPE)
    _set_from_consolidated(ref, full, saved)
    return got, carried, said, _continue(engine), _continue(ref)


def _save(stage, d):
    engine = checkpoint_engine(stage, DTYPE)
    for s in range(4):
        _one_step(engine, s)
    engine.save_checkpoint(d)
    return _carried(engine)


def _save_each(folders):
    """_save at every stage, one after the other on these ranks (one launch, not four)."""
    return [_save(stage, d) for stage, d in enumerate(folders)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of 2 ranks at every stage (fp16, 4 steps), with its consolidated state."""
    folders = [str(tmp_path_factory.mktemp(f"stage{stage}")) for stage in range(4)]
    carried = run_ranks(_save_each, 2, (folders,))[0]
    return {stage: (d, {k: consolidate(d, kind=k) for k in KINDS}, carried[stage]) for stage, d in enumerate(folders)}


# ----------------------------------------------------------------------------- load-time reshard

RESUMES = [
    (0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1),      # N = 2 -> 1 at every stage
    (0, 0, 4), (1, 1, 4), (2, 2, 4), (3, 3, 4),      # N = 2 -> 4
    (3, 1, 1), (0, 2, 2), (1, 3, 4), (2, 0, 4),      # across stages ((1, 3, 4): also the offline CLI's reference)
]


def _load_and_continue_each(cases, saved_file):
    """_load_and_continue for each (saved_stage, stage) of `cases`, one after the other on
    these ranks: every case builds its own engines from its own seed and ends before the next
    starts, so a case sees what it would see in a launch of its own. saved_file: the `saved`
    fixture in a file (the forkserver would pass each of its tensors as a descriptor: too many)."""
    saved = torch.load(saved_file)
    return {(saved_stage, stage): _load_and_continue(stage, *saved[saved_stage]) for saved_stage, stage in cases}


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory):
    """{(saved_stage, stage, world): each rank's _load_and_continue}: one launch per world
    size for all of RESUMES, not one per case."""
    saved_file = str(tmp_path_factory.mktemp("resumed") / "saved.pt")
    torch.save(saved, saved_file)
    out = {}
    for world in sorted({w for _, _, w in RESUMES}):
        cases = [(a, b) for a, b, w in RESUMES if w == world]
        per_rank = run_ranks(_load_and_continue_each, world, (cases, saved_file), env={"MINIZERO_FORCE_PG": "1"})
        out.update({(a, b, world): [r[(a, b)] for r in per_rank] for a, b in cases})
    return out


@pytest.mark.parametrize("saved_stage,stage,world", RESUMES)
def test_resume_at_another_world_size_and_stage(saved, resumed, saved_stage, stage, world):
    d, full, carried = saved[saved_stage]
    results = resumed[(saved_stage, stage, world)]
    for rank, (got, now, said, losses, ref_losses) in enumerate(results):
        for kind in KINDS:   # consolidated after loading == consolidated before, bit for bit
            assert set(got[kind]) == set(full[kind])
            for name, t in full[kind].items():
                assert torch.equal(got[kind][name], t), (rank, kind, name)
        assert now == carried, rank   # Adam's step, lr, schedule, loss scale, counters
        # The reference has the same state at the same world size and stage: the same
        # arithmetic in the same order, so the losses are equal bit for bit, in fp16 too.
        assert losses == ref_losses, rank
    said = results[0][2]
    assert len(said) == 1, said   # one line, on rank 0
    how = "loaded as saved" if saved_stage == stage == 0 else "resharded"   # stage 0 is not sharded
    assert f"checkpoint of 2 ranks at ZeRO stage {saved_stage} {how} onto {world} rank" in said[0], said
    if world != 2:
        assert "data order" in said[0] and "RNG" in said[0]
    assert all(r[2] == [] for r in results[1:])


# ----------------------------------------------------------------------------- offline: python -m minizero.reshard

def _load_offline(offline, stage):
    """Load the offline-resharded folder at this world size and stage; return what the engine
    holds, the lines said, and its next losses (as _load_and_continue's engine)."""
    engine = checkpoint_engine(stage, DTYPE)
    said = _load(engine, offline)
    return _full_state(engine), _carried(engine), said, _continue(engine)


def test_reshard_cli_round_trip_equals_load_time_reshard(saved, resumed, tmp_path, capsys):
    """2 ranks at ZeRO-1 -> 4 ranks at ZeRO-3 offline, loaded at 4 ranks, against the same
    checkpoint resharded as it loads at 4 ranks and stage 3: `resumed`'s case (1, 3, 4), the
    same engine, load and steps (_continue seeds its own dropout RNG)."""
    from minizero.checkpoint_files.reshard import main
    d, full, carried = saved[1]
    out = str(tmp_path / "four")
    assert main([d, out, "--world-size", "4", "--stage", "3"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "2 ranks at ZeRO stage 1 -> 4 ranks at stage 3" in line, line
    assert "ranks 2-3 get no RNG state" in line
    assert complete_tags(out) == ["global_step4"] and open(os.path.join(out, "latest")).read() == "global_step4"
    assert sorted(f for f in os.listdir(os.path.join(out, "global_step4")) if "optim" in f) == \
        sorted(optim_file(r) for r in range(4))
    for kind in KINDS:   # the offline folder consolidates to the same state
        again = consolidate(out, kind=kind)
        assert all(torch.equal(again[k], full[kind][k]) for k in full[kind]), kind
    load_time = resumed[(1, 3, 4)]
    for (sa, ca, said_a, la), (sb, cb, said_b, lb, _) in zip(run_ranks(_load_offline, 4, (out, 3)), load_time):
        assert said_a == []     # its layout is the engine's: loaded as saved, no reshard
        assert len(said_b) in (0, 1)
        assert ca == cb == carried and la == lb
        assert all(torch.equal(sa[k][n], sb[k][n]) for k in KINDS for n in sa[k])


def test_reshard_cli_bad_input_is_one_line(saved, tmp_path, capsys, monkeypatch):
    from minizero.checkpoint_files.reshard import main
    d = saved[2][0]
    copy = str(tmp_path / "copy")
    shutil.copytree(d, copy)
    bad = os.path.join(copy, "global_step4", optim_file(1))
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    foreign = tmp_path / "ds" / "global_step1"
    foreign.mkdir(parents=True)
    torch.save({"module": {}, "ds_config": {}}, str(foreign / "mp_rank_00_model_states.pt"))
    (tmp_path / "ds" / "latest").write_text("global_step1")
    monkeypatch.setitem(sys.modules, "minizero.checkpoint_files.deepspeed_checkpoint", None)   # as if it were not there
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o1"), "--world-size", "2"], "no such directory"),
        ([d, str(tmp_path / "o2"), "--world-size", "0"], "--world-size must be a whole number >= 1, got 0"),
        ([d, str(tmp_path / "o3"), "--world-size", "two"], "invalid int value"),
        ([d, str(tmp_path / "o4"), "--world-size", "2", "--stage", "5"], "invalid choice"),
        ([d, d, "--world-size", "4"], "is the folder being read"),
        ([d, str(tmp_path / "o5"), "--world-size", "2", "--tag", "global_step9"], "no such checkpoint"),
        ([copy, str(tmp_path / "o6"), "--world-size", "3"], f"{bad}: damaged or incomplete checkpoint file"),
        ([str(tmp_path / "ds"), str(tmp_path / "o7"), "--world-size", "2"],
         "reading DeepSpeed checkpoints is not available"),
    ]
    for argv, want in cases:
        with pytest.raises(SystemExit) if "invalid" in want else _no_raise() as exc:
            rc = main(argv)
        rc = exc.value.code if exc is not None else rc
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and want in err, (argv, err)
        assert err.startswith("python -m minizero.reshard: error: ")
    assert not os.path.exists(tmp_path / "o6")   # the damaged file is found before DST is made: nothing written


@pytest.mark.parametrize("module", ["minizero.checkpoint_files.reshard", "minizero.checkpoint_files.export_deepspeed"])
def test_a_pickle_that_is_no_checkpoint_is_one_line(module, tmp_path, capsys):
    """Both commands that rewrite a checkpoint share one error path (checkpoint_folder.command_error):
    a model file that unpickles but holds no usable checkpoint is one line naming SRC, not a traceback."""
    import importlib
    src = tmp_path / "junk"
    (src / "t1").mkdir(parents=True)
    (src / "latest").write_text("t1")
    torch.save({"layout": 5, "world_size": 2}, str(src / "t1" / "mp_rank_00_model_states.pt"))
    argv = [str(src), str(tmp_path / "out")] + (["--world-size", "1"] if module.endswith("reshard") else [])
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}: cannot be read as a checkpoint (KeyError" in err, err


class _no_raise:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- one line for a bad folder

def _load_bad(d, stage):
    engine = checkpoint_engine(stage, DTYPE)
    before = _full_state(engine)
    try:
        engine.load_checkpoint(d)
        msg = None
    except CheckpointError as e:
        msg = str(e)
    after = _full_state(engine)   # a collective: every rank is still in step
    return msg, all(torch.equal(before[k][n], after[k][n]) for k in KINDS for n in before[k])


def test_damaged_shard_is_one_line_on_every_rank_of_another_world_size(saved, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(saved[1][0], copy)
    bad = os.path.join(copy, "global_step4", optim_file(1))
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    for msg, untouched in run_ranks(_load_bad, 4, (copy, 2)):   # ranks 2-3 read rank 1's file; 0-1 may not
        assert msg is not None and msg.count("\n") == 0 and msg.startswith(f"{bad}: damaged or incomplete"), msg
        assert untouched


def test_foreign_folders_are_one_line(tmp_path, monkeypatch):
    from minizero.gpt.model import GPT, get_preset
    d = str(tmp_path / "two_groups")
    engine = checkpoint_engine(1, "fp32")           # minGPT's two param groups
    _one_step(engine, 0)
    engine.save_checkpoint(d)
    torch.manual_seed(0)
    model = GPT(get_preset("micro"))
    one_group, *_ = minizero.initialize(model=model, config=checkpoint_config(2, "fp32"))
    with pytest.raises(CheckpointError, match=r"has 2 param groups, this run has 1; build the param groups"):
        one_group.load_checkpoint(d)
    ds = tmp_path / "ds" / "global_step1"           # DeepSpeed's ZeRO-3 names, no reader
    ds.mkdir(parents=True)
    torch.save({"module": None}, str(ds / "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    monkeypatch.setitem(sys.modules, "minizero.checkpoint_files.deepspeed_checkpoint", None)
    with pytest.raises(CheckpointError, match="looks like DeepSpeed's: reading DeepSpeed checkpoints is not available"):
        checkpoint_engine(2, "fp32").load_checkpoint(str(tmp_path / "ds"), tag="global_step1")


# ----------------------------------------------------------------------------- the trainer's --resume

def _train_main(argv):
    from minizero.train import train
    train.main(argv)


def test_train_resume_at_another_world_size_and_stage(tmp_path):
    import json
    small = ["--model", "micro", "--image-size", "8", "--synthetic-train", "256", "--synthetic-test", "64",
             "--num-samples", "0", "--data-dir", str(tmp_path / "data"), "--max-steps", "6"]   # no grid: not looked at
    run, resumed = str(tmp_path / "run"), str(tmp_path / "resumed")
    run_ranks(_train_main, 2, (small + ["--stage", "1", "--save-every", "3", "--save-dir", run],))
    run_ranks(_train_main, 1, (small + ["--stage", "3", "--resume", run, "--tag", "global_step3",
                                        "--save-dir", resumed],), env={"MINIZERO_FORCE_PG": "1"})
    a, b = (json.load(open(os.path.join(x, "summary.json"))) for x in (run, resumed))
    assert b["status"] == "completed" and b["world_size"] == 1 and b["steps"] == 6
    assert b["losses"][:3] == a["losses"][:3] and len(b["losses"]) == 6   # the first 3 carried in train_state


def test_data_position_at_another_world_size(monkeypatch):
    """runsetup.carry_data_position: the epoch's first b*m*N samples were used, so M ranks of
    m' go on at floor(b*m*N / (m'*M)); --epochs still ends after its last epoch."""
    from types import SimpleNamespace

    from minizero.checkpoint_files import checkpoint_io
    from minizero import comm
    from minizero.train import runsetup

    def run_at(world, micro, saved, state, spe, gas=1, epochs=None, max_steps=None):
        monkeypatch.setattr(checkpoint_io, "saved_batch", lambda path: saved)
        monkeypatch.setattr(comm, "get_world_size", lambda: world)
        steps = min(spe * (epochs or 10 ** 9), max_steps or 10 ** 18)   # as runsetup.setup
        run = SimpleNamespace(state=dict(state), args=SimpleNamespace(epochs=epochs, max_steps=max_steps),
                              engine=SimpleNamespace(train_micro_batch_size_per_gpu=lambda: micro),
                              steps_per_epoch=spe, gas=gas, n_epochs=math.ceil(steps / spe), max_steps=steps)
        return run, runsetup.carry_data_position(run, "ckpt")

    # 2 ranks x 8, 12 micro-batches (192 samples); 1 rank x 8, 32 steps an epoch, 2 epochs asked for
    run, said = run_at(1, 8, (2, 8), {"step": 12, "epoch": 0, "batch_in_epoch": 12}, spe=32, epochs=2)
    assert run.state["batch_in_epoch"] == 24 and run.state["epoch"] == 0
    assert run.max_steps == 12 + (32 - 24) + 32 and run.n_epochs == 2 and "first 192 samples" in said
    # 3 ranks x 8, 5 micro-batches (120 samples); 2 ranks x 16: 3 whole batches, 24 samples again
    run, said = run_at(2, 16, (3, 8), {"step": 5, "epoch": 1, "batch_in_epoch": 5}, spe=10, max_steps=40)
    assert run.state["batch_in_epoch"] == 3 and "(24 samples seen again)" in said
    # 7 steps left in epoch 1, 40 - 5 - 7 = 28 more: epochs 2, 3, 4 (the 4 asked for would stop short)
    assert run.max_steps == 40 and run.n_epochs == 5
    # no whole step left in the epoch at the new batch: the next epoch
    # 128 samples used = 16 micro-batches of 1 x 8; with 2 micro-batches a step and 9 steps
    # an epoch one step is left, with 8 steps none: the next epoch
    run, _ = run_at(1, 8, (2, 8), {"step": 4, "epoch": 0, "batch_in_epoch": 8}, spe=9, gas=2)
    assert (run.state["epoch"], run.state["batch_in_epoch"]) == (0, 16)
    run, _ = run_at(1, 8, (2, 8), {"step": 4, "epoch": 0, "batch_in_epoch": 8}, spe=8, gas=2)
    assert (run.state["epoch"], run.state["batch_in_epoch"]) == (1, 0)
    # the same world size and micro-batch: untouched
    run, said = run_at(2, 8, (2, 8), {"step": 3, "epoch": 0, "batch_in_epoch": 3}, spe=10)
    assert said == "" and run.state["batch_in_epoch"] == 3
