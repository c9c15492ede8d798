import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.core.graph import ModelError, load_model, parse_input_shapes
from tiny_models import conv_relu_gemm, make_model


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def test_constant_node_weights_become_initializers():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [
        helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w)),
        helper.make_node("MatMul", ["x", "W"], ["y"]),
    ]
    g = load_model(make_model(nodes, [vi("x", [1, 2])], [vi("y", [1, 3])]))
    np.testing.assert_array_equal(g.initializers["W"], w)
    assert "W" in g.constants and "W" not in g.activations
    assert [n.op_type for n in g.nodes] == ["MatMul"]
    assert g.activations == ["x", "y"]


def test_dynamic_batch_dimension_is_allowed():
    g = load_model(conv_relu_gemm(batch=None))
    assert g.tensors["input"].shape == (None, 3, 8, 8)
    assert g.activations == ["input", "conv", "act", "pool", "flat", "logits"]
    assert g.tensors["conv"].shape[1:] == (4, 8, 8)


def test_several_inputs_and_outputs():
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Mul", ["a", "b"], ["p"]),
        helper.make_node("Relu", ["s"], ["r"]),
    ]
    g = load_model(make_model(nodes, [vi("a", [2, 3]), vi("b", [2, 3])], [vi("r", [2, 3]), vi("p", [2, 3])]))
    assert g.inputs == ["a", "b"] and g.outputs == ["r", "p"]
    assert set(g.activations) == {"a", "b", "s", "p", "r"}
    assert g.activations.index("s") < g.activations.index("r")


@pytest.mark.parametrize("opset", [11, 21])
def test_opsets_11_and_21_load(opset):
    g = load_model(conv_relu_gemm(batch=1, opset=opset))
    assert g.opset == opset
    assert g.tensors["logits"].shape == (1, 5)
    assert {"W", "B", "WG", "BG", "lo", "hi"} <= g.constants


def test_dynamic_spatial_dims_need_input_shape():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    model = make_model(nodes, [vi("x", [1, 3, "H", "W"])], [vi("y", [1, 3, "H", "W"])])
    with pytest.raises(ModelError, match=r"dynamic dimensions \[2, 3\].*--input-shape x:"):
        load_model(model)
    g = load_model(model, {"x": (1, 3, 16, 20)})
    assert g.tensors["x"].shape == (1, 3, 16, 20) and g.tensors["y"].shape == (1, 3, 16, 20)
    with pytest.raises(ModelError, match="model's inputs are"):
        load_model(model, {"nope": (1, 3, 4, 4)})
    with pytest.raises(ModelError, match="rank 4"):
        load_model(model, {"x": (1, 3, 4)})


def shape_subgraph_model():
    """x (1,2,3,4) -> Relu -> Shape -> Gather(0) -> Unsqueeze -> Concat([-1]) -> Reshape(r) -> Relu."""
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["r", "newshape"], ["flat"]),
        helper.make_node("Neg", ["flat"], ["y"]),
    ]
    return make_model(nodes, [vi("x", [1, 2, 3, 4])], [vi("y", [1, 24])], inits, opset=17)


def test_shape_subgraph_stays_in_shape_tensors():
    g = load_model(shape_subgraph_model())
    assert {"shape", "batch", "batch1", "newshape"} <= g.shape_tensors
    assert g.activations == ["x", "r", "flat", "y"]
    assert not g.shape_tensors & set(g.activations)


def test_garbage_bytes_missing_file_and_opset_6_are_clear_errors(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01 this is not a protobuf \xff" * 10)
    with pytest.raises(ModelError, match="not a readable ONNX model"):
        load_model(junk)
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "missing.onnx")
    old = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [1, 2])], [vi("y", [1, 2])], opset=6)
    with pytest.raises(ModelError, match="opset 6; ptq supports opsets 7 to 21"):
        load_model(old)


def test_opsets_7_to_10_are_converted_to_11_and_nodes_know_their_opset():
    nodes = [helper.make_node("Clip", ["x"], ["c"], min=0.0, max=6.0),  # bounds as attributes before opset 11
             helper.make_node("Upsample", ["c", "scales"], ["u"], mode="nearest"),  # opset 9; Resize from 10
             helper.make_node("Softmax", ["u"], ["y"])]
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    model = make_model(nodes, [vi("x", [1, 2, 3, 3])], [vi("y", [1, 2, 6, 6])], [scales], opset=9)
    g = load_model(model)
    assert g.opset == 11 and [n.op_type for n in g.nodes] == ["Clip", "Resize", "Softmax"]
    assert all(n.opset == 11 for n in g.nodes)


def test_invalid_graph_is_a_model_error():
    nodes = [helper.make_node("Add", ["x", "undefined"], ["y"])]
    with pytest.raises(ModelError):
        load_model(make_model(nodes, [vi("x", [1, 2])], [vi("y", [1, 2])]))


def test_load_model_does_not_modify_a_proto_argument():
    model = make_model([helper.make_node("Constant", [], ["c"], value_float=2.0),
                        helper.make_node("Mul", ["x", "c"], ["y"])], [vi("x", [1, 2])], [vi("y", [1, 2])])
    before = model.SerializeToString()
    load_model(model)
    assert model.SerializeToString() == before


def test_parse_input_shapes():
    assert parse_input_shapes(["input:1,3,224,224", "a:b:2"]) == {"input": (1, 3, 224, 224), "a:b": (2,)}
    assert parse_input_shapes(None) == {}
    for bad in ("input", "input:1,x", "input:0,3", ":1"):
        with pytest.raises(ValueError, match="input-shape"):
            parse_input_shapes([bad])


def _rounds_reference(nodes, available):
    """The node order by rounds, computed the obvious quadratic way: each round, in file order, every pending
    node whose inputs are ready at the start of the round."""
    ordered, pending, ready = [], list(nodes), set(available)
    while pending:
        progress = [n for n in pending if all(i == "" or i in ready for i in n.input)]
        if not progress:
            return None
        ordered += progress
        for n in progress:
            ready.update(n.output)
        pending = [n for n in pending if all(n is not p for p in progress)]
    return ordered


@pytest.mark.parametrize("seed", range(20))
def test_toposort_orders_nodes_in_rounds_of_file_order(seed):
    """Random DAGs (repeated and empty inputs, several outputs, nodes in shuffled file order): the order equals
    the round-by-round reference; a cycle or an undefined input is an error naming the tensor."""
    from ptq.core.graph import _toposort

    rng = np.random.default_rng(seed)
    tensors, nodes = ["x", "w"], []
    for k in range(int(rng.integers(1, 60))):
        ins = [str(t) for t in rng.choice(tensors, size=int(rng.integers(1, 4)))] + [""] * int(rng.integers(0, 2))
        outs = [f"t{k}_{j}" for j in range(int(rng.integers(1, 3)))]
        nodes.append(helper.make_node("Op", ins, outs, name=f"n{k}"))
        tensors += outs
    shuffled = [nodes[k] for k in rng.permutation(len(nodes))]
    assert [n.name for n in _toposort(shuffled, {"x", "w"})] == [n.name for n in _rounds_reference(shuffled, {"x", "w"})]
    looped = shuffled + [helper.make_node("Op", ["x", "late"], ["early"]), helper.make_node("Op", ["early"], ["late"])]
    with pytest.raises(ModelError, match=r"cycle or undefined tensors: \['early', 'late'\]"):
        _toposort(looped, {"x", "w"})
    with pytest.raises(ModelError, match=r"undefined tensors: \['nowhere'\]"):
        _toposort(shuffled + [helper.make_node("Op", ["nowhere"], ["y"])], {"x", "w"})
