"""End to end: calibrate, run in integers, compare with float onnxruntime and with onnxruntime on the QDQ export.

EfficientNet-Lite0 is calibrated once per session (examples/calib, int8 per-channel weights) and run on the
20 labelled eval photos. The engine's checks (integer run against float and against onnxruntime's QDQ run,
layer by layer) calibrate with `extrema`, the ranges their bounds were measured on; the default calibrator
(`auto`, ranges chosen per tensor) has its own checks at the end of that section: the task figures and the QDQ
model's agreement with the integer run.

onnxruntime runs the QDQ model with graph optimizations disabled: then every QuantizeLinear/DequantizeLinear
pair and every op runs as written (the QDQ model's defined semantics). With optimizations on, onnxruntime
fuses the QDQ groups into QLinearConv, whose u8s8 kernel on AVX2 CPUs without VNNI (this machine) adds pairs
of products in saturating int16 (vpmaddubsw): a 64-deep sum of uint8 ~230 times int8 127 came out 52 LSB
instead of 93 in a one-Conv check, and EfficientNet's logits cosine to float drops to 0.84-0.94 with int8
weights, against 0.99+ for both the unfused QDQ model and ptq's exact integer run. The default export target
(ort-cpu) stores the weights as uint8, whose u8u8 kernels do not saturate: one test runs it optimized.

The QDQ model requantizes with the exact float ratio s_in * s_w / s_out; the executor's default multipliers
have 15 bits (the hardware's width, relative error up to 2^-15), which flips a few output codes by one LSB
per layer, and EfficientNet's depthwise layers (weights up to ~17 LSB of output per LSB of input) amplify
such flips. So the "same computation as the QDQ model" check runs the executor with 31-bit multipliers
(relative error 2^-31: what is left is onnxruntime's own float32 rounding); the default 15-bit run is held
to the measured, slightly looser agreement (mean cosine 0.9988 on this machine).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ptq.calibration.pipeline import calibrate, input_spec
from ptq.cli import main as cli_main
from tiny_models import conv_relu_gemm
from ops.registry import QuantizeOptions, bias_role
from ptq.engine.executor import ExecutorOptions, prepare
from ptq.core.graph import load_model
from ptq.data.images import ImageLog, Preprocess, load_image, select_files
from ptq.core.option_defaults import DEFAULT_CALIBRATOR
from ptq.core.qparams import compute_qparams
from ptq.table.quant_table import QuantTable, TensorEntry
from ptq.data.labels import label_from_filename


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _session(model, optimize: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------- EfficientNet-Lite0


class EfficientNetRun:
    def __init__(self, model_path: Path, calib_dir: Path, eval_dir: Path, out_dir: Path, calibrator: str):
        self.model_path = model_path
        self.result = calibrate(model_path, calib_dir, out_dir, calibrator=calibrator)
        graph = load_model(model_path)
        pre = Preprocess(**self.result.table.options.preprocess)
        spec = input_spec(graph, pre)
        self.files = select_files(eval_dir, ImageLog())
        samples = [load_image(p, pre, spec)[None] for p in self.files]
        prepared = prepare(graph, self.result.table)
        self.prepared, self.samples = prepared, samples
        self.float_nodes = prepared.float_nodes
        float_sess, qdq_sess = _session(model_path), _session(self.result.qdq_path, optimize=False)
        runs = [prepared.run({"input": x}, keep_all=False) for x in samples]
        self.overflows = [r.overflows for r in runs]
        self.int_logits = np.concatenate([r.outputs["logits"] for r in runs])
        wide = prepare(graph, self.result.table, options=ExecutorOptions(quantize=QuantizeOptions(mbits=31)))
        self.int31_logits = np.concatenate([wide.run({"input": x}, keep_all=False).outputs["logits"] for x in samples])
        self.float_logits = np.concatenate([float_sess.run(None, {"input": x})[0] for x in samples])
        self.qdq_logits = np.concatenate([qdq_sess.run(None, {"input": x})[0] for x in samples])


@pytest.fixture(scope="session")
def effnet(model_path, calib_dir, eval_dir, tmp_path_factory) -> EfficientNetRun:
    return EfficientNetRun(model_path, calib_dir, eval_dir, tmp_path_factory.mktemp("effnet"), "extrema")


@pytest.fixture(scope="session")
def effnet_default(model_path, calib_dir, eval_dir, tmp_path_factory) -> EfficientNetRun:
    return EfficientNetRun(model_path, calib_dir, eval_dir, tmp_path_factory.mktemp("effnet_default"),
                           DEFAULT_CALIBRATOR)


def test_efficientnet_runs_entirely_in_integers(effnet):
    assert len(effnet.files) == 20
    assert effnet.float_nodes == []


def test_efficientnet_integer_logits_match_float(effnet):
    cosines = [_cosine(i, f) for i, f in zip(effnet.int_logits, effnet.float_logits)]
    assert np.mean(cosines) >= 0.99, cosines
    agree = int(np.sum(effnet.int_logits.argmax(1) == effnet.float_logits.argmax(1)))
    assert agree >= 19, f"top-1 agreement {agree}/20"


def test_efficientnet_every_layer_matches_onnxruntime_qdq_in_isolation(effnet):
    """Each integer layer, fed the codes onnxruntime computed for its inputs (QDQ model, same tensor names:
    ptq's exporter keeps them), reproduces onnxruntime's output codes: codes differ by at most one LSB, in at
    most 0.5% of a layer's outputs and 0.1% over the network (15-bit multipliers, round half up, against
    onnxruntime's float32 rescale; measured 0.02% overall)."""
    from ptq.engine.executor import NodeKind

    prepared, x = effnet.prepared, effnet.samples[0]
    qdq = onnx.load(str(effnet.result.qdq_path))
    produced = {o for n in qdq.graph.node for o in n.output}
    existing = {o.name for o in qdq.graph.output}
    names = [n for n in prepared.qparams if n in produced and n not in existing]
    for name in names:
        qdq.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    values = dict(zip([o.name for o in qdq.graph.output], _session(qdq, optimize=False).run(None, {"input": x})))
    codes = {n: prepared.qparams[n].quantize(v) for n, v in values.items() if n in prepared.qparams}
    codes["input"] = prepared.qparams["input"].quantize(x)
    checked, differing, total = 0, 0, 0
    for step in prepared.steps:
        out = step.node.outputs[0]
        if step.kind is not NodeKind.INTEGER or out not in codes:
            continue
        args = [(codes[i] if i in codes else prepared.graph.initializers[i]) if i else None for i in step.node.inputs]
        got = prepared.run_step(step, args)[0].astype(np.int64)
        diff = np.abs(got - codes[out])
        assert diff.max() <= 1 and np.mean(diff) <= 5e-3, (step.node.name, int(diff.max()), float(np.mean(diff)))
        checked, differing, total = checked + 1, differing + int(diff.sum()), total + diff.size
    assert checked == len(prepared.steps) == 61  # 49 Conv (33 with a fused Clip), 9 Add, ReduceMean, Reshape, Gemm
    assert differing / total <= 1e-3, differing / total


def _check_top1_against_qdq(int_logits: np.ndarray, qdq_logits: np.ndarray, lsb: float) -> None:
    """Same top-1 wherever the QDQ model's top-2 margin exceeds 2 logit LSBs; where it does not (a tie at the
    output's resolution: measured on 2 of the 20 photos, margins of 1 LSB and 0), the integer top-1 must be
    one of the QDQ classes within 2 LSBs of its maximum."""
    for k, (i, q) in enumerate(zip(int_logits, qdq_logits)):
        top2 = np.sort(q)[-2:]
        if top2[1] - top2[0] > 2 * lsb:
            assert i.argmax() == q.argmax(), f"image {k}: top-1 {i.argmax()} vs QDQ {q.argmax()}"
        else:
            assert q[i.argmax()] >= q.max() - 2 * lsb, f"image {k}: top-1 {i.argmax()} is no near-tie of the QDQ's"


def test_efficientnet_integer_run_matches_onnxruntime_qdq(effnet):
    lsb = float(effnet.result.table.qparams("logits").scale[0])
    _check_top1_against_qdq(effnet.int31_logits, effnet.qdq_logits, lsb)
    cosines = [_cosine(i, q) for i, q in zip(effnet.int31_logits, effnet.qdq_logits)]
    assert np.mean(cosines) >= 0.999, cosines


def test_efficientnet_default_15_bit_multipliers_stay_close_to_onnxruntime_qdq(effnet):
    lsb = float(effnet.result.table.qparams("logits").scale[0])
    _check_top1_against_qdq(effnet.int_logits, effnet.qdq_logits, lsb)
    cosines = [_cosine(i, q) for i, q in zip(effnet.int_logits, effnet.qdq_logits)]
    assert np.mean(cosines) >= 0.998 and min(cosines) >= 0.995, cosines


@pytest.mark.skipif("CPUExecutionProvider" not in ort.get_available_providers(),
                    reason="onnxruntime has no CPU provider")
def test_efficientnet_qdq_model_keeps_its_accuracy_under_onnxruntime_default_optimizations(effnet):
    """The QDQ model `ptq calibrate` writes (target ort-cpu: uint8 weights) run the way a user deploys it,
    onnxruntime's default optimizations (QDQ groups fused into integer kernels), stays within 0.002 logits
    cosine of ptq's integer run (measured 0.9934 both; the int8-weight export fell to 0.936 on this AVX2 CPU)."""
    assert effnet.result.qdq_target == "ort-cpu"
    optimized = _session(effnet.result.qdq_path)
    qdq_logits = np.concatenate([optimized.run(None, {"input": x})[0] for x in effnet.samples])
    qdq_cosine = np.mean([_cosine(q, f) for q, f in zip(qdq_logits, effnet.float_logits)])
    int_cosine = np.mean([_cosine(i, f) for i, f in zip(effnet.int_logits, effnet.float_logits)])
    assert abs(qdq_cosine - int_cosine) <= 0.002, (qdq_cosine, int_cosine)


def test_efficientnet_integer_top1_accuracy_close_to_float(effnet):
    labels = np.array([label_from_filename(p) for p in effnet.files])
    int_correct = int(np.sum(effnet.int_logits.argmax(1) == labels))
    float_correct = int(np.sum(effnet.float_logits.argmax(1) == labels))
    assert int_correct >= float_correct - 1, (int_correct, float_correct)


def test_cli_run_prints_top5_and_summary(effnet, capsys):
    status = cli_main(
        ["run", str(effnet.model_path), "--quant", str(effnet.result.table_path),
         "--images", str(effnet.files[0]), "--top", "5"]
    )
    out = capsys.readouterr().out
    assert status == 0
    line = next(row for row in out.splitlines() if row.startswith(effnet.files[0].name))
    pairs = [p.split(":") for p in line.split(": ", 1)[1].split()]
    classes, probs = [int(c) for c, _ in pairs], [float(p) for _, p in pairs]
    assert len(classes) == 5 and probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-3
    assert classes[0] == int(effnet.int_logits[0].argmax())
    # the probabilities are the softmax of the dequantized logits (float64 by hand)
    z = effnet.int_logits[0].astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(probs, np.sort(p)[::-1][:5], atol=6e-5)
    hit = int(classes[0] == label_from_filename(effnet.files[0]))
    assert f"top-1 accuracy {hit}/1 on the images labelled" in out
    assert "every node ran in integers" in out
    assert "saturated their int32 accumulator" in out or "no int32 accumulator overflow" in out


def test_default_calibrator_chooses_per_tensor_and_keeps_the_task(effnet_default):
    """`ptq calibrate` with no accuracy flag: every activation's range chosen per tensor (and labelled with the
    choice), the whole graph in integers, the logits close to float and the labelled photos' top-1 accuracy
    within one photo of float's."""
    table = effnet_default.result.table
    labels_of = [e.calibrator for e in table.tensors.values() if e.kind == "activation"]
    assert labels_of and all(c.startswith(f"{DEFAULT_CALIBRATOR}:") for c in labels_of), set(labels_of)
    assert effnet_default.float_nodes == []
    cosines = [_cosine(i, f) for i, f in zip(effnet_default.int_logits, effnet_default.float_logits)]
    assert np.mean(cosines) >= 0.99, cosines
    labels = np.array([label_from_filename(p) for p in effnet_default.files])
    int_correct = int(np.sum(effnet_default.int_logits.argmax(1) == labels))
    float_correct = int(np.sum(effnet_default.float_logits.argmax(1) == labels))
    assert int_correct >= float_correct - 1, (int_correct, float_correct)


def test_default_qdq_model_scores_within_0005_of_the_integer_run(effnet_default):
    """Issue 26's bar: the QDQ model of the default table, in onnxruntime with optimizations off and on, within
    0.005 logits cosine (to float) of the integer run."""
    int_cosine = np.mean([_cosine(i, f) for i, f in zip(effnet_default.int_logits, effnet_default.float_logits)])
    optimized = _session(effnet_default.result.qdq_path)
    for qdq_logits in (effnet_default.qdq_logits,
                       np.concatenate([optimized.run(None, {"input": x})[0] for x in effnet_default.samples])):
        qdq_cosine = np.mean([_cosine(q, f) for q, f in zip(qdq_logits, effnet_default.float_logits)])
        assert abs(qdq_cosine - int_cosine) <= 0.005, (qdq_cosine, int_cosine)


# ---------------------------------------------------------------- a model of the other op kinds


def _se_model(rng) -> onnx.ModelProto:
    """Conv -> BN -> HardSwish -> SE (GlobalAveragePool -> Conv -> Relu -> Conv -> HardSigmoid -> Mul)
    -> standalone BN -> GlobalAveragePool -> Reshape -> MatMul -> Add -> Softmax."""
    c, r, k = 8, 4, 10
    init = {
        "w0": rng.normal(0, 0.4, (c, 3, 3, 3)).astype(np.float32),
        "b0": rng.normal(0, 0.1, c).astype(np.float32),
        "g0": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "be0": rng.normal(0, 0.2, c).astype(np.float32),
        "m0": rng.normal(0, 0.2, c).astype(np.float32),
        "v0": rng.uniform(0.5, 2.0, c).astype(np.float32),
        "w1": rng.normal(0, 0.5, (r, c, 1, 1)).astype(np.float32),
        "b1": rng.normal(0, 0.1, r).astype(np.float32),
        "w2": rng.normal(0, 0.5, (c, r, 1, 1)).astype(np.float32),
        "b2": rng.normal(0, 0.1, c).astype(np.float32),
        "g1": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "be1": rng.normal(0, 0.2, c).astype(np.float32),
        "m1": rng.normal(0, 0.2, c).astype(np.float32),
        "v1": rng.uniform(0.5, 2.0, c).astype(np.float32),
        "shape": np.array([1, c], np.int64),
        "wm": rng.normal(0, 0.5, (c, k)).astype(np.float32),
        "bm": rng.normal(0, 0.1, k).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c0", "g0", "be0", "m0", "v0"], ["bn0"], name="bn0"),
        helper.make_node("HardSwish", ["bn0"], ["hs"], name="hswish"),
        helper.make_node("GlobalAveragePool", ["hs"], ["se_pool"], name="se_pool"),
        helper.make_node("Conv", ["se_pool", "w1", "b1"], ["se_c1"], name="se_conv1"),
        helper.make_node("Relu", ["se_c1"], ["se_r"], name="se_relu"),
        helper.make_node("Conv", ["se_r", "w2", "b2"], ["se_c2"], name="se_conv2"),
        helper.make_node("HardSigmoid", ["se_c2"], ["se_gate"], name="se_hsig"),
        helper.make_node("Mul", ["hs", "se_gate"], ["se_out"], name="se_mul"),
        helper.make_node("BatchNormalization", ["se_out", "g1", "be1", "m1", "v1"], ["bn1"], name="bn1"),
        helper.make_node("GlobalAveragePool", ["bn1"], ["pool"], name="pool"),
        helper.make_node("Reshape", ["pool", "shape"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "wm"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "bm"], ["logits"], name="bias_add"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "se_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, k])],
        [numpy_helper.from_array(v, n) for n, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.fixture(scope="module")
def se_net():
    rng = np.random.default_rng(7)
    model = _se_model(rng)
    calib = rng.normal(0, 1, (32, 3, 8, 8)).astype(np.float32)
    result = calibrate(model, calib, write_qdq=False)
    return model, result.table, rng.normal(0, 1, (8, 1, 3, 8, 8)).astype(np.float32)


def test_se_net_rewrites_and_runs_in_integers(se_net):
    model, table, samples = se_net
    prepared = prepare(load_model(model), table)
    assert [(f.conv, f.batchnorm) for f in prepared.rewrites.batchnorm_folds] == [("conv0", "bn0")]
    assert [(f.host, f.activation) for f in prepared.rewrites.fusions] == [("se_conv1", "se_relu")]
    ops_run = [s.node.op_type for s in prepared.steps]
    assert ops_run.count("BatchNormalization") == 1  # bn1 follows a Mul: it stays, as an integer op
    assert prepared.float_nodes == []
    # the folded weight's qparams are recomputed: symmetric, per output channel, max|W'| on the grid's edge
    fold = prepared.rewrites.batchnorm_folds[0]
    w = prepared.graph.initializers[fold.weight].astype(np.float64)
    qp = prepared.qparams[fold.weight]
    original = table.qparams("w0")
    assert qp.axis == 0 and qp.symmetric and (qp.bits, qp.narrow) == (original.bits, original.narrow)
    levels = 127.0 if original.narrow else 127.5  # codes +-127, or -128..127
    np.testing.assert_allclose(qp.scale, np.abs(w).reshape(8, -1).max(1) / levels, rtol=1e-6)


def test_se_net_integer_run_is_close_to_float(se_net):
    model, table, samples = se_net
    prepared = prepare(load_model(model), table)
    sess = _session(model)
    probs_cos, logit_cos = [], []
    for x in samples:
        result = prepared.run({"x": x})
        want_probs = sess.run(None, {"x": x})[0]
        probs_cos.append(_cosine(result.outputs["probs"], want_probs))
        logits_q = result.tensors["logits"]
        got_logits = result.qparams["logits"].dequantize(logits_q)
        want_logits = _session_logits(model, x)
        logit_cos.append(_cosine(got_logits, want_logits))
        assert result.overflows == {}
    assert np.mean(logit_cos) >= 0.99, logit_cos
    assert np.mean(probs_cos) >= 0.99, probs_cos


def _session_logits(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10]))
    return _session(m).run(["logits"], {"x": x})[0]


def test_cli_run_with_float_nodes_lists_them(effnet, capsys):
    status = cli_main(
        ["run", str(effnet.model_path), "--quant", str(effnet.result.table_path),
         "--images", str(effnet.files[1]), "--float-nodes", "node_linear", "logits"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "1 node(s) run in float (dequantize -> float op -> quantize):\n  node_linear (Gemm): marked float" in out
    top1 = int(out.split(f"{effnet.files[1].name}: ", 1)[1].split(":", 1)[0])
    assert top1 == int(effnet.float_logits[1].argmax())


def _with_16_bits(table: QuantTable, names) -> QuantTable:
    """The table with the activations `names` re-quantized to 16 bits over their calibrated ranges."""
    tensors = dict(table.tensors)
    for name in names:
        e = tensors[name]
        tensors[name] = TensorEntry(e.kind, e.calibrator, e.min, e.max, compute_qparams(e.min, e.max, 16, symmetric=False))
    return QuantTable(table.options, tensors)


def _logits_cosines(prepared, model, samples) -> list[float]:
    cosines = []
    for x in samples:
        result = prepared.run({"x": x})
        logits = result.qparams["logits"].dequantize(result.tensors["logits"])
        cosines.append(_cosine(logits, _session_logits(model, x)))
    return cosines


@pytest.mark.parametrize("wide", [("hs", "se_gate", "logits"), "all"])
def test_se_net_mixed_precision_bits_come_from_the_table(se_net, wide):
    model, table, samples = se_net
    activations = [n for n, e in table.tensors.items() if e.kind == "activation"]
    wide = activations if wide == "all" else list(wide)
    prepared = prepare(load_model(model), _with_16_bits(table, wide))
    result = prepared.run({"x": samples[0]})
    for name in activations:
        if name in result.tensors:
            # the output Softmax is at 16 bits by default (ptq.calibration.output_scores)
            wide_in_table = table.tensors[name].qparams.bits == 16
            assert result.tensors[name].itemsize == (2 if name in wide or wide_in_table else 1), name
    cos16 = np.mean(_logits_cosines(prepared, model, samples))
    cos8 = np.mean(_logits_cosines(prepare(load_model(model), table), model, samples))
    assert cos16 >= 0.999
    if wide == activations:  # what is left is the 8-bit weights' error
        assert 1 - cos16 < 0.25 * (1 - cos8), (cos16, cos8)


def test_cli_run_skips_undecodable_images(se_net, tmp_path, capsys):
    from PIL import Image

    from ptq.table.quant_table import save_quant_table

    model, table, _ = se_net
    onnx.save(model, str(tmp_path / "se.onnx"))
    save_quant_table(table, tmp_path / "se.quant.json")
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(3)
    for k in range(2):
        Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(images / f"img_{k}.png")
    (images / "broken_9.jpg").write_bytes(b"not a jpeg")  # labelled like the others: labels stay on
    status = cli_main(["run", str(tmp_path / "se.onnx"), "--quant", str(tmp_path / "se.quant.json"),
                       "--images", str(images), "--top", "3"])
    out = capsys.readouterr().out
    assert status == 0
    assert "broken_9.jpg: skipped (cannot decode image" in out
    assert "2 image(s) in integers" in out and ", 1 skipped" in out
    rows = [line for line in out.splitlines() if line.startswith("img_")]
    assert len(rows) == 2
    # img_0.png and img_1.png carry labels 0 and 1 in their names
    hits = sum(int(row.split(": ")[1].split(":")[0]) == int(row[4]) for row in rows)
    assert f"top-1 accuracy {hits}/2 on the images labelled" in out


def test_integer_graph_and_qdq_export_quantize_every_bias_identically(effnet):
    """One `ptq.core.bias.quantize_bias` serves both: each Conv/Gemm bias of the QDQ model holds exactly the
    int32 codes the integer graph adds to its accumulators."""
    qdq = onnx.load(str(effnet.result.qdq_path))
    stored = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer if i.name.endswith("_quantized")}
    compared = 0
    for step in effnet.prepared.steps:
        role = bias_role(step.node)
        if step.quantized is None or role is None:
            continue
        codes = stored[f"{step.node.inputs[role.input_index]}_quantized"]
        assert codes.dtype == np.int32
        np.testing.assert_array_equal(step.quantized.bias.ravel(), codes.astype(np.int64), err_msg=step.node.name)
        compared += 1
    assert compared == sum(1 for n in effnet.prepared.graph.nodes if bias_role(n) is not None) > 40


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C anywhere in a command: one line on stderr, exit status 130, no traceback, no output written."""
    import ptq.calibration.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ptq.calibration.pipeline, "calibrate", interrupted)
    model = tmp_path / "m.onnx"
    onnx.save(conv_relu_gemm(), str(model))
    code = cli_main(["calibrate", str(model), "--images", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 130
    assert capsys.readouterr().err == "ptq calibrate: interrupted\n"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
