"""`python -m minizero.zero_to_fp32 CHECKPOINT_DIR OUT.pt [--tag TAG]`

Turn a sharded minizero checkpoint into one fp32 state dict that a plain `GPT` loads
with `load_state_dict` (the counterpart of DeepSpeed's zero_to_fp32.py).

A missing folder, a missing tag or a damaged file is one line on stderr and exit code 2."""
import argparse
import os
import sys

import torch

from . import durable
from .checkpoint_folder import MODEL_FILE, CheckpointError, load_file, tag_folder
from .checkpoint_io import read_every_file
from .checkpoint_state import MinizeroSource

PROG = "python -m minizero.zero_to_fp32"


def consolidate(checkpoint_dir: str, tag: str | None = None, kind: str = "master") -> dict[str, torch.Tensor]:
    """Full fp32 state dict (name -> tensor) from a sharded checkpoint, on one process.

    Each parameter's slice of every rank's fp32 master is read from the files that hold
    it (checkpoint_state.MinizeroSource: the shards in rank order are the padded flat
    buffer, the parameter lies at its offset in it) and viewed back into its shape: the
    exact inverse of the partitioning in flat_param.py. Loadable by a plain `GPT` with
    `model.load_state_dict(sd)`. (DeepSpeed's equivalent is zero_to_fp32.py.)
    kind "exp_avg" / "exp_avg_sq": Adam's moments instead, laid out the same way.
    """
    tag, path = tag_folder(checkpoint_dir, tag)
    meta = load_file(checkpoint_dir, tag, MODEL_FILE)
    if "layout" not in meta:
        raise CheckpointError(f"{path} is not a minizero checkpoint (saved by DeepSpeed? use the zero_to_fp32.py "
                              f"DeepSpeed saves next to its tag folders)")
    source = MinizeroSource(path, meta)
    read_every_file(source)   # a folder with a file the allow-list refuses is refused whole, as by every reader
    return {name: source.read(kind, name).view(source.shapes[name]) for f in source.layout for name in f["names"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    ap.add_argument("checkpoint_dir", help="folder with a 'latest' file and <tag>/ sub-folders")
    ap.add_argument("output", help="where to write the fp32 state dict (.pt)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = ap.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):   # say so before the work, not after
        print(f"{PROG}: error: cannot write {args.output}: {out_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        sd = consolidate(args.checkpoint_dir, args.tag)
    except CheckpointError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        durable.save(sd, args.output)
    except (OSError, RuntimeError) as e:   # no permission, disk full, ...
        print(f"{PROG}: error: cannot write {args.output}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in sd.values())
    print(f"wrote {len(sd)} tensors, {n:,} fp32 parameters to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
