"""A folder a command will write into (--save-dir, --trace, compare's --out), checked before
anything is created.

A run that finds out late that its --trace path is a file dies with a traceback after it
has already made its save folder; checked first, the same mistake is one line and nothing
on disk. Plain os.path only (no torch): the command line is checked before torch is
imported.
"""
from __future__ import annotations

import os


def problem(path: str, flag: str) -> str | None:
    """Why `path` cannot be (or become) a folder this process writes into; None if it can."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return f"{flag} {path} is a file, not a folder: pass the path of a folder (it is created if missing)"
    parent = full
    while not os.path.exists(parent):   # the deepest part of the path that exists
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is a file, so no folder can be made under it; pass another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: {parent} is not writable by this user; pass another path"
    return None


def missing_parts(path: str) -> list[str]:
    """The folders that creating `path` would make, deepest first (empty: it exists)."""
    made, full = [], os.path.abspath(path)
    while not os.path.exists(full):
        made.append(full)
        full = os.path.dirname(full)
    return made
