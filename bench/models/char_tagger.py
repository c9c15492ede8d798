"""Build bench/models/char_tagger.onnx: an ALBERT-style character tagger exported by torch (opset 17), and its
samples (padded batches with an attention_mask).

The encoder shares one layer's weights across its layers (ALBERT), computes its attention mask as HF BERT does,
`(1 - attention_mask) * finfo(float32).min` added to the scores before Softmax, and returns the tags as an
int64 ArgMax `[N, T]`. Task (synthetic, needs context): per character, 0 = space/punctuation, 1 = first
letter of a word, 2 = other letter of a word, 3 = first digit of a number, 4 = other digit. Trained for a few
hundred steps on padded batches of random lengths, so it is confident.

Run with torch (CPU): `/work/torchenv/bin/python bench/models/char_tagger.py [OUT_DIR]`; writes
`char_tagger.onnx` and `char_tagger_data/{calib,eval}/NNN.npz` (input_ids, attention_mask; int64 [1, 32]).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

SEQ = 32
VOCAB = 40  # 0 = pad, 1 = space, 2..27 letters, 28..37 digits, 38 '.', 39 ','
HIDDEN, HEADS, LAYERS, TAGS = 64, 4, 3, 5


def make_batch(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, mask, tags) int64 [n, SEQ]; each row a random length in 6..SEQ, padded with 0 (mask 0, tag 0)."""
    ids = np.zeros((n, SEQ), np.int64)
    tags = np.zeros((n, SEQ), np.int64)
    mask = np.zeros((n, SEQ), np.int64)
    for row in range(n):
        length = int(rng.integers(6, SEQ + 1))
        pos = 0
        while pos < length:
            kind = rng.random()
            word = int(rng.integers(1, 7))
            end = min(pos + word, length)
            if kind < 0.7:  # a word
                ids[row, pos:end] = rng.integers(2, 28, end - pos)
                tags[row, pos:end] = 2
                tags[row, pos] = 1
            elif kind < 0.9:  # a number
                ids[row, pos:end] = rng.integers(28, 38, end - pos)
                tags[row, pos:end] = 4
                tags[row, pos] = 3
            else:  # punctuation
                word = 1
                ids[row, pos] = int(rng.integers(38, 40))
            pos += word
            if pos < length:
                ids[row, pos] = 1  # space
                pos += 1
        ids[row, length:] = 0
        tags[row, length:] = 0
        mask[row, :length] = 1
    return ids, mask, tags


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def heads(self, x):
        n, t, _ = x.shape
        return x.view(n, t, HEADS, HIDDEN // HEADS).permute(0, 2, 1, 3)

    def forward(self, x, extended_mask):
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HIDDEN // HEADS)
        scores = scores + extended_mask
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(x.shape)
        return self.out(context)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.ffn = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x, extended_mask):
        x = self.norm1(x + self.attention(x, extended_mask))
        return self.norm2(x + self.ffn(x))


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.chars = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.layer = Layer()  # shared by every layer (ALBERT)
        self.classifier = nn.Linear(HIDDEN, TAGS)

    def logits(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        x = self.norm(self.chars(input_ids) + self.positions(positions))
        extended = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        for _ in range(LAYERS):
            x = self.layer(x, extended)
        return self.classifier(x)

    def forward(self, input_ids, attention_mask):
        return torch.argmax(self.logits(input_ids, attention_mask), dim=-1)


def train(model: Tagger, steps: int = 600) -> float:
    rng = np.random.default_rng(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    for step in range(steps):
        ids, mask, tags = (torch.from_numpy(a) for a in make_batch(rng, 64))
        logits = model.logits(ids, mask)
        loss = (loss_fn(logits.reshape(-1, TAGS), tags.reshape(-1)) * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ids, mask, tags = (torch.from_numpy(a) for a in make_batch(np.random.default_rng(1), 256))
    with torch.no_grad():
        pred = model(ids, mask)
    real = mask.bool()
    return float((pred[real] == tags[real]).float().mean())


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Tagger()
    accuracy = train(model)
    model.eval()
    print(f"tag accuracy on real positions after training: {accuracy:.4f}")
    ids, mask, _ = make_batch(np.random.default_rng(2), 2)
    path = out_dir / "char_tagger.onnx"
    torch.onnx.export(model, (torch.from_numpy(ids), torch.from_numpy(mask)), str(path), dynamo=False,
                      opset_version=17, input_names=["input_ids", "attention_mask"], output_names=["tags"],
                      dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                    "attention_mask": {0: "batch", 1: "sequence"}, "tags": {0: "batch", 1: "sequence"}})
    data = out_dir / "char_tagger_data"
    for split, seed, count in (("calib", 3, 64), ("eval", 4, 200)):
        folder = data / split
        folder.mkdir(parents=True, exist_ok=True)
        ids, mask, tags = make_batch(np.random.default_rng(seed), count)
        for i in range(count):
            np.savez(folder / f"{i:03d}.npz", input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1])
    print(f"wrote {path} and {data}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
