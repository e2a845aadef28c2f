"""The same training run as minizero/train/train.py, under PyTorch's own data parallelism.

    torchrun --nproc-per-node 2 reference/torch_train.py --stage 3   # FSDP2, fully_shard per block + root
    torchrun --nproc-per-node 2 reference/torch_train.py --stage 2   # FSDP2, reshard_after_forward=False
    torchrun --nproc-per-node 2 reference/torch_train.py --stage 0   # DistributedDataParallel
    torchrun --nproc-per-node 4 reference/torch_train.py --stage 3 --config hsdp.json   # HSDP: zero_optimization.hsdp_shard_size 2

Same flags, loop, model, data, seed, LR schedule and clipping (imported from minizero, not
copied), same files (metrics.csv, summary.json with "library": "torch", samples.png, the
memory at the last step's two moments, the comm table), default save dir
runs/torch-<stage>-<dtype>. Only the engine differs: reference/torch_engine.py, where each
choice is explained (stage 1 and fp16 are refused: FSDP2 has neither). Checkpoints are
PyTorch's Distributed Checkpoint folders (DCP, as torchtitan saves: reference/torch_checkpoint.py):
`--save-every` writes one, `--resume DIR` continues one at any world size, FSDP2's, DDP's or
minizero's (`python -m minizero.export_dcp` converts a minizero or DeepSpeed folder).
"""
from __future__ import annotations

import os
import sys

# `python reference/torch_train.py` puts reference/ on sys.path, not the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from reference.comm_counter import COUNTER  # noqa: E402  (installs the counters first)
from minizero import comm  # noqa: E402
from minizero.config import load_config  # noqa: E402
from minizero.train import runlog  # noqa: E402
from minizero.train import train as mtrain  # noqa: E402
from reference.torch_engine import TorchEngine, TorchEngineError, held_bytes, hierarchy  # noqa: E402


def _initialize(model, param_groups, cfg, args):
    model.to(comm.get_device())
    engine = TorchEngine(model, param_groups, cfg)
    kind = {0: "DistributedDataParallel", 2: "FSDP2 fully_shard(reshard_after_forward=False)",
            3: "FSDP2 fully_shard(reshard_after_forward=True)"}[engine.stage]
    if engine.hsdp_shard_size:
        S = engine.hsdp_shard_size
        kind += f", HSDP: mesh ({comm.get_world_size() // S} replicas, {S} shard ranks)"
    if engine.hpz_partition_size:
        kind = kind.replace("=True", f"={engine.hpz_partition_size}") + " (hpZ: backward gathers within " \
            f"{engine.hpz_partition_size} ranks)"
    runlog.log0(f"torch: {kind} on every block, then the root; checkpoints in DCP" if engine.stage
                else f"torch: {kind}; checkpoints in DCP")
    return engine


def _check_config(cfg, world_size):
    rest, hsdp, hpz = hierarchy(cfg, world_size)   # the two multi-node keys: reference/torch_engine.py
    parsed = load_config(rest, world_size)   # the rest: the same keys and checks as minizero's
    stage = parsed.zero.stage
    if (hsdp or hpz) and stage not in (2, 3) or hpz and stage != 3:
        raise TorchEngineError(f"{'hsdp_shard_size' if hsdp else 'zero_hpz_partition_size'} needs "
                               f"{'--stage 3' if hpz else '--stage 2 or 3'} (FSDP2), not stage {stage}")
    if stage == 1:
        raise TorchEngineError("FSDP2 has no ZeRO-1 setting (optimizer state sharded, parameters and gradients "
                               "whole): use --stage 0 (DDP), 2 or 3 (FSDP2)")
    if parsed.fp16.enabled:
        raise TorchEngineError("the PyTorch reference runs fp32 and bf16; fp16 needs DeepSpeed's loss scaler: "
                               "use --dtype bf16 or fp32")
    return cfg


def _track_peaks(engine):
    from reference.torch_engine import track_peaks
    return track_peaks(engine) if engine.stage != 0 else _NoPeaks()


class _NoPeaks:
    """DDP's reducer keeps its bucket buffers in C++, out of the recorder's reach: no peaks."""

    def arm(self):
        pass

    def result(self):
        return {}


TORCH = mtrain.Library(
    name="torch",
    initialize=_initialize,
    loss_scale=lambda engine: 1.0,
    model_state_bytes=held_bytes,          # what the rank holds at the end of the run
    comm_snapshot=lambda engine: COUNTER.snapshot(),
    check_config=_check_config,
    user_errors=(TorchEngineError,),
    held_bytes=held_bytes,                 # at the moments runlog.MemoryMoments picks
    peaks=_track_peaks,                    # FSDP2's peaks in the last step (DDP: none)
)


def main(argv=None) -> None:
    parser = mtrain.build_parser(prog="reference/torch_train.py", description=__doc__.split("\n\n")[0])
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        # One process without a launcher: minizero would skip torch.distributed, but DDP and
        # fully_shard need a process group. Make it a world of one.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.free_port()))
    mtrain.main(argv, lib=TORCH, parser=parser)


if __name__ == "__main__":
    main()
