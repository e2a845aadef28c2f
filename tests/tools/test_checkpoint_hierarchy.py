"""Checkpoints written under hpZ or HSDP load at any world size, as every ZeRO-3 checkpoint does.

Saved on 4 ranks (fp16, 3 steps of the micro GPT, so the loss scale moves and must carry over):
HSDP with S = 2 (each parameter cut in 2 shards, replicated across 2 groups: one optimizer file
per shard, written by the first rank of each, partition_count 2) and hpZ with k = 2 (cut in 4
shards like plain ZeRO-3; the secondary partition is no state: it is dropped at every step and
load, and rebuilt from the parameters). Each is resumed

- on 4 ranks with the same setting: the layout is the same, so the run goes on bit for bit as
  if it had never stopped (losses and final weights equal to the uninterrupted run's);
- on 2 ranks, plain ZeRO-3: HSDP's 2 shards are loaded file for file (the same partition
  count), hpZ's 4 resharded into 2;
- on 1 rank: resharded into 1.

At another world size nothing can be bitwise against the uninterrupted 4-rank run: each rank
averages another set of micro-batches, and the gradient's sum runs over other ranks in another
order. What must hold, and is checked bit for bit, as tests/tools/test_reshard.py does for plain
ZeRO-3: after loading, the masters and both Adam moments, gathered, equal the checkpoint's
consolidated state (zero_to_fp32's consolidate, which reads HSDP's 2 files as 2 shards); Adam's
step, the learning rate, the schedule, the loss scale and the counters are the saved ones; and
the next steps equal those of an engine at that world size started from the consolidated state
by hand (tests/tools/test_reshard.py's _set_from_consolidated).

Cost: 4 launches (saves on 4 ranks, then resumes on 4, 2 and 1), each loading both checkpoints,
of the micro GPT: 25 s measured alone on 2 shared cores (the forkserver's start included).
"""
import logging

import pytest
import torch

from minizero.checkpoint_files.zero_to_fp32 import consolidate
from tests.support.launcher import run_ranks
from tests.tools.test_checkpoint_io import _one_step, checkpoint_config, checkpoint_engine
from tests.tools.test_reshard import KINDS, _carried, _continue, _full_state, _load, _set_from_consolidated

DTYPE = "fp16"
SAVED_WORLD, SAVED_STEPS = 4, 3
SCHEMES = {"hsdp": {"hsdp_shard_size": 2}, "hpz": {"zero_hpz_partition_size": 2}}


def _engine(zero):
    return checkpoint_engine(3, DTYPE, config=checkpoint_config(3, DTYPE, zero=zero))


def _save_and_go_on(folders):
    """On 4 ranks, per scheme: 3 steps, save, then 2 more (the uninterrupted run)."""
    out = {}
    for scheme, d in folders.items():
        engine = _engine(SCHEMES[scheme])
        for s in range(SAVED_STEPS):
            _one_step(engine, s)
        engine.save_checkpoint(d)
        carried = _carried(engine)
        out[scheme] = (carried, _continue(engine), engine.full_fp32_state_dict(), engine.partition)
        engine.destroy()
    return out


def _resume(folders, same_setting, fulls, carried):
    """On this world size, per scheme: load (with the scheme, or plain ZeRO-3), and return what
    was loaded, the lines said, the next steps and the final weights, and, away from the saved
    layout, the next steps of a reference started from the consolidated state."""
    out = {}
    for scheme, d in folders.items():
        zero = SCHEMES[scheme] if same_setting else {}
        engine = _engine(zero)
        said = _load(engine, d)
        got, now = _full_state(engine), _carried(engine)
        losses = _continue(engine)
        ref_losses = None
        if not same_setting:
            ref = _engine(zero)
            _set_from_consolidated(ref, fulls[scheme], carried[scheme])
            ref_losses = _continue(ref)
            ref.destroy()
        out[scheme] = (got, now, said, losses, engine.full_fp32_state_dict(), ref_losses)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folders = {scheme: str(tmp_path_factory.mktemp(scheme)) for scheme in SCHEMES}
    per_rank = run_ranks(_save_and_go_on, SAVED_WORLD, (folders,))
    fulls = {scheme: {k: consolidate(d, kind=k) for k in KINDS} for scheme, d in folders.items()}
    return folders, per_rank, fulls


def test_the_files_hsdp_writes_one_per_shard(saved):
    import os
    folders, per_rank, _ = saved
    assert [r["hsdp"][3] for r in per_rank] == [(2, 0), (2, 1), (2, 0), (2, 1)]   # (shards, this rank's)
    assert [r["hpz"][3] for r in per_rank] == [(4, r) for r in range(4)]
    for scheme, files in (("hsdp", 2), ("hpz", 4)):
        (tag,) = [t for t in os.listdir(folders[scheme]) if t.startswith("global_step")]
        names = os.listdir(os.path.join(folders[scheme], tag))
        assert len([n for n in names if "optim_states" in n]) == files, names
        meta = torch.load(os.path.join(folders[scheme], tag, "mp_rank_00_model_states.pt"), weights_only=False)
        assert meta["partition_count"] == files and meta["world_size"] == SAVED_WORLD


@pytest.mark.parametrize("world, same_setting", [(4, True), (2, False), (1, False)])
def test_resume_at_any_world_size(saved, world, same_setting):
    folders, per_rank, fulls = saved
    carried = {scheme: per_rank[0][scheme][0] for scheme in SCHEMES}
    env = {"MINIZERO_FORCE_PG": "1"} if world == 1 else None
    results = run_ranks(_resume, world, (folders, same_setting, fulls, carried), env=env)
    for scheme in SCHEMES:
        for rank, r in enumerate(results):
            got, now, said, losses, final, ref_losses = r[scheme]
            for kind in KINDS:   # consolidated after loading == the checkpoint's, bit for bit
                assert set(got[kind]) == set(fulls[scheme][kind])
                for name, t in fulls[scheme][kind].items():
                    assert torch.equal(got[kind][name], t), (scheme, world, rank, kind, name)
            assert now == carried[scheme], (scheme, world, rank)   # Adam's step, lr, schedule, scale, counters
            if same_setting:   # the same layout: as if never stopped
                _, uninterrupted, final_uninterrupted, _ = per_rank[rank][scheme]
                assert losses == uninterrupted, (scheme, rank)
                assert all(torch.equal(final[n], final_uninterrupted[n]) for n in final), (scheme, rank)
            else:
                assert losses == ref_losses, (scheme, world, rank)
        said = results[0][scheme][2]
        file_for_file = same_setting or (scheme == "hsdp" and world == 2)   # 2 shards onto 2 ranks
        if file_for_file and world == SAVED_WORLD:
            assert said == [], said
        else:
            how = "loaded as saved" if file_for_file else "resharded"
            assert len(said) == 1 and f"checkpoint of {SAVED_WORLD} ranks at ZeRO stage 3 {how} onto {world} rank" \
                in said[0], said
        assert all(r[scheme][2] == [] for r in results[1:])
