import csv
import io
import json
import math
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pytest

from ptq.core.qparams import QParams, compute_qparams
from reports.html import render_html
from reports.layers import LayerReport, OutputReport, Report, cosine_drops, rank_bottlenecks
from reports.metrics import Similarity
from reports.value_histogram import ValueHistogram
from reports.writers import CSV_COLUMNS, report_csv, report_json, summary_text


def _sim(cos, mse=0.01, sqnr=20.0, err=0.1):
    return Similarity(cosine=cos, mse=mse, sqnr_db=sqnr, max_abs_err=err, samples=4)


def _layer(name, inputs, cum, iso, op="Conv", qp=None):
    qp = qp or compute_qparams(-1.0, 1.0, 8)
    return LayerReport(name=name, node=f"node_{name}", op_type=op, qparams=qp, inputs=inputs,
                       cumulative=_sim(cum), isolated=_sim(iso), cosine_drop=0.0)


def _chain():
    """input -> a -> b -> c, with a damaged b: b alone loses 0.2, and c inherits b's loss."""
    layers = [
        _layer("input", [], 0.9999, 0.9999, op="Input"),
        _layer("a", ["input"], 0.999, 0.999),
        _layer("b", ["a"], 0.80, 0.80),
        _layer("c <&>", ["b"], 0.79, 0.795),
    ]
    drops = cosine_drops([l.name for l in layers], {l.name: l.inputs for l in layers},
                         {l.name: l.cumulative.cosine for l in layers})
    for layer in layers:
        layer.cosine_drop = drops[layer.name]
    return layers


def test_cosine_drop_is_min_input_minus_own():
    drops = cosine_drops(["x", "y", "z"], {"y": ["x"], "z": ["x", "y"]}, {"x": 0.99, "y": 0.95, "z": 0.94})
    assert drops["x"] == pytest.approx(0.01)  # from the exact float input
    assert drops["y"] == pytest.approx(0.04)
    assert drops["z"] == pytest.approx(0.01)  # from the worse input


def test_ranking_charges_the_damaged_layer_not_its_consumer():
    ranked = rank_bottlenecks(_chain())
    assert ranked[0].name == "b"
    assert "falls 0.1990" in ranked[0].reason and "adds 0.1990" in ranked[0].reason
    assert ranked[0].score == pytest.approx(0.199 + 0.1 * 0.199)
    # c: alone 0.205 lost, but 0.2 of it inherited from b -> adds 0.005; cumulative drop 0.01 counts a tenth
    c = next(b for b in ranked if b.name == "c <&>")
    assert c.score == pytest.approx(0.005 + 0.1 * 0.01)
    assert rank_bottlenecks(_chain(), top=2)[1].name == "c <&>"


def _report():
    layers = _chain()
    layers[1].qparams = QParams(scale=np.array([0.1, 0.2]), zero_point=np.array([0, 0]), axis=1)
    values = np.random.default_rng(0).normal(0, 0.6, size=1000).astype(np.float32)
    for layer in layers:
        layer.histogram = ValueHistogram.for_grid(layer.qparams, 2)
        layer.histogram.update(values)
    return Report(
        model="model.onnx", quant="model.quant.json", images=4, layers=layers,
        outputs=[OutputReport("logits", Similarity(0.98, 0.5, math.inf, 1.5, 4))],
        classification={"samples": 4, "top1_agreement": 0.75, "top5_agreement": 1.0, "labelled": 4,
                        "float_accuracy": 0.5, "int_accuracy": 0.25},
        bottlenecks=rank_bottlenecks(layers), notes=["a note"],
    )


def test_json_has_the_documented_fields():
    data = json.loads(report_json(_report()))
    assert [l["name"] for l in data["layers"]] == ["input", "a", "b", "c <&>"]
    layer = data["layers"][2]
    assert {"name", "op_type", "bits", "qparams", "cumulative", "isolated", "cosine_drop"} <= set(layer)
    assert set(layer["cumulative"]) == {"cosine", "mse", "sqnr_db", "max_abs_err"}
    assert layer["qparams"]["scale"] == pytest.approx(2 / 255)
    assert data["layers"][1]["qparams"]["granularity"] == "per-channel"
    assert data["outputs"]["tensors"][0]["sqnr_db"] is None  # infinite -> null
    assert data["outputs"]["top1_agreement"] == 0.75 and data["outputs"]["int_accuracy"] == 0.25
    assert data["bottlenecks"][0]["name"] == "b" and data["bottlenecks"][0]["reason"]
    assert layer["clipped_fraction"] == 0.0
    hist = data["histograms"]["b"]
    assert list(data["histograms"]) == ["input", "a", "b", "c <&>"]
    assert sum(hist["counts"]) == 1000 and len(hist["counts"]) == hist["inner_bins"] + 2 * hist["margin_bins"] + 2
    assert hist["below"] + hist["above"] == sum(hist["counts"][:17]) + sum(hist["counts"][-17:]) > 0


def test_csv_one_row_per_layer():
    rows = list(csv.reader(io.StringIO(report_csv(_report()))))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [r[1] for r in rows[1:]] == ["input", "a", "b", "c <&>"]
    by_col = dict(zip(rows[0], rows[3]))
    assert by_col["suspect_rank"] == "1" and float(by_col["cumulative_cosine"]) == pytest.approx(0.8)
    assert dict(zip(rows[0], rows[2]))["scale"] == "0.1..0.2"


def test_summary_lists_outputs_and_suspects():
    text = summary_text(_report())
    assert "output logits: cosine 0.980000" in text
    assert "top-1 agreement 0.750" in text
    assert "1. b:" in text


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)


def test_html_is_well_formed_and_self_contained():
    page = render_html(_report())
    body = page.split("\n", 1)[1]  # the doctype aside, the page is well-formed XML
    root = ET.fromstring(body)
    assert root.tag == "html"
    parser = _Collector()
    parser.feed(page)
    parser.close()
    assert {"svg", "table", "script", "style", "polyline", "circle"} <= set(parser.tags)
    # no resource outside the page: no URLs, no src/href attributes, no CSS imports
    assert not re.search(r"(https?:|//[a-z0-9.-]+\.[a-z]{2,}/|url\(|@import)", page, re.I)
    assert not [a for a, _ in parser.attrs if a in ("src", "href")]
    # the layer names are escaped; each layer is one table row
    assert "c &lt;&amp;&gt;" in page
    rows = root.findall(".//table[@id='layers']/tbody/tr")
    assert len(rows) == 4
    assert rows[2].get("class") == "suspect"
    # a histogram per suspect (the per-channel layer "a" among them), a hover target per layer
    report = _report()
    figures = root.findall(".//figure[@class='hist']")
    assert [f.get("data-layer") for f in figures] == [b.name for b in report.bottlenecks]
    assert [g.get("data-layer") for g in root.findall(".//g[@class='pt']")] == ["input", "a", "b", "c <&>"]
    assert "per-channel grid" in page and page.count('class="bar"') == sum(
        np.count_nonzero(layer.histogram.counts) for layer in report.layers if layer.name in
        {b.name for b in report.bottlenecks})
    assert len(render_html(report, histograms=1).split('<figure class="hist"')) == 2


# --- end to end on a three-layer toy graph: x -> Gemm -> t1 -> Gemm -> t2 -> Gemm -> y (identity weights) ---

def _toy_model():
    from onnx import TensorProto, helper, numpy_helper

    eye, zero = np.eye(8, dtype=np.float32), np.zeros(8, dtype=np.float32)
    inits, nodes = [], []
    for k, (src, dst) in enumerate((("x", "t1"), ("t1", "t2"), ("t2", "y")), 1):
        inits += [numpy_helper.from_array(eye, f"W{k}"), numpy_helper.from_array(zero, f"b{k}")]
        nodes.append(helper.make_node("Gemm", [src, f"W{k}", f"b{k}"], [dst], name=f"gemm{k}", transB=1))
    graph = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _fq(qp, v):
    return qp.dequantize(qp.quantize(v)).astype(np.float64)


def _hand_similarity(ref, test):
    """Independent float64 formulas: mean per-sample cosine, global mse and sqnr, max abs error."""
    cos = np.mean([a @ b / np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(ref, test)])
    err = ref - test
    return cos, np.mean(err**2), 10 * np.log10(np.sum(ref**2) / np.sum(err**2)), np.abs(err).max()


def test_float_reference_returns_every_listed_tensor_of_one_sample_on_one_thread():
    from ptq.core.graph import load_model
    from reports.float_reference import float_reference

    x = np.random.default_rng(2).normal(size=(1, 8)).astype(np.float32)
    runner = float_reference(load_model(_toy_model()), ["t2", "x", "t1", "t2"])
    floats = runner.run_dict(x)
    assert sorted(floats) == ["t1", "t2", "x"]
    for name, value in floats.items():  # identity Gemms: every tensor is the input, exactly
        assert np.array_equal(value, x), name
    assert runner.session.get_session_options().intra_op_num_threads == 1


@pytest.mark.parametrize("threads", [True, False], ids=["helper-threads", "one-thread"])
def test_isolated_vs_cumulative_on_toy_graph(threads):
    from ptq.calibration.pipeline import calibrate
    from ptq.core.graph import load_model
    from reports.build import build_report
    from reports.evaluate import evaluate
    from ptq.data.image_source import ArraySamples
    from reports.tables import scale_range

    model = _toy_model()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 8)).astype(np.float32)
    table = calibrate(model, x, write_qdq=False).table
    damaged = scale_range(table, "t1", 1 / 20)  # t1 saturates: its range shrinks 20x
    ev = evaluate(load_model(model), damaged, ArraySamples(x), threads=threads)
    report = build_report(ev, "toy", "damaged")
    layers = {layer.name: layer for layer in report.layers}
    assert list(layers) == ["x", "t1", "t2", "y"]
    q0, q1, q2, q3 = (ev.qparams[n] for n in ("x", "t1", "t2", "y"))
    assert q1.scale[0] == pytest.approx(table.qparams("t1").scale[0] / 20, rel=1e-6)

    xf = x.astype(np.float64)  # identity layers: every float tensor equals x
    # cumulative: each layer requantizes what the integer graph produced upstream
    cum1 = _fq(q1, _fq(q0, xf))
    cum2 = _fq(q2, cum1)
    cum3 = _fq(q3, cum2)
    # isolated: each layer is fed the float tensor quantized with its input's qparams
    iso = {"x": _fq(q0, xf), "t1": _fq(q1, _fq(q0, xf)), "t2": _fq(q2, _fq(q1, xf)), "y": _fq(q3, _fq(q2, xf))}
    cum = {"x": _fq(q0, xf), "t1": cum1, "t2": cum2, "y": cum3}
    # the integer Gemm requantizes with M/2^N (15-bit M): within 1 LSB of the ideal, hence the tolerances
    for name in layers:
        for kind, expected in (("cumulative", cum[name]), ("isolated", iso[name])):
            got = getattr(layers[name], kind)
            cos, mse, sqnr, err = _hand_similarity(xf, expected)
            assert got.cosine == pytest.approx(cos, abs=2e-3), (name, kind)
            assert got.mse == pytest.approx(mse, rel=0.05, abs=1e-5), (name, kind)
            assert got.sqnr_db == pytest.approx(sqnr, abs=0.5), (name, kind)
            lsb = ev.qparams[name].scale[0]
            assert got.max_abs_err == pytest.approx(err, abs=1.01 * lsb), (name, kind)
    # the damage is cumulative downstream, but the last layer alone is fine
    assert layers["y"].cumulative.cosine < 0.9 < 0.999 < layers["y"].isolated.cosine
    assert layers["t1"].isolated.cosine < 0.9
    assert report.bottlenecks[0].name == "t1"
    lo, hi = q1.real_range()
    beyond = np.mean((xf < lo[0] - q1.scale[0] / 2) | (xf > hi[0] + q1.scale[0] / 2))
    assert beyond > 0.5 and layers["t1"].clipped == pytest.approx(beyond)
    assert layers["t2"].clipped == 0.0  # t2 keeps its calibrated range
    assert "beyond its range" in report.bottlenecks[0].reason
    # t1's histogram: the float values (x) over t1's grid, the clipped ones in the outer bins
    hist = layers["t1"].histogram
    edges = hist.edges()
    inside, _ = np.histogram(xf, bins=edges)
    np.testing.assert_array_equal(hist.counts, [np.sum(xf < edges[0]), *inside, np.sum(xf >= edges[-1])])
    assert hist.below + hist.above == round(beyond * xf.size) and hist.counts[-1] > 0
    assert layers["t2"].histogram.below + layers["t2"].histogram.above == 0
    assert report.outputs[0].similarity.cosine == pytest.approx(layers["y"].cumulative.cosine, abs=1e-12)


@pytest.mark.parametrize("bits, symmetric", [(8, False), (8, True), (16, False), (16, True)])
def test_dequantize32_equals_qparams_dequantize_on_every_code(bits, symmetric):
    from reports.grid import dequantize32

    qp = compute_qparams(-1.3, 4.1, bits, symmetric=symmetric)
    codes = np.arange(qp.qmin, qp.qmax + 1).astype(qp.dtype)
    assert np.array_equal(dequantize32(qp, codes), qp.dequantize(codes))


@pytest.mark.parametrize("threads", [True, False], ids=["helper-thread", "calling-thread"])
def test_worker_keeps_at_most_lag_images_open_and_reraises_their_errors(threads):
    from reports.inline import background
    from reports.worker import MetricWorker

    done = []
    with background(threads, "test") as pool:
        worker = MetricWorker(pool)
        worker.LAG = 2
        worker.submit(done.append, 0)
        worker.settle()
        worker.submit(lambda: 1 / 0)  # image 1 fails in the worker
        worker.settle()
        assert len(worker.open) == 2  # nothing waited for yet
        worker.settle()  # a third open image: waits for image 0
        assert done == [0] and len(worker.open) == 2
        with pytest.raises(ZeroDivisionError):
            worker.settle()  # waits for image 1, whose error surfaces in the calling thread
