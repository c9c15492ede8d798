"""Weight scale floors: int32 biases never saturate; dead channels keep a full-precision requant factor."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate
from ptq.engine.executor import NodeKind, prepare
from ptq.qdq.export import export_qdq
from ptq.core.qparams import compute_qparams
from ptq.core.requant import INT32_MAX
from ptq.engine.weight_scale_floor import MIN_REQUANT_FACTOR
from tiny_models import make_model


def run_ort(model, feeds):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def conv_clip_model(w, b):
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B"),
             numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Clip", ["conv", "lo", "hi"], ["y"], name="clip")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 6, 6])
    return make_model(nodes, [x], [y], inits)


def dead_channel_case():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (3, 4, 3, 3)).astype(np.float32)
    w[1] *= 1e-7  # bias -1: pinned below the Clip's 0 whatever the input
    w[2] *= 1e-8  # bias 0.5: the weights move the output by far less than 1/64 of a step
    b = np.array([0.1, -1.0, 0.5], np.float32)
    samples = rng.uniform(-1, 1, (8, 4, 6, 6)).astype(np.float32)
    return conv_clip_model(w, b), w, samples


def test_dead_channels_get_the_raised_scale_and_live_ones_keep_theirs():
    model, w, samples = dead_channel_case()
    table = calibrate(model, samples, write_qdq=False).table
    s_x, s_y = table.qparams("x").scale[0], table.qparams("conv").scale[0]
    s_w = table.qparams("W").scale
    assert np.isclose(s_w[0], np.abs(w[0]).max() / 127, rtol=1e-6)  # extrema, restricted range
    raised = MIN_REQUANT_FACTOR * s_y / s_x
    assert np.all(s_w[1:] >= raised) and np.all(s_w[1:] <= raised * (1 + 1e-5))
    assert np.all(s_x * s_w / s_y >= 2.0 ** -17)  # no pre-rounding needed anywhere
    entry = table.tensors["W"]  # the widened range still yields the stored scale
    again = compute_qparams(entry.min, entry.max, 8, symmetric=True, narrow=True, axis=0)
    assert np.array_equal(again.scale, s_w)


def test_dead_channels_leave_the_quantized_outputs_as_they_were():
    model, w, samples = dead_channel_case()
    result = calibrate(model, samples, write_qdq=False)
    y_qp = result.table.qparams("y")
    (y,) = run_ort(export_qdq(result.graph, result.table), {"x": samples[:1]})
    codes = np.rint(y / y_qp.scale[0]).astype(int) + int(y_qp.zero_point[0])
    assert np.all(codes[0, 1] == int(y_qp.zero_point[0]))  # pinned at 0
    assert np.all(codes[0, 2] == int(np.rint(0.5 / y_qp.scale[0])) + int(y_qp.zero_point[0]))
    prepared = prepare(result.graph, result.table)
    out = prepared.run({"x": samples[:1]})
    assert np.array_equal(out.outputs["y"], y)  # the integer graph agrees with the QDQ model exactly


def test_large_bias_with_tiny_scales_fits_int32():
    rng = np.random.default_rng(1)
    wg = rng.normal(0, 1e-3, (6, 5)).astype(np.float32)
    bg = np.array([1.0, -2.0, 0.5, 0.0, 3.0, -1.0], np.float32)
    inits = [numpy_helper.from_array(wg, "WG"), numpy_helper.from_array(bg, "BG")]
    nodes = [helper.make_node("Gemm", ["x", "WG", "BG"], ["y"], transB=1, name="gemm")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits)
    samples = rng.uniform(-1e-3, 1e-3, (16, 5)).astype(np.float32)
    result = calibrate(model, samples, write_qdq=False)
    s_x, s_w = result.table.qparams("x").scale[0], result.table.qparams("WG").scale
    assert np.all(np.abs(bg) / (np.float32(s_x) * s_w.astype(np.float32)) <= INT32_MAX)
    (y,) = run_ort(export_qdq(result.graph, result.table), {"x": samples[:1]})
    expected = samples[:1] @ wg.T + bg
    assert np.max(np.abs(y - expected)) <= result.table.qparams("y").scale[0]  # the bias is not saturated


def _dead_channel_conv_bn(standalone_bn: bool):
    """Conv 3->8 whose channels 2 and 5 are dead (|w| ~ 1e-13, BN variance ~ 0, as trained networks leave
    them), then BatchNormalization and Relu. With `standalone_bn` the Conv output is also a graph output, so
    the BN is not folded and runs as its own integer op."""
    rng = np.random.default_rng(0)
    c = 8
    w = rng.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32)
    w[2] *= 1e-12
    w[5] *= 1e-13
    b = rng.normal(0, 0.1, c).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 2, c).astype(np.float32), rng.normal(0, 1, c).astype(np.float32)
    mean, var = rng.normal(0, 0.1, c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    mean[[2, 5]], var[[2, 5]] = 0, 1e-12
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "g", "be", "m", "v"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["y"], name="relu")]
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(w, "W"), (b, "B"), (gamma, "g"), (beta, "be"), (mean, "m"), (var, "v")]]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])]
    if standalone_bn:
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, c, 8, 8]))
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])], outputs, inits)
    return model, rng.normal(0, 1, (24, 3, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("standalone_bn", [False, True])
def test_dead_channels_with_batchnorm_never_saturate_the_accumulator(standalone_bn):
    """Folding BN into a Conv multiplies a dead channel's bias by gamma / sqrt(var + eps), ~300x here: the
    folded weight gets the calibration's scale floors too, so no int32 value saturates and the integer run
    agrees with float."""
    model, x = _dead_channel_conv_bn(standalone_bn)
    result = calibrate(model, x[:16], write_qdq=False)
    graph = prepare(result.graph, result.table)
    kinds = {s.node.op_type: s.kind for s in graph.steps}
    assert set(kinds.values()) == {NodeKind.INTEGER}
    assert ("BatchNormalization" in kinds) == standalone_bn
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y_qp = graph.qparams["y"]
    lo, hi = (float(v[0]) for v in y_qp.real_range())
    for sample in x[:4]:  # calibration images: the comparison is of the arithmetic, not of the range
        run = graph.run({"x": sample[None]})
        assert run.overflows == {}
        want = np.clip(sess.run(["y"], {"x": sample[None]})[0], lo, hi)
        got = run.outputs["y"]
        assert float(np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want))) > 0.999
        dead = got[:, [2, 5]]
        np.testing.assert_array_equal(dead, y_qp.dequantize(y_qp.quantize(want[:, [2, 5]])))


def test_range_search_keeps_the_weight_scale_floors(model_path, calib_dir, tmp_path):
    """A step that changes activation grids after the table is built (here `--range-search` clipping ranges on the
    bundled model) raises the weight scale floors its new scales call for: the calibrated table is a fixed point of
    `floor_weight_scales` (before, 19 of its weights were below their floors)."""
    import copy

    from ptq.core.graph import load_model
    from ptq.data.images import Preprocess
    from ptq.engine.weight_scale_floor import floor_weight_scales

    table = calibrate(model_path, calib_dir, tmp_path, preprocess=Preprocess(mean=127, std=128), write_qdq=False,
                      range_search=True).table
    tensors = copy.deepcopy(table.tensors)
    floor_weight_scales(load_model(model_path), tensors, table.options)
    moved = [n for n in tensors if not np.array_equal(tensors[n].qparams.scale, table.tensors[n].qparams.scale)]
    assert moved == []
