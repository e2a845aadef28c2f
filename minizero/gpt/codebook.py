"""The colour codebook: k-means on sampled pixels, computed on rank 0 and broadcast.

Every rank must quantise with the very same colours (a rank with its own codebook would be
training on a different dataset), so rank 0 alone computes it (or loads it from a disk
cache keyed on the image bytes) and broadcasts it. `quantize` and `decode` map pixels to
codebook indices and back.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time

import torch

from minizero import comm
from minizero.gpt.images import DataConfigError, as_images

_CHUNK = 8192  # pixels per distance chunk: 8192 x 512 clusters x fp32 = 16 MB


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
    images = as_images(images)
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
            codebook = _codebook_on_rank0(as_images(images), ncluster, niter, seed, cache_dir).float()
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


def quantize(images, codebook: torch.Tensor) -> torch.Tensor:
    """uint8 images (N, H, W, 3) -> nearest-centroid indices (N, H*W), raster order.

    Photos reuse colours: CIFAR's 51M training pixels hold far fewer distinct RGB
    values, so we find the nearest centroid once per distinct colour and scatter back.
    """
    images = as_images(images)
    N, H, W, _ = images.shape
    px = images.reshape(-1, 3).int()
    codes = (px[:, 0] << 16) | (px[:, 1] << 8) | px[:, 2]
    uniq, inverse = torch.unique(codes, return_inverse=True)
    colours = torch.stack([(uniq >> 16) & 255, (uniq >> 8) & 255, uniq & 255], dim=1).float()
    return _nearest(colours, codebook.float())[inverse].view(N, H * W)


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
