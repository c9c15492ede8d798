"""Build the recurrent taggers of issue 25 (an LSTM and a GRU, exported by torch, trained briefly).

Task (`recurrent_task.tagger_data`): per frame x_t ~ N(0, 1) in R^8; s_t = 0.8 s_{t-1} + x_t[:2] (a smoothed 2-D drift,
s_0 = 0); the label of frame t is the quadrant of s_t (4 classes). A frame's label depends on the frames before
it, so the tagger has to carry state. Each model: Linear(8, 24) -> tanh -> LSTM/GRU(24, 32) -> Linear(32, 4)
over [1, 48, 8] (batch first; torch writes the Transposes around the cell), trained for a few hundred steps of
Adam (about 95% frame accuracy). Run with the torch side environment:

    /work/torchenv/bin/python bench/models/build_recurrent.py

writes bench/models/lstm_frame_tagger.onnx and bench/models/gru_frame_tagger.onnx (opset 17).
"""
from __future__ import annotations

from pathlib import Path

import torch

from recurrent_task import CLASSES, FEATURES, STEPS, tagger_data

HERE = Path(__file__).parent


class Tagger(torch.nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        self.proj = torch.nn.Linear(FEATURES, 24)
        self.rnn = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(24, 32, batch_first=True)
        self.head = torch.nn.Linear(32, CLASSES)

    def forward(self, x):
        y, _ = self.rnn(torch.tanh(self.proj(x)))
        return self.head(y)


def train(cell: str, steps: int = 600) -> Tagger:
    torch.manual_seed(0)
    net = Tagger(cell)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for step in range(steps):
        x, y = tagger_data(1000 + step, 32)
        logits = net(torch.from_numpy(x[:, 0]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), torch.from_numpy(y).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = tagger_data(7, 256)
    with torch.no_grad():
        accuracy = (net(torch.from_numpy(x[:, 0])).argmax(-1).numpy() == y).mean()
    print(f"{cell}: frame accuracy {accuracy:.3f} after {steps} steps")
    return net.eval()


def main() -> None:
    for cell in ("lstm", "gru"):
        net = train(cell)
        torch.onnx.export(net, (torch.zeros(1, STEPS, FEATURES),), HERE / f"{cell}_frame_tagger.onnx", opset_version=17,
                          input_names=["x"], output_names=["logits"], dynamo=False)


if __name__ == "__main__":
    main()
