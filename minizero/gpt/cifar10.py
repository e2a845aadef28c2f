"""CIFAR-10 via torchvision, fetched once per job by global rank 0 and renamed into place whole.

Its own module because the fetch is a small distributed protocol (rank 0 downloads into a
temporary folder, renames it atomically, broadcasts how it went; every rank then reads and
reports) that has nothing to do with what is done with the images afterwards.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile

import torch

from minizero import comm


class DatasetNotFoundError(RuntimeError):
    """CIFAR-10 is not on disk and could not be downloaded."""


CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TARBALL = "cifar-10-python.tar.gz"


def _fetch_cifar10(root: str, download: bool) -> None:
    """Put cifar-10-batches-py into root, whole or not at all (rank 0 only).

    Everything is written into a temporary folder beside the target and renamed into place
    in one step, so a reader (another node sharing --data-dir, a second job) sees either
    no folder or the complete one, never a half-extracted one.
    """
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive, extract_archive

    folder, tarball = os.path.join(root, CIFAR_FOLDER), os.path.join(root, CIFAR_TARBALL)
    if not os.path.isfile(tarball) and not download:
        return  # nothing to do; the read below says what is missing
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".cifar-10-incomplete-")
    try:
        if os.path.isfile(tarball):
            extract_archive(tarball, tmp)  # a tarball placed by hand: no network needed
        else:
            old = socket.getdefaulttimeout()
            socket.setdefaulttimeout(30)  # urllib has no timeout: don't hang on a dead network
            try:
                download_and_extract_archive(CIFAR10.url, tmp, filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)
            finally:
                socket.setdefaulttimeout(old)
        try:
            os.rename(os.path.join(tmp, CIFAR_FOLDER), folder)  # atomic on one file system
        except OSError:
            if not os.path.isdir(folder):  # else another job put it there first: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_cifar10(root, train: bool, download: bool = True) -> torch.Tensor:
    """CIFAR-10's train or test images as a uint8 tensor (N, 32, 32, 3).

    Collective when distributed (call it on every rank). If the data is not there, global
    rank 0 alone fetches it (`_fetch_cifar10`: one download for the whole job, even with
    --data-dir shared by several nodes) and then tells every rank how it went; the others
    wait for that message, then every rank reads the files. If rank 0 failed, or any rank
    cannot read them, all raise the same DatasetNotFoundError together instead of some
    ranks hanging in the next collective.
    """
    import torchvision

    root = os.path.abspath(os.path.expanduser(str(root)))
    error = None
    if comm.get_rank() == 0 and not os.path.isdir(os.path.join(root, CIFAR_FOLDER)):
        try:
            _fetch_cifar10(root, download)
        except Exception as e:
            error = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever urllib says
    error = comm.broadcast_object(error)  # also the barrier: nobody reads before rank 0 is done

    data, unreadable = None, []
    if error is None:  # the same on every rank: all of them join the all_gather below, or none
        try:
            data = torch.from_numpy(torchvision.datasets.CIFAR10(root, train=train, download=False).data)
        except Exception:
            pass
        unreadable = [r for r, ok in enumerate(comm.all_gather_object(data is not None)) if not ok]
    if error is not None or unreadable:
        how = ""
        if error is not None:
            how = f"fetching it failed ({error}); "
        elif len(unreadable) < comm.get_world_size():
            how = f"ranks {unreadable} cannot read it (a --data-dir on several nodes must be one shared folder); "
        # Compute nodes are often offline: the fix is a fetch where the network is (a login
        # node), into a folder every node sees.
        raise DatasetNotFoundError(
            f"CIFAR-10 not found in {root}: {how}compute nodes are often offline, so fetch it once where the "
            f"network is (a login node): python -c \"from torchvision.datasets import CIFAR10; "
            f"CIFAR10('{root}', download=True)\", or place the extracted '{CIFAR_FOLDER}' folder (or "
            f"{CIFAR_TARBALL}) in {root}; on a cluster --data-dir (./data) and --save-dir (runs/) must be on a "
            f"file system every node mounts. Or use the built-in data with --dataset synthetic")
    return data
