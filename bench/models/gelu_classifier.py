"""Build bench/models/gelu_classifier.onnx: a byte-token classifier in the jax2tf/tf2onnx style (opset 15), and
its samples.

The graph is written with onnx.helper as tf2onnx writes a converted JAX/Flax model: int32 token ids, an
embedding Gather, LayerNorms written out (ReduceMean -> Sub -> Mul(d, d) -> ReduceMean -> Add eps -> Sqrt ->
Reciprocal -> Mul, and the ReduceMean/Sub/Pow/Sqrt/Div form), tanh-GELU written out
`x * (0.5 * (1 + tanh(0.7978845608 * (x + 0.044715 * x^3))))` with the cube as Pow(x, 3) in the token MLP and
as x * x * x in the head, an RMSNorm (x * Reciprocal(Sqrt(mean(x^2) + eps)) * gamma) before the head. Two
channels of the first LayerNorm carry a large fixed gain (120), the outlier features real transformers have,
so the first GELU's input reaches +-100 and its cube +-1e6.

Weights: trained briefly in torch (CPU) on a synthetic 10-class task (each class draws 30% of its 64 bytes from
its own 24-byte alphabet), so the classifier is confident; the trained weights are then written into the
onnx.helper graph, checked against torch.

    /work/torchenv/bin/python bench/models/gelu_classifier.py [OUT_DIR]

writes `gelu_classifier.onnx` and `gelu_classifier_data/{calib,eval}/NNN.npy` (int32 [1, 64]).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator  # torchenv has no onnxruntime
from torch import nn

SEQ, DIM, HIDDEN, CLASSES, ALPHABET = 64, 32, 128, 10, 24
OWN_FRACTION = 0.3  # the share of a sample's bytes drawn from its class alphabet: a task float gets ~95% right
OUTLIERS, OUTLIER_GAIN = (3, 17), 120.0


def make_batch(rng: np.random.Generator, n: int, alphabets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, CLASSES, n)
    tokens = rng.integers(0, 256, (n, SEQ))
    own = rng.random((n, SEQ)) < OWN_FRACTION
    picks = alphabets[labels][np.arange(n)[:, None], rng.integers(0, ALPHABET, (n, SEQ))]
    return np.where(own, picks, tokens).astype(np.int32), labels


def tanh_gelu(x):
    return x * (0.5 * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3))))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.norm1 = nn.LayerNorm(DIM)
        gain = torch.ones(DIM)
        gain[list(OUTLIERS)] = OUTLIER_GAIN
        self.register_buffer("outlier_gain", gain)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.rms_gamma = nn.Parameter(torch.ones(DIM))
        self.head1, self.head2 = nn.Linear(DIM, DIM), nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens.long()) + self.position
        h = self.norm1(x) * self.outlier_gain
        x = x + self.down(tanh_gelu(self.up(h)))
        x = self.norm2(x).mean(dim=1)
        x = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * self.rms_gamma
        return self.head2(tanh_gelu(self.head1(x)))


def train(model: Classifier, alphabets: np.ndarray, steps: int = 700) -> float:
    rng = np.random.default_rng(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        tokens, labels = make_batch(rng, 64, alphabets)
        loss = nn.functional.cross_entropy(model(torch.from_numpy(tokens)), torch.from_numpy(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tokens, labels = make_batch(np.random.default_rng(1), 500, alphabets)
    with torch.no_grad():
        return float((model(torch.from_numpy(tokens)).argmax(-1).numpy() == labels).mean())


def _layer_norm_reciprocal(x: str, p: str, gamma: str, beta: str) -> list:
    """tf2onnx's LayerNorm: the variance from Mul(d, d), 1/sqrt by Reciprocal."""
    return [helper.make_node("ReduceMean", [x], [f"{p}/mean"], axes=[-1], keepdims=1),
            helper.make_node("Sub", [x, f"{p}/mean"], [f"{p}/d"]),
            helper.make_node("Mul", [f"{p}/d", f"{p}/d"], [f"{p}/sq"]),
            helper.make_node("ReduceMean", [f"{p}/sq"], [f"{p}/var"], axes=[-1], keepdims=1),
            helper.make_node("Add", [f"{p}/var", "eps"], [f"{p}/var_eps"]),
            helper.make_node("Sqrt", [f"{p}/var_eps"], [f"{p}/std"]),
            helper.make_node("Reciprocal", [f"{p}/std"], [f"{p}/inv"]),
            helper.make_node("Mul", [f"{p}/d", f"{p}/inv"], [f"{p}/n"]),
            helper.make_node("Mul", [f"{p}/n", gamma], [f"{p}/scaled"]),
            helper.make_node("Add", [f"{p}/scaled", beta], [f"{p}/out"])]


def _layer_norm_div(x: str, p: str, gamma: str, beta: str) -> list:
    """The ReduceMean/Sub/Pow/Sqrt/Div form."""
    return [helper.make_node("ReduceMean", [x], [f"{p}/mean"], axes=[-1], keepdims=1),
            helper.make_node("Sub", [x, f"{p}/mean"], [f"{p}/d"]),
            helper.make_node("Pow", [f"{p}/d", "two"], [f"{p}/sq"]),
            helper.make_node("ReduceMean", [f"{p}/sq"], [f"{p}/var"], axes=[-1], keepdims=1),
            helper.make_node("Add", [f"{p}/var", "eps"], [f"{p}/var_eps"]),
            helper.make_node("Sqrt", [f"{p}/var_eps"], [f"{p}/std"]),
            helper.make_node("Div", [f"{p}/d", f"{p}/std"], [f"{p}/n"]),
            helper.make_node("Mul", [f"{p}/n", gamma], [f"{p}/scaled"]),
            helper.make_node("Add", [f"{p}/scaled", beta], [f"{p}/out"])]


def _gelu(x: str, p: str, cube: str) -> list:
    """jax.nn.gelu(approximate=True) as tf2onnx writes it; the cube as Pow(x, 3) or x * x * x."""
    if cube == "pow":
        nodes = [helper.make_node("Pow", [x, "three"], [f"{p}/cube"])]
    else:
        nodes = [helper.make_node("Mul", [x, x], [f"{p}/square"]),
                 helper.make_node("Mul", [f"{p}/square", x], [f"{p}/cube"])]
    return nodes + [helper.make_node("Mul", [f"{p}/cube", "c0044715"], [f"{p}/cubic"]),
                    helper.make_node("Add", [x, f"{p}/cubic"], [f"{p}/inner"]),
                    helper.make_node("Mul", [f"{p}/inner", "sqrt_2_over_pi"], [f"{p}/arg"]),
                    helper.make_node("Tanh", [f"{p}/arg"], [f"{p}/tanh"]),
                    helper.make_node("Add", [f"{p}/tanh", "one"], [f"{p}/one_plus"]),
                    helper.make_node("Mul", [f"{p}/one_plus", "half"], [f"{p}/cdf"]),
                    helper.make_node("Mul", [x, f"{p}/cdf"], [f"{p}/out"])]


def to_onnx(model: Classifier) -> onnx.ModelProto:
    w = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    consts = {"eps": np.float32(1e-5), "eps_rms": np.float32(1e-6), "two": np.float32(2.0), "three": np.float32(3.0),
              "c0044715": np.float32(0.044715), "sqrt_2_over_pi": np.float32(0.7978845608), "one": np.float32(1.0),
              "half": np.float32(0.5), "embed": w["embed.weight"], "position": w["position"],
              "g1": w["norm1.weight"] * w["outlier_gain"], "b1": w["norm1.bias"] * w["outlier_gain"],
              "W_up": w["up.weight"].T.copy(), "b_up": w["up.bias"], "W_down": w["down.weight"].T.copy(),
              "b_down": w["down.bias"], "g2": w["norm2.weight"], "b2": w["norm2.bias"], "g_rms": w["rms_gamma"],
              "W_h1": w["head1.weight"].T.copy(), "b_h1": w["head1.bias"], "W_h2": w["head2.weight"].T.copy(),
              "b_h2": w["head2.bias"]}
    nodes = [helper.make_node("Gather", ["embed", "tokens"], ["emb"], axis=0),
             helper.make_node("Add", ["emb", "position"], ["x0"])]
    nodes += _layer_norm_reciprocal("x0", "ln1", "g1", "b1")
    nodes += [helper.make_node("MatMul", ["ln1/out", "W_up"], ["up/mm"]),
              helper.make_node("Add", ["up/mm", "b_up"], ["up/out"])]
    nodes += _gelu("up/out", "gelu1", "pow")
    nodes += [helper.make_node("MatMul", ["gelu1/out", "W_down"], ["down/mm"]),
              helper.make_node("Add", ["down/mm", "b_down"], ["down/out"]),
              helper.make_node("Add", ["x0", "down/out"], ["x1"])]
    nodes += _layer_norm_div("x1", "ln2", "g2", "b2")
    nodes += [helper.make_node("ReduceMean", ["ln2/out"], ["pooled"], axes=[1], keepdims=0),
              helper.make_node("Mul", ["pooled", "pooled"], ["rms/sq"]),
              helper.make_node("ReduceMean", ["rms/sq"], ["rms/ms"], axes=[-1], keepdims=1),
              helper.make_node("Add", ["rms/ms", "eps_rms"], ["rms/ms_eps"]),
              helper.make_node("Sqrt", ["rms/ms_eps"], ["rms/rms"]),
              helper.make_node("Reciprocal", ["rms/rms"], ["rms/inv"]),
              helper.make_node("Mul", ["pooled", "rms/inv"], ["rms/n"]),
              helper.make_node("Mul", ["rms/n", "g_rms"], ["rms/out"]),
              helper.make_node("MatMul", ["rms/out", "W_h1"], ["h1/mm"]),
              helper.make_node("Add", ["h1/mm", "b_h1"], ["h1/out"])]
    nodes += _gelu("h1/out", "gelu2", "mul")
    nodes += [helper.make_node("MatMul", ["gelu2/out", "W_h2"], ["h2/mm"]),
              helper.make_node("Add", ["h2/mm", "b_h2"], ["logits"])]
    for k, node in enumerate(nodes):
        node.name = f"{node.op_type}_{k}"
    graph = helper.make_graph(nodes, "tf2onnx",
                              [helper.make_tensor_value_info("tokens", TensorProto.INT32, ["unk__0", SEQ])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["unk__0", CLASSES])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items()])
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8,
                                    producer_name="tf2onnx")
    onnx.checker.check_model(model_proto)
    return model_proto


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    alphabets = np.random.default_rng(7).integers(0, 256, (CLASSES, ALPHABET))
    model = Classifier()
    print(f"accuracy after training: {train(model, alphabets):.4f}")
    model.eval()
    proto = to_onnx(model)
    tokens, _ = make_batch(np.random.default_rng(9), 16, alphabets)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).numpy()
    got = ReferenceEvaluator(proto).run(None, {"tokens": tokens})[0]
    assert np.allclose(got, want, atol=1e-3), np.abs(got - want).max()
    probs = np.exp(got - got.max(-1, keepdims=True))
    print(f"mean top-1 probability: {(probs.max(-1) / probs.sum(-1)).mean():.3f}")
    path = out_dir / "gelu_classifier.onnx"
    onnx.save(proto, path)
    for split, seed, count in (("calib", 3, 64), ("eval", 4, 200)):
        folder = out_dir / "gelu_classifier_data" / split
        folder.mkdir(parents=True, exist_ok=True)
        tokens, _ = make_batch(np.random.default_rng(seed), count, alphabets)
        for i in range(count):
            np.save(folder / f"{i:03d}.npy", tokens[i:i + 1])
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
