"""Build bench/models/mini_resnet.onnx: a small ResNet (He et al. 2016, BasicBlocks) for 32x32 RGB images, and its
samples, for the mixed 4/8-bit DSP lanes bench (`bench/int4_mix.py --model bench/models/mini_resnet.onnx --data`).

Network: Conv 3x3 (16) + BN + ReLU; three stages of two BasicBlocks (16, 32 stride 2, 64 stride 2; a 1x1
projection where the shape changes); global average pool; Linear (10). Trained briefly in torch (CPU) on a
synthetic 10-class task: each class is an oriented sinusoidal grating of its own frequency and colour,
randomly shifted in phase, plus a random blob and strong Gaussian noise, so the classes overlap and the
trained network is right on most samples but not saturated (held-out accuracy printed: 94 %). Exported in eval
mode (BatchNorm folded by the exporter's constant folding where it can), opset 17, batch 1.

    /work/torchenv/bin/python bench/models/mini_resnet.py [OUT_DIR]

writes `mini_resnet.onnx` and `mini_resnet_data/{calib,eval}/NNN.npy` (float32 [1, 3, 32, 32]: 24 calibration
samples, 16 evaluation samples, drawn apart).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

SIZE, CLASSES = 32, 10
CALIB, EVAL = 24, 16
STEPS, BATCH = 150, 64
NOISE = 1.5  # per-pixel noise over a grating of amplitude 0.5: the classes overlap, float accuracy ~90 %


def make_batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, CLASSES, n)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    angle = labels * np.pi / CLASSES
    freq = 2 + (labels % 4) * 1.5
    phase = rng.uniform(0, 2 * np.pi, n)
    grating = np.sin(2 * np.pi * freq[:, None, None] * (np.cos(angle)[:, None, None] * xx
                                                        + np.sin(angle)[:, None, None] * yy) + phase[:, None, None])
    colour = np.stack([np.cos(labels * 0.7), np.sin(labels * 1.3), np.cos(labels * 2.1 + 1)], 1)
    x = 0.5 * grating[:, None] * (0.6 + 0.4 * colour[:, :, None, None])
    cy, cx = rng.uniform(0.2, 0.8, (2, n))
    blob = np.exp(-((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2) / 0.02)
    x = x + rng.normal(0, 1, (n, 3, 1, 1)) * blob[:, None] + rng.normal(0, NOISE, x.shape)
    return x.astype(np.float32), labels


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class MiniResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    net = MiniResNet()
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    for step in range(STEPS):
        x, y = make_batch(rng, BATCH)
        loss = nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    net.eval()
    x, y = make_batch(np.random.default_rng(1), 512)
    with torch.no_grad():
        accuracy = (net(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    print(f"held-out accuracy {accuracy:.1%}")
    path = out / "mini_resnet.onnx"
    torch.onnx.export(net, torch.zeros(1, 3, SIZE, SIZE), str(path), input_names=["input"], output_names=["logits"],
                      opset_version=17, do_constant_folding=True, dynamo=False)
    for part, count, seed in (("calib", CALIB, 2), ("eval", EVAL, 3)):
        folder = out / "mini_resnet_data" / part
        folder.mkdir(parents=True, exist_ok=True)
        samples, _ = make_batch(np.random.default_rng(seed), count)
        for k, sample in enumerate(samples):
            np.save(folder / f"{k:03d}.npy", sample[None])
    print(f"wrote {path} and {out / 'mini_resnet_data'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
