"""LSTM and GRU (ops/recurrent.py) over whole sequences: forward_int equals an int64 reference of the module
docstring's formulas written out here (its own weight codes, multipliers, shifts and correctly rounded gate
tables), the integer outputs are within the declared LSB bound of onnxruntime's float op on the dequantized
inputs (random sequences of 20-50 steps, weights scaled like a trained cell's), forward_float equals
onnxruntime, and the configurations the kernel refuses run in float, visibly, with the reason."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from scipy.special import expit

from op_testing import Check, context, covers, runtime
from ops.registry import QuantizationError, get_op
from ptq.core.graph import Node
from ptq.core.qparams import compute_qparams
from ptq.core.requant import quantize_multiplier

MBITS = 15
Z_FRAC, C_FRAC, G_FRAC = 11, 12, 15  # the fixed grids, restated: sigmoid / tanh pre-activations, gates and h
LO, HI = -(1 << 15), (1 << 15) - 1
GATES = {"LSTM": 4, "GRU": 3}


def _sequence_model(op_type, direction="forward", steps=30, batch=2, inputs=16, hidden=24, seed=0, lbr=0,
                    lengths=None, layout=0):
    """One LSTM/GRU node with weights ~ N(0, 1/fan_in) (a trained cell's scale), biases ~ N(0, 0.3), the initial
    states as graph inputs; returns (model, feeds, attrs, constants)."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    rows = GATES[op_type] * hidden
    consts = {"W": (rng.normal(0, 1, (dirs, rows, inputs)) / np.sqrt(inputs)).astype(np.float32),
              "R": (rng.normal(0, 1, (dirs, rows, hidden)) / np.sqrt(hidden)).astype(np.float32),
              "B": rng.normal(0, 0.3, (dirs, 2 * rows)).astype(np.float32)}
    x_shape = (batch, steps, inputs) if layout else (steps, batch, inputs)
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    feeds = {"X": rng.normal(0, 1, x_shape).astype(np.float32),
             "H0": rng.uniform(-0.5, 0.5, state_shape).astype(np.float32)}
    names = ["X", "W", "R", "B", "", "H0"]
    if lengths is not None:
        consts["L"] = np.array(lengths, np.int32)
        names[4] = "L"
    if op_type == "LSTM":
        feeds["C0"] = rng.uniform(-1, 1, state_shape).astype(np.float32)
        names.append("C0")
    outputs = ["Y", "Y_h", "Y_c"][:3 if op_type == "LSTM" else 2]
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout}
    if op_type == "GRU":
        attrs["linear_before_reset"] = lbr
    node = helper.make_node(op_type, names, outputs, name="cell", **attrs)
    graph = helper.make_graph([node], "seq", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
                                               for k, v in feeds.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, feeds, names, outputs, attrs, consts


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _quantized_case(op_type, **kw):
    """The node quantized on 8-bit inputs and outputs calibrated on the float run; the float reference is
    onnxruntime on the dequantized inputs."""
    model, feeds, names, outputs, attrs, consts = _sequence_model(op_type, **kw)
    in_qp = {k: compute_qparams(float(v.min()), float(v.max()), 8, symmetric=False) for k, v in feeds.items()}
    codes = {k: in_qp[k].quantize(v) for k, v in feeds.items()}
    dequantized = {k: in_qp[k].dequantize(c) for k, c in codes.items()}
    if attrs["layout"]:  # onnxruntime runs layout 0 only: the same cell on transposed inputs and outputs
        seq_first = _sequence_model(op_type, **{**kw, "layout": 0})[0]
        want = _ort(seq_first, {k: v.transpose(1, 0, 2) for k, v in dequantized.items()})
        want = [want[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in want[1:]]
    else:
        want = _ort(model, dequantized)
    out_qp = [compute_qparams(float(w.min()), float(w.max()), 8, symmetric=False) for w in want]
    node = Node("cell", op_type, names, outputs, attrs=attrs)
    index = {"W": 1, "R": 2, "B": 3, "L": 4}
    constants = {index[k]: v for k, v in consts.items()}
    q = get_op(op_type).quantize(context(node, [in_qp.get(n) for n in names], out_qp, constants))
    args = [codes[n] if n in codes else consts.get(n) for n in names]
    got = get_op(op_type).forward_int(q, args, runtime())
    return q, got, want, out_qp, feeds, codes, in_qp, consts, attrs


# --- the int64 reference ------------------------------------------------------------------------------------

def _shift_round(acc, m, n):
    acc, m, n = (np.asarray(v, dtype=np.int64) for v in (acc, m, n))
    return (acc * m + (np.int64(1) << (n - 1))) >> n


def _table(fn, in_frac):
    """The correctly rounded function of every 16-bit code, as a dict-free array indexed by code + 2^15."""
    codes = np.arange(LO, HI + 1)
    return np.clip(np.rint(fn(codes * 2.0 ** -in_frac) * 2.0 ** G_FRAC), LO, HI).astype(np.int64)


def _lookup(table, codes):
    return table[np.asarray(codes) - LO]


def _weights(w):
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 32767, 1.0)
    return np.clip(np.rint(w / scale[:, None]), -32767, 32767).astype(np.int64), scale


def _reference(op_type, attrs, x_q, x_qp, h0_q, h0_qp, c0_q, c0_qp, consts, out_qp, cell_bits):
    """Y, Y_h (, Y_c) codes of the module docstring's integer formulas (no sequence_lens, layout 0)."""
    hidden = attrs["hidden_size"]
    lbr = attrs.get("linear_before_reset", 0)
    s_g, s_c = 2.0 ** -G_FRAC, 2.0 ** -(G_FRAC - cell_bits)
    sig, tanh_z, tanh_c = _table(expit, Z_FRAC), _table(np.tanh, C_FRAC), _table(np.tanh, G_FRAC - cell_bits)
    gates = GATES[op_type]
    s_z = np.full(gates * hidden, 2.0 ** -Z_FRAC)
    s_z[(gates - 1) * hidden:] = 2.0 ** -C_FRAC  # the candidate rows (LSTM's c, GRU's h) come last
    x_c = x_q.astype(np.int64) - int(x_qp.zero_point[0])
    steps = x_c.shape[0]
    w_all, r_all, b_all = consts["W"], consts["R"], consts["B"]
    ys, hs, cs = [], [], []
    for d in range(w_all.shape[0]):
        w_q, s_w = _weights(w_all[d].astype(np.float64))
        r_q, s_r = _weights(r_all[d].astype(np.float64))
        mx, nx = quantize_multiplier(float(x_qp.scale[0]) * s_w / s_z, MBITS)
        mh, nh = quantize_multiplier(s_g * s_r / s_z, MBITS)
        rows = w_q.shape[0]
        wb, rb = b_all[d, :rows].astype(np.float64), b_all[d, rows:].astype(np.float64)
        m0, n0 = quantize_multiplier(float(h0_qp.scale[0]) / s_g, MBITS)
        h = np.clip(_shift_round(h0_q[d].astype(np.int64) - int(h0_qp.zero_point[0]), m0, n0), LO, HI)
        c = None
        if op_type == "LSTM":
            m0, n0 = quantize_multiplier(float(c0_qp.scale[0]) / s_c, MBITS)
            c = np.clip(_shift_round(c0_q[d].astype(np.int64) - int(c0_qp.zero_point[0]), m0, n0), LO, HI)
        reverse = attrs["direction"] == "reverse" or d == 1
        y = [None] * steps
        for step in range(steps):
            t = steps - 1 - step if reverse else step
            zx = _shift_round(x_c[t] @ w_q.T, mx, nx)
            if op_type == "LSTM":
                z = np.clip(zx + _shift_round(h @ r_q.T, mh, nh) + np.rint((wb + rb) / s_z).astype(np.int64), LO, HI)
                i, o, f = (_lookup(sig, z[:, k * hidden:(k + 1) * hidden]) for k in range(3))
                g = _lookup(tanh_z, z[:, 3 * hidden:])
                c = np.clip(_shift_round(((f * c) << cell_bits) + i * g, 1, G_FRAC + cell_bits), LO, HI)
                h = np.clip(_shift_round(o * _lookup(tanh_c, c), 1, G_FRAC), LO, HI)
            else:
                zr = slice(0, 2 * hidden)
                bias_zr = np.rint((wb[zr] + rb[zr]) / s_z[zr]).astype(np.int64)
                z = np.clip(zx[:, zr] + _shift_round(h @ r_q[zr].T, mh[zr], nh[zr]) + bias_zr, LO, HI)
                u, r = _lookup(sig, z[:, :hidden]), _lookup(sig, z[:, hidden:])
                cand = slice(2 * hidden, 3 * hidden)
                if lbr:
                    a = _shift_round(h @ r_q[cand].T, mh[cand], nh[cand]) + np.rint(rb[cand] / s_z[cand]).astype(np.int64)
                    inner = _shift_round(r * a, 1, G_FRAC)
                    bias = np.rint(wb[cand] / s_z[cand]).astype(np.int64)
                else:
                    rh = np.clip(_shift_round(r * h, 1, G_FRAC), LO, HI)
                    inner = _shift_round(rh @ r_q[cand].T, mh[cand], nh[cand])
                    bias = np.rint((wb[cand] + rb[cand]) / s_z[cand]).astype(np.int64)
                n = _lookup(tanh_z, np.clip(zx[:, cand] + inner + bias, LO, HI))
                h = np.clip(_shift_round(((1 << G_FRAC) - u) * n + u * h, 1, G_FRAC), LO, HI)
            y[t] = h
        ys.append(np.stack(y)), hs.append(h), cs.append(c)
    grids = [(np.stack(ys, axis=1), s_g), (np.stack(hs), s_g)]
    if op_type == "LSTM":
        grids.append((np.stack(cs), s_c))
    out = []
    for (grid, scale), qp in zip(grids, out_qp):
        m, n = quantize_multiplier(scale / float(qp.scale[0]), MBITS)
        out.append(np.clip(_shift_round(grid, m, n) + int(qp.zero_point[0]), qp.qmin, qp.qmax))
    return out


@covers("LSTM", "GRU", check=Check.INT_REFERENCE)
@pytest.mark.parametrize("op_type, direction, lbr", [
    ("LSTM", "forward", 0), ("LSTM", "bidirectional", 0), ("GRU", "reverse", 0), ("GRU", "forward", 1),
    ("GRU", "bidirectional", 1),
])
def test_forward_int_equals_the_int64_reference(op_type, direction, lbr):
    q, got, _, out_qp, _, codes, in_qp, consts, attrs = _quantized_case(op_type, direction=direction, lbr=lbr,
                                                                        steps=20, hidden=12)
    want = _reference(op_type, attrs, codes["X"], in_qp["X"], codes["H0"], in_qp["H0"], codes.get("C0"),
                      in_qp.get("C0"), consts, out_qp, q.cell_bits)
    for g, w, qp in zip(got, want, out_qp):
        assert g.dtype == qp.dtype
        np.testing.assert_array_equal(g, w)


def _lsb(qp, codes, value) -> float:
    lo, hi = (float(v[0]) for v in qp.real_range())
    return float(np.abs(qp.dequantize(codes).astype(np.float64) - np.clip(value, lo, hi)).max() / qp.scale[0])


@covers("LSTM", "GRU", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("op_type, kw", [
    ("LSTM", {}), ("LSTM", {"direction": "reverse", "steps": 50}), ("LSTM", {"direction": "bidirectional"}),
    ("LSTM", {"direction": "bidirectional", "lengths": [30, 17]}), ("LSTM", {"layout": 1, "seed": 3}),
    ("GRU", {}), ("GRU", {"lbr": 1, "direction": "bidirectional", "lengths": [11, 30]}),
    ("GRU", {"direction": "reverse", "steps": 50, "seed": 5}), ("GRU", {"layout": 1, "lbr": 1}),
])
def test_within_the_declared_bound_of_onnxruntime_over_whole_sequences(op_type, kw):
    q, got, want, out_qp, feeds, codes, in_qp, consts, attrs = _quantized_case(op_type, **kw)
    bound = get_op(op_type).lsb_bound
    for g, w, qp in zip(got, want, out_qp):
        assert _lsb(qp, g, w) <= bound
    # forward_float is the ONNX op
    names = list(q.node.inputs)
    floats = [in_qp[n].dequantize(codes[n]) if n in codes else consts.get(n) for n in names]
    for f, w in zip(get_op(op_type).forward_float(q.node, floats), want):
        np.testing.assert_allclose(f, w, atol=2e-6)


def test_the_cell_state_grid_widens_to_its_calibrated_range():
    """cb holds twice the calibrated reach of Y_c / initial_c (+-16 at least): a cell state of +-40 gets +-128."""
    _, _, names, outputs, attrs, consts = _sequence_model("LSTM", steps=3, hidden=4, inputs=3)
    qp = compute_qparams(-1.0, 1.0, 8, symmetric=False)
    wide = compute_qparams(-40.0, 40.0, 8, symmetric=False)
    node = Node("cell", "LSTM", names, outputs, attrs=attrs)
    constants = {1: consts["W"], 2: consts["R"], 3: consts["B"]}
    narrow_q = get_op("LSTM").quantize(context(node, [qp] * len(names), [qp, qp, qp], constants))
    wide_q = get_op("LSTM").quantize(context(node, [qp] * len(names), [qp, qp, wide], constants))
    assert (narrow_q.cell_bits, wide_q.cell_bits) == (4, 7)
    # a constant initial_c (torch exports zeros) counts by its values, not by the degenerate grid (scale 1) a
    # table gives a tensor whose min == max: that grid once widened the cell to +-512 and cost 5 LSB
    zeros = np.zeros((1, 1, 4), np.float32)
    degenerate = compute_qparams(0.0, 0.0, 8, symmetric=False)
    with_c0 = Node("cell", "LSTM", names[:6] + ["c0"], outputs, attrs=attrs)
    c0_q = get_op("LSTM").quantize(context(with_c0, [qp] + [None] * 5 + [degenerate], [qp, qp, qp],
                                           {**constants, 5: zeros, 6: zeros}))
    assert c0_q.cell_bits == 4


@pytest.mark.parametrize("attrs, extra, reason", [
    ({"activations": ["Sigmoid", "Relu", "Tanh"]}, {}, "activations"),
    ({"clip": 3.0}, {}, "clip"),
    ({}, {"P": 1}, "peepholes"),
    ({"input_forget": 1, "activations": ["HardSigmoid", "Tanh", "Softsign"], "activation_alpha": [0.3],
      "activation_beta": [0.4]}, {}, "activations"),
])
def test_unsupported_configurations_run_in_float_with_the_reason(attrs, extra, reason):
    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate

    rng = np.random.default_rng(7)
    hidden, inputs = 6, 4
    inits = [numpy_helper.from_array((rng.normal(0, 1, (1, 4 * hidden, inputs)) / 2).astype(np.float32), "W"),
             numpy_helper.from_array((rng.normal(0, 1, (1, 4 * hidden, hidden)) / 2).astype(np.float32), "R")]
    names = ["x", "W", "R"]
    if extra:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, (1, 3 * hidden)).astype(np.float32), "P"))
        names += ["", "", "", "", "P"]
    nodes = [helper.make_node("LSTM", names, ["y"], hidden_size=hidden, name="cell", **attrs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 1, inputs])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 1, 1, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = rng.normal(0, 1, (4, 20, 1, inputs)).astype(np.float32)
    result = calibrate(model, data.reshape(-1, 1, inputs), write_qdq=False)  # axis 0 (time) is dynamic
    prepared = prepare(result.graph, result.table)
    step = prepared.steps[0]
    assert step.kind is NodeKind.FLOAT and step.reason.startswith("cannot quantize") and reason in step.reason
    y = prepared.run({"x": data[0]}).outputs["y"]
    want = _ort(model, {"x": data[0]})[0]
    node = next(n for n in result.graph.nodes if n.name == "cell")
    values = [data[0] if n == "x" else (result.graph.initializers[n] if n else None) for n in names]
    np.testing.assert_allclose(get_op("LSTM").forward_float(node, values)[0], want, atol=2e-6)  # the fallback's op
    assert np.abs(y - want).max() < 4 * float(prepared.qparams["y"].scale[0])
    with pytest.raises(QuantizationError, match=reason):
        get_op("LSTM").quantize(context(Node("cell", "LSTM", names, ["y"], attrs={"hidden_size": hidden, **attrs}),
                                        [prepared.qparams["x"]] + [None] * (len(names) - 1),
                                        [prepared.qparams["y"]], {1: np.ones((1, 4 * hidden, inputs)),
                                                                  2: np.ones((1, 4 * hidden, hidden))}))


@pytest.mark.parametrize("op_type", ["LSTM", "GRU"])
def test_a_sequence_model_calibrates_and_runs_the_cell_in_integers(op_type, tmp_path):
    """MatMul -> cell (state from a graph input) -> Y_h -> MatMul: calibrated from the float run alone (the cell's
    internal grids are fixed), its QDQ model exported and checked, the cell one integer step."""
    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate

    rng = np.random.default_rng(11)
    steps, inputs, hidden, gates = 24, 6, 16, GATES[op_type]
    inits = {"P": rng.normal(0, 1 / np.sqrt(inputs), (inputs, inputs)),
             "W": rng.normal(0, 1 / np.sqrt(inputs), (1, gates * hidden, inputs)),
             "R": rng.normal(0, 1 / np.sqrt(hidden), (1, gates * hidden, hidden)),
             "B": rng.normal(0, 0.3, (1, 2 * gates * hidden)), "O": rng.normal(0, 1 / np.sqrt(hidden), (hidden, 3))}
    cell_out = ["", "h"] + (["c"] if op_type == "LSTM" else [])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name="time_first"),
             helper.make_node("MatMul", ["xt", "P"], ["p"], name="proj"),
             helper.make_node(op_type, ["p", "W", "R", "B", "", "state"], cell_out, hidden_size=hidden, name="cell"),
             helper.make_node("Squeeze", ["h", "zero"], ["hs"], name="squeeze"),
             helper.make_node("MatMul", ["hs", "O"], ["y"], name="head")]
    graph = helper.make_graph(
        nodes, "seq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, steps, inputs]),
                       helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 1, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(np.array([0], np.int64), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    samples = [{"x": rng.normal(0, 1, (1, steps, inputs)).astype(np.float32),
                "state": rng.uniform(-0.5, 0.5, (1, 1, hidden)).astype(np.float32)} for _ in range(12)]
    for k, sample in enumerate(samples):
        np.savez(tmp_path / f"sample{k:02d}.npz", **sample)
    onnx.save(model, tmp_path / "seq.onnx")
    result = calibrate(tmp_path / "seq.onnx", out_dir=tmp_path, data=tmp_path)
    assert (tmp_path / "seq.qdq.onnx").exists()
    prepared = prepare(result.graph, result.table)
    step = next(s for s in prepared.steps if s.node.name == "cell")
    assert step.kind is NodeKind.INTEGER and not prepared.float_nodes
    scale = float(prepared.qparams["y"].scale[0])
    for sample in samples[:4]:
        got = prepared.run(sample).outputs["y"]
        want = _ort(model, sample)[0]
        assert np.abs(got - want).max() < 4 * scale
