"""The project's own CIFAR-shaped images, so that it runs with no download at all.

Deterministic given a seed; the held-out split is the same generator with another seed
(`SYNTHETIC_TEST_SEED_OFFSET`).
"""
from __future__ import annotations

import numpy as np
import torch

from minizero.gpt.images import DataConfigError

SYNTHETIC_TEST_SEED_OFFSET = 1_000_003  # the held-out synthetic split uses seed + this


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
