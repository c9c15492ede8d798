"""Issue 10's "done means" for transformers: a BERT-style encoder block built with onnx.helper -- embeddings
plus positions, LayerNorms in the decomposed ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add form,
multi-head attention with Softmax, a GELU MLP (x * 0.5 * (1 + erf(x / sqrt 2))), residual Adds -- calibrated
on random data, runs with zero float nodes and agrees with onnxruntime's float run (cosine >= 0.99), with
and without a -1e4 padding mask on the attention scores, from embeddings or from int64 token ids through an
embedding Gather."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.engine.executor import NodeKind, prepare
from ptq.calibration.pipeline import calibrate
from test_transformer_rewrites import decomposed_layer_norm

T, D, H, FF, VOCAB = 8, 32, 4, 64, 50
DH = D // H


def encoder_block(rng, padding_mask: bool = False, token_ids: bool = False) -> onnx.ModelProto:
    """One BERT-style block; with `padding_mask`, the last two tokens are masked out of the attention
    (an additive -1e4 on their keys, broadcast over heads and queries); with `token_ids`, the input is int64
    token ids looked up in a constant embedding table (Gather)."""
    init: dict[str, np.ndarray] = {
        "pos": rng.normal(0, 0.3, (T, D)), "two": np.float32(2.0), "eps": np.float32(1e-5),
        "sqrt_dh": np.float32(np.sqrt(DH)), "sqrt2": np.float32(np.sqrt(2.0)), "one": np.float32(1.0),
        "half": np.float32(0.5),
        "heads_shape": np.array([0, T, H, DH], np.int64), "merge_shape": np.array([0, T, D], np.int64),
    }
    for name, shape, std in (("Wq", (D, D), 0.25), ("Wk", (D, D), 0.25), ("Wv", (D, D), 0.2), ("Wo", (D, D), 0.2),
                             ("W1", (D, FF), 0.2), ("W2", (FF, D), 0.15)):
        init[name] = rng.normal(0, std, shape)
        init[f"b{name[1:]}"] = rng.normal(0, 0.05, shape[1])
    for ln in ("ln0", "ln1", "ln2"):
        init[f"{ln}_gamma"] = rng.uniform(0.7, 1.3, D)
        init[f"{ln}_beta"] = rng.normal(0, 0.1, D)

    def linear(x, w, out):
        return [helper.make_node("MatMul", [x, f"W{w}"], [f"{out}_mm"], name=f"{out}_mm"),
                helper.make_node("Add", [f"{out}_mm", f"b{w}"], [out], name=out)]

    def heads(x, out, perm):
        return [helper.make_node("Reshape", [x, "heads_shape"], [f"{out}_r"], name=f"{out}_r"),
                helper.make_node("Transpose", [f"{out}_r"], [out], perm=perm, name=out)]

    nodes = [helper.make_node("Add", ["embeddings", "pos"], ["x0"], name="add_pos")]
    if token_ids:
        init["table"] = rng.normal(0, 1, (VOCAB, D))
        nodes.insert(0, helper.make_node("Gather", ["table", "ids"], ["embeddings"], axis=0, name="embed"))
    nodes += decomposed_layer_norm("x0", "x1", "ln0", "ln0_gamma", "ln0_beta")
    nodes += linear("x1", "q", "q") + linear("x1", "k", "k") + linear("x1", "v", "v")
    nodes += heads("q", "qh", [0, 2, 1, 3]) + heads("k", "kt", [0, 2, 3, 1]) + heads("v", "vh", [0, 2, 1, 3])
    nodes += [
        helper.make_node("MatMul", ["qh", "kt"], ["scores"], name="scores"),
        helper.make_node("Div", ["scores", "sqrt_dh"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["masked" if padding_mask else "scaled"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["probs", "vh"], ["ctx"], name="ctx"),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3], name="ctx_t"),
        helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["ctx_m"], name="ctx_m"),
    ]
    if padding_mask:
        init["mask"] = np.where(np.arange(T) >= T - 2, -1e4, 0.0).reshape(1, 1, 1, T)
        nodes.insert([n.name for n in nodes].index("softmax"),
                     helper.make_node("Add", ["scaled", "mask"], ["masked"], name="mask"))
    nodes += linear("ctx_m", "o", "attn")
    nodes += [helper.make_node("Add", ["x1", "attn"], ["res1"], name="res1")]
    nodes += decomposed_layer_norm("res1", "x2", "ln1", "ln1_gamma", "ln1_beta")
    nodes += linear("x2", "1", "ff1")
    nodes += [
        helper.make_node("Div", ["ff1", "sqrt2"], ["g_s"], name="gelu_div"),
        helper.make_node("Erf", ["g_s"], ["g_e"], name="gelu_erf"),
        helper.make_node("Add", ["g_e", "one"], ["g_a"], name="gelu_add"),
        helper.make_node("Mul", ["ff1", "g_a"], ["g_m"], name="gelu_mul"),
        helper.make_node("Mul", ["g_m", "half"], ["gelu"], name="gelu"),
    ]
    nodes += linear("gelu", "2", "ff2")
    nodes += [helper.make_node("Add", ["x2", "ff2"], ["res2"], name="res2")]
    nodes += decomposed_layer_norm("res2", "out", "ln2", "ln2_gamma", "ln2_beta")
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", T]) if token_ids else
         helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["N", T, D])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", T, D])],
        [numpy_helper.from_array(v if v.dtype == np.int64 else np.asarray(v, np.float32), k) for k, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("padding_mask", [False, True])
def test_encoder_block_runs_in_integers_and_matches_float(padding_mask):
    rng = np.random.default_rng(0)
    model = encoder_block(rng, padding_mask)
    calib = rng.normal(0, 1, (32, T, D)).astype(np.float32)
    result = calibrate(model, calib, write_qdq=False)
    graph = prepare(result.graph, result.table)

    assert graph.float_nodes == []
    assert all(step.kind is NodeKind.INTEGER for step in graph.steps)
    ops = sorted({step.node.op_type for step in graph.steps})
    softmax = "AddSoftmax" if padding_mask else "Softmax"
    assert ops == sorted(["Add", "Gelu", "LayerNormalization", "MatMul", "Reshape", "ScaledMatMul", softmax,
                          "Transpose"])
    assert [p.op_type for p in graph.rewrites.patterns] == (["Gelu"] + ["LayerNormalization"] * 3 + ["ScaledMatMul"]
                                                            + ["AddSoftmax"] * padding_mask)
    produced = {out for step in graph.steps for out in step.node.outputs}
    assert {"x1", "x2", "out", "gelu", "scaled"} <= produced  # the patterns' outputs keep their names

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    held_out = rng.normal(0, 1, (8, T, D)).astype(np.float32)
    for sample in held_out:
        want = sess.run(None, {"embeddings": sample[None]})[0].ravel().astype(np.float64)
        got = graph.run({"embeddings": sample[None]}).outputs["out"].ravel().astype(np.float64)
        cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
        assert cosine >= 0.99


def test_encoder_block_from_token_ids_through_an_embedding_gather():
    """Token ids (int64) in: the embedding Gather runs in integers on the quantized table, the ids stay exact
    index tensors, and the block agrees with float."""
    rng = np.random.default_rng(1)
    model = encoder_block(rng, token_ids=True)
    calib = rng.integers(0, VOCAB, (32, T)).astype(np.int64)
    result = calibrate(model, calib, write_qdq=False)
    assert "ids" not in result.table.tensors  # an index input: never calibrated
    graph = prepare(result.graph, result.table)
    assert graph.float_nodes == []
    assert [s.kind for s in graph.steps if s.node.op_type == "Gather"] == [NodeKind.INTEGER]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for sample in rng.integers(0, VOCAB, (8, T)).astype(np.int64):
        want = sess.run(None, {"ids": sample[None]})[0].ravel().astype(np.float64)
        got = graph.run({"ids": sample[None]}).outputs["out"].ravel().astype(np.float64)
        assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) >= 0.99
