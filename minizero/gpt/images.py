"""The image format the data pipeline passes between its stages, and the area resize.

Every stage (CIFAR-10, the synthetic set, the codebook, the token dataset) takes or gives
uint8 images (N, H, W, 3); `as_images` checks that in one place, and `DataConfigError`
lives here so that every data module can raise it without importing another.
"""
from __future__ import annotations

import torch


class DataConfigError(ValueError):
    """Inconsistent data settings (image size, batch size, codebook shape...)."""


def as_images(images) -> torch.Tensor:
    """`images` as a uint8 tensor (N, H, W, 3), or one clear error saying what it got."""
    images = torch.as_tensor(images)
    if images.dim() != 4 or images.size(-1) != 3 or images.dtype != torch.uint8:
        raise DataConfigError(f"expected uint8 images of shape (N, H, W, 3), got {images.dtype} "
                              f"{tuple(images.shape)}")
    return images


def resize_images(images, size: int) -> torch.Tensor:
    """Downsample (N, H, W, 3) uint8 images to (N, size, size, 3) by averaging HxW/size^2 areas."""
    images = as_images(images)
    N, H, W, _ = images.shape
    if H != W or H % size != 0:
        raise DataConfigError(f"cannot area-resize {H}x{W} images to {size}x{size}: "
                              f"size must divide {H} (e.g. 8, 16 or 32 for CIFAR)")
    if size == H:
        return images
    f = H // size
    x = images.reshape(N, size, f, size, f, 3).float().mean(dim=(2, 4))
    return x.round().clamp(0, 255).to(torch.uint8)
