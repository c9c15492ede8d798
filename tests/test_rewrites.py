"""Graph rewrites: static (shape / weight) folding, BatchNormalization folding, activation fusion."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.engine.float_fallback import NodeFloatEvaluator, node_proto
from ptq.core.graph import Graph, load_model
from ptq.engine.rewrites import (apply_rewrites, copy_graph, drop_zero_states, fold_batchnorm, fold_static,
                                 fuse_activations)

OPSET = 18
IR_VERSION = 9  # onnxruntime 1.x reads IR <= 13; onnx 1.23 would write 14


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def _to_model(graph: Graph) -> onnx.ModelProto:
    """The rewritten IR back as an ONNX model (no fused activations allowed), to run it in onnxruntime."""
    used = {i for n in graph.nodes for i in n.inputs if i}
    graph_proto = helper.make_graph(
        [node_proto(n) for n in graph.nodes],
        "rewritten",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, graph.tensors[n].shape) for n in graph.inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, graph.tensors[n].shape) for n in graph.outputs],
        [numpy_helper.from_array(v, k) for k, v in graph.initializers.items() if k in used],
    )
    return helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _conv_bn_model(rng, with_bias: bool, extra_consumer: bool = False) -> onnx.ModelProto:
    cout, cin = 4, 3
    init = {
        "W": rng.normal(size=(cout, cin, 3, 3)).astype(np.float32),
        "gamma": rng.uniform(0.5, 2.0, cout).astype(np.float32),
        "beta": rng.normal(size=cout).astype(np.float32),
        "mean": rng.normal(size=cout).astype(np.float32),
        "var": rng.uniform(0.1, 3.0, cout).astype(np.float32),
    }
    conv_inputs = ["x", "W"]
    if with_bias:
        init["B"] = rng.normal(size=cout).astype(np.float32)
        conv_inputs.append("B")
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn", epsilon=1e-3),
    ]
    outputs = [("y", [1, cout, 6, 6])]
    if extra_consumer:
        nodes.append(helper.make_node("Neg", ["c"], ["z"], name="neg"))
        outputs.append(("z", [1, cout, 6, 6]))
    return _model(nodes, [("x", [1, cin, 6, 6])], outputs, init)


@pytest.mark.parametrize("with_bias", [True, False])
def test_batchnorm_folded_into_conv_is_numerically_equal(with_bias):
    rng = np.random.default_rng(0)
    model = _conv_bn_model(rng, with_bias)
    graph = load_model(model)
    before = [n.op_type for n in graph.nodes]
    rewritten, log = apply_rewrites(graph, NodeFloatEvaluator(OPSET))
    assert [n.op_type for n in rewritten.nodes] == ["Conv"]
    assert rewritten.nodes[0].outputs == ["y"]
    assert [n.op_type for n in graph.nodes] == before, "the caller's graph must not change"
    assert len(log.batchnorm_folds) == 1 and log.batchnorm_folds[0].original_weight == "W"
    fold = log.batchnorm_folds[0]
    # the seed-003 formula, in float64 by hand
    init = graph.initializers
    k = init["gamma"].astype(np.float64) / np.sqrt(init["var"].astype(np.float64) + 1e-3)
    b = init["B"].astype(np.float64) if with_bias else 0.0
    np.testing.assert_allclose(rewritten.initializers[fold.weight], init["W"] * k[:, None, None, None], rtol=1e-6)
    np.testing.assert_allclose(rewritten.initializers[fold.bias], (b - init["mean"]) * k + init["beta"], rtol=1e-5, atol=1e-6)
    x = rng.normal(size=(1, 3, 6, 6)).astype(np.float32)
    (want,) = _ort(model, {"x": x})
    (got,) = _ort(_to_model(rewritten), {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_batchnorm_not_folded_when_conv_output_has_another_consumer():
    graph = load_model(_conv_bn_model(np.random.default_rng(1), True, extra_consumer=True))
    g = copy_graph(graph)
    assert fold_batchnorm(g) == []
    assert [n.op_type for n in g.nodes] == ["Conv", "BatchNormalization", "Neg"]


def test_batchnorm_not_folded_into_protected_conv():
    graph = load_model(_conv_bn_model(np.random.default_rng(2), True))
    g = copy_graph(graph)
    assert fold_batchnorm(g, protected=frozenset({"conv"})) == []


def _conv_act_model(act_nodes, init_extra=None, second_consumer=False):
    rng = np.random.default_rng(3)
    init = {"W": rng.normal(size=(2, 2, 1, 1)).astype(np.float32), **(init_extra or {})}
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv")] + act_nodes
    outputs = [("y", [1, 2, 3, 3])] + ([("c", [1, 2, 3, 3])] if second_consumer else [])
    return _model(nodes, [("x", [1, 2, 3, 3])], outputs, init)


@pytest.mark.parametrize(
    "act, extra, attrs",
    [
        (helper.make_node("Relu", ["c"], ["y"], name="act"), {}, {"activation": "Relu"}),
        (
            helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="act"),
            {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)},
            {"activation": "Clip", "activation_params": [0.0, 6.0]},
        ),
        (
            helper.make_node("LeakyRelu", ["c"], ["y"], name="act", alpha=0.25),
            {},
            {"activation": "LeakyRelu", "activation_params": [0.25]},
        ),
    ],
)
def test_activation_fused_into_conv(act, extra, attrs):
    graph = copy_graph(load_model(_conv_act_model([act], extra)))
    fusions = fuse_activations(graph)
    assert [n.op_type for n in graph.nodes] == ["Conv"]
    conv = graph.nodes[0]
    assert conv.outputs == ["y"]
    assert {k: conv.attrs[k] for k in attrs} == attrs
    assert "activation_params" in conv.attrs or attrs["activation"] == "Relu"
    assert fusions[0].removed_tensor == "c" and "c" not in graph.activations


def test_clip_with_omitted_min_uses_float32_lowest():
    act = helper.make_node("Clip", ["c", "", "hi"], ["y"], name="act")
    graph = copy_graph(load_model(_conv_act_model([act], {"hi": np.array(6.0, np.float32)})))
    fuse_activations(graph)
    assert graph.nodes[0].attrs["activation_params"] == [float(np.finfo(np.float32).min), 6.0]


def test_activation_not_fused_when_conv_output_is_also_a_graph_output():
    act = helper.make_node("Relu", ["c"], ["y"], name="act")
    graph = copy_graph(load_model(_conv_act_model([act], second_consumer=True)))
    assert fuse_activations(graph) == []
    assert [n.op_type for n in graph.nodes] == ["Conv", "Relu"]


def test_activation_not_fused_into_refused_or_protected_host():
    act = helper.make_node("Relu", ["c"], ["y"], name="act")
    graph = copy_graph(load_model(_conv_act_model([act])))
    assert fuse_activations(graph, can_host=lambda node: False) == []
    assert fuse_activations(graph, protected=frozenset({"act"})) == []
    assert len(graph.nodes) == 2


def test_shape_subgraph_is_folded_to_a_constant():
    # y = Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [-1])) : shape depends only on x's static shape
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "i0"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"], name="unsq"),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
    ]
    init = {"i0": np.array(0, np.int64), "ax0": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    graph = copy_graph(load_model(_model(nodes, [("x", [2, 3, 4])], [("y", [2, 12])], init)))
    folded = fold_static(graph, NodeFloatEvaluator(OPSET))
    assert folded == ["shape", "gather", "unsq", "concat"]
    assert [n.op_type for n in graph.nodes] == ["Reshape"]
    np.testing.assert_array_equal(graph.initializers["target"], [2, -1])
    assert "target" in graph.constants


def _window_pad_model() -> onnx.ModelProto:
    """Swin's window padding as torch's legacy exporter writes it: pads = (4 - W % 4) % 4 computed from
    Shape(x) (Mod is beyond onnx's data propagation, so the Pad's output shape stays unknown), then a mask
    built from the padded tensor's shape: y = Pad(x) + ConstantOfShape(Shape(Pad(x)), 1)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "i3"], ["w"], name="gather", axis=0),
        helper.make_node("Mod", ["w", "four"], ["wm"], name="mod1"),
        helper.make_node("Sub", ["four", "wm"], ["d"], name="sub"),
        helper.make_node("Mod", ["d", "four"], ["p"], name="mod2"),
        helper.make_node("Unsqueeze", ["p", "ax0"], ["p1"], name="unsq"),
        helper.make_node("Concat", ["zeros7", "p1"], ["pads"], name="concat", axis=0),
        helper.make_node("Pad", ["x", "pads"], ["xp"], name="pad"),
        helper.make_node("Shape", ["xp"], ["sp"], name="shape_padded"),
        helper.make_node("ConstantOfShape", ["sp"], ["mask"], name="mask",
                         value=numpy_helper.from_array(np.array([1.0], np.float32))),
        helper.make_node("Add", ["xp", "mask"], ["y"], name="add"),
    ]
    init = {"i3": np.array(3, np.int64), "four": np.array(4, np.int64), "ax0": np.array([0], np.int64),
            "zeros7": np.zeros(7, np.int64)}
    return _model(nodes, [("x", [1, 1, 3, 5])], [("y", [1, 1, 3, 8])], init)


def test_shape_subgraph_after_a_pad_of_unknown_shape_is_folded():
    model = _window_pad_model()
    loaded = load_model(model)
    assert loaded.tensors["xp"].shape is None or None in loaded.tensors["xp"].shape  # the idiom under test
    graph = copy_graph(loaded)
    folded = fold_static(graph, NodeFloatEvaluator(OPSET))
    assert [n.op_type for n in graph.nodes] == ["Pad", "Add"]
    assert {"shape_padded", "mask"} <= set(folded)
    assert graph.tensors["xp"].shape == (1, 1, 3, 8)
    np.testing.assert_array_equal(graph.initializers["mask"], np.ones((1, 1, 3, 8), np.float32))
    x = np.random.default_rng(5).normal(size=(1, 1, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(_ort(_to_model(graph), {"x": x})[0], _ort(model, {"x": x})[0])


def test_shape_of_a_dynamic_batch_tensor_is_not_folded():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape"),
    ]
    graph = copy_graph(load_model(_model(nodes, [("x", ["n", 3])], [("y", ["n", 3])], {})))
    assert fold_static(graph, NodeFloatEvaluator(OPSET)) == []


def test_weight_only_subgraph_is_constant_folded():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(5, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], name="transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"], name="matmul"),
    ]
    graph = copy_graph(load_model(_model(nodes, [("x", [2, 3])], [("y", [2, 5])], {"w": w})))
    assert fold_static(graph, NodeFloatEvaluator(OPSET)) == ["transpose"]
    np.testing.assert_array_equal(graph.initializers["wt"], w.T)
    assert [n.op_type for n in graph.nodes] == ["MatMul"]


def test_dequantize_linear_on_a_weight_is_folded():
    wq = np.array([[-3, 7], [12, -128]], np.int8)
    scale = np.array(0.5, np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="dq"),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul"),
    ]
    graph_proto = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(scale, "ws")],
    )
    graph = copy_graph(load_model(helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", OPSET)])))
    fold_static(graph, NodeFloatEvaluator(OPSET))
    np.testing.assert_array_equal(graph.initializers["w"], wq.astype(np.float32) * 0.5)


def _gru_with_filled_state(fill: float) -> onnx.ModelProto:
    """A GRU whose initial_h is ConstantOfShape(fill) sized [1, batch, 4] from the dynamic batch of x [n, 3, 2]."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero_axis"], ["batch_1d"], name="unsqueeze"),
        helper.make_node("Concat", ["one", "batch_1d", "hidden"], ["state_shape"], name="concat", axis=0),
        helper.make_node("ConstantOfShape", ["state_shape"], ["h0"], name="fill",
                         value=numpy_helper.from_array(np.array([fill], np.float32))),
        helper.make_node("Transpose", ["x"], ["xt"], name="to_time", perm=[1, 0, 2]),
        helper.make_node("GRU", ["xt", "w", "r", "", "", "h0"], ["y"], name="gru", hidden_size=4),
    ]
    inits = {"zero": np.array(0, np.int64), "zero_axis": np.array([0], np.int64), "one": np.array([1], np.int64),
             "hidden": np.array([4], np.int64), "w": rng.normal(0, 0.5, (1, 12, 2)).astype(np.float32),
             "r": rng.normal(0, 0.5, (1, 12, 4)).astype(np.float32)}
    return _model(nodes, [("x", ["n", 3, 2])], [("y", [3, 1, "n", 4])], inits)


@pytest.mark.parametrize("fill, dropped", [(0.0, True), (0.5, False)])
def test_a_zero_initial_state_of_a_recurrent_cell_is_omitted_with_its_shape_subgraph(fill, dropped):
    model = _gru_with_filled_state(fill)
    graph = copy_graph(load_model(model))
    removed = drop_zero_states(graph)
    gru = next(n for n in graph.nodes if n.op_type == "GRU")
    if not dropped:
        assert removed == [] and gru.inputs[5] == "h0"
        return
    assert gru.inputs[5] == "" and sorted(removed) == ["concat", "fill", "gather", "shape", "unsqueeze"]
    x = np.random.default_rng(6).normal(size=(2, 3, 2)).astype(np.float32)
    np.testing.assert_allclose(_ort(_to_model(graph), {"x": x})[0], _ort(model, {"x": x})[0], atol=1e-6)
