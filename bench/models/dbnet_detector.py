"""Build bench/models/dbnet_detector.onnx: a small DBNet-style text detector in the Paddle export style, opset 11,
trained briefly on synthetic pages.

    /work/torchenv/bin/python bench/models/dbnet_detector.py [--steps 400]

Input `x` [1, 3, 160, 160] in [0, 1]. A MobileNetV3-small backbone (inverted residuals with depthwise Convs,
hardswish, squeeze-excite; strides 4..32) as PP-OCR's detectors use, a DBFPN neck as PP-OCR's
(1x1 input convs, top-down sums with nearest Resize x2, 3x3 output convs, each level resized to 1/4 and the four
joined by a Concat), a DB head (Conv-BN-ReLU, two ConvTranspose x2 with BN-ReLU between, Sigmoid): the output
`maps` [1, 1, 160, 160] is the text probability map. After the export (BN folded into the Convs), every Conv's
bias moves into an `Add` of a [1, C, 1, 1] constant, as Paddle2ONNX writes them (`paddle_style`).

Training: BCE + dice loss against the pages' text maps; the map ends near 1 on words and near 0 on the paper.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from paddle_style import rewrite_export  # noqa: E402
from synthetic import text_page  # noqa: E402

SIZE = 160


def cbr(c_in: int, c_out: int, k: int = 3, s: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class SqueezeExcite(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand, k x k depthwise, optional squeeze-excite, 1x1 project, residual."""

    def __init__(self, c_in: int, k: int, expand: int, c_out: int, se: bool, hswish: bool, stride: int):
        super().__init__()
        act = nn.Hardswish if hswish else nn.ReLU
        self.block = nn.Sequential(
            nn.Conv2d(c_in, expand, 1, bias=False), nn.BatchNorm2d(expand), act(),
            nn.Conv2d(expand, expand, k, stride, k // 2, groups=expand, bias=False), nn.BatchNorm2d(expand), act(),
            SqueezeExcite(expand) if se else nn.Identity(),
            nn.Conv2d(expand, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


# MobileNetV3-small (PP-OCR's detectors use MobileNetV3 backbones): kernel, expansion, out, SE, hardswish, stride
BLOCKS = [(3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
          (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 120, 48, True, True, 1),
          (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2), (5, 576, 96, True, True, 1)]
TAPS = (0, 2, 6, 8)  # the blocks whose outputs feed the FPN (strides 4, 8, 16, 32)


class DBNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        blocks, c = [], 16
        for k, e, out, se, hs, s in BLOCKS:
            blocks.append(InvertedResidual(c, k, e, out, se, hs, s))
            c = out
        self.blocks = nn.ModuleList(blocks)
        self.ins = nn.ModuleList(nn.Conv2d(BLOCKS[t][2], 48, 1, bias=False) for t in TAPS)
        self.outs = nn.ModuleList(nn.Conv2d(48, 12, 3, 1, 1, bias=False) for _ in range(4))
        self.head = nn.Sequential(
            cbr(48, 12), nn.ConvTranspose2d(12, 12, 2, 2), nn.BatchNorm2d(12), nn.ReLU(),
            nn.ConvTranspose2d(12, 1, 2, 2))

    def features(self, x):
        taps = []
        x = self.stem(x)
        for k, block in enumerate(self.blocks):
            x = block(x)
            if k in TAPS:
                taps.append(x)
        return taps

    def forward(self, x):
        c2, c3, c4, c5 = self.features(x)
        in2, in3, in4, in5 = (conv(c) for conv, c in zip(self.ins, (c2, c3, c4, c5)))
        p4 = in4 + F.interpolate(in5, scale_factor=2.0, mode="nearest")
        p3 = in3 + F.interpolate(p4, scale_factor=2.0, mode="nearest")
        p2 = in2 + F.interpolate(p3, scale_factor=2.0, mode="nearest")
        levels = [conv(p) for conv, p in zip(self.outs, (p2, p3, p4, in5))]
        fuse = torch.cat([levels[0]] + [F.interpolate(p, scale_factor=float(2 ** k), mode="nearest")
                                        for k, p in enumerate(levels[1:], 1)], 1)
        return torch.sigmoid(self.head(fuse))


def train(model: nn.Module, steps: int, batch: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        pages = [text_page(rng, SIZE) for _ in range(batch)]
        x = torch.tensor(np.stack([p[0] for p in pages]))
        t = torch.tensor(np.stack([p[1] for p in pages]))[:, None]
        prob = model(x)
        bce = F.binary_cross_entropy(prob, t)
        dice = 1 - 2 * (prob * t).sum() / (prob.sum() + t.sum() + 1)
        loss = bce + dice
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: bce {bce.item():.3f} dice {dice.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=str(HERE / "dbnet_detector.onnx"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DBNet()
    train(model, args.steps, args.batch, seed=1)
    torch.onnx.export(model, torch.zeros(1, 3, SIZE, SIZE), args.out, input_names=["x"], output_names=["maps"],
                      opset_version=11, dynamo=False)
    moved = rewrite_export(args.out)
    print(f"wrote {args.out} ({moved} Conv biases moved into Adds)")


if __name__ == "__main__":
    main()
