"""The student's copy: minizero's core files with the pieces to write removed.

Each piece (parts.Hole) is a function or method of a core file. Its body is replaced by a
`raise NotImplementedError` naming the part; its signature, its docstring (the specification)
and the rest of the file stay as minizero has them. Comments inside the removed body go with
it (they would give the answer away); the task's hint is the part's (parts.py), written above
the raise. The copy is made from the files in this checkout, every time: it cannot drift.
"""
from __future__ import annotations

import ast
import io
import os
import textwrap
import tokenize

from .parts import CORE, PARTS, Hole


def hole_nodes(source: str, holes: list[Hole]) -> list[tuple[Hole, ast.AST]]:
    """Each hole's function node in `source` (KeyError names a hole the file lacks)."""
    tree = ast.parse(source)
    found = []
    for hole in holes:
        scope, node = tree, None
        for name in hole.qualname.split("."):
            node = next((n for n in getattr(scope, "body", []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                         and n.name == name), None)
            if node is None:
                raise KeyError(f"{hole.file}: no {hole.qualname} (the lab's parts.py names a piece the core no longer has)")
            scope = node
        found.append((hole, node))
    return found


def body_span(source: str, node: ast.FunctionDef) -> tuple[int, int]:
    """(first, last) line of the body after its docstring, 1-based, inclusive: everything
    from the line after the docstring (or after the `def` line's end) to the function's
    last line, comments included."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        if len(body) == 1:
            raise ValueError(f"{node.name}: a docstring and no code: nothing to write")
        return body[0].end_lineno + 1, node.end_lineno
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NEWLINE and tok.start[0] >= node.lineno:   # the end of the def line
            return tok.start[0] + 1, node.end_lineno
    raise ValueError(f"{node.name}: no end of its def line")


def holed(source: str, holes: list[Hole], part: str) -> str:
    """`source` with each hole's body replaced by its task and a NotImplementedError."""
    lines = source.splitlines(keepends=True)
    spans = []
    for hole, node in hole_nodes(source, holes):
        first, last = body_span(source, node)
        indent = " " * (node.col_offset + 4)
        task = "".join(f"{indent}# {ln}\n" if ln else f"{indent}#\n"
                       for ln in textwrap.wrap(f"lab part {part}: {hole.task}", 92 - len(indent)))
        stub = task + f"{indent}raise NotImplementedError(\"{hole.qualname}: lab part {part}\")\n"
        spans.append((first, last, stub))
    for first, last, stub in sorted(spans, reverse=True):
        lines[first - 1:last] = [stub]
    return "".join(lines)


def files_of(part: str) -> dict[str, list[Hole]]:
    """The core files a part's pieces are in, and the pieces in each."""
    out: dict[str, list[Hole]] = {}
    for hole in PARTS[part].holes:
        out.setdefault(hole.file, []).append(hole)
    return out


def make(folder: str) -> list[str]:
    """Write the student's copy into `folder` (created; an existing file there is refused, so
    a student's work is never overwritten). Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    planned = {}
    for part in PARTS:
        for file, holes in files_of(part).items():
            with open(os.path.join(CORE, file)) as f:
                planned[file] = holed(f.read(), holes, part)
    planned["README.md"] = readme()
    taken = [name for name in planned if os.path.exists(os.path.join(folder, name))]
    if taken:
        raise FileExistsError(f"{folder} already holds {', '.join(sorted(taken))}: a student's work is never "
                              f"overwritten; make the copy into a new folder")
    written = []
    for name, text in planned.items():
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    return written


def readme() -> str:
    lines = ["# The ZeRO lab", "",
             "Each part below is a few of minizero's functions, with their bodies removed. Their docstrings say "
             "what each must do, and so do the module docstrings around them; the lesson (docs/lesson.md) shows "
             "each mechanism run. Write them in the files of this folder, then grade a part:", "",
             "```bash", "python -m minizero.lab check PART --student THIS_FOLDER", "```", "",
             "The grader runs your files in place of minizero's on 2 ranks (a laptop's CPU is enough), and "
             "compares with minizero's own code and, where it is installed, DeepSpeed: the losses and weights bit "
             "for bit, the bytes of every collective, the memory each rank holds. Each part uses only its own "
             "files from this folder, so the parts can be done in any order; the lesson's order is below.", ""]
    for name, part in PARTS.items():
        lines += [f"## {name}: {part.title}", "", part.task, "", "To write:", ""]
        lines += [f"- `{h.file}`: `{h.qualname}`" for h in part.holes]
        lines.append("")
    return "\n".join(lines)
