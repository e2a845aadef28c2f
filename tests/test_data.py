"""Data pipeline: synthetic images, the k-means codebook (rank-0 compute + broadcast + disk
cache), CIFAR's missing-files message, token shifting and per-rank loader slices."""
import pytest
import torch
from torch.utils.data import TensorDataset

from minizero import comm, data
from tests.launcher import run_ranks


def test_synthetic_is_deterministic_and_structured():
    a = data.synthetic_images(64, 32, seed=0)
    assert a.shape == (64, 32, 32, 3) and a.dtype == torch.uint8
    assert torch.equal(a, data.synthetic_images(64, 32, seed=0))
    assert not torch.equal(a, data.synthetic_images(64, 32, seed=1))
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
    out = data.resize_images(im, 2)
    assert out.shape == (1, 2, 2, 3)
    assert out[0, 0, 0, 0] == 200 and out[0, 0, 1, 0] == 25 and out[0, 1, 1, 0] == 0
    with pytest.raises(data.DataConfigError, match="must divide"):
        data.resize_images(im, 3)


def test_kmeans_gives_finite_centroids():
    images = data.synthetic_images(40, 8, seed=3)
    c = data.compute_codebook(images, ncluster=16, niter=4, seed=0)
    assert c.shape == (16, 3) and c.dtype == torch.float32
    assert torch.isfinite(c).all() and c.min() >= 0 and c.max() <= 255
    assert torch.equal(c, data.compute_codebook(images, ncluster=16, niter=4, seed=0))  # seeded


def test_codebook_cache_hit_on_second_call(tmp_path, monkeypatch, capsys):
    calls = []
    real = data.kmeans
    monkeypatch.setattr(data, "kmeans", lambda *a, **k: calls.append(1) or real(*a, **k))
    images = data.synthetic_images(40, 8, seed=3)
    c1 = data.compute_codebook(images, ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    c2 = data.compute_codebook(images, ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    assert len(calls) == 1 and torch.equal(c1, c2)
    out = capsys.readouterr().out
    assert "computed" in out and "loaded" in out
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt"]  # no temp file left behind
    # Any input change is a different key: other images, other seed.
    data.compute_codebook(images, ncluster=16, niter=4, seed=1, cache_dir=tmp_path)
    data.compute_codebook(images[:39], ncluster=16, niter=4, seed=0, cache_dir=tmp_path)
    assert len(calls) == 3


def _codebook_on_ranks():
    # Every rank passes different images AND a different seed: only a broadcast from
    # rank 0 can make the results agree.
    rank = comm.get_rank()
    images = data.synthetic_images(40, 8, seed=3 + rank)
    return data.compute_codebook(images, ncluster=16, niter=4, seed=rank)


def test_codebook_is_rank0s_on_every_rank():
    results = run_ranks(_codebook_on_ranks, world_size=2)
    expected = data.compute_codebook(data.synthetic_images(40, 8, seed=3), ncluster=16, niter=4, seed=0)
    rank1_alone = data.compute_codebook(data.synthetic_images(40, 8, seed=4), ncluster=16, niter=4, seed=1)
    assert not torch.equal(expected, rank1_alone)  # the test could fail without the broadcast
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def test_missing_cifar_is_one_clear_error(tmp_path):
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.load_cifar10(tmp_path, train=True, download=False)
    msg = str(e.value)
    assert str(tmp_path) in msg and "cifar-10-batches-py" in msg and "--dataset synthetic" in msg
    assert "\n" not in msg
    with pytest.raises(data.DatasetNotFoundError):
        data.build_datasets("cifar10", root=tmp_path, download=False)
    with pytest.raises(data.UnknownDatasetError, match="synthetic"):
        data.build_datasets("imagenet", root=tmp_path)


def test_image_tokens_shift_and_decode(tmp_path):
    train, test, codebook = data.build_datasets("synthetic", root=tmp_path, image_size=8, ncluster=62, niter=4,
                                                n_synthetic_train=200, n_synthetic_test=50)
    assert (len(train), len(test), codebook.shape) == (200, 50, (62, 3))
    assert (train.vocab_size, train.block_size) == (62, 63)
    x, y = train[5]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (63,)
    assert torch.equal(x[1:], y[:-1])
    assert 0 <= int(train.tokens.min()) and int(train.tokens.max()) < 62

    # Tokens decode back to an approximation of the image.
    full = torch.cat([x, y[-1:]])[None]
    img = data.decode(full, codebook, 8)
    original = data.resize_images(data.synthetic_images(200, 32, seed=0), 8)[5]
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
    with pytest.raises(data.DataConfigError, match="micro-batch"):
        data.make_loader(TensorDataset(torch.arange(3)), micro_batch=4)
