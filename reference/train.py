"""The same training run as minizero/train/train.py, under real DeepSpeed (the reference).

    python reference/train.py --max-steps 30                       # one process
    torchrun --nproc-per-node 2 reference/train.py --stage 3
    deepspeed --num_gpus 2 reference/train.py --deepspeed_config launch/ds_config_basic.json

Same flags (the parser, the loop, the model and the data are imported from minizero, not
copied), same files (metrics.csv, summary.json with "library": "deepspeed", samples.png),
default save dir runs/deepspeed-<stage>-<dtype>. Only the engine differs. What this file
adds for DeepSpeed (docs/deepspeed.md has each fact and the test that pins it):

- `torch_adam: true` goes *inside* optimizer.params (beside it DeepSpeed ignores it and
  builds its JIT FusedAdam; docs/deepspeed.md, "torch_adam belongs inside optimizer.params")
  and ZeRO-3 gets `memory_efficient_linear: false` (docs/deepspeed.md, "ZeRO-3 replaces
  F.linear (memory_efficient_linear)"): reference.ds_run.prepare_ds_config.
- fp16 on a CPU: the CPU accelerator claims no fp16 support (docs/deepspeed.md, "The CPU
  accelerator refuses fp16"); reference.ds_run.patch_cpu_fp16.
- activation checkpointing: deepspeed.initialize parses the section but never applies
  it (docs/deepspeed.md, "activation_checkpointing is parsed, not applied"), so we call
  deepspeed.checkpointing.configure and hook GPT.checkpoint_fn ourselves.
- comm bytes: DeepSpeed has no byte ledger, so the collectives of torch.distributed are
  wrapped with counters (reference/comm_counter.py) *before* deepspeed is imported.
- model_state_bytes: reference.ds_memory.deepspeed_model_state_bytes walks the live engine
  (at the end of the run, and at the last step's two memory moments: runlog.MemoryMoments).
- comms_logger: with the section in the config, deepspeed.comm.log_summary(return_dict=True)
  at the end (every rank; rank 0 prints), written to comms_summary.json / comms_summary.txt
  as minizero.train writes minizero's own.

Config keys are validated by DeepSpeed itself here (it ignores unknown top-level keys,
docs/deepspeed.md, "Unknown top-level config keys are ignored"; minizero refuses them).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

# `python reference/train.py` puts reference/ on sys.path, not the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_reference_parser():
    """minizero.train's flags, plus DeepSpeed's own spellings: --deepspeed_config is --config;
    the deepspeed launcher passes --local_rank (torch's newer launchers --local-rank);
    --deepspeed is the usual "use DeepSpeed" switch of deepspeed.add_config_arguments. All
    are accepted. Torch-free, so the command line is checked before torch and DeepSpeed load."""
    import argparse
    from minizero.train.train_args import build_parser
    parser = build_parser(prog="reference/train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", dest="config", metavar="JSON", help="same as --config")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":   # the command line first: a usage error costs no torch or DeepSpeed import
    from minizero.train.train_args import precheck
    precheck(build_reference_parser())

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from reference.comm_counter import COUNTER, CommCounter  # noqa: E402,F401  (before `import deepspeed`)

import deepspeed  # noqa: E402

from minizero import comm  # noqa: E402
from minizero.train import train as mtrain  # noqa: E402
from reference.ds_run import _loss_scale, patch_cpu_fp16, prepare_ds_config, skip_inference_shm_op  # noqa: E402

skip_inference_shm_op()   # an inference-only op DeepSpeed would compile on its first CPU run (a minute)


def _model_state_bytes(engine) -> dict:
    try:
        from reference.ds_memory import deepspeed_model_state_bytes
    except ImportError:   # the walker is optional; without it, report what the module holds
        return {"params": sum(p.numel() * p.element_size() for p in engine.module.parameters())}
    return deepspeed_model_state_bytes(engine)


def _held_bytes(engine) -> dict:
    from reference.ds_memory import held_bytes
    return held_bytes(engine)


def _initialize(model, param_groups, cfg, args):
    if (cfg.get("fp16") or {}).get("enabled") and not torch.cuda.is_available():
        patch_cpu_fp16()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=cfg)
    engine.load_checkpoint = _one_line_world_size_refusal(_through_allow_list(engine.load_checkpoint), args)
    if "activation_checkpointing" in cfg:
        # deepspeed.initialize parses this section but does not apply it. After initialize:
        # configure() asks deepspeed.comm for the rank, which initialize sets up.
        deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
        engine.module.checkpoint_fn = deepspeed.checkpointing.checkpoint
    return engine


def _through_allow_list(load_checkpoint):
    """DeepSpeed's load_checkpoint, without running code from the files: DeepSpeed unpickles
    with torch.load(weights_only=False), which calls whatever a file names. First every file
    of the tag folder is read through minizero's allow-list for DeepSpeed's files
    (checkpoint_files/deepspeed_pickle.py, mmap'd: the pickles only), on every rank alike, so
    a planted file is one line on all ranks before DeepSpeed reads anything; then DeepSpeed
    loads with its every torch.load made weights-only, its own pickled classes (the same
    DEEPSPEED_GLOBALS) allowed and nothing else."""
    import importlib
    import pickle

    from minizero.checkpoint_files.checkpoint_folder import UnsafeCheckpointError, read_latest
    from minizero.checkpoint_files.deepspeed_pickle import torch_load
    from minizero.checkpoint_files.safe_load import DEEPSPEED_GLOBALS, refusal

    real_classes = [(getattr(importlib.import_module(g.rsplit(".", 1)[0]), g.rsplit(".", 1)[1]), g)
                    for g in DEEPSPEED_GLOBALS]
    allowed = {cls for cls, _ in real_classes}

    def reconstructor(cls, base, state):
        # the form older minizero exports pickled DeepSpeed's loss scaler in: object.__new__(cls)
        if cls not in allowed or base is not object or state is not None:
            raise pickle.UnpicklingError(f"Weights only load failed: copyreg._reconstructor({cls!r}, {base!r})")
        return object.__new__(cls)
    real_classes += [(reconstructor, "copyreg._reconstructor"), (object, "builtins.object")]
    torch_load_unsafe = torch.load

    def weights_only_load(f, map_location=None, *a, weights_only=None, **k):
        try:
            with torch.serialization.safe_globals(real_classes):
                return torch_load_unsafe(f, map_location, *a, weights_only=True, **k)
        except Exception as e:
            line = refusal(str(f), e, real_classes)
            if line is not None:
                raise UnsafeCheckpointError(line) from None
            raise

    def load(load_dir, tag=None, *a, **k):
        folder = os.path.join(load_dir, tag or read_latest(load_dir) or "")
        if os.path.isdir(folder) and os.path.normpath(folder) != os.path.normpath(load_dir):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".pt"):
                    torch_load(os.path.join(folder, name))
        torch.load = weights_only_load
        try:
            return load_checkpoint(load_dir, tag, *a, **k)
        finally:
            torch.load = torch_load_unsafe
    return load


def _one_line_world_size_refusal(load_checkpoint, args):
    """DeepSpeed loads a ZeRO checkpoint only at the world size that wrote it (engine.py:
    _load_zero_checkpoint raises ZeRORuntimeException "used a DP world size of 8 but the current
    world size is 2"); say so in one line, with the way that works: minizero resumes a
    DeepSpeed checkpoint at any world size (docs/checkpoints.md)."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    def load(*a, **k):
        try:
            return load_checkpoint(*a, **k)
        except ZeRORuntimeException as e:
            if "world size" not in str(e):
                raise
            raise mtrain.UserError(f"{str(e).split('. ')[0]}: DeepSpeed resumes ZeRO only at the world size that "
                                   f"saved it; launch that many ranks, or resume it with minizero at any world size "
                                   f"(-m minizero.train --resume {args.resume})") from None
    return load


def _check_config(cfg, world_size):
    # torch_adam inside optimizer.params; ZeRO-3: memory_efficient_linear false, because
    # DeepSpeed's default replaces torch.nn.functional.linear process-wide with a
    # matmul-then-add-bias version that rounds differently in bf16/fp16 (the only reason
    # its ZeRO-3 differs from ZeRO-2 there), which would make it a different model from
    # minizero's rather than the same model trained differently.
    try:
        return prepare_ds_config(cfg)
    except ValueError as e:
        raise mtrain.UserError(str(e)) from None


def _comms_summary(run):
    """DeepSpeed's own comms summary, when the config has a comms_logger section (DeepSpeed
    logs whenever the section is present, even with "enabled": false: docs/deepspeed.md,
    "comms_logger is on whenever the section is present"). log_summary is collective (two
    barriers): every rank calls it, rank 0 prints the table. Returns (summary, the printed
    table) for runlog.write_comms_summary, or None without the section."""
    if "comms_logger" not in run.cfg:
        return None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = deepspeed.comm.log_summary(return_dict=True)
    table = printed.getvalue()
    if comm.get_rank() == 0:
        print(f"deepspeed: comms logger, rank 0 (deepspeed.comm.log_summary; also in "
              f"{os.path.join(run.save_dir, 'comms_summary.txt')}):\n{table}", end="")
    return (result or {}).get("summary") or {}, table


def _track_peaks(engine):
    from reference.ds_memory import track_peaks
    return track_peaks(engine)


DEEPSPEED = mtrain.Library(
    name="deepspeed",
    initialize=_initialize,
    loss_scale=_loss_scale,
    model_state_bytes=_model_state_bytes,
    comm_snapshot=lambda engine: COUNTER.snapshot(),
    check_config=_check_config,
    held_bytes=_held_bytes,   # the same walk (+ layout), at the moments runlog.MemoryMoments picks
    peaks=_track_peaks,       # the same walk at every event of the last step (reference.ds_memory.track_peaks)
    comms_summary=_comms_summary,
)


def main(argv=None) -> None:
    parser = build_reference_parser()
    if "RANK" not in os.environ:
        # One process without a launcher: DeepSpeed would go looking for MPI. Make it a
        # world of one instead.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.free_port()))
    mtrain.main(argv, lib=DEEPSPEED, parser=parser)


if __name__ == "__main__":
    main()
