"""Images -> token sequences, as in minGPT's play_image notebook: the datasets and loaders.

The pipeline (all of it CPU, all of it deterministic), one module per stage:

1. Images, uint8 (N, H, W, 3): CIFAR-10 via torchvision (cifar10.py), or
   `synthetic_images` (synthetic_images.py), a CIFAR-shaped set generated so the project
   runs with no download at all. `resize_images` (images.py) area-averages them down
   (8x8, 16x16) for fast CPU runs.
2. A colour codebook (codebook.py): k-means on 5 random pixels per training image, 512
   clusters, 8 iterations, dead clusters re-seeded from random pixels: the tutorial's
   recipe. It is computed once, on rank 0, cached on disk, and broadcast, so every rank
   quantises with the very same colours (a rank with its own codebook would be training
   on a different dataset).
3. `ImageTokens` (here): each pixel -> index of its nearest centroid, raster order, and the
   usual next-token shift x = a[:-1], y = a[1:]. Vocabulary = ncluster,
   block size = H*W - 1.
4. `make_loader` (here): a DataLoader over a DistributedSampler, so each rank reads its own slice.
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from minizero import comm
from minizero.gpt.cifar10 import load_cifar10
from minizero.gpt.codebook import compute_codebook, quantize
from minizero.gpt.images import DataConfigError, as_images, resize_images
from minizero.gpt.presets import DATASETS
from minizero.gpt.synthetic_images import SYNTHETIC_TEST_SEED_OFFSET, synthetic_images


class UnknownDatasetError(ValueError):
    """build_datasets() was given a dataset name it does not know."""


class ImageTokens(Dataset):
    """Images as codebook-index sequences; item i = (x, y) = (a[:-1], a[1:]) of image i.

    All images are quantised once, here, and stored as int16 (50k CIFAR images at 32x32
    are 100 MB that way rather than 400 MB as int64), so __getitem__ is a slice.
    """

    def __init__(self, images, codebook: torch.Tensor):
        images = as_images(images)
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
