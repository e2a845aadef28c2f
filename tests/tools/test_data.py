"""Data pipeline (images, synthetic_images, cifar10, codebook, data): synthetic images, the
k-means codebook (rank-0 compute + broadcast + disk cache), CIFAR's missing-files message,
token shifting and per-rank loader slices."""
import os
import time
import urllib.error

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from minizero.gpt import cifar10, codebook, data
from minizero import comm
from minizero.gpt.images import DataConfigError, resize_images
from minizero.gpt.synthetic_images import synthetic_images
from tests.support.launcher import run_ranks


def test_synthetic_is_deterministic_and_structured():
    a = synthetic_images(64, 32, seed=0)
    assert a.shape == (64, 32, 32, 3) and a.dtype == torch.uint8
    assert torch.equal(a, synthetic_images(64, 32, seed=0))
    assert not torch.equal(a, synthetic_images(64, 32, seed=1))
    assert len({bytes(im.numpy().tobytes()) for im in a}) == 64  # no duplicates

    # Structure: horizontally adjacent pixels are far closer than random pixel pairs.
    x = a.float()
    neighbour = (x[:, :, 1:] - x[:, :, :-1]).abs().mean()
    flat = x.reshape(-1, 3)
    shuffled = (flat - flat[torch.randperm(flat.size(0), generator=torch.Generator().manual_seed(0))]).abs().mean()
    assert neighbour < 0.2 * shuffled


def test_resize_area_averages():
    im = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    im[0, :2, :2] = 200  # top-left 2x2 block
    im[0, 0, 2] = 100
    out = resize_images(im, 2)
    assert out.shape == (1, 2, 2, 3)
    assert out[0, 0, 0, 0] == 200 and out[0, 0, 1, 0] == 25 and out[0, 1, 1, 0] == 0
    with pytest.raises(DataConfigError, match="must divide"):
        resize_images(im, 3)


def test_kmeans_gives_finite_centroids():
    images = synthetic_images(40, 8, seed=3)
    c = codebook.compute_codebook(images, ncluster=16, niter=4, seed=0)
    assert c.shape == (16, 3) and c.dtype == torch.float32
    assert torch.isfinite(c).all() and c.min() >= 0 and c.max() <= 255
    assert torch.equal(c, codebook.compute_codebook(images, ncluster=16, niter=4, seed=0))  # seeded


def test_codebook_cache_hit_on_second_call(tmp_path, monkeypatch, capsys):
    calls = []
    real = codebook.kmeans
    monkeypatch.setattr(codebook, "kmeans", lambda *a, **k: calls.append(1) or real(*a, **k))
    images = synthetic_images(40, 8, seed=3)
    c1 = codebook.compute_codebook(images, ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    c2 = codebook.compute_codebook(images, ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    assert len(calls) == 1 and torch.equal(c1, c2)
    out = capsys.readouterr().out
    assert "computed" in out and "loaded" in out
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt"]  # no temp file left behind
    # Any input change is a different key: other images, other seed.
    codebook.compute_codebook(images, ncluster=16, niter=4, seed=1, cache_dir=tmp_path)
    codebook.compute_codebook(images[:39], ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    assert len(calls) == 3


def _codebook_on_ranks():
    # Every rank passes different images AND a different seed: only a broadcast from
    # rank 0 can make the results agree.
    rank = comm.get_rank()
    images = synthetic_images(40, 8, seed=3 + rank)
    return codebook.compute_codebook(images, ncluster=16, niter=4, seed=rank)


def test_codebook_is_rank0s_on_every_rank():
    results = run_ranks(_codebook_on_ranks, world_size=2)
    expected = codebook.compute_codebook(synthetic_images(40, 8, seed=3), ncluster=16, niter=4, seed=0)
    rank1_alone = codebook.compute_codebook(synthetic_images(40, 8, seed=4), ncluster=16, niter=4, seed=1)
    assert not torch.equal(expected, rank1_alone)  # the test could fail without the broadcast
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def test_missing_cifar_is_one_clear_error(tmp_path):
    with pytest.raises(cifar10.DatasetNotFoundError) as e:
        cifar10.load_cifar10(tmp_path, train=True, download=False)
    msg = str(e.value)
    assert str(tmp_path) in msg and "cifar-10-batches-py" in msg and "--dataset synthetic" in msg
    assert "\n" not in msg
    # on a cluster: how to pre-fetch where the network is, and that data and runs must be shared
    assert "a login node" in msg and f"CIFAR10('{tmp_path}', download=True)" in msg
    assert "file system every node mounts" in msg and "--save-dir (runs/)" in msg
    with pytest.raises(cifar10.DatasetNotFoundError):
        data.build_datasets("cifar10", root=tmp_path, download=False)
    with pytest.raises(data.UnknownDatasetError, match="synthetic"):
        data.build_datasets("imagenet", root=tmp_path)


def test_image_tokens_shift_and_decode(tmp_path):
    train, test, book = data.build_datasets("synthetic", root=tmp_path, image_size=8, ncluster=62, niter=4,
                                            n_synthetic_train=200, n_synthetic_test=50)
    assert (len(train), len(test), book.shape) == (200, 50, (62, 3))
    assert (train.vocab_size, train.block_size) == (62, 63)
    x, y = train[5]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (63,)
    assert torch.equal(x[1:], y[:-1])
    assert 0 <= int(train.tokens.min()) and int(train.tokens.max()) < 62

    # Tokens decode back to an approximation of the image.
    full = torch.cat([x, y[-1:]])[None]
    img = codebook.decode(full, book, 8)
    original = resize_images(synthetic_images(200, 32, seed=0), 8)[5]
    assert img.shape == (1, 8, 8, 3) and img.dtype == torch.uint8
    assert (img[0].float() - original.float()).abs().mean() < 20
    assert any(p.name == "minizero_cache" for p in tmp_path.iterdir())  # codebook cached under root


def _loader_indices():
    loader = data.make_loader(TensorDataset(torch.arange(20)), micro_batch=2, shuffle=True, seed=0)
    loader.sampler.set_epoch(1)
    return [int(i) for (batch,) in loader for i in batch]


def test_make_loader_gives_disjoint_slices_per_rank():
    r0, r1 = run_ranks(_loader_indices, world_size=2)
    assert len(r0) == len(r1) == 10
    assert not set(r0) & set(r1) and set(r0) | set(r1) == set(range(20))


def test_make_loader_too_little_data_is_clear():
    with pytest.raises(DataConfigError, match="micro-batch"):
        data.make_loader(TensorDataset(torch.arange(3)), micro_batch=4)


def test_make_loader_pins_memory_only_for_a_gpu(monkeypatch):
    ds = TensorDataset(torch.arange(8))
    assert data.make_loader(ds, micro_batch=2).pin_memory is False  # CPU training: nothing to pin for
    monkeypatch.setattr(comm, "get_device", lambda: torch.device("cuda", 0))
    assert data.make_loader(ds, micro_batch=2).pin_memory is True


# ----------------------------------------------------------------------------- CIFAR-10 fetch
# No network here: torchvision's download is replaced by a fake that writes small files in
# CIFAR's format, and torchvision's md5 check by "the file exists".

CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
N_FAKE = 4  # images per fake batch file


def _write_fake_cifar(folder, after_each_file=lambda: None):
    import pickle

    os.makedirs(folder)
    for i, name in enumerate(CIFAR_FILES):
        rows = np.full((N_FAKE, 3 * 32 * 32), i, dtype=np.uint8)
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": rows, "labels": [0] * N_FAKE}, f)
        after_each_file()
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f)


def _fake_torchvision(root, log, fail=False):
    """Replace torchvision's download (wherever it is looked up) by one that appends
    "<rank> <download_root>" to `log`, then fails or writes the files one by one, noting
    "VISIBLE" if <root>/cifar-10-batches-py already exists while it writes (a reader
    could see it half-written)."""
    import torchvision.datasets.cifar as cifar
    import torchvision.datasets.utils as utils

    def download_and_extract_archive(url, download_root, filename=None, md5=None, **kw):
        with open(log, "a") as f:
            f.write(f"{comm.get_rank()} {download_root}\n")
        if fail:
            raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
        def check():
            if os.path.exists(os.path.join(root, cifar10.CIFAR_FOLDER)):
                with open(log, "a") as f:
                    f.write("VISIBLE\n")
            time.sleep(0.05)  # a window for another rank to look
        _write_fake_cifar(os.path.join(download_root, cifar10.CIFAR_FOLDER), check)

    utils.download_and_extract_archive = cifar.download_and_extract_archive = download_and_extract_archive
    cifar.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)


def _cifar_on_two_nodes(root, log, fail=False):
    # Each rank plays a node of its own (LOCAL_RANK 0 on both) sharing `root`, as two nodes
    # with one --data-dir on a shared file system.
    os.environ["LOCAL_RANK"] = "0"
    _fake_torchvision(root, log, fail)
    try:
        return tuple(cifar10.load_cifar10(root, train=t).shape for t in (True, False))
    except cifar10.DatasetNotFoundError as e:
        return str(e)


def _log_lines(log):
    return open(log).read().splitlines() if os.path.exists(log) else []


def test_cifar_is_fetched_once_by_rank0_and_appears_whole(tmp_path):
    root, log = tmp_path / "data", str(tmp_path / "downloads.log")
    shapes = run_ranks(_cifar_on_two_nodes, world_size=2, args=(str(root), log), timeout=120)
    assert shapes == [((5 * N_FAKE, 32, 32, 3), (N_FAKE, 32, 32, 3))] * 2
    lines = _log_lines(log)
    assert "VISIBLE" not in lines  # nobody could see the folder half-written
    assert len(lines) == 1, lines  # one download for the job: not one per node, not one per split
    rank, where = lines[0].split(" ", 1)
    # rank 0, into a temporary folder beside the target, renamed into place when complete
    assert rank == "0" and os.path.dirname(where) == str(root) and os.path.basename(where) != cifar10.CIFAR_FOLDER
    assert os.listdir(root) == [cifar10.CIFAR_FOLDER]  # the temporary folder is gone
    # The data is there now: nobody downloads again.
    assert run_ranks(_cifar_on_two_nodes, world_size=2, args=(str(root), log), timeout=120) == shapes
    assert len(_log_lines(log)) == 1


def test_cifar_fetch_failure_is_the_same_clear_error_on_every_rank(tmp_path):
    root, log = tmp_path / "data", str(tmp_path / "downloads.log")
    msgs = run_ranks(_cifar_on_two_nodes, world_size=2, args=(str(root), log, True), timeout=120)
    assert msgs[0] == msgs[1]  # rank 1 did not hang waiting for rank 0: it got rank 0's reason
    assert "URLError" in msgs[0] and "cifar-10-batches-py" in msgs[0] and "--dataset synthetic" in msgs[0]
    assert "\n" not in msgs[0]
    assert [line.split()[0] for line in _log_lines(log)] == ["0"]  # one attempt, by rank 0
    assert os.listdir(root) == []  # no half-written folder left behind


def test_hand_placed_tarball_is_extracted_beside_and_renamed(tmp_path, monkeypatch):
    import tarfile

    import torchvision.datasets.cifar as cifar
    import torchvision.datasets.utils as utils

    _write_fake_cifar(str(tmp_path / "src" / cifar10.CIFAR_FOLDER))
    root = tmp_path / "data"
    root.mkdir()
    with tarfile.open(root / cifar10.CIFAR_TARBALL, "w:gz") as tar:
        tar.add(tmp_path / "src" / cifar10.CIFAR_FOLDER, arcname=cifar10.CIFAR_FOLDER)
    real, seen = utils.extract_archive, []

    def extract_archive(src, dest=None, **kw):
        out = real(src, dest, **kw)
        seen.append(os.path.exists(root / cifar10.CIFAR_FOLDER))  # in place before it is complete?
        return out
    monkeypatch.setattr(utils, "extract_archive", extract_archive)
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))
    assert cifar10.load_cifar10(root, train=False, download=False).shape == (N_FAKE, 32, 32, 3)
    assert seen == [False]  # extracted elsewhere, then renamed into place
    assert sorted(os.listdir(root)) == sorted([cifar10.CIFAR_FOLDER, cifar10.CIFAR_TARBALL])
