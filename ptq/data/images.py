"""Calibration images: discovery, decoding and preprocessing into model inputs.

Preprocessing of one image (all values in pixel units, 0..255):

    1. decode; apply the EXIF orientation; convert to 8-bit RGB (grayscale, RGBA, palette, CMYK, 16-bit);
    2. resize (bilinear, antialiased) so that the short side is `resize` (default: crop / crop_ratio, so
       a 224 crop with ratio 0.875 resizes the short side to 256), keeping the aspect ratio;
    3. center-crop to the model's input size;
    4. x = (pixel - mean[c]) / std[c], channel order RGB (or BGR with `bgr`), layout NCHW or NHWC.

Files are searched recursively; hidden files are ignored. Files whose extension is not an image extension,
and image files that cannot be decoded, are skipped with a warning (`logging`, logger "ptq.data.images") and
recorded in `ImageLog`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
from PIL import Image, ImageOps

from ptq.data.image_log import ImageLog
from ptq.core.option_defaults import LAYOUTS

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})
# torchvision's ImageNet normalization, in pixel units: the most common convention for ONNX vision models
DEFAULT_MEAN = (123.675, 116.28, 103.53)
DEFAULT_STD = (58.395, 57.12, 57.375)
DEFAULT_CROP_RATIO = 0.875


def _three(values, what: str) -> tuple[float, float, float]:
    """One value (for every channel) or three (R, G, B) -> a 3-tuple of floats."""
    if isinstance(values, str):
        parts = [p for p in values.replace(" ", "").split(",") if p]
        try:
            values = [float(p) for p in parts]
        except ValueError as exc:
            raise ValueError(f"{what} expects numbers like 127 or 123.7,116.3,103.5, got {values!r}") from exc
    elif isinstance(values, (int, float)):
        values = [values]
    values = [float(v) for v in values]
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise ValueError(f"{what} needs one value or three (R,G,B), got {len(values)}")
    if not all(np.isfinite(values)):
        raise ValueError(f"{what} must be finite, got {values}")
    return tuple(values)


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes a model input. `mean`/`std` are in pixel units and in RGB order (even with
    `bgr`, which only reorders the output channels). `layout=None` reads it from the model's input shape."""

    mean: tuple = DEFAULT_MEAN
    std: tuple = DEFAULT_STD
    resize: Optional[int] = None
    crop_ratio: float = DEFAULT_CROP_RATIO
    bgr: bool = False
    layout: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "mean", _three(self.mean, "mean"))
        object.__setattr__(self, "std", _three(self.std, "std"))
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.resize is not None and (int(self.resize) != self.resize or self.resize <= 0):
            raise ValueError(f"resize must be a positive integer (short side in pixels), got {self.resize}")
        if not 0 < float(self.crop_ratio) <= 1:
            raise ValueError(f"crop ratio must be in (0, 1], got {self.crop_ratio}")
        if self.layout is not None and str(self.layout).upper() not in LAYOUTS:
            raise ValueError(f"layout must be NCHW or NHWC, got {self.layout!r}")
        if self.layout is not None:
            object.__setattr__(self, "layout", str(self.layout).upper())

    @classmethod
    def from_config(cls, path: Union[str, Path], **overrides) -> "Preprocess":
        """A JSON file with the keys of the CLI flags (`mean`, `std`, `resize`, `crop_ratio`, `bgr`,
        `layout`); `overrides` that are not None win over the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"preprocessing config not found: {path}") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"preprocessing config {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"preprocessing config {path} must hold a JSON object")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"preprocessing config {path}: unknown keys {unknown} (known: {sorted(known)})")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def to_dict(self) -> dict:
        """JSON-ready (lists, not tuples), so that a saved and reloaded table compares equal."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self) for v in [getattr(self, f.name)]}


@dataclass(frozen=True)
class InputSpec:
    """Where images go: the model input's layout, channel count and spatial size."""

    layout: str
    channels: int
    height: int
    width: int

    @classmethod
    def from_shape(cls, shape: Sequence[Optional[int]], layout: Optional[str] = None) -> "InputSpec":
        """From a rank-4 input shape; the layout is guessed from where the 1 or 3 channels sit if not given."""
        if shape is None or len(shape) != 4:
            raise ValueError(f"the model's input has shape {shape}: --images needs an image input of rank 4 "
                             "(NCHW or NHWC)")
        if layout is None:
            if shape[1] in (1, 3):
                layout = "NCHW"
            elif shape[3] in (1, 3):
                layout = "NHWC"
            else:
                raise ValueError(f"cannot tell the layout of input shape {tuple(shape)}; give --layout")
        c, h, w = (shape[1], shape[2], shape[3]) if layout == "NCHW" else (shape[3], shape[1], shape[2])
        if c not in (1, 3):
            raise ValueError(f"input shape {tuple(shape)} as {layout} has {c} channels; images give 1 or 3")
        if not h or not w:
            raise ValueError(f"input shape {tuple(shape)} has dynamic spatial dimensions; give them to `ptq calibrate "
                             "--input-shape` (the quant table records them for the other commands)")
        return cls(layout, int(c), int(h), int(w))


def _noun(flag: str) -> str:
    return "image" if flag == "--images" else "sample"


def find_files(folder: Union[str, Path], flag: str = "--images") -> list[Path]:
    """Every non-hidden file under `folder` (recursively), sorted. `flag` names the option in errors."""
    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"{_noun(flag)} folder not found: {folder}")
    if not folder.is_dir():
        raise ValueError(f"{flag} expects a folder, {folder} is a file")
    return sorted(
        p for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _to_rgb_array(img: Image.Image) -> np.ndarray:
    """Any PIL image -> uint8 (H, W, 3) RGB. 16/32-bit integer images are scaled from 0..65535."""
    if img.mode.startswith("I"):  # I;16, I;16B, I (16-bit grayscale PNG/TIFF)
        gray = np.asarray(img).astype(np.float64) / 257.0
        gray = np.clip(np.rint(gray), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode == "F":
        gray = np.clip(np.rint(np.asarray(img, dtype=np.float64)), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # palette transparency must go through RGBA before dropping alpha
    return np.asarray(img.convert("RGB"))


def decode_image(path: Union[str, Path]) -> np.ndarray:
    """Decode an image file into uint8 RGB (H, W, 3), EXIF orientation applied. Raises ValueError."""
    try:
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img)
            img.load()
            return _to_rgb_array(img)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot decode image: {exc}") from exc


def _resize_and_crop(rgb: np.ndarray, pre: Preprocess, height: int, width: int) -> np.ndarray:
    h, w = rgb.shape[:2]
    if pre.resize is not None:
        factor = pre.resize / min(h, w)
    else:
        factor = max(height / (pre.crop_ratio * h), width / (pre.crop_ratio * w))
    factor = max(factor, height / h, width / w)  # the crop must fit
    new_w, new_h = max(width, round(w * factor)), max(height, round(h * factor))
    img = Image.fromarray(rgb)
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    left, top = (new_w - width) // 2, (new_h - height) // 2
    return np.asarray(img.crop((left, top, left + width, top + height)))


def preprocess_array(rgb: np.ndarray, pre: Preprocess, spec: InputSpec) -> np.ndarray:
    """uint8 RGB (H, W, 3) -> one float32 sample in the model's layout (no batch axis)."""
    x = _resize_and_crop(rgb, pre, spec.height, spec.width).astype(np.float32)
    mean, std = np.asarray(pre.mean, np.float32), np.asarray(pre.std, np.float32)
    if spec.channels == 1:
        # ITU-R 601 luma, as PIL's convert("L"), normalized with the first mean/std value
        gray = x @ np.asarray([0.299, 0.587, 0.114], np.float32)
        x = ((gray - mean[0]) / std[0])[:, :, None]
    else:
        x = (x - mean) / std
        if pre.bgr:
            x = x[:, :, ::-1]
    if spec.layout == "NCHW":
        x = x.transpose(2, 0, 1)
    return np.ascontiguousarray(x, dtype=np.float32)


def load_image(path: Union[str, Path], pre: Preprocess, spec: InputSpec) -> np.ndarray:
    return preprocess_array(decode_image(path), pre, spec)


def select_files(
    folder: Union[str, Path, Sequence[Union[str, Path]]],
    log_: ImageLog,
    *,
    num_images: Optional[int] = None,
    seed: int = 0,
    extensions: frozenset = IMAGE_EXTENSIONS,
    flag: str = "--images",
) -> list[Path]:
    """The candidate files of a folder (or an explicit list of files), other extensions than `extensions`
    skipped. `flag` names the option in errors (`--images`, or `--data` for sample files).

    With `num_images`, the candidates are shuffled with `seed` so that the first valid `num_images` files
    are a random sample; otherwise they stay in sorted order.
    """
    if num_images is not None and num_images <= 0:
        raise ValueError(f"--num-images must be positive, got {num_images}")
    if isinstance(folder, (str, Path)):
        files = find_files(folder, flag)
        if not files:
            raise ValueError(f"{_noun(flag)} folder {folder} is empty")
    else:
        files = [Path(f) for f in folder]
        if not files:
            raise ValueError(f"no {_noun(flag)} files given")
    kind = "an image" if extensions is IMAGE_EXTENSIONS else "a " + "/".join(sorted(extensions))
    candidates = []
    for path in files:
        if path.suffix.lower() in extensions:
            candidates.append(path)
        else:
            log_.skip(path, f"not {kind} file (extension {path.suffix or 'none'!r})")
    if num_images is not None:
        random.Random(seed).shuffle(candidates)
    return candidates


def iter_images(
    candidates: Sequence[Path],
    pre: Preprocess,
    spec: InputSpec,
    log_: ImageLog,
    *,
    num_images: Optional[int] = None,
) -> Iterator[np.ndarray]:
    """Decode and preprocess candidates in order, skipping unreadable ones, until `num_images` are used."""
    for path in candidates:
        if num_images is not None and len(log_.used) >= num_images:
            return
        try:
            sample = load_image(path, pre, spec)
        except ValueError as exc:
            log_.skip(path, str(exc))
            continue
        log_.used.append(path)
        yield sample


def iter_batches(samples: Iterator[np.ndarray], batch_size: int) -> Iterator[np.ndarray]:
    """Group samples into arrays of up to `batch_size` along a new axis 0."""
    if batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {batch_size}")
    batch = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            yield np.stack(batch)
            batch = []
    if batch:
        yield np.stack(batch)
