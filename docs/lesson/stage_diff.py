"""The code of two stage files side by side, without their docstrings and comments: what to project.

    python docs/lesson/stage_diff.py zero0 zero1     # minizero/zero0.py -> minizero/zero1.py
    python docs/lesson/stage_diff.py zero2 zero3
    python docs/lesson/stage_diff.py a.py b.py       # any two Python files

Why: each stage file explains itself at length (why, papers, DeepSpeed's names), which is
what a reader needs and what a projector cannot show: a plain `diff zero2.py zero3.py` is
mostly prose. This prints a unified diff of the code alone: docstrings (module, class and
function) and comments removed, blank lines kept where the code had them, so the lines a
stage adds or changes are what is left. It reads whatever the files hold: nothing here
knows what a stage does.
"""
from __future__ import annotations

import ast
import difflib
import io
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def docstring_lines(source: str) -> set[int]:
    """The line numbers (1-based) of every docstring: the first statement of the module, a
    class or a function, when it is a string constant."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_only(source: str) -> list[str]:
    """source's lines without docstrings and comments. A line that held only a docstring or
    a comment goes; a blank line of the code stays (one, where several followed each other)."""
    drop = docstring_lines(source)
    comments: dict[int, int] = {}   # line -> column where its comment starts
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.start[1]
    out: list[str] = []
    for n, line in enumerate(source.splitlines(), start=1):
        if n in drop:
            continue
        code = line[:comments[n]].rstrip() if n in comments else line.rstrip()
        if not code and line.strip():   # it held only a comment
            continue
        if not code and (not out or not out[-1]):
            continue                    # no blank line at the top, nor two in a row
        out.append(code)
    while out and not out[-1]:
        out.pop()
    return out


def resolve(name: str) -> str:
    """`zero2` -> minizero/zero2.py; a path stays a path."""
    if name.endswith(".py") or os.sep in name:
        return name
    return os.path.join(ROOT, "minizero", f"{name}.py")


def stage_diff(old: str, new: str, context: int = 3) -> list[str]:
    """The unified diff of two files' code (code_only), headed by their paths as given."""
    with open(old) as f:
        a = code_only(f.read())
    with open(new) as f:
        b = code_only(f.read())
    name = lambda p: os.path.relpath(p, ROOT) if os.path.abspath(p).startswith(ROOT + os.sep) else p
    return list(difflib.unified_diff(a, b, fromfile=name(old), tofile=name(new), n=context, lineterm=""))


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python docs/lesson/stage_diff.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="a stage (zero0 ... zero3, a file of minizero/) or the path of a Python file")
    ap.add_argument("new", help="the stage or file to compare it with")
    ap.add_argument("-U", "--context", type=int, default=3, help="lines of context around each change")
    args = ap.parse_args(argv)
    paths = [resolve(args.old), resolve(args.new)]
    for given, path in zip((args.old, args.new), paths):
        if not os.path.isfile(path):
            print(f"{ap.prog}: error: {given}: no such file ({path}); name a stage (zero0, zero1, zero2, "
                  f"zero3) or a Python file", file=sys.stderr)
            return 2
    try:
        lines = stage_diff(*paths, context=args.context)
    except (SyntaxError, UnicodeDecodeError) as e:
        print(f"{ap.prog}: error: cannot read Python from {e.filename or 'a file'}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    changed = sum(1 for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
    print(f"({changed} lines differ; docstrings and comments left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
