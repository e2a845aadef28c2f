"""Writing a checkpoint so that it survives a crash of the node or of the file server.

A rename is atomic, but only in memory until the folder holding it reaches the disk, and a
file's bytes reach the disk when the page cache sends them, in any order. A published
checkpoint could then be a name whose file is short after a power cut (`latest` naming a tag
whose shards are truncated). So every file of a checkpoint is fsynced as it is written,
each rank fsyncs the `<tag>.tmp` folder after writing its files (all before the barrier
that lets rank 0 publish), rank 0 fsyncs the save folder after renaming `<tag>.tmp` to
`<tag>`, and `latest` is replaced durably (`write_text`): a temp file, fsynced, renamed
over it, the folder fsynced. On NFS, fsync sends the client's unwritten pages to the
server and waits for its COMMIT; a folder's fsync is how the rename is known to be stable.
"""
from __future__ import annotations

import os

import torch


def save(obj, path: str, writer=None) -> None:
    """writer(obj, path), then fsync the file: after a crash of the node or of the file
    server, a file a published checkpoint names holds all its bytes, not only those the page
    cache had sent. `writer`: torch.save, or deepspeed_pickle.torch_save for DeepSpeed's files."""
    (writer or torch.save)(obj, path)   # looked up now: a test may stand in for torch.save
    fsync_file(path)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)   # fsync acts on the file, whichever descriptor asks
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a folder: the names created, renamed or removed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Replace a small text file (`latest`) so that a crash leaves the old or the new text,
    whole: write a temp file, fsync it, rename it over `path`, fsync the folder."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
