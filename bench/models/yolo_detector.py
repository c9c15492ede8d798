"""Build bench/models/yolo_detector.onnx: a small YOLOv8-style detector, trained briefly on synthetic rectangles.

    /work/torchenv/bin/python bench/models/yolo_detector.py [--steps 700]

Input `images` [1, 3, 160, 160] in [0, 1]. A CSP-style backbone (Conv-BN-SiLU, C2f blocks), a top-down neck,
an anchor-free head per stride (8, 16, 32) with a box branch (4 x 16 DFL bins) and a class branch (18 classes);
the export decodes as Ultralytics does: Softmax over the 16 bins of each box side, the 1x1 Conv with weights
0..15 (the expected distance), dist2bbox to (cx, cy, w, h) times the stride, and one output
`output0` [1, 4 + 18, 525] = Concat(boxes in pixels 0..160, sigmoid class scores 0..1) on axis 1.

Training (a few minutes on one core): the anchors inside a box near its center (the level chosen by box size)
are positives; BCE on the class scores, DFL cross-entropy on the box sides. The scores end confident (near 1 on
the rectangles, near 0 elsewhere), as a trained detector's are. torch is needed to build, not to use the model.
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

from synthetic import DETECTOR_CLASSES, rectangles  # noqa: E402

SIZE = 160
STRIDES = (8, 16, 32)
BINS = 16


class ConvBnAct(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, k: int = 3, s: int = 1):
        super().__init__(nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())


class Bottleneck(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a, self.b = ConvBnAct(c, c), ConvBnAct(c, c)

    def forward(self, x):
        return x + self.b(self.a(x))


class C2f(nn.Module):
    def __init__(self, c_in: int, c_out: int, n: int = 1):
        super().__init__()
        self.hidden = c_out // 2
        self.cv1 = ConvBnAct(c_in, 2 * self.hidden, 1)
        self.blocks = nn.ModuleList(Bottleneck(self.hidden) for _ in range(n))
        self.cv2 = ConvBnAct((2 + n) * self.hidden, c_out, 1)

    def forward(self, x):
        y = list(self.cv1(x).split(self.hidden, 1))
        for block in self.blocks:
            y.append(block(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Detector(nn.Module):
    def __init__(self, classes: int = DETECTOR_CLASSES):
        super().__init__()
        self.classes = classes
        self.stem = ConvBnAct(3, 16, 3, 2)
        self.s2 = nn.Sequential(ConvBnAct(16, 32, 3, 2), C2f(32, 32))
        self.s3 = nn.Sequential(ConvBnAct(32, 48, 3, 2), C2f(48, 48))
        self.s4 = nn.Sequential(ConvBnAct(48, 64, 3, 2), C2f(64, 64))
        self.s5 = nn.Sequential(ConvBnAct(64, 96, 3, 2), C2f(96, 96))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.n4 = C2f(96 + 64, 64)
        self.n3 = C2f(64 + 48, 48)
        widths = (48, 64, 96)
        self.box = nn.ModuleList(nn.Sequential(ConvBnAct(c, 32), ConvBnAct(32, 32), nn.Conv2d(32, 4 * BINS, 1))
                                 for c in widths)
        self.cls = nn.ModuleList(nn.Sequential(ConvBnAct(c, 32), ConvBnAct(32, 32), nn.Conv2d(32, classes, 1))
                                 for c in widths)
        for head in self.cls:  # the usual prior: scores start near 0.01
            nn.init.constant_(head[-1].bias, -4.6)
        self.dfl = nn.Conv2d(BINS, 1, 1, bias=False)
        self.dfl.weight.data[:] = torch.arange(BINS, dtype=torch.float32).view(1, BINS, 1, 1)
        self.dfl.requires_grad_(False)
        anchors, strides = make_anchors(SIZE)
        self.register_buffer("anchors", anchors)
        self.register_buffer("strides", strides)
        self.export = False

    def raw(self, x):
        """Box logits [N, 64, A] and class logits [N, C, A], the anchors of stride 8, 16, 32 in order."""
        p3_in = self.s3(self.s2(self.stem(x)))
        p4_in = self.s4(p3_in)
        p5 = self.s5(p4_in)
        p4 = self.n4(torch.cat([self.up(p5), p4_in], 1))
        p3 = self.n3(torch.cat([self.up(p4), p3_in], 1))
        n = x.shape[0]
        boxes = torch.cat([b(p).view(n, 4 * BINS, -1) for b, p in zip(self.box, (p3, p4, p5))], 2)
        scores = torch.cat([c(p).view(n, self.classes, -1) for c, p in zip(self.cls, (p3, p4, p5))], 2)
        return boxes, scores

    def forward(self, x):
        boxes, scores = self.raw(x)
        if not self.export:
            return boxes, scores
        n, _, a = boxes.shape
        dist = self.dfl(boxes.view(n, 4, BINS, a).transpose(2, 1).softmax(1)).view(n, 4, a)
        lt, rb = dist.chunk(2, 1)
        x1y1, x2y2 = self.anchors - lt, self.anchors + rb
        dbox = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides
        return torch.cat((dbox, scores.sigmoid()), 1)


def make_anchors(size: int):
    """Anchor centers [1, 2, A] in stride units and the strides [1, 1, A], stride 8 first (as the head)."""
    points, strides = [], []
    for s in STRIDES:
        n = size // s
        ys, xs = np.meshgrid(np.arange(n) + 0.5, np.arange(n) + 0.5, indexing="ij")
        points.append(np.stack([xs.ravel(), ys.ravel()]))
        strides.append(np.full(n * n, s))
    return (torch.tensor(np.concatenate(points, 1)[None], dtype=torch.float32),
            torch.tensor(np.concatenate(strides)[None, None], dtype=torch.float32))


def targets(batch_boxes, anchors: torch.Tensor, strides: torch.Tensor, classes: int):
    """Per anchor: one-hot class targets [N, C, A], positives [N, A], side distances in stride units [N, 4, A]."""
    centers = anchors[0] * strides[0]  # [2, A] pixels
    s = strides[0, 0]
    a = centers.shape[1]
    cls_t = torch.zeros(len(batch_boxes), classes, a)
    pos = torch.zeros(len(batch_boxes), a, dtype=torch.bool)
    dist_t = torch.zeros(len(batch_boxes), 4, a)
    for i, boxes in enumerate(batch_boxes):
        for c, x1, y1, x2, y2 in sorted(boxes, key=lambda b: -(b[3] - b[1]) * (b[4] - b[2])):  # small boxes win
            side = max(x2 - x1, y2 - y1)
            level = 8 if side < 40 else (16 if side < 80 else 32)
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            inside = ((centers[0] > x1) & (centers[0] < x2) & (centers[1] > y1) & (centers[1] < y2) & (s == level)
                      & ((centers[0] - cx).abs() < 2.5 * level) & ((centers[1] - cy).abs() < 2.5 * level))
            if not inside.any():
                inside = (s == level) & (((centers[0] - cx) ** 2 + (centers[1] - cy) ** 2)
                                         == ((centers[0] - cx) ** 2 + (centers[1] - cy) ** 2)[s == level].min())
            pos[i, inside] = True
            cls_t[i, :, inside] = 0.0
            cls_t[i, c, inside] = 1.0
            ltrb = torch.stack([centers[0] - x1, centers[1] - y1, x2 - centers[0], y2 - centers[1]]) / s
            dist_t[i][:, inside] = ltrb[:, inside].clamp(0, BINS - 1.01)
    return cls_t, pos, dist_t


def train(model: Detector, steps: int, batch: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    start = time.time()
    for step in range(steps):
        samples = [rectangles(rng, SIZE) for _ in range(batch)]
        x = torch.tensor(np.stack([s[0] for s in samples]))
        cls_t, pos, dist_t = targets([s[1] for s in samples], model.anchors, model.strides, model.classes)
        box_logits, cls_logits = model.raw(x)
        npos = max(int(pos.sum()), 1)
        cls_loss = F.binary_cross_entropy_with_logits(cls_logits, cls_t, reduction="sum") / npos
        logits = box_logits.view(batch, 4, BINS, -1).permute(0, 3, 1, 2)[pos]  # [P, 4, 16]
        t = dist_t.permute(0, 2, 1)[pos]  # [P, 4]
        left = t.floor().long()
        w_left = left + 1 - t
        logp = logits.log_softmax(-1)
        dfl = -(logp.gather(-1, left[..., None])[..., 0] * w_left
                + logp.gather(-1, (left + 1)[..., None])[..., 0] * (1 - w_left)).mean()
        loss = cls_loss + dfl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: cls {cls_loss.item():.3f} dfl {dfl.item():.3f} ({time.time() - start:.0f} s)",
                  flush=True)
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=str(HERE / "yolo_detector.onnx"))
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Detector()
    train(model, args.steps, args.batch, seed=0)
    model.export = True
    torch.onnx.export(model, torch.zeros(1, 3, SIZE, SIZE), args.out, input_names=["images"],
                      output_names=["output0"], opset_version=17, dynamo=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
