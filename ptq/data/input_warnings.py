"""Warnings about input that runs but is likely not what the user meant (the `ptq.data` logger: the command line
prints `ptq: warning: ...`, --quiet silences it):

- a normalization given in 0..1 units (torchvision's `mean=(0.485, 0.456, 0.406)`, `std=(0.229, 0.224, 0.225)`)
  where ptq reads images as 0..255 pixels: the inputs then span about -2..1136 instead of -2..2.6;
- a calibration on fewer than MIN_CALIBRATION_IMAGES readable images: ranges from a handful of images miss
  the tails of the activations the model meets later.
"""
from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger("ptq.data")

MIN_CALIBRATION_IMAGES = 16
PIXEL_MAX = 255.0


def unit_normalization(mean: Sequence[float], std: Sequence[float]) -> bool:
    """Whether (mean, std) look like 0..1 units: every mean in [0, 1] and every std below 1 (in pixel units
    such a std multiplies the pixel values, which no model expects)."""
    return all(0.0 <= m <= 1.0 for m in mean) and all(s < 1.0 for s in std)


def warn_unit_normalization(mean: Sequence[float], std: Sequence[float]) -> None:
    """The warning, with the span the inputs get and the values in pixel units."""
    if not unit_normalization(mean, std):
        return
    lo = min(-m / s for m, s in zip(mean, std))
    hi = max((PIXEL_MAX - m) / s for m, s in zip(mean, std))

    def flag(values) -> str:
        return ",".join(f"{PIXEL_MAX * v:.6g}" for v in values)

    log.warning(f"mean {','.join(f'{m:g}' for m in mean)} and std {','.join(f'{s:g}' for s in std)} look like 0..1 "
                f"units, but ptq reads pixels as 0..255: the inputs span {lo:.3g}..{hi:.4g}; in pixel units: "
                f"--mean {flag(mean)} --std {flag(std)}")


def warn_few_images(readable: int, candidates: int) -> None:
    """Calibrated on fewer than MIN_CALIBRATION_IMAGES readable images."""
    if readable >= MIN_CALIBRATION_IMAGES:
        return
    of = f" of {candidates}" if candidates != readable else ""
    log.warning(f"calibrated on {readable} readable image(s){of}: fewer than {MIN_CALIBRATION_IMAGES} give ranges "
                "that miss the values other inputs reach; calibrate on a few hundred representative images")
