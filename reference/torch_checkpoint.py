"""The PyTorch reference's checkpoints: torch.distributed.checkpoint (DCP), as torchtitan saves.

    engine.save_checkpoint(save_dir)            every rank writes its shards: <save_dir>/global_step<N>/, `latest`
    engine.load_checkpoint(load_dir[, tag])     at any world size, from FSDP2, DDP or minizero's DCP

What a folder holds is minizero/checkpoint_files/dcp_checkpoint.py's table (torchtitan's keys):
the model's state_dict at the top level, the optimizer's in the flattened per-parameter form
`get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))`
gives (FSDP2: each rank's dim-0 shard of every parameter and moment), the step counters under
`train_state`, each rank's RNG under `rng.rank_<r>`, the trainer's `client_state`, and a `run`
record (library "torch", world size, stage, dtype, config, param groups). The folder and
`latest` are published as minizero publishes its own (`<tag>.tmp`, renamed, then `latest`:
minizero/checkpoint_files/checkpoint_folder.py), so a kill at any instant leaves `latest` on a
complete checkpoint.

Loading reads `.metadata` and every non-tensor value through minizero's allow-lists (DCP's own
reader unpickles `.metadata` with plain pickle: minizero/checkpoint_files/dcp_files.py) and
checks the folder first, so a folder of another model (the names that differ), one without
optimizer state, or a truncated file is one line, on every rank, before the engine is touched.
DCP then reads, on each rank, the saved chunks that overlap its own shards: a folder saved by
minizero's flat shards (rectangles cut anywhere in a tensor) or by FSDP2 at another world size
loads the same way.
"""
from __future__ import annotations

import os

import torch

from minizero import comm
from minizero.checkpoint_files.checkpoint_folder import (CheckpointError, describe_tags, open_tmp, publish_together,
                                                        resolve_tag)
from minizero.checkpoint_files.checkpoint_state import model_difference
from minizero.checkpoint_files.dcp_checkpoint import _common, _run_record
from minizero.checkpoint_files.dcp_source import DcpSource
from minizero.checkpoint_files.dcp_files import SafeLoadPlanner, SafeReader, damaged_chunks, is_dcp_folder
from minizero.checkpoint_files.save_guards import rng_state, set_rng_state

OPTIONS = dict(flatten_optimizer_state_dict=True)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(**OPTIONS)


def save(engine, save_dir: str, tag: str | None, client_state: dict | None, save_latest: bool = True) -> str:
    """Collective: every rank writes its shards of the model and optimizer into `<tag>.tmp`
    (DCP), then rank 0 publishes it as `<tag>` and points `latest` at it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    steps = engine.micro_steps // engine.gradient_accumulation_steps()
    tag = str(tag or f"global_step{steps}")
    rank, world = comm.get_rank(), comm.get_world_size()
    tmp = open_tmp(save_dir, tag)
    msd, osd = get_state_dict(engine.module, engine.optimizer, options=_options())
    state = {**msd, "optimizer": osd, "rng": {f"rank_{rank}": rng_state()}}
    if rank == 0:
        names = {id(p): n for n, p in engine.module.named_parameters()}
        groups = [[names[id(p)] for p in g["params"]] for g in engine.optimizer.param_groups]
        run = _run_record("torch", world, engine.stage, engine.dtype, engine.cfg.raw, groups,
                          [n for n, _ in engine.module.named_parameters()])
        counters = {"global_steps": steps, "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
                    "global_samples": engine.global_samples}
        state.update(_common(counters, None, None, client_state, run))
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    return publish_together(save_dir, tag, save_latest)


def _check(engine, source: DcpSource, path: str, load_optimizer_states: bool) -> None:
    """One line for a folder this engine cannot continue from: another model (the names and
    shapes that differ), no optimizer state."""
    ours = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    what = model_difference(source.shapes, ours)
    if what:
        raise CheckpointError(f"checkpoint {path} is from a different model ({what}); load it into the model it was "
                              f"saved from")
    if load_optimizer_states and not source.has_optimizer_state:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (Adam's moments): it cannot continue "
                              f"training; start a new run from its weights instead")


def load(engine, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True):
    """Collective: (tag folder, client_state), or (None, None) when load_dir has no `latest`.
    Every rank opens and checks the folder first and all agree before the engine is touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
    decided = None
    if comm.get_rank() == 0:
        decided = resolve_tag(load_dir, tag)
    tag = comm.broadcast_object(decided)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    err, source = None, None
    try:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint; {describe_tags(load_dir)}")
        if not is_dcp_folder(path):
            raise CheckpointError(f"{path} is not a DCP checkpoint (no .metadata): convert it first, python -m "
                                  f"minizero.export_dcp {load_dir} {load_dir.rstrip('/')}-dcp --tag {tag}")
        source = DcpSource(path)
        _check(engine, source, path, load_optimizer_states)
    except CheckpointError as e:
        err = str(e)
    comm.raise_if_any_rank_failed(err, CheckpointError, label="checkpoint_ok")

    msd, osd = get_state_dict(engine.module, engine.optimizer, options=_options())
    keys = set(source.metadata.state_dict_metadata)
    # hyper-parameters the writer's optimizer did not have keep this run's values (as torch's
    # load_state_dict keeps a group's keys the saved group lacks)
    osd = {k: v for k, v in osd.items() if f"optimizer.{k}" in keys or not k.startswith("param_groups.")} \
        if load_optimizer_states else {}
    state = {**msd, "optimizer": osd} if osd else dict(msd)
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path))
        err = None
    except CheckpointError as e:
        err = str(e)
    except BaseException as e:   # DCP raises its CheckpointException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        err = damaged_chunks(path, e)
    comm.raise_if_any_rank_failed(err, CheckpointError, label="checkpoint_read")
    if osd:
        set_state_dict(engine.module, engine.optimizer, model_state_dict=msd, optim_state_dict=state["optimizer"],
                       options=_options())
    else:
        set_model_state_dict(engine.module, msd, options=_options())
    c = source.counters
    engine.micro_steps, engine.global_samples, engine.skipped_steps = c["micro_steps"], c["global_samples"], \
        c["skipped_steps"]
    rng = source.rng_state(comm.get_rank())
    if rng is not None:
        set_rng_state(rng)
    if comm.get_rank() == 0 and (source.world_size != comm.get_world_size() or source.writer != "torch"):
        comm_note = f"{path}: DCP checkpoint of {source.world_size} rank(s) written by {source.writer} loaded onto " \
                    f"{comm.get_world_size()} rank(s) of {'DDP' if engine.stage == 0 else 'FSDP2'}"
        print(f"torch: {comm_note}", flush=True)
    return path, source.client_state

