"""`python -m minizero.export_dcp SRC DST [--tag TAG]`

Write a checkpoint as a PyTorch Distributed Checkpoint (DCP) folder, `DST/<tag>/` with
`.metadata` and its chunk file, and `DST/latest`: what FSDP2's `torch.distributed.checkpoint.load`
(with `set_state_dict`) and torchtitan resume at any world size, optimizer state included.
SRC is a minizero folder or a DeepSpeed one (ZeRO 0-3, any world size: DeepSpeed -> FSDP2
in one step), or a DCP folder (rewritten whole, one chunk per tensor).

Offline, one process, no process group and no model: the state is read parameter by
parameter from SRC (a CheckpointSource: checkpoint_state.py) and each tensor written whole,
under torchtitan's keys (dcp_checkpoint.py's table): the fp32 masters by parameter name,
Adam's moments and step flattened per parameter, the hyper-parameters, the step counters
(`train_state`), the LR schedule, the fp16 loss scale, each saving rank's RNG (`rng.rank_<r>`),
the trainer's client_state. A folder in the memory of this one process: the whole model's
fp32 masters and moments (the tutorial GPT: docs/checkpoints.md gives the time).

Refused in one line, nothing written: a missing or damaged folder or file, a file that would
run code, a source without optimizer state (it could not continue training), a tag that
exists in DST already. Exit code 2.
"""
from __future__ import annotations

import os
import sys
import time

from ..checkpoint_files.checkpoint_folder import (CheckpointError, CommandParser, command_error, offline_tmp,
                                                      publish, tag_folder)
from ..checkpoint_files.checkpoint_io import open_checkpoint, read_every_file
from ..checkpoint_files.dcp_checkpoint import write_source

PROG = "python -m minizero.export_dcp"


def export(src_dir: str, dst_dir: str, tag: str | None = None):
    """Write the checkpoint `tag` of src_dir (default: `latest`) as DCP into dst_dir/<tag>;
    returns (the source read, the tag folder written)."""
    tag, folder = tag_folder(src_dir, tag)
    if os.path.realpath(dst_dir) == os.path.realpath(src_dir):
        raise CheckpointError(f"{dst_dir} is the folder being read: write the DCP checkpoint to another one")
    final = os.path.join(dst_dir, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists: pick another DST, or remove it")
    source = open_checkpoint(folder)
    read_every_file(source)   # a refused or damaged file is said before DST exists
    if not source.has_optimizer_state:
        raise CheckpointError(f"{folder} holds no optimizer state (Adam's moments): a DCP checkpoint of it could not "
                              f"continue training; export one saved after a step")
    with offline_tmp(dst_dir, tag) as tmp:
        write_source(source, tmp)
    publish(dst_dir, tag, save_latest=True)
    return source, final


def main(argv=None) -> int:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[1])
    ap.add_argument("src", help="checkpoint folder (with 'latest' and <tag>/ sub-folders): minizero's, DeepSpeed's "
                                "or a DCP one")
    ap.add_argument("dst", help="folder to write the DCP checkpoint into (its 'latest' and <tag>/)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        source, out = export(args.src, args.dst, args.tag)
    except Exception as e:
        return command_error(PROG, e, args.src, args.dst)
    n = sum(source.numel(name) for name in source.names)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: DCP, {len(source.names)} parameters ({n:,} fp32 values), "
          f"Adam's moments and step, counters, lr schedule and client_state from {source.describe()}; load it with "
          f"torch.distributed.checkpoint.load at any world size (reference/torch_train.py --resume {args.dst})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
