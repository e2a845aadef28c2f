"""The torch these tests run under has every torch API the repository names.

pyproject.toml promises a range of torch versions, and the suite runs under one torch at a
time; tests/support/other_torch.sh runs its version-sensitive part under another one (the
versions it passed under: docs/results/torch-versions.md). This test is the cheap first
look: every `torch....` name written in minizero/, reference/, launch/ and tests/support/
(through `import torch.distributed as dist` and the like too) must resolve in this torch,
or be in VERSION_GATED with the fallback the code takes before it exists. Names read off
objects (`t.untyped_storage()`) are no module attribute: the Tensor and Module methods the
package relies on are listed in METHODS.

A torch that lacks a name fails here with the file and line that use it, in a second,
rather than as an AttributeError deep in one rank of a distributed test.
"""
from __future__ import annotations

import ast
import glob
import importlib
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ["minizero/**/*.py", "reference/*.py", "launch/*.py", "tests/support/*.py"]

# name -> (the first torch that has it, what the code does on an older one)
VERSION_GATED = {
    "torch.distributed.set_timeout": ("2.14", "observe/desync.py set_group_timeout: distributed_c10d._set_pg_timeout"),
    "torch.distributed.all_gather_single": ("2.13", "comm.py all_gather_into_tensor: dist.all_gather_into_tensor"),
    "torch.distributed.reduce_scatter_single": ("2.13", "comm.py reduce_scatter_tensor: dist.reduce_scatter_tensor"),
}
# Methods the package calls on objects, where no import names them.
METHODS = {
    torch.Tensor: ["untyped_storage", "register_post_accumulate_grad_hook", "nextafter", "data_ptr"],
    torch.UntypedStorage: ["resize_", "resizable", "nbytes", "data_ptr"],
    torch.nn.Module: ["register_forward_pre_hook", "register_forward_hook"],
    torch.optim.Optimizer: ["register_step_pre_hook"],
}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """local name -> the torch module or object it stands for, from the module's imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def torch_names() -> dict[str, str]:
    """Every torch name the scanned files use -> the first `file:line` that uses it."""
    found: dict[str, str] = {}
    for pattern in SCANNED:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            tree = ast.parse(open(path).read(), path)
            inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}   # a.b of a.b.c
            aliases = _aliases(tree)
            where = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                        (node.module == "torch" or node.module.startswith("torch.")):
                    names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("torch.")]
                elif isinstance(node, ast.Attribute) and id(node) not in inner:
                    chain = _dotted(node)
                    names = [".".join([aliases[chain[0]], *chain[1:]])] if chain and chain[0] in aliases else []
                else:
                    continue
                for n in names:
                    found.setdefault(n, f"{where}:{node.lineno}")
    return found


def resolves(name: str) -> bool:
    """`name` is an importable module, or an attribute path under the longest one that is."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_torch_name_the_repository_uses_exists_in_this_torch():
    names = torch_names()
    assert "torch.distributed.all_gather_into_tensor" in names and "torch.cuda.Event" in names   # the scan sees
    missing = [f"{where}: {n}" for n, where in sorted(names.items(), key=lambda kv: kv[1])
               if n not in VERSION_GATED and not resolves(n)]
    assert not missing, f"torch {torch.__version__} lacks:\n" + "\n".join(missing)


@pytest.mark.parametrize("cls", list(METHODS), ids=lambda c: c.__name__)
def test_the_methods_the_package_calls_exist_in_this_torch(cls):
    assert [m for m in METHODS[cls] if not hasattr(cls, m)] == [], torch.__version__


def test_version_gated_names_are_used_only_behind_their_fallback():
    """Each gated name exists from its version on, and the fallback it names exists before."""
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    for name, (since, fallback) in VERSION_GATED.items():
        first = tuple(int(x) for x in since.split("."))
        assert resolves(name) == (have >= first), (name, torch.__version__)
    from torch.distributed import distributed_c10d
    assert hasattr(distributed_c10d, "_set_pg_timeout")   # set_group_timeout's fallback
    assert hasattr(distributed_c10d, "all_gather_into_tensor") and hasattr(distributed_c10d, "reduce_scatter_tensor")
