"""Synthetic images for the detector and OCR test models (numpy only, deterministic from a seed).

- `rectangles`: colored rectangles of 18 classes (6 colors x 3 aspect ratios) on a noisy background, with their
  boxes: what the YOLO-style detector (`bench/models/yolo_detector.py`) learns to find;
- `text_page`: dark "words" (rows of small strokes) on a light page, with the map of text pixels: what the
  DBNet-style text detector (`bench/models/dbnet_detector.py`) learns to segment;
- `glyph_line`: a line of glyphs (fixed random bit patterns) with the class sequence: what the CRNN-style
  recognizer (`bench/models/crnn_recognizer.py`) learns to read with CTC.

Images are float32 in [0, 1], channels first. `bench/models/make_samples.py` writes the calibration and eval
arrays the benches and tests read.
"""
from __future__ import annotations

import numpy as np

COLORS = np.array([[0.9, 0.1, 0.1], [0.1, 0.8, 0.1], [0.15, 0.2, 0.95], [0.95, 0.9, 0.1], [0.1, 0.9, 0.9],
                   [0.9, 0.15, 0.9]], dtype=np.float32)
ASPECTS = (1.0, 2.2, 1 / 2.2)  # width / height: square, wide, tall
DETECTOR_CLASSES = len(COLORS) * len(ASPECTS)  # 18


def rectangles(rng: np.random.Generator, size: int = 160, max_objects: int = 3):
    """One image (3, size, size) and its boxes [(class, x1, y1, x2, y2)] in pixels; class = color * 3 + aspect."""
    image = rng.uniform(0.3, 0.6, (3, 1, 1)).astype(np.float32) + rng.normal(0, 0.05, (3, size, size)).astype(np.float32)
    boxes = []
    for _ in range(rng.integers(1, max_objects + 1)):
        color, aspect = int(rng.integers(len(COLORS))), int(rng.integers(len(ASPECTS)))
        area = rng.uniform(16, 72) ** 2
        w = int(np.clip(np.sqrt(area * ASPECTS[aspect]), 8, size - 2))
        h = int(np.clip(np.sqrt(area / ASPECTS[aspect]), 8, size - 2))
        x1, y1 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
        shade = COLORS[color] * rng.uniform(0.85, 1.1) + rng.normal(0, 0.03, 3)
        image[:, y1:y1 + h, x1:x1 + w] = shade[:, None, None].astype(np.float32)
        boxes.append((color * len(ASPECTS) + aspect, float(x1), float(y1), float(x1 + w), float(y1 + h)))
    image += rng.normal(0, 0.02, image.shape).astype(np.float32)
    return np.clip(image, 0, 1), boxes


def text_page(rng: np.random.Generator, size: int = 160):
    """One page (3, size, size) and its text map (size, size) in {0, 1}: the word boxes' shrunk interiors."""
    paper = rng.uniform(0.75, 0.95)
    image = np.full((3, size, size), paper, np.float32) + rng.normal(0, 0.03, (3, size, size)).astype(np.float32)
    target = np.zeros((size, size), np.float32)
    y = int(rng.integers(4, 16))
    while y < size - 14:
        h = int(rng.integers(7, 14))
        x = int(rng.integers(2, 20))
        while x < size - 20:
            w = int(rng.integers(14, 50))
            w = min(w, size - 2 - x)
            ink = rng.uniform(0.0, 0.3, 3)[:, None, None]
            strokes = rng.random((1, h, w)) < 0.55  # letters as broken strokes
            strokes[:, :, ::max(2, int(rng.integers(2, 5)))] = False
            region = image[:, y:y + h, x:x + w]
            image[:, y:y + h, x:x + w] = np.where(strokes, ink, region)
            target[y + 1:y + h - 1, x + 1:x + w - 1] = 1.0
            x += w + int(rng.integers(6, 18))
        y += h + int(rng.integers(6, 20))
    return np.clip(image, 0, 1), target


def glyph_bank(count: int, seed: int = 7, height: int = 20, width: int = 10) -> np.ndarray:
    """`count` fixed glyphs: random bit patterns (height, width), each with at least a third of its bits set."""
    rng = np.random.default_rng(seed)
    return (rng.random((count, height, width)) < 0.45).astype(np.float32)


def glyph_line(rng: np.random.Generator, glyphs: np.ndarray, height: int = 32, width: int = 128, max_len: int = 8):
    """One text line (3, height, width), its glyph indices (into `glyphs`) left to right, and each glyph's
    columns [x0, x1)."""
    gh, gw = glyphs.shape[1:]
    n = int(rng.integers(3, max_len + 1))
    labels = rng.integers(0, len(glyphs), n)
    image = np.full((3, height, width), rng.uniform(0.7, 0.95), np.float32)
    x = int(rng.integers(1, 6))
    y = (height - gh) // 2
    ink = rng.uniform(0.0, 0.25, 3)[:, None, None].astype(np.float32)
    kept, spans = [], []
    for label in labels:
        if x + gw >= width:
            break
        dy = int(rng.integers(-2, 3))
        mask = glyphs[label] > 0
        image[:, y + dy:y + dy + gh, x:x + gw] = np.where(mask, ink, image[:, y + dy:y + dy + gh, x:x + gw])
        kept.append(int(label))
        spans.append((x, x + gw))
        x += gw + int(rng.integers(3, 7))
    image += rng.normal(0, 0.03, image.shape).astype(np.float32)
    return np.clip(image, 0, 1), kept, spans
