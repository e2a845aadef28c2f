"""The data folder a run reads: nothing in it runs code, and another node sees it late (gpt/cifar10.py).

CIFAR-10's batches are pickles. Each file is checked against torchvision's md5 sums first,
which already stops a planted file that is not one of CIFAR-10's own; the fakes here (as in
tests/tools/test_data.py) replace that check by "the file exists", so what is tested is what
stands behind it: the allow-list unpickler. The codebook cache is a torch file loaded with
weights_only=True; a planted one is recomputed.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from minizero.gpt import cifar10, codebook
from tests.support.launcher import run_ranks
from tests.tools.test_checkpoint_safe_load import PlantedCall
from tests.tools.test_data import N_FAKE, _fake_torchvision, _write_fake_cifar


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_planted_batch_is_refused_before_it_runs(tmp_path, monkeypatch, protocol):
    """protocol 2 names os.system with GLOBAL (as CIFAR-10's own Python 2 pickles name numpy),
    4 with STACK_GLOBAL; either way the unpickler's find_class refuses it before the call.
    batches.meta (label names, which torchvision also unpickled) is never read now."""
    import torchvision.datasets.cifar as cifar

    folder, marker = tmp_path / cifar10.CIFAR_FOLDER, tmp_path / "marker"
    _write_fake_cifar(str(folder))
    planted = folder / "data_batch_3"
    for path in (planted, folder / "batches.meta"):
        with open(path, "wb") as f:
            pickle.dump({"data": PlantedCall(marker), "labels": []}, f, protocol=protocol)
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    with pytest.raises(cifar10.UnsafeDataError) as e:
        cifar10.load_cifar10(tmp_path, train=True, download=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{planted}: refused to read: unpickling it would call posix.system "
                                              f"(os.system); a CIFAR-10 batch holds numpy arrays"), msg
    assert cifar10.load_cifar10(tmp_path, train=False, download=False).shape == (N_FAKE, 32, 32, 3)
    assert not marker.exists()
    # a batch that unpickles but holds no image rows is one line too, not a deeper error
    with open(planted, "wb") as f:
        pickle.dump({"data": np.zeros((2, 5), np.float64), "labels": [0, 0]}, f)
    with pytest.raises(cifar10.UnsafeDataError, match="not a CIFAR-10 batch"):
        cifar10.load_cifar10(tmp_path, train=True, download=False)


def test_a_planted_codebook_cache_is_recomputed_and_never_runs(tmp_path):
    from minizero.gpt.synthetic_images import synthetic_images
    images, marker = synthetic_images(16, 8, seed=0), tmp_path / "marker"
    path = tmp_path / f"codebook-{codebook._fingerprint(images, 4, 2, 0)}.pt"
    torch.save({"codebook": PlantedCall(marker)}, str(path))
    c = codebook.compute_codebook(images, 4, 2, seed=0, cache_dir=str(tmp_path))
    assert c.shape == (4, 3) and not marker.exists()
    assert torch.equal(torch.load(str(path), weights_only=True), c)   # overwritten with the computed one


def _fetch_with_rank_1_lagging(root: str, log: str):
    """Rank 1's node looked for the CIFAR-10 folder before rank 0 fetched it (its NFS client
    remembers it missing); both ranks then load the data."""
    from minizero import comm
    from tests.tools.test_shared_folder_lag import _lagging_on_rank_1
    os.environ["LOCAL_RANK"] = "0"   # each rank a node of its own, sharing root
    _fake_torchvision(root, log)
    _lagging_on_rank_1(os.path.dirname(root), files=True)
    if comm.get_rank() == 1:
        assert not os.path.isdir(os.path.join(root, cifar10.CIFAR_FOLDER))
    comm.barrier()
    try:
        return tuple(cifar10.load_cifar10(root, train=t).shape for t in (True, False))
    except cifar10.DatasetNotFoundError as e:
        return str(e)


def test_a_node_that_remembers_the_data_folder_missing_looks_again(tmp_path):
    # Before: "CIFAR-10 not found in ...: ranks [1] cannot read it" on both ranks.
    root = tmp_path / "data"
    root.mkdir()
    out = run_ranks(_fetch_with_rank_1_lagging, 2, args=(str(root), str(tmp_path / "log")), timeout=120)
    assert out == [((5 * N_FAKE, 32, 32, 3), (N_FAKE, 32, 32, 3))] * 2, out
