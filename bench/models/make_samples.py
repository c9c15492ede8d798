"""Write the calibration and eval inputs of the detector and OCR test models (numpy only, deterministic):

    python bench/models/make_samples.py [--out bench/models/data] [--calib 32] [--eval 256]

One `.npy` per sample (`ptq --data DIR`), [1, 3, H, W] float32 in [0, 1]:
    DIR/yolo/{calib,eval}/NNN.npy    160x160 rectangles (`synthetic.rectangles`)
    DIR/dbnet/{calib,eval}/NNN.npy   160x160 text pages (`synthetic.text_page`)
    DIR/crnn/{calib,eval}/NNN.npy    32x128 glyph lines (`synthetic.glyph_line`)
Calibration and eval samples come from different seeds (never the training seeds 0, 1, 2). The arrays are
generated, not committed (about 180 MB with 256 eval samples: enough to tell 95% from 92% on a per-sample
figure); `bench/detectors.py` writes them when they are missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synthetic import glyph_bank, glyph_line, rectangles, text_page  # noqa: E402

DEFAULT_OUT = HERE / "data"
GLYPHS = 64  # as crnn_recognizer.GLYPHS (that module needs torch)


def _generators():
    glyphs = glyph_bank(GLYPHS)
    return {
        "yolo": lambda rng: rectangles(rng, 160)[0],
        "dbnet": lambda rng: text_page(rng, 160)[0],
        "crnn": lambda rng: glyph_line(rng, glyphs, 32, 128)[0],
    }


def write_samples(out: Path = DEFAULT_OUT, calib: int = 32, evaluate: int = 256) -> dict[str, dict[str, Path]]:
    """{model: {"calib": folder, "eval": folder}}, written unless a folder already holds its count of files."""
    folders: dict[str, dict[str, Path]] = {}
    for k, (model, make) in enumerate(_generators().items()):
        folders[model] = {}
        for split, count, seed in (("calib", calib, 100 + k), ("eval", evaluate, 200 + k)):
            folder = out / model / split
            folders[model][split] = folder
            if folder.is_dir() and len(list(folder.glob("*.npy"))) == count:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(seed)
            for i in range(count):
                np.save(folder / f"{i:03d}.npy", make(rng)[None].astype(np.float32))
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--calib", type=int, default=32)
    parser.add_argument("--eval", type=int, default=256)
    args = parser.parse_args()
    for model, splits in write_samples(Path(args.out), args.calib, args.eval).items():
        print(model, ", ".join(f"{split}: {folder}" for split, folder in splits.items()))


if __name__ == "__main__":
    main()
