"""CIFAR-10 via torchvision, fetched once per job by global rank 0 and renamed into place whole.

Its own module because the fetch is a small distributed protocol (rank 0 downloads into a
temporary folder, renames it atomically, broadcasts how it went; every rank then waits until
it sees the folder, as a lagging NFS client may not at once (checkpoint_files/shared_folder.py),
reads and reports) that has nothing to do with what is done with the images afterwards.

Reading never runs code. CIFAR-10's python batches are pickles, and torchvision unpickles
them with Python's own unpickler, which calls whatever a file names. They are checked
against torchvision's md5 sums, as torchvision does, and then read by `_BatchUnpickler`,
which builds only what a batch holds (dicts, lists, bytes, strings, numbers, and numpy
arrays through numpy's own array-building functions) and refuses any other global before
calling it, so a planted --data-dir is one line naming the file and the global.
"""
from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile

import torch

from minizero import comm
from minizero.checkpoint_files import shared_folder
from minizero.gpt.images import DataConfigError


class DatasetNotFoundError(RuntimeError):
    """CIFAR-10 is not on disk and could not be downloaded."""


class UnsafeDataError(DataConfigError):
    """A file in the data folder whose unpickling would call something a CIFAR-10 batch never holds."""


CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TARBALL = "cifar-10-python.tar.gz"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]


def _numpy_globals() -> dict:
    """The globals a pickled numpy array names, under numpy 1's module names (CIFAR-10's
    files) and numpy 2's: what rebuilds an array and its dtype, nothing else."""
    import numpy as np
    core = np._core if hasattr(np, "_core") else np.core
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for module in ("numpy.core", "numpy._core"):
        allowed[(f"{module}.multiarray", "_reconstruct")] = core.multiarray._reconstruct
        allowed[(f"{module}.numeric", "_frombuffer")] = core.numeric._frombuffer
    return allowed


class _BatchUnpickler(pickle.Unpickler):
    """Python's unpickler with an allow-list: every global a pickle names goes through
    find_class (GLOBAL, STACK_GLOBAL, INST, OBJ, extension codes), so refusing there refuses
    it before anything is called."""

    def __init__(self, fh, path: str):
        super().__init__(fh, encoding="latin1")   # the files are Python 2 pickles (torchvision's encoding)
        self.path, self.allowed = path, _numpy_globals()

    def find_class(self, module, name):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        shown = f"{module}.{name}" + (f" (os.{name})" if module in ("posix", "nt") else "")
        raise UnsafeDataError(f"{self.path}: refused to read: unpickling it would call {shown}; a CIFAR-10 batch "
                              f"holds numpy arrays, lists, bytes, strings and numbers only, and reading the data "
                              f"folder never runs code: replace {os.path.dirname(self.path)} with CIFAR-10's own files")

    def persistent_load(self, pid):
        raise UnsafeDataError(f"{self.path}: refused to read: it holds a persistent reference, which a CIFAR-10 "
                              f"batch never does")


def read_batch(path: str):
    """One CIFAR-10 batch file: (uint8 images (N, 3072) as numpy, labels), through _BatchUnpickler."""
    import numpy as np
    with open(path, "rb") as fh:
        entry = _BatchUnpickler(fh, path).load()
    data = entry.get("data") if isinstance(entry, dict) else None
    labels = entry.get("labels", entry.get("fine_labels")) if isinstance(entry, dict) else None
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise UnsafeDataError(f"{path}: not a CIFAR-10 batch (no uint8 'data' array of rows of 3072 bytes)")
    return data, labels


def read_cifar10(root: str, train: bool):
    """The images of the train or test batches under root/cifar-10-batches-py as uint8 numpy
    (N, 32, 32, 3), each file checked against torchvision's md5 first (as torchvision does)."""
    import numpy as np
    from torchvision.datasets import cifar
    folder = os.path.join(root, CIFAR_FOLDER)
    sums = dict(cifar.CIFAR10.train_list + cifar.CIFAR10.test_list)
    rows = []
    for name in TRAIN_FILES if train else TEST_FILES:
        path = os.path.join(folder, name)
        if not cifar.check_integrity(path, sums.get(name)):
            raise RuntimeError(f"{path}: missing or corrupted (md5)")
        rows.append(read_batch(path)[0])
    return np.vstack(rows).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # CHW rows -> HWC, as torchvision


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


def _has_batches(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in TRAIN_FILES + TEST_FILES)


def load_cifar10(root, train: bool, download: bool = True) -> torch.Tensor:
    """CIFAR-10's train or test images as a uint8 tensor (N, 32, 32, 3).

    Collective when distributed (call it on every rank). If the data is not there, global
    rank 0 alone fetches it (`_fetch_cifar10`: one download for the whole job, even with
    --data-dir shared by several nodes) and then tells every rank how it went; the others
    wait for that message, then every rank reads the files. If rank 0 failed, or any rank
    cannot read them, all raise the same DatasetNotFoundError together instead of some
    ranks hanging in the next collective.
    """
    root = os.path.abspath(os.path.expanduser(str(root)))
    folder = os.path.join(root, CIFAR_FOLDER)
    error, found = None, False
    if comm.get_rank() == 0:
        if not os.path.isdir(folder):
            try:
                _fetch_cifar10(root, download)
            except Exception as e:
                error = " ".join(f"{type(e).__name__}: {e}".split())  # one line, whatever urllib says
        found = os.path.isdir(folder)
    # also the barrier: nobody reads before rank 0 is done
    error, found = comm.broadcast_object((error, found))
    if error is None and found:   # a node that looked for it before rank 0 fetched it: look again
        shared_folder.ranks_blind_to(folder, _has_batches, shared_folder.uncounted_max, torch.device("cpu"))

    data, unreadable = None, []
    if error is None:  # the same on every rank: all of them join the all_gather below, or none
        refused = None
        try:
            data = torch.from_numpy(read_cifar10(root, train))
        except UnsafeDataError as e:
            refused = str(e)
        except Exception:
            pass
        said = comm.all_gather_object(refused if refused is not None else data is not None)
        refusals = [s for s in said if isinstance(s, str)]
        if refusals:   # a planted file: the first rank's line, on every rank
            raise UnsafeDataError(refusals[0])
        unreadable = [r for r, ok in enumerate(said) if not ok]
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
