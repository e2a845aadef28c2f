"""minizero: DeepSpeed's ZeRO, loss scaling and activation checkpointing, in plain torch.distributed.

The public surface mirrors DeepSpeed's names (initialize, the engine's methods,
checkpointing.configure/checkpoint), so one script runs under either:

    engine, optimizer, train_loader, lr_scheduler = minizero.initialize(model=model, config=cfg)
    loss = engine(x, y)[1]; engine.backward(loss); engine.step()
"""
import logging as _logging

from .launcher_env import launcher_rank as _launcher_rank
from .version import __version__  # noqa: F401

_log = _logging.getLogger("minizero")
if not _log.handlers:  # rank 0 speaks, the others stay quiet (as DeepSpeed's logger)
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("[minizero] %(message)s"))
    _log.addHandler(_h)
    # The launcher's rank, before any process group exists (torch-free: `python -m
    # minizero.train` checks its command line before torch is imported).
    _log.setLevel(_logging.INFO if _launcher_rank() == 0 else _logging.WARNING)
    _log.propagate = False


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, config=None, config_params=None, collate_fn=None):
    """Wrap `model` in a minizero Engine, as `deepspeed.initialize` does.

    Returns (engine, optimizer, training_dataloader or None, lr_scheduler or None). The
    config is a DeepSpeed JSON dict or path; it may also come from `args.deepspeed_config`.
    """
    from .checkpoint_files import checkpoint_io
    from .engine import Engine
    from .observe import switches

    if model is None:
        raise ValueError("minizero.initialize: pass model=<your nn.Module>")
    if optimizer is not None:
        raise ValueError("minizero.initialize: a client optimizer is not supported; describe it in the "
                         "config's \"optimizer\" section (Adam or AdamW) instead")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("minizero.initialize: no config; pass config=<dict or path to a DeepSpeed JSON file>")
    switches.subscribe()   # the tools the config may switch on watch the engine (observe/switches.py)
    engine = Engine(model, model_parameters=model_parameters, config=config, lr_scheduler=lr_scheduler,
                    checkpoint_io=checkpoint_io)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(training_data, num_replicas=engine.world_size, rank=engine.global_rank)
        loader = DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                            sampler=sampler, collate_fn=collate_fn, drop_last=True)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def consolidate(checkpoint_dir, tag=None, kind="master"):
    """Full fp32 state dict from a sharded minizero checkpoint (DeepSpeed's zero_to_fp32);
    kind "exp_avg" / "exp_avg_sq": Adam's moments, laid out the same way."""
    from .checkpoint_files.zero_to_fp32 import consolidate as _consolidate
    return _consolidate(checkpoint_dir, tag, kind=kind)
