"""`ptq ops MODEL [--quant T]`: will my model run? Its nodes by op type, integer or float, and why; the registry
without a model; both in 80 columns (issue 27, item 10)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.opdocs.model_ops import model_ops
from ptq.calibration.pipeline import calibrate
from ptq.table.quant_table import save_quant_table
from tiny_models import make_model


def conv_celu_shape() -> onnx.ModelProto:
    """input (1,3,8,8) -> Conv (BatchNormalization folded in) -> Relu (fused) -> Celu (no integer kernel:
    float) -> Flatten -> out, and the input's Shape as a second output (static: folded into a constant)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "B")]
    inits += [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
              (("g", rng.uniform(0.5, 1.5, 4)), ("b", rng.normal(0, 0.1, 4)), ("m", rng.normal(0, 0.1, 4)),
               ("v", rng.uniform(0.5, 1.5, 4)))]
    nodes = [
        helper.make_node("Conv", ["input", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["conv", "g", "b", "m", "v"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
        helper.make_node("Celu", ["relu"], ["celu"], name="a_celu_node_with_a_long_name_from_an_exporter_0"),
        helper.make_node("Flatten", ["celu"], ["out"], name="flatten"),
        helper.make_node("Shape", ["input"], ["shape"], name="shape"),
    ]
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])
    outs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 256]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [4])]
    return make_model(nodes, [inp], outs, inits)


def test_model_ops_counts_the_nodes_by_how_they_run_with_or_without_a_table():
    graph = load_model(conv_celu_shape())
    provisional = model_ops(graph)
    by_op = {op.op_type: (op.integer, op.float, op.shape) for op in provisional.ops}
    assert by_op == {"Conv": (1, 0, 0), "Celu": (0, 1, 0), "Flatten": (1, 0, 0)}
    assert provisional.model_nodes == 6 and provisional.fused == 2  # the BatchNormalization and the Relu
    assert provisional.folded == 1  # the Shape
    assert [(f.name, f.op_type) for f in provisional.float_nodes] == [
        ("a_celu_node_with_a_long_name_from_an_exporter_0", "Celu")]
    x = np.random.default_rng(1).normal(size=(4, 3, 8, 8)).astype(np.float32)
    calibrated = model_ops(graph, calibrate(conv_celu_shape(), x, write_qdq=False).table)
    assert calibrated.ops == provisional.ops and calibrated.float_nodes == provisional.float_nodes


def test_ptq_ops_model_prints_80_columns_with_the_reason_of_each_float_node(tmp_path, capsys):
    model = tmp_path / "model.onnx"
    onnx.save(conv_celu_shape(), model)
    assert main(["ops", str(model)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80
    assert " ".join(lines).startswith(f"{model}: 6 nodes; after the rewrites 3 run")
    assert "(1 folded into constants, 2 BatchNormalization folds and activation fusions): 2 in integers, 1 in " \
           "float, 0 shape computations" in " ".join(lines)
    assert ["Celu", "1", "0", "1", "-"] in [line.split() for line in lines]  # op, nodes, integer, float, shape
    assert ["Conv", "1", "1", "-", "-"] in [line.split() for line in lines]
    float_lines = lines[lines.index("1 node(s) run in float (dequantize, float op, quantize):") + 1:]
    assert float_lines[0].startswith("  a_celu_node_with_a_long_name_from_an_exporter_0 (Celu): ")
    assert "registered" in " ".join(float_lines)  # why: no integer kernel for Celu
    x = np.random.default_rng(1).normal(size=(4, 3, 8, 8)).astype(np.float32)
    table = save_quant_table(calibrate(conv_celu_shape(), x, write_qdq=False).table, tmp_path / "m.quant.json")
    assert main(["ops", str(model), "--quant", str(table)]) == 0
    with_table = capsys.readouterr().out
    assert "random sample" not in with_table and "Celu" in with_table


def test_ptq_ops_without_a_model_lists_the_registry_in_80_columns(capsys):
    from ops.registry import REGISTRY

    assert main(["ops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    firsts = {line.split()[0] for line in lines if line and not line.startswith(" ")}
    assert {op_type for _, op_type in REGISTRY} <= firsts
    assert "`ptq ops MODEL` tells how each node of a model runs" in "\n".join(lines)


@pytest.mark.parametrize("argv, message", [
    (["ops", "--quant", "t.json"], "--quant and --input-shape go with MODEL: ptq ops MODEL --quant TABLE"),
    (["ops", "m.onnx", "--domain", "ai.ptq"], "--domain lists the registry's ops: not with MODEL"),
])
def test_ptq_ops_refuses_options_that_do_not_go_together(capsys, argv, message):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"ptq ops: error: {message}\n"
