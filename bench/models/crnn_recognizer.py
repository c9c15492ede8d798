"""Build bench/models/crnn_recognizer.onnx: a small CRNN-style text recognizer with a CTC head over 6,625 classes
(PP-OCR's Chinese dictionary size), opset 11, trained briefly on synthetic glyph lines.

    /work/torchenv/bin/python bench/models/crnn_recognizer.py [--steps 600]

Input `x` [1, 3, 32, 128] in [0, 1]. A Conv-BN-ReLU stack with max pooling down to height 1 (32 time steps),
Squeeze and Transpose to a sequence [1, 32, 128], two Linear layers (the second over 6,625 classes) and a Softmax
over the classes (`softmax_out` [1, 32, 6625], opset-11 `Softmax(axis=2)`), as a Paddle CTC head exports. Class 0
is the CTC blank; the 64 glyphs of `synthetic.glyph_bank` are classes spread over 1..6624. The Conv biases move
into `Add`s as Paddle2ONNX writes them (`paddle_style`).

Training: on random lines of 3..8 glyphs, a cross-entropy per time step against the frame labels the generator
knows (the glyph under the step's center column, else the blank), which converges in minutes where CTC alone
sits on its all-blank plateau; the peaks end confident (the top class near 1 at most steps), as a trained CTC
recognizer's are, and the greedy CTC decode reads the lines.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from paddle_style import rewrite_export  # noqa: E402
from synthetic import glyph_bank, glyph_line  # noqa: E402

CLASSES = 6625
GLYPHS = 64
HEIGHT, WIDTH = 32, 128


def glyph_classes() -> np.ndarray:
    """The class id of each glyph: 64 ids spread over 1..CLASSES-1 (0 is the blank)."""
    return np.linspace(1, CLASSES - 1, GLYPHS).round().astype(np.int64)


def cbr(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class Recognizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            cbr(3, 32), nn.MaxPool2d(2), cbr(32, 64), nn.MaxPool2d(2), cbr(64, 96), nn.MaxPool2d((2, 1)),
            cbr(96, 128), nn.MaxPool2d((2, 1)), nn.Conv2d(128, 128, (2, 1)), nn.ReLU())
        self.neck = nn.Sequential(nn.Linear(128, 128), nn.ReLU())
        self.fc = nn.Linear(128, CLASSES)

    def logits(self, x):
        seq = self.features(x).squeeze(2).transpose(1, 2)  # [N, T, 128]
        return self.fc(self.neck(seq))

    def forward(self, x):
        return self.logits(x).softmax(2)


def train(model: Recognizer, steps: int, batch: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    glyphs, ids = glyph_bank(GLYPHS), glyph_classes()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        lines = [glyph_line(rng, glyphs, HEIGHT, WIDTH) for _ in range(batch)]
        x = torch.tensor(np.stack([line[0] for line in lines]))
        logits = model.logits(x)  # [N, T, C]
        frames = torch.tensor(np.stack([frame_labels(line[1], line[2], ids, logits.shape[1]) for line in lines]))
        loss = nn.functional.cross_entropy(logits.reshape(-1, CLASSES), frames.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: frame cross-entropy {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()


def frame_labels(labels: list[int], spans: list[tuple[int, int]], ids: np.ndarray, steps: int) -> np.ndarray:
    """The class of each time step: the glyph whose columns hold the step's center column, else 0 (blank)."""
    centers = (np.arange(steps) + 0.5) * WIDTH / steps
    frames = np.zeros(steps, np.int64)
    for label, (x0, x1) in zip(labels, spans):
        frames[(centers >= x0) & (centers < x1)] = ids[label]
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=str(HERE / "crnn_recognizer.onnx"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Recognizer()
    train(model, args.steps, args.batch, seed=2)
    torch.onnx.export(model, torch.zeros(1, 3, HEIGHT, WIDTH), args.out, input_names=["x"],
                      output_names=["softmax_out"], opset_version=11, dynamo=False)
    moved = rewrite_export(args.out)
    print(f"wrote {args.out} ({moved} Conv biases moved into Adds)")


if __name__ == "__main__":
    main()
