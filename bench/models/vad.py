"""Build bench/models/vad.onnx: a Silero-style streaming voice-activity model exported by torch (opset 16), and
its samples.

Inputs: `input` float [1, 512] (one 32 ms chunk at 16 kHz), `state` float [2, 1, 128] (the LSTM's h and c from
the previous chunk: axis 0 is no batch), `sr` int64 scalar (16000 or 8000). An `If` on the sample rate picks the
feature front end (its subgraphs nested in the If node); an LSTM (one ONNX LSTM node) carries the state; output
`output` [1, 1] the speech probability and `stateN` [2, 1, 128] the state for the next chunk.

Task (synthetic): chunks of a stream are speech (harmonic tones with a moving pitch, varying loudness) or not
(noise of varying level); a stream switches between the two every few chunks. Trained briefly on 16 kHz streams
with the state carried over, so its decisions are confident.

Samples: streams run through the float model chunk by chunk; each step's (input, state, sr) is one .npz, the
state being what the previous step returned -- how a streaming model is calibrated with `--data`.

    /work/torchenv/bin/python bench/models/vad.py [OUT_DIR]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

CHUNK, HIDDEN, FRAME = 512, 128, 64


def make_stream(rng: np.random.Generator, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(audio [chunks, CHUNK], speech label per chunk)."""
    audio = np.zeros((chunks, CHUNK), np.float32)
    labels = np.zeros(chunks, np.float32)
    speech = bool(rng.integers(2))
    t = np.arange(CHUNK) / 16000.0
    for k in range(chunks):
        if rng.random() < 0.2:
            speech = not speech
        noise = rng.normal(0, rng.uniform(0.005, 0.05), CHUNK)
        if speech:
            pitch = rng.uniform(90, 250)
            voice = sum(rng.uniform(0.2, 1.0) / h * np.sin(2 * np.pi * pitch * h * t + rng.uniform(0, 6.3))
                        for h in range(1, 6))
            audio[k] = rng.uniform(0.05, 0.5) * voice + noise
        else:
            audio[k] = noise
        labels[k] = float(speech)
    return audio, labels


class VAD(nn.Module):
    def __init__(self):
        super().__init__()
        self.front16 = nn.Conv1d(1, 64, FRAME, stride=FRAME)
        self.front8 = nn.Conv1d(1, 64, FRAME // 2, stride=FRAME // 2)
        self.lstm = nn.LSTM(64, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor, sr: torch.Tensor):
        if bool(sr == 16000):
            feats = self.front16(x.unsqueeze(1))
        else:
            feats = self.front8(x[:, ::2].unsqueeze(1))
        feats = torch.relu(torch.log1p(feats.abs()) * 4.0).transpose(1, 2)
        out, (h, c) = self.lstm(feats, (state[:1], state[1:]))
        prob = torch.sigmoid(self.head(out[:, -1]))
        return prob, torch.cat([h, c], dim=0)


def train(model: VAD, steps: int = 150) -> float:
    rng = np.random.default_rng(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sr = torch.tensor(16000)
    for _ in range(steps):
        audio, labels = make_stream(rng, 12)
        state = torch.zeros(2, 1, HIDDEN)
        loss = torch.zeros(())
        for k in range(len(audio)):
            prob, state = model(torch.from_numpy(audio[k:k + 1]), state, sr)
            loss = loss + nn.functional.binary_cross_entropy(prob[0], torch.from_numpy(labels[k:k + 1]))
        optimizer.zero_grad()
        (loss / len(audio)).backward()
        optimizer.step()
    correct = total = 0
    with torch.no_grad():
        for seed in range(10):
            audio, labels = make_stream(np.random.default_rng(100 + seed), 20)
            state = torch.zeros(2, 1, HIDDEN)
            for k in range(len(audio)):
                prob, state = model(torch.from_numpy(audio[k:k + 1]), state, sr)
                correct += int((float(prob) > 0.5) == bool(labels[k]))
                total += 1
    return correct / total


def write_samples(model: VAD, folder: Path, seed: int, streams: int, chunks: int) -> None:
    """Each step of float streams as one .npz: input, the state the previous step returned, sr."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sr = torch.tensor(16000)
    index = 0
    with torch.no_grad():
        for _ in range(streams):
            audio, _ = make_stream(rng, chunks)
            state = torch.zeros(2, 1, HIDDEN)
            for k in range(chunks):
                np.savez(folder / f"{index:03d}.npz", input=audio[k:k + 1], state=state.numpy(),
                         sr=np.array(16000, np.int64))
                _, state = model(torch.from_numpy(audio[k:k + 1]), state, sr)
                index += 1


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = VAD()
    print(f"chunk accuracy after training: {train(model):.4f}")
    model.eval()
    scripted = torch.jit.script(model)
    path = out_dir / "vad.onnx"
    example = (torch.zeros(1, CHUNK), torch.zeros(2, 1, HIDDEN), torch.tensor(16000))
    torch.onnx.export(scripted, example, str(path), dynamo=False, opset_version=16,
                      input_names=["input", "state", "sr"], output_names=["output", "stateN"],
                      dynamic_axes={"input": {0: "batch", 1: "samples"}})
    write_samples(model, out_dir / "vad_data" / "calib", 3, 4, 16)
    write_samples(model, out_dir / "vad_data" / "eval", 4, 10, 20)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
