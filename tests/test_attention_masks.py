"""Attention masks (issue 25, scope 1): an additive mask computed from an `attention_mask` input as HF BERT does,
`(1 - Cast(mask)) * finfo(float32).min` (or -1e9, -1e4), added to the scores (scores first) before Softmax.
The Add and the Softmax fuse into AddSoftmax whatever the operand order; the masked positions get exactly zero
probability in integers; the integer output agrees with float; the QDQ model keeps the meaning."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import load_model
from ptq.engine.executor import NodeKind, prepare
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.calibration.pipeline import calibrate
from ptq.qdq.export import export_qdq
from ptq.engine.rewrites import apply_rewrites

T, D = 6, 8
FINFO_MIN = float(np.finfo(np.float32).min)


def masked_attention(mask_value: float, scores_first: bool = True, where: bool = False) -> onnx.ModelProto:
    """x [N, T, D], attention_mask int64 [N, T] -> single-head attention with the additive mask -> y [N, T, D].
    The mask is (1 - Cast(mask)) * mask_value, or with `where` Where(Cast(mask, bool), 0, mask_value)."""
    rng = np.random.default_rng(0)
    init = {"Wq": rng.normal(0, 0.6, (D, D)), "Wk": rng.normal(0, 0.6, (D, D)), "Wv": rng.normal(0, 0.5, (D, D)),
            "root": np.sqrt(D), "one": 1.0, "big": mask_value, "zero": 0.0}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "Wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "Wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["raw"], name="scores"),
             helper.make_node("Div", ["raw", "root"], ["scaled"], name="scale"),
             *([helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL, name="cast"),
                helper.make_node("Where", ["keep", "zero", "big"], ["additive"], name="additive")] if where else
               [helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="cast"),
                helper.make_node("Sub", ["one", "maskf"], ["inverted"], name="invert"),
                helper.make_node("Mul", ["inverted", "big"], ["additive"], name="additive")]),
             helper.make_node("Unsqueeze", ["additive", "axis1"], ["extended"], name="extend"),
             helper.make_node("Add", ["scaled", "extended"] if scores_first else ["extended", "scaled"], ["masked"],
                              name="mask"),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["probs", "v"], ["y"], name="context")]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", T, D]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", T, D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def padded_batch(rng, n: int) -> dict:
    x = rng.normal(0, 1, (n, T, D)).astype(np.float32)
    lengths = rng.integers(2, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    return {"x": x, "attention_mask": mask}


def _ort(model: onnx.ModelProto, feeds: dict, name: str = "y") -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run([name], feeds)[0]


@pytest.mark.parametrize("scores_first", [True, False])
def test_the_mask_operand_is_found_in_either_order(scores_first):
    """Before the fix, scores + mask (scores first) made the mask the 'scores' operand and nothing fused."""
    graph = load_model(masked_attention(FINFO_MIN, scores_first))
    rewritten, log = apply_rewrites(graph, NodeFloatEvaluator(graph.opset))
    fused = [n for n in rewritten.nodes if n.op_type == "AddSoftmax"]
    assert len(fused) == 1 and fused[0].inputs == ["scaled", "extended"]
    assert ["masked"] in [f.removed_tensors for f in log.patterns]


def calibrated(model: onnx.ModelProto, folder, batch: dict):
    """Calibrate from `--data` samples (one .npz per row of `batch`), with extrema ranges: the checks compare
    the masked tensors' ranges with the real positions' exact min and max (the default `auto` may clip them)."""
    folder.mkdir()
    for i in range(len(batch["x"])):
        np.savez(folder / f"{i:02d}.npz", **{name: value[i:i + 1] for name, value in batch.items()})
    return calibrate(model, data=folder, write_qdq=False, calibrator="extrema")


@pytest.mark.parametrize("mask_value, where", [(FINFO_MIN, False), (-1e9, False), (-1e4, False),
                                               (-np.inf, True), (FINFO_MIN, True)])
def test_a_computed_mask_gives_exact_zeros_and_the_float_output(mask_value, where, tmp_path):
    model = masked_attention(mask_value, where=where)
    calib = padded_batch(np.random.default_rng(1), 32)
    table = calibrated(model, tmp_path / "calib", calib).table
    # the mask never sets a range: the pure mask gets [-1e4, 0]; the masked scores the real scores' range
    assert (table.tensors["additive"].min[0], table.tensors["additive"].max[0]) == (-1e4, 0.0)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info("scaled", TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    scaled = np.concatenate([session.run(["scaled"], {k: v[i:i + 1] for k, v in calib.items()})[0]
                             for i in range(32)])
    real = np.broadcast_to(calib["attention_mask"][:, None, :] == 1, scaled.shape)
    masked = table.tensors["masked"]
    assert (masked.min[0], masked.max[0]) == pytest.approx((scaled[real].min(), scaled[real].max()), abs=1e-5)
    prepared = prepare(load_model(model), table)
    assert not prepared.float_nodes  # the finfo.min Mul saturates in integers (before: a float fallback)
    assert all(step.kind is NodeKind.INTEGER for step in prepared.steps if step.node.inputs != ["attention_mask"])
    assert "AddSoftmax" in [step.node.op_type for step in prepared.steps]
    feeds = padded_batch(np.random.default_rng(2), 8)
    run = prepared.run(feeds)
    masked = np.broadcast_to(feeds["attention_mask"][:, None, :] == 0, run.tensors["probs"].shape)
    assert masked.any() and np.all(run.tensors["probs"][masked] == 0)  # exactly zero probability
    want = _ort(model, feeds)
    got = run.outputs["y"]
    assert np.sum(got * want) / np.linalg.norm(got) / np.linalg.norm(want) > 0.995


def test_the_qdq_model_keeps_the_mask_meaning(tmp_path):
    """The masked scores (an AddSoftmax's internal tensor, range -3.4e38..) get no Q/DQ pair: onnxruntime adds the
    mask in float as the integer op does; before, every score fell on one code of a 1.3e36-wide grid."""
    model = masked_attention(FINFO_MIN)
    table = calibrated(model, tmp_path / "calib", padded_batch(np.random.default_rng(1), 32)).table
    qdq = export_qdq(load_model(model), table)
    assert "masked" not in {n.input[0] for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    feeds = padded_batch(np.random.default_rng(2), 8)
    got, want = _ort(qdq, feeds), _ort(model, feeds)
    assert np.sum(got * want) / np.linalg.norm(got) / np.linalg.norm(want) > 0.995
