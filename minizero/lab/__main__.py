"""python -m minizero.lab: make the student's copy, or grade a part (minizero/lab/__init__.py)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    from .parts import PARTS
    ap = argparse.ArgumentParser(prog="python -m minizero.lab",
                                 description="The ZeRO lab: write ZeRO's pieces, graded against minizero and DeepSpeed.")
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write the student's copy into a new folder")
    mk.add_argument("folder")
    ck = sub.add_parser("check", help="grade a part (or all) on 2 ranks")
    ck.add_argument("part", choices=list(PARTS) + ["all"])
    ck.add_argument("--student", metavar="DIR", help="the student's folder (default: grade minizero's own code)")
    ck.add_argument("--mistake", type=int, metavar="K",
                    help="grade the part's seeded mistake K instead (minizero/lab/mistakes.py): what a student hears")
    ck.add_argument("--no-deepspeed", action="store_true", help="compare with minizero only")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""      # a CPU grade on any machine: gloo ranks
    if args.command == "make":
        from .make import make
        try:
            written = make(args.folder)
        except (FileExistsError, KeyError, ValueError) as e:
            print(f"{ap.prog} make: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(written)} files into {args.folder}: "
              + ", ".join(os.path.basename(p) for p in written))
        print(f"the tasks: {os.path.join(args.folder, 'README.md')}; grade a part with "
              f"`python -m minizero.lab check PART --student {args.folder}`")
        return 0
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.mistake is not None and args.student:
        ap.error("--mistake grades a seeded mistake: give it or --student, not both")
    folder = args.student
    if args.mistake is not None:
        from .mistakes import MISTAKES, write
        if args.part == "all" or not 1 <= args.mistake <= len(MISTAKES[args.part]):
            ap.error(f"--mistake needs one part and 1 <= K <= {len(MISTAKES.get(args.part, []))}")
        folder = write(args.part, args.mistake, tempfile.mkdtemp(prefix=f"minizero-lab-{args.part}-"))
        print(f"seeded mistake {args.mistake} of part {args.part}: {MISTAKES[args.part][args.mistake - 1].what}")
    if folder is not None and not os.path.isdir(folder):
        print(f"{ap.prog} check: error: {folder}: no such folder; `python -m minizero.lab make {folder}` writes the "
              f"student's copy", file=sys.stderr)
        return 2
    from .grade import grade
    from .run import student_files
    try:
        for p in parts:
            student_files(p, folder)
    except FileNotFoundError as e:
        print(f"{ap.prog} check: error: {e}", file=sys.stderr)
        return 2
    from .grade import deepspeed_available
    if args.no_deepspeed or not deepspeed_available():
        print("graded against minizero only: " + ("--no-deepspeed" if args.no_deepspeed else
              "DeepSpeed is not installed (pip install -e \".[dev]\" adds it)"))
    t0 = time.perf_counter()
    graded = grade(parts, {"student": folder}, with_deepspeed=not args.no_deepspeed)["student"]
    for p in parts:
        print(graded[p].report())
        print()
    failed = [p for p in parts if not graded[p].passed]
    print(f"{len(parts) - len(failed)} of {len(parts)} parts pass ({time.perf_counter() - t0:.0f} s)"
          + (f"; failing: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
