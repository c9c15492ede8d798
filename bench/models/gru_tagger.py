"""Build bench/models/gru_tagger.onnx: a GRU sequence tagger exported by torch (opset 17, one ONNX GRU node),
and its samples.

Task (synthetic, needs memory): frames of 16 noisy features; now and then a marker frame lights one of 4 marker
channels; every frame is tagged with the last marker seen (0 before the first). Trained briefly (CPU), so the
per-frame decisions are confident. Output: per-frame logits [N, T, 4].

    /work/torchenv/bin/python bench/models/gru_tagger.py [OUT_DIR]

writes `gru_tagger.onnx` and `gru_tagger_data/{calib,eval}/NNN.npy` (float32 [1, 50, 16]).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gru_task import FEATURES, TAGS, make_batch  # numpy only: the bench draws more samples from it

HIDDEN = 48


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, TAGS)

    def forward(self, frames):
        hidden, _ = self.gru(frames)
        return self.head(hidden)


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Tagger()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(300):
        x, tags = make_batch(rng, 32)
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)).reshape(-1, TAGS), torch.from_numpy(tags).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    x, tags = make_batch(np.random.default_rng(1), 200)
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(x)).argmax(-1).numpy() == tags).mean())
    print(f"per-frame accuracy after training: {accuracy:.4f}")
    path = out_dir / "gru_tagger.onnx"
    torch.onnx.export(model, (torch.from_numpy(x[:1]),), str(path), dynamo=False, opset_version=17,
                      input_names=["frames"], output_names=["logits"],
                      dynamic_axes={"frames": {0: "batch", 1: "time"}, "logits": {0: "batch", 1: "time"}})
    for split, seed, count in (("calib", 3, 64), ("eval", 4, 200)):
        folder = out_dir / "gru_tagger_data" / split
        folder.mkdir(parents=True, exist_ok=True)
        x, _ = make_batch(np.random.default_rng(seed), count)
        for i in range(count):
            np.save(folder / f"{i:03d}.npy", x[i:i + 1])
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
