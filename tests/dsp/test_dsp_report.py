"""Slice plans and the packed-DSP resource report (`ptq dsp-report`), counted by hand on a tiny model."""
import json

import numpy as np
import onnx
import pytest

from dsp.backend import DspBackend
from dsp.packing import CodeRange
from dsp.plan import plan_dot
from ptq.cli import main
from ptq.core.graph import load_model
from ptq.data.images import Preprocess
from ptq.calibration.pipeline import calibrate
from reports.dsp_resources import DspArray, dsp_report, report_text
from tiny_models import conv_relu_gemm, write_images

RAW = Preprocess(mean=0, std=255, crop_ratio=1.0)
INT8, UINT8, INT4, UINT4 = CodeRange(8, True), CodeRange(8, False), CodeRange(4, True), CodeRange(4, False)


def test_plans_pack_pixels_for_depthwise_and_put_unsigned_activations_on_b():
    depthwise = plan_dot("int8", (96, 1, 9), (1, 96, 9, 3136), INT8, UINT8)  # one output channel per group
    assert depthwise.swap and depthwise.scheme.case == "iuu"  # two pixels share each weight
    assert depthwise.ops == 96 * 1568 * 9 and depthwise.macs == 96 * 3136 * 9 and depthwise.chain_ops == 96 * 1568 * 12
    gemm = plan_dot("int4", (1, 1280), (1280, 1000), UINT4, INT4)  # activation @ weight
    assert gemm.swap and gemm.scheme.x == UINT4 and gemm.scheme.w == INT4
    assert gemm.ops == 500 * 1 * 1280 and gemm.lane_slots == 4 * gemm.ops


def test_backend_stats_are_the_plans():
    rng = np.random.default_rng(2)
    for scheme, (lo, hi) in (("int8", (-128, 128)), ("int4", (0, 16))):
        backend = DspBackend(scheme)
        a, b = rng.integers(lo, hi, (3, 7, 11)), rng.integers(-8, 8, (11, 5))
        backend.matmul(a, b)
        bits = 8 if scheme == "int8" else 4
        plan = plan_dot(scheme, a.shape, b.shape, CodeRange(bits, lo < 0), CodeRange(bits, True))
        stats = backend.stats
        assert (stats.macs, stats.ops, stats.chain_ops, stats.lane_slots) == (
            plan.macs, plan.ops, plan.chain_ops, plan.lane_slots)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model_path = folder / "tiny.onnx"
    onnx.save(conv_relu_gemm(batch=1), model_path)
    write_images(folder / "images", 5, size=(8, 8))
    result = calibrate(model_path, folder / "images", folder / "out", preprocess=RAW)
    return model_path, result.table, result.table_path


def test_report_counts_every_layer_by_hand(tiny):
    model_path, table, _ = tiny
    report = dsp_report(load_model(model_path), table, DspArray(dsps=100, clock_mhz=200))
    conv, gemm = report.layers
    assert (conv.name, conv.op_type, gemm.name, gemm.op_type) == ("act", "Conv", "logits", "Gemm")
    # Conv: weights (4, 27) int8 @ uint8 columns (27, 64): 2 weight rows per slice, 128 slices, K = 27,
    # uint8 x int8 chains of 4: 7 chains, 28 slots
    s = conv.stats["int8"]
    assert (s.macs, s.ops, s.chain_ops, s.lane_slots) == (4 * 27 * 64, 128 * 27, 128 * 28, 2 * 128 * 27)
    # int4: 2 rows x 2 pixels per slice, 64 slices, chains of 8: 4 chains, 32 slots
    s = conv.stats["int4"]
    assert (s.ops, s.chain_ops, s.lane_slots) == (64 * 27, 64 * 32, 4 * 64 * 27)
    # Gemm: (1, 4) uint8 @ (4, 5) int8: 2 output channels share the activation, 3 slices (one lane padded)
    s = gemm.stats["int8"]
    assert (s.macs, s.ops, s.chain_ops) == (20, 12, 12) and s.padding_loss == pytest.approx(1 / 6)
    s = gemm.stats["int4"]  # 3 slices of 2 x 2 lanes: 12 lanes per k, 5 useful; chains of 8 for K = 4
    assert (s.ops, s.chain_ops) == (12, 24) and s.padding_loss == pytest.approx(1 - 20 / 48)
    assert report.cycles("int8") == 36 + 1 and report.cycles("int4") == 21 + 1
    assert report.array.milliseconds(37) == pytest.approx(37 / 200e3)
    text = report_text(report, top=1)
    assert "1    act" in text and "logits" not in text.split("ranked")[1]


def test_dsp_report_command_writes_json(tiny, tmp_path, capsys):
    model_path, _, table_path = tiny
    argv = ["dsp-report", str(model_path), "--quant", str(table_path)]
    assert main(argv + ["--dsps", "100", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dsp_report.json").read_text())
    assert data["dsps"] == 100 and data["totals"]["int8"]["cycles"] == 37
    assert [layer["name"] for layer in data["layers"]] == ["act", "logits"]
    assert "MACs/DSP/cyc" in capsys.readouterr().out
    assert main(argv + ["--dsps", "0"]) == 2
    assert "positive slice count" in capsys.readouterr().err


def test_report_with_a_dsp_backend_adds_the_resource_section(tiny, tmp_path, capsys):
    model_path, _, table_path = tiny
    argv = ["report", str(model_path), "--quant", str(table_path), "--images", str(model_path.parent / "images"),
            "--out", str(tmp_path), "--backend", "dsp:int8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layers ranked by int8 cycles" in out and "acc rank" in out
    assert json.loads((tmp_path / "dsp_report.json").read_text())["totals"]["int8"]["macs"] == 4 * 27 * 64 + 20
    assert main(argv[:-2] + ["--out", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "dsp_report.json").exists()
