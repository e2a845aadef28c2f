"""Part 8's comparison with DeepSpeed, as recorded, for a laptop where DeepSpeed will not install.

    python docs/lesson/recorded.py           # the recording: what ran, where, and its summary table
    python docs/lesson/recorded.py --all     # the whole report: memory at two moments, peaks, comms tables

`python -m minizero.compare` runs both libraries and needs DeepSpeed, which often will not
install on a laptop (docs/lesson/troubleshooting.md). This prints the report that command
wrote when `python docs/lesson/lesson_numbers.py --record` ran it (docs/results/lesson-compare.md),
under a first line that says so: on a projector nobody should take it for a run of this
machine. Plain Python: no torch, no DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = os.path.join(ROOT, "docs", "results", "lesson-compare")


def banner(rec: dict) -> str:
    return (f"RECORDED, NOT RUN ON THIS MACHINE: `{rec['command']}`, on {rec['machine']}, {rec['date'][:10]}, "
            f"torch {rec['versions']['torch']}, DeepSpeed {rec['versions']['deepspeed']} "
            f"(docs/results/lesson-compare.md). Where DeepSpeed installs, run the command itself.")


def report(whole: bool) -> str:
    with open(RECORDED + ".md") as f:
        text = f.read()
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("<!--"))
    if not whole:
        text = text.split("\n## ", 1)[0].rstrip()
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/lesson/recorded.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="the whole report, not only its summary")
    args = ap.parse_args(argv)
    try:
        with open(RECORDED + ".json") as f:
            rec = json.load(f)
    except OSError as e:
        print(f"{ap.prog}: error: no recording ({e.filename}): run `python docs/lesson/lesson_numbers.py --record` "
              f"where DeepSpeed is installed", file=sys.stderr)
        return 2
    print(banner(rec))
    print()
    print(report(args.all))
    print()
    print(banner(rec).split(":", 1)[0] + ".")
    return 0


if __name__ == "__main__":
    sys.exit(main())
