"""Small models in the styles of other exporters (Paddle, TensorFlow converters, the legacy PyTorch exporter)
and variants of the bundled EfficientNet-Lite0 (opset 11, dynamic batch with a shape subgraph), built with
onnx.helper for tests/test_model_zoo.py. Each has one output of class scores, so `ptq run` can print it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _const(name: str, value) -> onnx.NodeProto:
    """A Constant node (exporters write them everywhere instead of initializers)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _weights(rng, shape, scale=0.3) -> np.ndarray:
    return rng.normal(0, scale, shape).astype(np.float32)


def paddle_style() -> onnx.ModelProto:
    """Paddle idioms at opset 11: a dynamic batch, Identity chains, empty and repeated node names, tensor names
    that are not valid file names, Constant nodes, a weight that is also a graph input, BatchNormalization,
    hard-swish written as x * clip(x + 3, 0, 6) / 6, an inference-time dropout left as Mul by 1.0, a Cast
    between float types, and Flatten written as Shape -> Slice -> Concat -> Reshape."""
    rng = np.random.default_rng(1)
    c = 8
    w = _weights(rng, (c, 3, 3, 3))
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (w, "conv2d_0.w_0"), (rng.uniform(0.5, 1.5, c).astype(np.float32), "bn.scale"),
        (rng.normal(0, 0.1, c).astype(np.float32), "bn.bias"), (rng.normal(0, 0.1, c).astype(np.float32), "bn.mean"),
        (rng.uniform(0.5, 1.5, c).astype(np.float32), "bn.var"), (_weights(rng, (c, 10)), "fc.w_0"),
        (rng.normal(0, 0.1, 10).astype(np.float32), "fc.b_0")]]
    nodes = [
        helper.make_node("Identity", ["image"], ["image/id:0"], name=""),
        helper.make_node("Identity", ["image/id:0"], ["image/id:1"], name="identity"),
        helper.make_node("Conv", ["image/id:1", "conv2d_0.w_0"], ["conv2d_0.tmp_0"], pads=[1, 1, 1, 1], name=""),
        helper.make_node("BatchNormalization", ["conv2d_0.tmp_0", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
                         ["bn/out:0"], name="identity"),
        _const("three", np.float32(3)), _const("zero", np.float32(0)), _const("six", np.float32(6)),
        helper.make_node("Add", ["bn/out:0", "three"], ["hs/add:0"], name="hs_add"),
        helper.make_node("Clip", ["hs/add:0", "zero", "six"], ["hs/clip:0"], name="hs_clip"),
        helper.make_node("Mul", ["bn/out:0", "hs/clip:0"], ["hs/mul:0"], name="hs_mul"),
        helper.make_node("Div", ["hs/mul:0", "six"], ["hs/div:0"], name="hs_div"),
        _const("one", np.float32(1)),
        helper.make_node("Mul", ["hs/div:0", "one"], ["dropout:0"], name="dropout"),
        helper.make_node("Cast", ["dropout:0"], ["cast:0"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("GlobalAveragePool", ["cast:0"], ["pool:0"], name="pool"),
        helper.make_node("Shape", ["pool:0"], ["pool/shape:0"], name="shape"),
        _const("starts", np.array([0], np.int64)), _const("ends", np.array([1], np.int64)),
        helper.make_node("Slice", ["pool/shape:0", "starts", "ends"], ["batch:0"], name="slice"),
        _const("minus_one", np.array([-1], np.int64)),
        helper.make_node("Concat", ["batch:0", "minus_one"], ["flat/shape:0"], axis=0, name="concat"),
        helper.make_node("Reshape", ["pool:0", "flat/shape:0"], ["flat:0"], name="reshape"),
        helper.make_node("MatMul", ["flat:0", "fc.w_0"], ["fc/mm:0"], name="fc_mm"),
        helper.make_node("Add", ["fc/mm:0", "fc.b_0"], ["logits:0"], name="fc_add"),
        helper.make_node("Softmax", ["logits:0"], ["probs"], axis=1, name="softmax"),
    ]
    inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 16, 16]),
              helper.make_tensor_value_info("conv2d_0.w_0", TensorProto.FLOAT, list(w.shape))]
    graph = helper.make_graph(nodes, "paddle", inputs,
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6,
                             producer_name="PaddlePaddle")


def tensorflow_style() -> onnx.ModelProto:
    """tf2onnx idioms at opset 12: an NHWC input transposed to NCHW, an explicit Pad, ReLU6 as Clip,
    ReduceMean with axes as an attribute, a dense layer as MatMul + Add, a Squeeze written as a Reshape whose
    shape is Shape -> Gather -> Unsqueeze -> Concat, Softmax at opset 12 over axis 1 of a 2-D tensor."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (_weights(rng, (8, 3, 3, 3)), "conv/kernel"), (rng.normal(0, 0.1, 8).astype(np.float32), "conv/bias"),
        (_weights(rng, (16, 8, 1, 1)), "pw/kernel"), (_weights(rng, (16, 6)), "dense/kernel"),
        (rng.normal(0, 0.1, 6).astype(np.float32), "dense/bias"),
        (np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads"), (np.float32(0), "relu6/min"),
        (np.float32(6), "relu6/max"), (np.array(0, np.int64), "zero_index"), (np.array([-1], np.int64), "minus_one")]]
    nodes = [
        helper.make_node("Transpose", ["input_1:0"], ["nchw"], perm=[0, 3, 1, 2], name="to_nchw"),
        helper.make_node("Pad", ["nchw", "pads"], ["padded"], mode="constant", name="pad"),
        helper.make_node("Conv", ["padded", "conv/kernel", "conv/bias"], ["conv"], strides=[2, 2], name="conv"),
        helper.make_node("Clip", ["conv", "relu6/min", "relu6/max"], ["relu6"], name="relu6"),
        helper.make_node("Conv", ["relu6", "pw/kernel"], ["pw"], name="pw"),
        helper.make_node("Relu", ["pw"], ["pw/relu"], name="pw_relu"),
        helper.make_node("ReduceMean", ["pw/relu"], ["gap"], axes=[2, 3], keepdims=1, name="gap"),
        helper.make_node("Shape", ["gap"], ["gap/shape"], name="shape"),
        helper.make_node("Gather", ["gap/shape", "zero_index"], ["gap/batch"], axis=0, name="gather"),
        helper.make_node("Unsqueeze", ["gap/batch"], ["gap/batch1"], axes=[0], name="unsqueeze"),
        helper.make_node("Concat", ["gap/batch1", "minus_one"], ["squeeze/shape"], axis=0, name="concat"),
        helper.make_node("Reshape", ["gap", "squeeze/shape"], ["squeezed"], name="squeeze"),
        helper.make_node("MatMul", ["squeezed", "dense/kernel"], ["dense"], name="dense"),
        helper.make_node("Add", ["dense", "dense/bias"], ["logits"], name="dense_bias"),
        helper.make_node("Softmax", ["logits"], ["Identity:0"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(nodes, "tf", [helper.make_tensor_value_info("input_1:0", TensorProto.FLOAT,
                                                                          ["unk__1", 16, 16, 3])],
                              [helper.make_tensor_value_info("Identity:0", TensorProto.FLOAT, ["unk__1", 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7, producer_name="tf2onnx")


def legacy_opset9() -> onnx.ModelProto:
    """The legacy PyTorch exporter at opset 9: Clip bounds as attributes, Upsample, Flatten, Softmax's old
    default axis (1, with the input coerced to 2-D)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (_weights(rng, (6, 3, 3, 3)), "0.weight"), (rng.normal(0, 0.1, 6).astype(np.float32), "0.bias"),
        (_weights(rng, (4, 6, 3, 3)), "3.weight"), (np.array([1, 1, 2, 2], np.float32), "scales"),
        (_weights(rng, (5, 4)), "fc.weight"), (rng.normal(0, 0.1, 5).astype(np.float32), "fc.bias")]]
    nodes = [
        helper.make_node("Conv", ["input.1", "0.weight", "0.bias"], ["7"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Clip", ["7"], ["8"], min=0.0, max=6.0),
        helper.make_node("Upsample", ["8", "scales"], ["9"], mode="nearest"),
        helper.make_node("Conv", ["9", "3.weight"], ["10"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["10"], ["11"]),
        helper.make_node("GlobalAveragePool", ["11"], ["12"]),
        helper.make_node("Flatten", ["12"], ["13"]),
        helper.make_node("Gemm", ["13", "fc.weight", "fc.bias"], ["14"], transB=1),
        helper.make_node("Softmax", ["14"], ["output"]),
    ]
    graph = helper.make_graph(nodes, "torch-jit-export",
                              [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4, producer_name="pytorch")


def lite0_opset11(path: Path) -> onnx.ModelProto:
    """The bundled model at opset 11: ReduceMean's axes back to an attribute, attributes opset 11 lacks dropped."""
    model = onnx.load(str(path))
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        keep = [a for a in node.attribute if a.name not in ("noop_with_empty_axes", "allowzero")]
        if node.op_type == "ReduceMean" and len(node.input) > 1:
            axes = [int(a) for a in initializers[node.input[1]]]
            del node.input[1]
            keep.append(helper.make_attribute("axes", axes))
        del node.attribute[:]
        node.attribute.extend(keep)
    model.opset_import[0].version = 11
    model.ir_version = 6
    del model.graph.value_info[:]
    return model


def lite0_dynamic_batch(path: Path) -> onnx.ModelProto:
    """The bundled model with a dynamic batch and its final Reshape's shape computed at run time as the
    legacy exporter writes it: Shape -> Gather -> Unsqueeze -> Concat."""
    model = onnx.load(str(path))
    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    nodes = list(model.graph.node)
    reshape = next(n for n in nodes if n.op_type == "Reshape")
    data = reshape.input[0]
    shape_nodes = [
        helper.make_node("Shape", [data], ["dyn_shape"], name="dyn_shape"),
        _const("dyn_index", np.array(0, np.int64)),
        helper.make_node("Gather", ["dyn_shape", "dyn_index"], ["dyn_batch"], axis=0, name="dyn_gather"),
        _const("dyn_axes", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["dyn_batch", "dyn_axes"], ["dyn_batch1"], name="dyn_unsqueeze"),
        _const("dyn_rest", np.array([-1], np.int64)),
        helper.make_node("Concat", ["dyn_batch1", "dyn_rest"], ["dyn_newshape"], axis=0, name="dyn_concat"),
    ]
    reshape.input[1] = "dyn_newshape"
    at = nodes.index(reshape)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:at] + shape_nodes + nodes[at:])
    return model
