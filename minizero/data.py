"""Images -> token sequences, as in minGPT's play_image notebook.

The pipeline (all of it CPU, all of it deterministic):

1. Images, uint8 (N, H, W, 3): CIFAR-10 via torchvision, or `synthetic_images`, a
   CIFAR-shaped set generated here so the project runs with no download at all.
   `resize_images` area-averages them down (8x8, 16x16) for fast CPU runs.
2. A colour codebook: k-means on 5 random pixels per training image, 512 clusters,
   8 iterations, dead clusters re-seeded from random pixels: the tutorial's recipe.
   It is computed once, on rank 0, cached on disk, and broadcast, so every rank
   quantises with the very same colours (a rank with its own codebook would be training
   on a different dataset).
3. `ImageTokens`: each pixel -> index of its nearest centroid, raster order, and the
   usual next-token shift x = a[:-1], y = a[1:]. Vocabulary = ncluster,
   block size = H*W - 1.
4. `make_loader`: a DataLoader over a DistributedSampler, so each rank reads its own slice.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from minizero import comm


class DatasetNotFoundError(RuntimeError):
    """CIFAR-10 is not on disk and could not be downloaded."""


class UnknownDatasetError(ValueError):
    """build_datasets() was given a dataset name it does not know."""


class DataConfigError(ValueError):
    """Inconsistent data settings (image size, batch size, codebook shape...)."""


CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TARBALL = "cifar-10-python.tar.gz"
SYNTHETIC_TEST_SEED_OFFSET = 1_000_003  # the held-out synthetic split uses seed + this
_CHUNK = 8192  # pixels per distance chunk: 8192 x 512 clusters x fp32 = 16 MB


# ----------------------------------------------------------------------------- CIFAR-10

def _as_images(images) -> torch.Tensor:
    images = torch.as_tensor(images)
    if images.dim() != 4 or images.size(-1) != 3 or images.dtype != torch.uint8:
        raise DataConfigError(f"expected uint8 images of shape (N, H, W, 3), got {images.dtype} "
                              f"{tuple(images.shape)}")
    return images


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
        raise DatasetNotFoundError(
            f"CIFAR-10 not found in {root}: {how}place the extracted '{CIFAR_FOLDER}' folder "
            f"(or {CIFAR_TARBALL}) in {root}, or use the built-in data with --dataset synthetic")
    return data


# ----------------------------------------------------------------------------- synthetic

# A few colour palettes (RGB). Each image picks one, so colours co-occur the way they do
# in photos (sky with sea, sand with sun), which gives the k-means codebook real clusters.
_PALETTES = np.array([
    [[135, 190, 235], [250, 250, 245], [30, 80, 160], [240, 200, 60]],    # sky
    [[40, 110, 50], [120, 170, 70], [90, 60, 30], [200, 220, 120]],       # forest
    [[250, 140, 50], [120, 40, 110], [220, 50, 60], [255, 220, 120]],     # sunset
    [[210, 180, 130], [160, 120, 80], [245, 230, 200], [90, 70, 50]],     # desert
    [[10, 20, 50], [60, 60, 120], [230, 230, 180], [20, 120, 140]],       # night / sea
    [[30, 30, 30], [128, 128, 128], [230, 230, 230], [200, 30, 30]],      # grey + red
], dtype=np.float32)


def synthetic_images(n: int, image_size: int = 32, seed: int = 0) -> torch.Tensor:
    """n deterministic CIFAR-shaped images, uint8 (n, image_size, image_size, 3).

    Each image: a smooth two-colour gradient in a random direction, from one of a few
    palettes, with (3 times in 4) a third-colour shape on top: stripes, a rectangle or a
    disk. Neighbouring pixels are strongly correlated, so a GPT's next-pixel loss falls
    fast, which is all a ZeRO run needs to show it is learning.
    """
    if n < 1 or image_size < 2:
        raise DataConfigError(f"synthetic_images needs n >= 1 and image_size >= 2, got n={n}, "
                              f"image_size={image_size}")
    rng = np.random.default_rng(seed)
    S = image_size
    c = (np.arange(S, dtype=np.float32) + 0.5) / S
    v, u = np.meshgrid(c, c, indexing="ij")  # v: row coordinate, u: column coordinate, in (0, 1)
    u, v = u[None], v[None]

    # Per-image parameters, drawn all at once (vectorised).
    pal = _PALETTES[rng.integers(0, len(_PALETTES), n)]               # (n, 4, 3)
    pal = pal + rng.uniform(-25, 25, size=(n, 1, 3)).astype(np.float32)  # per-image tint
    order = rng.permuted(np.tile(np.arange(4), (n, 1)), axis=1)        # which colour plays which role
    col = np.take_along_axis(pal, order[:, :, None], axis=1)           # (n, 4, 3)
    theta = rng.uniform(0, 2 * np.pi, n).astype(np.float32)[:, None, None]
    kind = rng.integers(0, 4, n)[:, None, None]                        # 0 plain, 1 stripes, 2 rect, 3 disk
    period = rng.uniform(0.15, 0.5, n).astype(np.float32)[:, None, None]
    vertical = rng.random(n)[:, None, None] < 0.5
    r0, r1 = np.sort(rng.uniform(0.05, 0.95, (2, n)).astype(np.float32), axis=0)
    q0, q1 = np.sort(rng.uniform(0.05, 0.95, (2, n)).astype(np.float32), axis=0)
    cx, cy = rng.uniform(0.2, 0.8, (2, n)).astype(np.float32)
    rad = rng.uniform(0.12, 0.35, n).astype(np.float32)[:, None, None]

    # Background: a linear gradient from colour 0 to colour 1 along direction theta.
    t = np.clip(0.5 + (u - 0.5) * np.cos(theta) + (v - 0.5) * np.sin(theta), 0, 1)[..., None]
    img = col[:, None, None, 0] * (1 - t) + col[:, None, None, 1] * t   # (n, S, S, 3)

    # Foreground shape in colour 2 (stripes alternate colour 2 and the background).
    stripes = (np.floor(np.where(vertical, u, v) / period) % 2) == 0
    rect = (u >= r0[:, None, None]) & (u <= r1[:, None, None]) & (v >= q0[:, None, None]) & (v <= q1[:, None, None])
    disk = (u - cx[:, None, None]) ** 2 + (v - cy[:, None, None]) ** 2 <= rad ** 2
    mask = ((kind == 1) & stripes) | ((kind == 2) & rect) | ((kind == 3) & disk)
    img = np.where(mask[..., None], col[:, None, None, 2], img)
    return torch.from_numpy(np.clip(np.rint(img), 0, 255).astype(np.uint8))


def resize_images(images, size: int) -> torch.Tensor:
    """Downsample (N, H, W, 3) uint8 images to (N, size, size, 3) by averaging HxW/size^2 areas."""
    images = _as_images(images)
    N, H, W, _ = images.shape
    if H != W or H % size != 0:
        raise DataConfigError(f"cannot area-resize {H}x{W} images to {size}x{size}: "
                              f"size must divide {H} (e.g. 8, 16 or 32 for CIFAR)")
    if size == H:
        return images
    f = H // size
    x = images.reshape(N, size, f, size, f, 3).float().mean(dim=(2, 4))
    return x.round().clamp(0, 255).to(torch.uint8)


# ----------------------------------------------------------------------------- k-means codebook

def _nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (squared distance) for each row of x (M, 3).

    Chunked, and summed one channel at a time, so 250k pixels x 512 clusters never
    materialises more than a (_CHUNK, ncluster) matrix (16 MB) per temporary.
    """
    out = torch.empty(x.size(0), dtype=torch.long)
    for i in range(0, x.size(0), _CHUNK):
        xc = x[i:i + _CHUNK]
        d = (xc[:, 0:1] - c[None, :, 0]) ** 2
        for ch in range(1, x.size(1)):
            d += (xc[:, ch:ch + 1] - c[None, :, ch]) ** 2
        out[i:i + _CHUNK] = d.argmin(1)
    return out


def sample_pixels(images, per_image: int = 5, generator: torch.Generator | None = None) -> torch.Tensor:
    """`per_image` distinct random pixels from every image, as float RGB rows (N*per_image, 3)."""
    images = _as_images(images)
    N, H, W, _ = images.shape
    flat = images.reshape(N, H * W, 3)
    picks = []
    for i in range(0, N, 4096):  # a random permutation prefix per image, chunked
        idx = torch.rand(min(4096, N - i), H * W, generator=generator).argsort(dim=1)[:, :per_image]
        picks.append(torch.gather(flat[i:i + 4096], 1, idx[..., None].expand(-1, -1, 3)))
    return torch.cat(picks).reshape(-1, 3).float()


def kmeans(x: torch.Tensor, ncluster: int, niter: int = 8, generator: torch.Generator | None = None,
           verbose: bool = False) -> torch.Tensor:
    """The tutorial's k-means: init at random points, then niter rounds of
    assign-to-nearest / move-to-mean, re-seeding empty ("dead") clusters at random points."""
    N = x.size(0)
    if N < ncluster:
        raise DataConfigError(f"k-means needs at least ncluster={ncluster} pixels, got {N}: "
                              f"use more images or a smaller ncluster")
    c = x[torch.randperm(N, generator=generator)[:ncluster]].clone()
    for i in range(niter):
        a = _nearest(x, c)
        counts = torch.bincount(a, minlength=ncluster).to(x.dtype)
        c = torch.zeros_like(c).index_add_(0, a, x) / counts[:, None]  # empty cluster -> 0/0 = nan
        dead = torch.isnan(c).any(dim=1)
        ndead = int(dead.sum())
        if verbose:
            print(f"k-means step {i + 1}/{niter}, re-initialized {ndead} dead clusters")
        c[dead] = x[torch.randperm(N, generator=generator)[:ndead]]
    return c


def _fingerprint(images: torch.Tensor, ncluster: int, niter: int, seed: int) -> str:
    """A hash of everything the codebook depends on: the image bytes themselves (hashing
    150 MB of CIFAR takes a fraction of a second, and anything cheaper could collide)."""
    h = hashlib.sha256()
    h.update(f"kmeans-v1|{tuple(images.shape)}|{ncluster}|{niter}|{seed}|".encode())
    h.update(images.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def _codebook_on_rank0(images, ncluster, niter, seed, cache_dir) -> torch.Tensor:
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"codebook-{_fingerprint(images, ncluster, niter, seed)}.pt")
        if os.path.isfile(path):
            try:
                c = torch.load(path, weights_only=True)
                if isinstance(c, torch.Tensor) and c.shape == (ncluster, 3):
                    print(f"codebook: loaded {ncluster} colours from {path}")
                    return c.float()
            except Exception:
                pass  # a corrupt cache file: recompute and overwrite it
    t0 = time.time()
    g = torch.Generator().manual_seed(seed)
    px = sample_pixels(images, per_image=5, generator=g)
    c = kmeans(px, ncluster, niter, generator=g)
    msg = f"codebook: computed k-means ({ncluster} clusters, {niter} iters, {px.size(0)} pixels) in {time.time() - t0:.1f}s"
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        os.close(fd)
        torch.save(c, tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        msg += f", cached to {path}"
    print(msg)
    return c


def compute_codebook(images, ncluster: int = 512, niter: int = 8, seed: int = 0,
                     cache_dir=None) -> torch.Tensor:
    """The (ncluster, 3) float colour codebook, identical on every rank.

    Collective when distributed: rank 0 loads it from `cache_dir` or computes it (and
    caches it there), then broadcasts it; the other ranks only allocate and receive. The
    other ranks' `images` are not read. cache_dir=None: no caching.
    """
    codebook = torch.empty(ncluster, 3)
    error = None
    if comm.get_rank() == 0:
        try:
            codebook = _codebook_on_rank0(_as_images(images), ncluster, niter, seed, cache_dir).float()
        except Exception as e:
            error = e
    # Share rank 0's failure first, so no rank waits in a broadcast that never comes.
    error_msg = comm.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if error_msg is not None:
        raise DataConfigError(f"rank 0 could not compute the codebook: {error_msg}")
    # On the rank's device for the collective (NCCL moves only GPU tensors), and back:
    # quantising and the dataset are CPU work.
    codebook = codebook.to(comm.get_device())
    return comm.broadcast(codebook, src=0, label="codebook").cpu()


# ----------------------------------------------------------------------------- tokens

def quantize(images, codebook: torch.Tensor) -> torch.Tensor:
    """uint8 images (N, H, W, 3) -> nearest-centroid indices (N, H*W), raster order.

    Photos reuse colours: CIFAR's 51M training pixels hold far fewer distinct RGB
    values, so we find the nearest centroid once per distinct colour and scatter back.
    """
    images = _as_images(images)
    N, H, W, _ = images.shape
    px = images.reshape(-1, 3).int()
    codes = (px[:, 0] << 16) | (px[:, 1] << 8) | px[:, 2]
    uniq, inverse = torch.unique(codes, return_inverse=True)
    colours = torch.stack([(uniq >> 16) & 255, (uniq >> 8) & 255, uniq & 255], dim=1).float()
    return _nearest(colours, codebook.float())[inverse].view(N, H * W)


class ImageTokens(Dataset):
    """Images as codebook-index sequences; item i = (x, y) = (a[:-1], a[1:]) of image i.

    All images are quantised once, here, and stored as int16 (50k CIFAR images at 32x32
    are 100 MB that way rather than 400 MB as int64), so __getitem__ is a slice.
    """

    def __init__(self, images, codebook: torch.Tensor):
        images = _as_images(images)
        if codebook.dim() != 2 or codebook.size(1) != 3:
            raise DataConfigError(f"codebook must be (ncluster, 3), got {tuple(codebook.shape)}")
        dtype = torch.int16 if codebook.size(0) <= 2 ** 15 else torch.int32
        self.tokens = quantize(images, codebook).to(dtype)
        self.image_size = images.size(1)
        self.vocab_size = codebook.size(0)
        self.block_size = self.tokens.size(1) - 1

    def __len__(self):
        return self.tokens.size(0)

    def __getitem__(self, i):
        a = self.tokens[i].long()
        return a[:-1], a[1:]


def decode(tokens, codebook: torch.Tensor, image_size: int) -> torch.Tensor:
    """Token sequences (B, image_size**2) -> uint8 images (B, image_size, image_size, 3)."""
    tokens = torch.as_tensor(tokens).long().cpu()
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.size(1) != image_size * image_size:
        raise DataConfigError(f"decode needs {image_size * image_size} tokens per image "
                              f"({image_size}x{image_size}), got {tokens.size(1)}")
    px = codebook.float().cpu()[tokens]
    return px.round().clamp(0, 255).to(torch.uint8).view(-1, image_size, image_size, 3)


# ----------------------------------------------------------------------------- datasets & loaders

DATASETS = ("cifar10", "synthetic")


def build_datasets(name: str, root="./data", image_size: int = 32, ncluster: int = 512, niter: int = 8,
                   seed: int = 0, n_synthetic_train: int = 10000, n_synthetic_test: int = 1000,
                   cache_dir=None, download: bool = True):
    """(train_ds, test_ds, codebook). Collective when distributed: call on every rank.

    The model must have vocab_size == ncluster and block_size == image_size**2 - 1.
    cache_dir=None caches the codebook under <root>/minizero_cache.
    """
    if name not in DATASETS:
        raise UnknownDatasetError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if image_size < 2 or 32 % image_size != 0:
        raise DataConfigError(f"image_size {image_size} must divide 32 (use 8, 16 or 32)")
    if name == "cifar10":
        train_images = load_cifar10(root, train=True, download=download)
        test_images = load_cifar10(root, train=False, download=download)
    else:
        # Generated at CIFAR's 32x32 and area-resized like CIFAR would be, so both
        # datasets go through the same pipeline.
        train_images = synthetic_images(n_synthetic_train, 32, seed=seed)
        test_images = synthetic_images(n_synthetic_test, 32, seed=seed + SYNTHETIC_TEST_SEED_OFFSET)
    train_images = resize_images(train_images, image_size)
    test_images = resize_images(test_images, image_size)

    if cache_dir is None:
        cache_dir = os.path.join(root, "minizero_cache")
    codebook = compute_codebook(train_images, ncluster, niter, seed=seed, cache_dir=cache_dir)
    return ImageTokens(train_images, codebook), ImageTokens(test_images, codebook), codebook


def make_loader(dataset, micro_batch: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                num_workers: int = 0) -> DataLoader:
    """A DataLoader that gives this rank its own slice of `dataset` (DistributedSampler).

    Call `loader.sampler.set_epoch(epoch)` each epoch, or every epoch sees the same order.
    """
    world, rank = comm.get_world_size(), comm.get_rank()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    # Pinned batches on a GPU: the copy to the device can then be asynchronous
    # (x.to(device, non_blocking=True)) and skips a staging copy.
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=drop_last,
                        num_workers=num_workers, pin_memory=comm.get_device().type == "cuda")
    if len(loader) == 0:
        raise DataConfigError(f"{len(dataset)} samples give no full micro-batch of {micro_batch} on each of "
                              f"{world} rank(s): lower the micro-batch size or use more data")
    return loader
