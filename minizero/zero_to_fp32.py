"""`python -m minizero.zero_to_fp32 CHECKPOINT_DIR OUT.pt [--tag TAG]`

Turn a sharded minizero checkpoint into one fp32 state dict that a plain `GPT` loads
with `load_state_dict` (the counterpart of DeepSpeed's zero_to_fp32.py)."""
import argparse
import sys

import torch

from .checkpoint import CheckpointError, consolidate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minizero.zero_to_fp32", description=__doc__.split("\n\n")[1])
    ap.add_argument("checkpoint_dir", help="folder with a 'latest' file and <tag>/ sub-folders")
    ap.add_argument("output", help="where to write the fp32 state dict (.pt)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = ap.parse_args(argv)
    try:
        sd = consolidate(args.checkpoint_dir, args.tag)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(sd, args.output)
    n = sum(t.numel() for t in sd.values())
    print(f"wrote {len(sd)} tensors, {n:,} fp32 parameters to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
