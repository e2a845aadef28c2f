"""The repository stands alone, and minizero/ reads without import loops (issue 10).

- No tracked file names a file outside the repository: a reader of the repo does not have
  someone's private notes or the author's machine, so every fact the code relies on lives
  in the repo's own docs (docs/deepspeed.md) and is cited from there.
- Every citation `docs/deepspeed.md, "<title>"` names a section that exists, every
  relative link in a tracked Markdown file points to a file (and heading) that exists, and
  every test a doc names (tests/x.py::test_y) exists.
- No import cycle inside minizero/. Imports inside functions count: a deferred import
  only hides the cycle from the interpreter, not from a reader, who still has to hold
  both modules in mind to follow either; the fix is the same as for a top-level cycle
  (move what both need into a module that imports neither). The package's __init__.py
  counts as a module: a submodule that reads a name from the package (`from . import
  __version__`) depends on everything __init__ imports.

Cheap: no torch, no process group; a few hundred files read once.
"""
from __future__ import annotations

import ast
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minizero"

# Names of files outside the repository, built by concatenation so that this file does not
# contain them itself.
OUTSIDE = ("DEEPSPEED" + "_FACTS", "SEED" + "_FACTS", "LAYOUT" + ".md", "../" + "shared", "/work/" + "shared")
# The API notes file counts only as a file name (not inside a longer name such as OPEN-API notes), and
# only while the repository has no file of that name.
API_NAME = "API" + ".md"
API_MD = re.compile(r"(?<![\w.-])" + re.escape(API_NAME) + r"\b")


# ----------------------------------------------------------------------------- tracked files

@lru_cache(maxsize=None)
def tracked_text_files() -> tuple[tuple[str, str], ...]:
    """(path relative to the repo, text) of every tracked text file."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the hygiene checks read `git ls-files`")
    files = []
    for rel in sorted(p for p in out.decode().split("\0") if p):
        path = ROOT / rel
        if not path.is_file():      # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:    # binary (images, ...)
            continue
        try:
            files.append((rel, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return tuple(files)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_no_tracked_file_names_a_file_outside_the_repo():
    names = {Path(rel).name for rel, _ in tracked_text_files()}
    machine_path = str(ROOT) + "/"    # this checkout's absolute path: nobody else has it
    hits = []
    for rel, text in tracked_text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            found = [n for n in OUTSIDE if n in line]
            if API_MD.search(line) and API_NAME not in names:
                found.append(API_NAME)
            if machine_path in line:
                found.append(machine_path)
            if found:
                hits.append(f"{rel}:{lineno}: names {', '.join(found)}: {line.strip()[:120]}")
    assert not hits, ("files outside the repository are named (cite docs/deepspeed.md, \"<section title>\" "
                      "or another file in the repo instead):\n" + "\n".join(hits))


# ----------------------------------------------------------------------------- citations and links

def _headings(md: str) -> list[str]:
    """The ATX headings of a Markdown text, outside fenced code blocks."""
    out, fenced = [], False
    for line in md.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(md: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for h in _headings(md):
        s = _slug(h)
        anchors.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return anchors


CITATION = re.compile(r'docs/deepspeed\.md,\s*"([^"]{1,200})"')


def _joined(text: str) -> str:
    """`text` with each line break, and the indentation and comment marker (# or //) after
    it, replaced by one space: a citation wrapped over two comment lines reads as one.
    Offsets shift, so line numbers are taken from the original text."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#+|//)?[ \t]*", " ", text)


def test_deepspeed_md_citations_name_existing_sections():
    deepspeed_md = ROOT / "docs" / "deepspeed.md"
    assert deepspeed_md.is_file(), "docs/deepspeed.md is missing"
    titles = {h for h in _headings(deepspeed_md.read_text()) if h}
    bad = []
    for rel, text in tracked_text_files():
        if "docs/deepspeed.md" not in text:
            continue
        starts = [m.start() for m in re.finditer(r"docs/deepspeed\.md", text)]
        for i, m in enumerate(CITATION.finditer(_joined(text))):
            title = m.group(1).strip()
            if title not in titles and not title.startswith("<"):   # "<section title>": the form itself
                # the i-th "docs/deepspeed.md" of the joined text is at or after the i-th mention
                line = _line_of(text, starts[min(i, len(starts) - 1)])
                bad.append(f"{rel}:{line}: no section \"{title}\"")
    assert not bad, ("citations of docs/deepspeed.md name no section there (titles: "
                     + "; ".join(sorted(titles)) + "):\n" + "\n".join(bad))


LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _strip_code(md: str) -> str:
    """Blank out fenced code blocks and inline code spans, keeping line breaks."""
    md = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), md, flags=re.S)
    return re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), md)


def test_relative_markdown_links_point_to_existing_files_and_headings():
    bad = []
    for rel, text in tracked_text_files():
        if not rel.endswith(".md"):
            continue
        here = (ROOT / rel).parent
        for m in LINK.finditer(_strip_code(text)):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):     # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (here / path).resolve() if path else ROOT / rel
            where = f"{rel}:{_line_of(text, m.start())}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                bad.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
            elif ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where}: points outside the repository")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


TEST_REF = re.compile(r"\b(tests/(?:\w+/)*\w+\.py)::(\w+)")


def test_docs_name_tests_that_exist():
    """A fact "Pinned by: tests/x.py::test_y" is only pinned while test_y exists."""
    bad = []
    for rel, text in tracked_text_files():
        if not rel.endswith(".md"):
            continue
        for m in TEST_REF.finditer(text):
            path, name = ROOT / m.group(1), m.group(2)
            defined = path.is_file() and any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
                for n in ast.walk(ast.parse(path.read_text())))
            if not defined:
                bad.append(f"{rel}:{_line_of(text, m.start())}: {m.group(0)} does not exist")
    assert not bad, "docs name tests that do not exist (renamed? update the doc):\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- import cycles

def module_name(path: Path) -> str:
    """minizero/engine.py -> "engine", minizero/config/__init__.py -> "config",
    minizero/checkpointing/__init__.py -> "checkpointing"; the package itself is "__init__"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _package_imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(imported minizero module, line) for every import in `path`, at any depth, relative
    imports resolved against the file's own package."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [] if name == "__init__" else package

    def known(dotted: list[str]) -> str:
        """The longest prefix of `dotted` that is a module ("__init__" for the package)."""
        for n in range(len(dotted), 0, -1):
            if ".".join(dotted[:n]) in modules:
                return ".".join(dotted[:n])
        return "__init__"

    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "minizero":
                    out.append((known(parts[1:]), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "minizero":
                    continue
                base = parts[1:]
            else:
                up = len(package) - (node.level - 1)
                if up < 0:
                    continue
                base = package[:up] + (node.module.split(".") if node.module else [])
            for alias in node.names:     # from minizero import config: the module config
                out.append((known(base + [alias.name]), node.lineno))
    return [(m, line) for m, line in out if m in modules]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line of such an import}, inside minizero/ and
    every subpackage."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges: dict[str, int] = {}
        for target, line in _package_imports(path, set(files)):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _path_of(module: str) -> str:
    """The file of a module name of import_graph, for messages."""
    if module == "__init__":
        return "minizero/__init__.py"
    path = PACKAGE.joinpath(*module.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(ROOT))


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one module
    (Tarjan's algorithm, then a breadth-first search inside the component)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in (c for c in comps if len(c) > 1):
        start = min(comp)
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        cycles.append(path[::-1] + [start])
    return sorted(cycles)


def test_import_cycle_finder_finds_a_deferred_cycle():
    graph = {"a": {"b": 3}, "b": {"c": 9}, "c": {"a": 40}, "d": {"a": 1}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle_inside_minizero():
    graph = import_graph()
    assert {"engine", "config", "zero0"} <= set(graph), "minizero/ not found where expected"
    cycles = import_cycles(graph)
    lines = []
    for cyc in cycles:
        steps = ", ".join(f"{_path_of(a)}:{graph[a][b]} imports {b}" for a, b in zip(cyc, cyc[1:]))
        lines.append(f"{' -> '.join(cyc)}  ({steps})")
    assert not cycles, ("import cycles inside minizero/ (imports inside functions count; move what both "
                        "modules need into a third one):\n" + "\n".join(lines))


# ----------------------------------------------------------------------------- the core and its rooms

CORE_PACKAGES = ("config", "checkpointing", "offload")   # the core's own rooms: what it needs, a student opens later


def core_modules(graph: dict[str, dict[str, int]]) -> list[str]:
    """minizero/*.py but __init__.py (the front door that wires the tools to the engine), and
    every module of the core's own subpackages (CORE_PACKAGES)."""
    top = [m for m in graph if "." not in m and m != "__init__" and not PACKAGE.joinpath(m).is_dir()]
    own = [m for m in graph if m.split(".")[0] in CORE_PACKAGES]
    return sorted(top + own)


def test_the_core_imports_only_itself():
    """Every import in a core module (minizero/*.py and the core's own subpackages, config/,
    checkpointing/, offload/), at any depth, names another core module:
    no room (observe/, train/, compare/, checkpoint_files/, runtime/, gpt/, the command
    packages), no exemption. The rooms reach the core through its public API; the front door
    (minizero/__init__.py) hands the engine its checkpoint format and puts the config's tools
    on comm's observer seam."""
    graph = import_graph()
    core = core_modules(graph)
    assert {"engine", "comm", "zero3", "flat_param", "config", "config.zero", "checkpointing",
            "checkpointing.options", "offload", "offload.nvme"} <= set(core), core
    bad = [f"minizero/{m.replace('.', '/')}.py:{line} imports {t}" for m in core
           for t, line in sorted(graph[m].items(), key=lambda kv: kv[1]) if t not in core]
    assert not bad, "the core imports a room (use the engine's public API or comm's observer seam):\n" + \
        "\n".join(bad)
    front = {t for t in graph["__init__"] if t not in core}
    assert front == {"observe.switches", "checkpoint_files.checkpoint_io", "checkpoint_files.zero_to_fp32"}, front


def test_the_core_imports_only_torch_and_the_standard_library():
    """Outside minizero itself, a core module imports torch or the standard library: a
    student needs nothing else to read it, and a user nothing else to run it."""
    import sys
    allowed = set(sys.stdlib_module_names) | {"torch", "minizero", "__future__"}
    bad = []
    files = sorted(PACKAGE.glob("*.py")) + [p for d in CORE_PACKAGES for p in sorted(PACKAGE.joinpath(d).rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] not in allowed]
    assert not bad, "\n".join(bad)


def test_no_module_of_minizero_imports_deepspeed():
    """minizero never imports DeepSpeed, rooms included, at any depth: what runs DeepSpeed (the
    compare report, the selftest, the lab's grade against DeepSpeed's own classes) reaches it
    through the repository's reference/, which is where DeepSpeed's names may appear."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "deepspeed"]
    assert not bad, "\n".join(bad)


def test_boundary_checks_catch_a_room_import(tmp_path):
    """The import graph sees a function-level import of a room from a core module."""
    pkg = tmp_path / "minizero"
    (pkg / "observe").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "observe" / "__init__.py").write_text("")
    (pkg / "observe" / "trace.py").write_text("")
    (pkg / "engine.py").write_text("def f():\n    from .observe import trace\n")
    modules = {"__init__", "engine", "observe", "observe.trace"}
    global PACKAGE
    saved, PACKAGE = PACKAGE, pkg
    try:
        assert _package_imports(pkg / "engine.py", modules) == [("observe.trace", 2)]
    finally:
        PACKAGE = saved
