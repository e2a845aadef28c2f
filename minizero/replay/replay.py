"""Write the replay page of a traced run, or of two runs side by side on one clock.

    python -m minizero.replay runs/trace-z3                      # -> runs/trace-z3/replay.html
    python -m minizero.replay runs/z3-traced                     # a run folder: the trace its summary.json names
    python -m minizero.replay runs/trace-z2 runs/trace-z3        # -> runs/trace-z2/replay-vs-trace-z3.html
    python -m minizero.replay A B --names "ZeRO-3" "hpZ" --out hpz.html --step 3

`python -m minizero.train --trace DIR` writes DIR/replay.html itself. The page needs no network:
open it from the file system in any browser (docs/replay.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .build import find_trace, load
from .page import write_page


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minizero.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="DIR",
                    help="a trace folder (--trace DIR), or a run folder (--save-dir) whose run was traced; two: side by side")
    ap.add_argument("--names", nargs="+", metavar="NAME", help="what to call each run on the page (default: its folder's name)")
    ap.add_argument("--step", type=int, help="which traced optimizer step (default: the first traced)")
    ap.add_argument("--out", metavar="FILE", help="the page (default: replay.html in the first trace's folder, "
                                                  "or replay-vs-<second>.html for two runs)")
    args = ap.parse_args(argv)
    if len(args.runs) > 2:
        ap.error(f"{len(args.runs)} runs: the page shows one, or two side by side")
    if args.names is not None and len(args.names) != len(args.runs):
        ap.error(f"--names: {len(args.names)} name(s) for {len(args.runs)} run(s)")
    start = time.perf_counter()
    try:
        docs = [load(p) for p in args.runs]
        names = args.names or [os.path.basename(os.path.normpath(p)) for p in args.runs]
        where = find_trace(args.runs[0])
        folder = where if os.path.isdir(where) else os.path.dirname(where)
        out = args.out or os.path.join(folder, "replay.html" if len(docs) == 1 else f"replay-vs-{names[1]}.html")
        path = write_page(docs, out, names, args.step)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"{path} ({os.path.getsize(path):,} bytes, written in {time.perf_counter() - start:.2f} s); "
          f"open it in a browser, no network needed")
    return 0
