"""What a stage adds to the one before, in its own code: what to project.

    python docs/lesson/stage_diff.py zero0 zero1     # class Zero1(Zero0): what it adds and overrides
    python docs/lesson/stage_diff.py zero2 zero3
    python docs/lesson/stage_diff.py --whole a.py b.py   # any two Python files, line by line
    python docs/lesson/stage_diff.py --show unit.Unit pre_forward post_forward   # some members of one class

Why: each stage is a subclass of the one before (zero1.py's `Zero1(Zero0)`, ...), so a plain
diff of two stage files is wrong twice over: every method the later stage inherits shows as
deleted (a student reads "ZeRO-2 drops the all-gather after the step"), and the prose that
explains each file (why, papers, DeepSpeed's names) fills the screen. This prints the later
class's own code, member by member in its order: a member it adds as `+` lines; a member it
overrides beside the parent's member it replaces (`-` the parent's, `+` its own, lines they
share as context), whichever ancestor defined it; then, as a comment, what it inherits
unchanged, and the module's other functions. Docstrings and comments are left out, except a
docstring that is a function's whole body (it stays, so every `def` has a body): the `-`
side with the context lines, and the `+` side with them, are each valid Python. It reads
whatever the files hold: nothing here knows what a stage does.

Two files with no such class (or --whole): the unified diff of their code, line by line.
--show prints chosen members of one class the same way (ZeRO-3's `Unit` and its four hooks:
a few lines, where the file is two hundred).
"""
from __future__ import annotations

import ast
import difflib
import io
import os
import sys
import textwrap
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------------------- code without prose

def docstring_lines(source: str) -> set[int]:
    """The line numbers (1-based) of every docstring to drop: the first statement of the
    module, a class or a function, when it is a string constant; not one that is a
    function's only statement (the function would have no body left)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) == 1:
                    continue
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_only(source: str) -> list[str]:
    """source's lines without docstrings (docstring_lines) and comments. A line that held
    only a docstring or a comment goes; a blank line of the code stays (one, where several
    followed each other)."""
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


# ----------------------------------------------------------------------------- classes and their parents

class Member:
    """A class member: a method (decorators included) or a class attribute."""

    def __init__(self, name: str, owner: str, lines: list[str]):
        self.name, self.owner, self.lines = name, owner, lines   # lines: code_only, indented as in the class


class ClassInfo:
    def __init__(self, name: str, path: str, node: ast.ClassDef, source: str, module: ast.Module):
        self.name, self.path, self.node, self.module = name, path, node, module
        self.header = code_only(ast.get_source_segment(source, node).split(":\n", 1)[0] + ":\n    pass")[0]
        src_lines = source.splitlines()
        self.members: list[Member] = []
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = item.name
            elif isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
                name = item.targets[0].id
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                name = item.target.id
            else:
                continue   # the class docstring, a bare expression
            first = min([item.lineno] + [d.lineno for d in getattr(item, "decorator_list", [])])
            text = textwrap.dedent("\n".join(src_lines[first - 1:item.end_lineno])) + "\n"
            self.members.append(Member(name, self.name, ["    " + ln if ln else ln for ln in code_only(text)]))
        self.bases = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def member(self, name: str) -> Member | None:
        return next((m for m in self.members if m.name == name), None)


def read_classes(path: str) -> tuple[dict[str, ClassInfo], ast.Module, str]:
    with open(path) as f:
        source = f.read()
    module = ast.parse(source)
    classes = {n.name: ClassInfo(n.name, path, n, source, module) for n in module.body if isinstance(n, ast.ClassDef)}
    return classes, module, source


def imported_from(module: ast.Module, path: str, name: str) -> str | None:
    """The file `name` comes from in this module: `from .zero1 import Zero1` -> zero1.py
    beside it (relative imports of a sibling module only; None for anything else)."""
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module \
                and any(a.name == name and a.asname is None for a in node.names):
            candidate = os.path.join(os.path.dirname(path), *node.module.split(".")) + ".py"
            return candidate if os.path.isfile(candidate) else None
    return None


def ancestors(cls: ClassInfo) -> list[ClassInfo]:
    """The parent chain of `cls`, nearest first (first base at each level, the chain the
    stages form), as far as it can be read from sibling files."""
    chain, current = [], cls
    while current.bases:
        base = current.bases[0]
        classes, module, _ = read_classes(current.path)
        path = current.path if base in classes else imported_from(current.module, current.path, base)
        if path is None:
            break
        found = read_classes(path)[0].get(base)
        if found is None:
            break
        chain.append(found)
        current = found
    return chain


def subclass_of(new_path: str, old_path: str) -> tuple[ClassInfo, list[ClassInfo]] | None:
    """The class of `new_path` whose parent chain passes through a class of `old_path`, and
    that chain; None when there is none."""
    old = os.path.abspath(old_path)
    for cls in read_classes(new_path)[0].values():
        chain = ancestors(cls)
        if any(os.path.abspath(a.path) == old for a in chain):
            return cls, chain
    return None


# ----------------------------------------------------------------------------- the projection

def name_of(path: str) -> str:
    return os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else path


def class_diff(cls: ClassInfo, chain: list[ClassInfo], context: int = 3) -> list[str]:
    """`cls`'s own members, each beside the member of its ancestors it replaces (module
    docstring). Lines: "--- parent", "+++ class", then " ", "-", "+" lines; a blank line
    between members is context."""
    parent = chain[0]
    out = [f"--- {name_of(parent.path)}: class {parent.name}, what {cls.name} replaces",
           f"+++ {name_of(cls.path)}: class {cls.name}, what it adds and overrides"]
    out += ["-" + parent.header, "+" + cls.header]
    own = {m.name for m in cls.members}
    for i, m in enumerate(cls.members):
        replaced = next((a.member(m.name) for a in chain if a.member(m.name) is not None), None)
        if i:
            out.append(" ")
        if replaced is None:
            out += ["+" + ln for ln in m.lines]
            continue
        if replaced.owner != parent.name:
            out.append(f"-    # {replaced.owner}'s, which {parent.name} inherits")
        matcher = difflib.SequenceMatcher(a=replaced.lines, b=m.lines, autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag == "equal":
                out += [" " + ln for ln in replaced.lines[a0:a1]]
            else:
                out += ["-" + ln for ln in replaced.lines[a0:a1]]
                out += ["+" + ln for ln in m.lines[b0:b1]]
    inherited = []
    for a in chain:
        inherited += [x.name for x in a.members if x.name not in own and x.name not in inherited]
    if inherited:
        out += [" ", f"     # inherited unchanged: {', '.join(inherited)}"]
    others = [n.name for n in cls.module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name != cls.name]
    if others:
        out.append(f"     # {os.path.basename(cls.path)} also defines: {', '.join(others)}")
    return out


def file_diff(old: str, new: str, context: int = 3) -> list[str]:
    """The unified diff of two files' code (code_only), headed by their paths."""
    with open(old) as f:
        a = code_only(f.read())
    with open(new) as f:
        b = code_only(f.read())
    return list(difflib.unified_diff(a, b, fromfile=name_of(old), tofile=name_of(new), n=context, lineterm=""))


def stage_diff(old: str, new: str, context: int = 3, whole: bool = False) -> list[str]:
    """The projection of `new`'s subclass of a class of `old` (class_diff), or, when there
    is none or `whole`, the two files' code diff (file_diff)."""
    found = None if whole else subclass_of(new, old)
    if found is None:
        return file_diff(old, new, context)
    return class_diff(*found, context=context)


def show(path: str, cls_name: str, members: list[str]) -> list[str]:
    """The class's header and the named members' code (code_only), in the class's order,
    then a comment naming its other members. KeyError names a member it does not have."""
    classes = read_classes(path)[0]
    if cls_name not in classes:
        raise KeyError(f"{name_of(path)} has no class {cls_name} (it has: {', '.join(classes) or 'none'})")
    cls = classes[cls_name]
    missing = [m for m in members if cls.member(m) is None]
    if missing:
        raise KeyError(f"class {cls_name} has no member {missing[0]} (it has: {', '.join(m.name for m in cls.members)})")
    out = [f"# {name_of(path)}", cls.header]
    for m in cls.members:
        if m.name in members:
            out += ([""] if len(out) > 2 else []) + m.lines
    others = [m.name for m in cls.members if m.name not in members]
    if others:
        out += ["", f"    # {cls_name} also has: {', '.join(others)}"]
    return out


def sides(lines: list[str]) -> tuple[str, str]:
    """The two programs a projection holds: ("-" and context lines, "+" and context lines)."""
    body = [ln for ln in lines if not ln.startswith(("---", "+++", "@@"))]
    old = "\n".join(ln[1:] for ln in body if ln[:1] in " -")
    new = "\n".join(ln[1:] for ln in body if ln[:1] in " +")
    return old + "\n", new + "\n"


def counts(lines: list[str]) -> tuple[int, int]:
    """(lines added, lines removed), comments the projection wrote left out."""
    body = [ln for ln in lines if not ln.startswith(("---", "+++")) and not ln[1:].strip().startswith("#")]
    return sum(ln.startswith("+") for ln in body), sum(ln.startswith("-") for ln in body)


def resolve(name: str) -> str:
    """`zero2` -> minizero/zero2.py; a path stays a path."""
    if name.endswith(".py") or os.sep in name:
        return name
    return os.path.join(ROOT, "minizero", f"{name}.py")


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python docs/lesson/stage_diff.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", nargs="?", help="a stage (zero0 ... zero3, a file of minizero/) or the path of a Python file")
    ap.add_argument("new", nargs="?", help="the stage or file to compare it with")
    ap.add_argument("-U", "--context", type=int, default=3, help="lines of context around each change (--whole)")
    ap.add_argument("--whole", action="store_true", help="the two files' code line by line, not the subclass")
    ap.add_argument("--show", nargs="+", metavar=("MODULE.CLASS", "MEMBER"),
                    help="print these members of one class of minizero/ (e.g. unit.Unit pre_forward post_forward)")
    args = ap.parse_args(argv)
    if args.show:
        where, members = args.show[0], args.show[1:]
        module, _, cls = where.rpartition(".")
        path = resolve(module) if module else ""
        if not module or not members or not os.path.isfile(path):
            print(f"{ap.prog}: error: --show {' '.join(args.show)}: give MODULE.CLASS (a file of minizero/) and one "
                  f"member or more, e.g. --show unit.Unit pre_forward post_forward", file=sys.stderr)
            return 2
        try:
            lines = show(path, cls, members)
        except KeyError as e:
            print(f"{ap.prog}: error: {e.args[0]}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        print(f"({sum(1 for ln in lines if ln.strip() and not ln.strip().startswith('#'))} lines; docstrings and "
              f"comments left out)")
        return 0
    if not args.old or not args.new:
        print(f"{ap.prog}: error: name two stages (e.g. zero0 zero1), or --show MODULE.CLASS MEMBER...", file=sys.stderr)
        return 2
    paths = [resolve(args.old), resolve(args.new)]
    for given, path in zip((args.old, args.new), paths):
        if not os.path.isfile(path):
            print(f"{ap.prog}: error: {given}: no such file ({path}); name a stage (zero0, zero1, zero2, "
                  f"zero3) or a Python file", file=sys.stderr)
            return 2
    try:
        lines = stage_diff(*paths, context=args.context, whole=args.whole)
    except (SyntaxError, UnicodeDecodeError) as e:
        print(f"{ap.prog}: error: cannot read Python from {e.filename or 'a file'}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    added, removed = counts(lines)
    print(f"({added} lines added, {removed} removed; docstrings and comments left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
