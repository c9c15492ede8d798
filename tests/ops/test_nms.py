"""NonMaxSuppression (ops/nms.py): (a) the integer forward equals a plain Python-integer NMS written here from
the docstring (corners from codes, `inter * 2^N > union * M`, `score_c * 2^N_s > M_s`); (b) the selected
indices equal onnxruntime's float NonMaxSuppression on the dequantized boxes and scores."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import Check, context, covers, random_qparams, runtime
from ops import get_op
from ops.registry import QuantizationError, check_quantized
from ort_untyped import ort_run
from ptq.core.graph import Node


def _python_nms(box_c, score_c, center, max_out, iou_mn, score_smn):
    """Python ints throughout: box_c (B, N, 4) and score_c (B, C, N) centered codes."""
    m, n = iou_mn
    out = []
    for b in range(len(box_c)):
        corners = []
        for v in box_c[b]:
            v = [int(t) for t in v]
            if center:
                xc, yc, w, h = v
                corners.append((2 * yc - h, 2 * xc - w, 2 * yc + h, 2 * xc + w))
            else:
                corners.append((min(v[0], v[2]), min(v[1], v[3]), max(v[0], v[2]), max(v[1], v[3])))
        area = [(c[2] - c[0]) * (c[3] - c[1]) for c in corners]
        for c in range(len(score_c[b])):
            s = [int(t) for t in score_c[b][c]]
            if score_smn is None:
                cand = list(range(len(s)))
            else:
                sign, sm, sn = score_smn
                cand = [i for i in range(len(s)) if s[i] * 2 ** sn > sign * sm]
            cand.sort(key=lambda i: (-s[i], i))
            kept = []
            for i in cand:
                if len(kept) >= max_out:
                    break
                suppressed = False
                for j in kept:
                    a, bb = corners[j], corners[i]
                    h = min(a[2], bb[2]) - max(a[0], bb[0])
                    w = min(a[3], bb[3]) - max(a[1], bb[1])
                    if h <= 0 or w <= 0 or area[i] <= 0 or area[j] <= 0:
                        continue
                    inter = h * w
                    union = area[i] + area[j] - inter
                    if union > 0 and inter * 2 ** n > union * m:
                        suppressed = True
                        break
                if not suppressed:
                    kept.append(i)
            out += [[b, c, i] for i in kept]
    return np.array(out, np.int64).reshape(-1, 3)


def _boxes(rng, batch, count, center):
    xy = rng.uniform(0, 10, (batch, count, 2))
    wh = rng.uniform(0.5, 4, (batch, count, 2))
    if center:
        return np.concatenate([xy, wh], axis=2).astype(np.float32)
    flip = rng.integers(2, size=(batch, count, 1)).astype(bool)  # either diagonal
    y1x1, y2x2 = xy[..., ::-1], xy[..., ::-1] + wh
    return np.where(flip, np.concatenate([y2x2, y1x1], 2), np.concatenate([y1x1, y2x2], 2)).astype(np.float32)


@covers("NonMaxSuppression", check=Check.INT_REFERENCE)
@covers("NonMaxSuppression", check=Check.ONNXRUNTIME)
@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("box_bits,iou,score,max_out", [
    (8, 0.5, 0.3, 5), (16, 0.35, None, 100), (8, 0.7, -0.2, 3), (16, 0.0, 0.6, 4),
])
def test_nms(center, box_bits, iou, score, max_out):
    rng = np.random.default_rng(box_bits + 3 * center + max_out)
    count = 40 if max_out < 100 else 230  # more candidates than one block of ops.nms.BLOCK
    boxes_f = _boxes(rng, 2, count, center)
    scores_f = rng.uniform(0, 1, (2, 3, count)).astype(np.float32)
    box_qp = random_qparams(rng, float(boxes_f.min()), float(boxes_f.max()), box_bits, symmetric=False)
    score_qp = random_qparams(rng, 0.0, 1.0, 8, signed=False)
    boxes, scores = box_qp.quantize(boxes_f), score_qp.quantize(scores_f)
    consts = {"max": np.array([max_out], np.int64), "iou": np.array([iou], np.float32)}
    if score is not None:
        consts["score"] = np.array([score], np.float32)
    names = ["boxes", "scores"] + list(consts)
    node = Node("nms", "NonMaxSuppression", names, ["sel"], {"center_point_box": center})
    const_inputs = {i + 2: v for i, v in enumerate(consts.values())}
    q = get_op("NonMaxSuppression").quantize(context(node, [box_qp, score_qp, None, None, None], [None], const_inputs))
    check_quantized(q)
    sel = get_op("NonMaxSuppression").forward_int(q, [boxes, scores] + list(consts.values()), runtime())[0]
    assert sel.dtype == np.int64 and sel.shape[1] == 3 and len(sel) > 0

    box_c = boxes.astype(np.int64) - int(box_qp.zero_point[0])
    score_c = scores.astype(np.int64) - int(score_qp.zero_point[0])
    iou_mn = (q.iou.m * q.iou.sign, q.iou.n)
    score_smn = None if score is None else (q.score.sign, q.score.m, q.score.n)
    np.testing.assert_array_equal(sel, _python_nms(box_c, score_c, center, max_out, iou_mn, score_smn))
    if iou:
        assert abs(q.iou.m / 2 ** q.iou.n - iou) <= iou * 2 ** -14
    want = ort_run("NonMaxSuppression", {"boxes": box_qp.dequantize(boxes), "scores": score_qp.dequantize(scores)},
                   {"center_point_box": center}, consts)[0]
    np.testing.assert_array_equal(sel, want)
    float_sel = get_op("NonMaxSuppression").forward_float(
        node, [box_qp.dequantize(boxes), score_qp.dequantize(scores)] + list(consts.values()))[0]
    np.testing.assert_array_equal(float_sel, want)


def test_constant_anchors_and_missing_max_output():
    rng = np.random.default_rng(9)
    anchors = _boxes(rng, 1, 12, 0)
    score_qp = random_qparams(rng, 0.0, 1.0, 8, signed=False)
    scores = score_qp.quantize(rng.uniform(0, 1, (1, 2, 12)))
    node = Node("nms", "NonMaxSuppression", ["a", "s", "m", "i"], ["sel"])
    consts = {0: anchors, 2: np.array([12], np.int64), 3: np.array([0.4], np.float32)}
    q = get_op("NonMaxSuppression").quantize(context(node, [None, score_qp, None, None], [None], consts))
    assert q.in_qparams[0].bits == 16
    sel = get_op("NonMaxSuppression").forward_int(q, [anchors, scores, consts[2], consts[3]], runtime())[0]
    want = ort_run("NonMaxSuppression", {"a": anchors, "s": score_qp.dequantize(scores)}, {},
                   {"m": consts[2], "i": consts[3]})[0]
    np.testing.assert_array_equal(sel, want)
    no_max = Node("nms", "NonMaxSuppression", ["a", "s"], ["sel"])
    q = get_op("NonMaxSuppression").quantize(context(no_max, [None, score_qp], [None], {0: anchors}))
    assert get_op("NonMaxSuppression").forward_int(q, [anchors, scores], runtime())[0].shape == (0, 3)


def test_run_time_threshold_is_refused():
    qp = random_qparams(np.random.default_rng(0), 0, 1, 8)
    node = Node("nms", "NonMaxSuppression", ["b", "s", "m", "iou"], ["sel"])
    with pytest.raises(QuantizationError, match="iou_threshold"):
        get_op("NonMaxSuppression").quantize(context(node, [qp, qp, None, None], [None], {2: np.array([3])}))


def test_nms_runs_in_integers_in_a_graph():
    """Scores from a graph input through Sigmoid, constant anchors: the NonMaxSuppression node, whose only output
    is int64, is an integer step and selects what the Python-integer NMS selects on the graph's own codes."""
    from onnx import TensorProto, helper, numpy_helper

    from ptq.engine.executor import NodeKind, prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(4)
    anchors = _boxes(rng, 1, 20, 0)
    nodes = [helper.make_node("Sigmoid", ["x"], ["scores"], name="sigmoid"),
             helper.make_node("NonMaxSuppression", ["anchors", "scores", "max", "iou", "thr"], ["sel"], name="nms")]
    inits = [numpy_helper.from_array(anchors, "anchors"), numpy_helper.from_array(np.array([5], np.int64), "max"),
             numpy_helper.from_array(np.array([0.45], np.float32), "iou"),
             numpy_helper.from_array(np.array([0.4], np.float32), "thr")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 20])],
                       [helper.make_tensor_value_info("sel", TensorProto.INT64, [None, 3])], inits)
    x = rng.normal(0, 1.5, (8, 1, 2, 20)).astype(np.float32)
    result = calibrate(model, x[:, 0], write_qdq=False)
    graph = prepare(result.graph, result.table)
    assert {s.node.name: s.kind for s in graph.steps}["nms"] is NodeKind.INTEGER
    out = graph.run({"x": x[0]})
    q = graph.steps[-1].quantized
    box_c = q.box_codes.astype(np.int64) - int(q.in_qparams[0].zero_point[0])
    score_c = out.tensors["scores"].astype(np.int64) - int(out.qparams["scores"].zero_point[0])
    want = _python_nms(box_c, score_c, 0, 5, (q.iou.m, q.iou.n), (q.score.sign, q.score.m, q.score.n))
    np.testing.assert_array_equal(out.outputs["sel"], want)
    assert len(want) > 0


def _iou(a, b):
    """IoU of two [y1, x1, y2, x2] boxes (corners in order)."""
    h = min(a[2], b[2]) - max(a[0], b[0])
    w = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(h, 0) * max(w, 0)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_detection_head_runs_with_zero_float_nodes():
    """Conv -> box decoding (anchors + deltas) and Sigmoid scores -> TopK -> Gather -> NonMaxSuppression ->
    Gather of the kept boxes: every node runs in integers (or on index tensors), and every box onnxruntime's
    float model keeps has a kept integer box with IoU >= 0.9."""
    from onnx import TensorProto, helper, numpy_helper
    import onnxruntime as ort

    from ptq.engine.executor import prepare
    from ptq.calibration.pipeline import calibrate
    from tiny_models import make_model

    rng = np.random.default_rng(12)
    centers = np.stack(np.meshgrid(np.arange(8) + 0.5, np.arange(8) + 0.5, indexing="ij"), -1).reshape(64, 2) * 2
    anchors = np.concatenate([centers - 1.5, centers + 1.5], axis=1)[None].astype(np.float32)  # (1, 64, 4)
    w = rng.normal(0, 0.15, (6, 3, 1, 1)).astype(np.float32)
    w[4:] *= 4  # spread class scores
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    inits = {"W": w, "anchors": anchors, "k": i64(24), "max": i64(6), "iou": np.array([0.5], np.float32),
             "thr": np.array([0.35], np.float32), "s0": i64(0), "s4": i64(4), "s6": i64(6), "ax1": i64(1),
             "box_shape": i64(1, 4, 64), "score_shape": i64(1, 2, 64), "c0": i64(0), "c1": i64(1),
             "col": i64(2), "col_end": i64(3), "ax0": i64(0), "sq1": i64(1)}
    n = helper.make_node
    nodes = [n("Conv", ["x", "W"], ["feat"], name="conv"),
             n("Slice", ["feat", "s0", "s4", "ax1"], ["deltas_map"], name="slice_deltas"),
             n("Reshape", ["deltas_map", "box_shape"], ["deltas_t"], name="reshape_deltas"),
             n("Transpose", ["deltas_t"], ["deltas"], perm=[0, 2, 1], name="transpose_deltas"),
             n("Add", ["anchors", "deltas"], ["boxes"], name="decode"),
             n("Slice", ["feat", "s4", "s6", "ax1"], ["logits_map"], name="slice_logits"),
             n("Reshape", ["logits_map", "score_shape"], ["logits"], name="reshape_logits"),
             n("Sigmoid", ["logits"], ["scores"], name="sigmoid"),
             n("Slice", ["scores", "c0", "c1", "ax1"], ["score0"], name="class0"),
             n("Squeeze", ["score0", "ax1"], ["score0_flat"], name="squeeze_class"),
             n("TopK", ["score0_flat", "k"], ["top_scores", "top_idx"], name="topk"),
             n("Squeeze", ["top_idx", "ax0"], ["top_idx_flat"], name="squeeze_idx"),
             n("Gather", ["boxes", "top_idx_flat"], ["top_boxes"], axis=1, name="gather_boxes"),
             n("Gather", ["scores", "top_idx_flat"], ["top_class_scores"], axis=2, name="gather_scores"),
             n("NonMaxSuppression", ["top_boxes", "top_class_scores", "max", "iou", "thr"], ["sel"], name="nms"),
             n("Slice", ["sel", "col", "col_end", "ax1"], ["sel_col"], name="slice_sel"),
             n("Squeeze", ["sel_col", "sq1"], ["sel_box"], name="squeeze_sel"),
             n("Gather", ["top_boxes", "sel_box"], ["kept"], axis=1, name="gather_kept")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("kept", TensorProto.FLOAT, [1, None, 4]),
                        helper.make_tensor_value_info("sel", TensorProto.INT64, [None, 3])],
                       [numpy_helper.from_array(v, k) for k, v in inits.items()])
    x = rng.normal(0, 1, (16, 1, 3, 8, 8)).astype(np.float32)
    # 16-bit activations: 8-bit codes of 64 sigmoid scores tie and reorder the TopK (the whitepaper, 5.1.3,
    # keeps detection scores in int16 for this reason)
    result = calibrate(model, x[:, 0], write_qdq=False, bits=16)
    graph = prepare(result.graph, result.table)
    assert graph.float_nodes == []
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    matched = 0
    for sample in x[:6]:
        want = sess.run(["kept"], {"x": sample})[0][0]
        got = graph.run({"x": sample}).outputs["kept"][0]
        for box in want:
            assert max((_iou(box, g) for g in got), default=0.0) >= 0.9
            matched += 1
    assert matched >= 6
