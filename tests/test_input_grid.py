"""A graph input whose calibration samples are finer than 8-bit data takes 16 bits by default
(`ptq.calibration.input_grid`, issue 24); image-like inputs (at most 256 values per channel) keep 8 bits."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from ptq.calibration.input_grid import DistinctValues, widen_fine_inputs
from ptq.calibration.pipeline import calibrate
from ptq.cli import main
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.table.quant_table import CalibrationOptions, load_quant_table
from tiny_models import conv_relu_gemm

MEAN, STD = np.array([0.4, 0.5, 0.6]), np.array([0.2, 0.25, 0.3])


def _continuous(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (count, 3, 8, 8)).astype(np.float32)


def _pixels(count: int, seed: int = 0) -> np.ndarray:
    """8-bit images normalized per channel, as the image loader feeds them: 256 values per channel at most."""
    codes = np.random.default_rng(seed).integers(0, 256, (count, 3, 8, 8))
    return ((codes / 255.0 - MEAN[:, None, None]) / STD[:, None, None]).astype(np.float32)


def test_distinct_values_counts_per_channel_and_stops_past_the_limit():
    counter = DistinctValues(limit=4)
    counter.update(np.array([[[0.0, 1.0]], [[2.0, 3.0]]]).transpose(1, 0, 2))  # [1, 2 channels, 2]
    assert counter.most == 2 and not counter.exceeded
    counter.update(np.array([[[0.5, 1.0, 0.25], [9.0, 9.0, 9.0]]]))  # channel 0 now {0, .25, .5, 1}, 1 {2, 3, 9}
    assert counter.most == 4 and not counter.exceeded
    counter.update(np.array([[[7.0], [2.0]]]))
    assert counter.exceeded


def test_continuous_samples_give_the_input_16_bits_and_say_why():
    result = calibrate(conv_relu_gemm(), _continuous(16), write_qdq=False, calibrator="extrema")
    entry = result.table.tensors["input"]
    assert entry.qparams.bits == 16 and "finer than 8-bit data" in entry.why
    # over the calibrated range (extrema: the samples' own); every other activation keeps 8 bits
    assert np.isclose(float(entry.min[0]), _continuous(16).min()) and np.isclose(float(entry.max[0]),
                                                                               _continuous(16).max())
    others = [e.qparams.bits for n, e in result.table.tensors.items() if e.kind == "activation" and n != "input"]
    assert others and set(others) == {8}


def test_image_like_samples_keep_8_bits():
    result = calibrate(conv_relu_gemm(), _pixels(16), write_qdq=False)
    entry = result.table.tensors["input"]
    assert entry.qparams.bits == 8 and not entry.why


def test_the_integer_run_holds_the_continuous_input_on_its_16_bit_grid():
    model, samples = conv_relu_gemm(), _continuous(16)
    result = calibrate(model, samples, write_qdq=False)
    graph = load_model(model)
    table8 = dataclasses.replace(result.table, tensors=dict(result.table.tensors))
    entry = table8.tensors["input"]
    qp8 = CalibrationOptions().derive_qparams("activation", entry.min, entry.max, 8)
    table8.tensors["input"] = entry.__class__("activation", entry.calibrator, entry.min, entry.max, qp8)
    held_out = _continuous(16, seed=1)
    errors = {}
    for bits, table in ((16, result.table), (8, table8)):
        prepared = prepare(graph, table)
        run = [prepared.run({"input": x[None]}, keep_all=True) for x in held_out]
        # the input codes hold the samples inside the calibrated range to half a step of their grid
        qp = table.tensors["input"].qparams
        lo, hi = qp.real_range()
        inside = (held_out >= float(lo[0])) & (held_out <= float(hi[0]))
        decoded = qp.dequantize(np.concatenate([r.tensors["input"] for r in run]))
        assert inside.mean() > 0.9
        assert np.abs(decoded - held_out)[inside].max() <= float(qp.scale[0]) / 2 + 1e-6
        errors[bits] = float(np.abs(decoded - held_out)[inside].mean())
    assert errors[16] < errors[8] / 100


def test_an_input_whose_entry_is_already_wide_or_absent_is_left_alone():
    graph = load_model(conv_relu_gemm())
    result = calibrate(conv_relu_gemm(), _continuous(8), write_qdq=False, bits=16)
    entries = dict(result.table.tensors)
    assert widen_fine_inputs(graph, entries, iter([_continuous(8)]), result.table.options) == []
    assert widen_fine_inputs(graph, {}, iter([_continuous(8)]), result.table.options) == []


def test_cli_calibrate_on_data_files_gives_the_input_16_bits(tmp_path):
    model = tmp_path / "net.onnx"
    onnx.save(conv_relu_gemm(), model)
    data = tmp_path / "data"
    data.mkdir()
    for k, x in enumerate(_continuous(6)):
        np.save(data / f"s{k}.npy", x[None])
    assert main(["calibrate", str(model), "--data", str(data), "--out", str(tmp_path / "o"), "-q"]) == 0
    entry = load_quant_table(tmp_path / "o" / "net.quant.json").tensors["input"]
    assert entry.qparams.bits == 16 and "finer than 8-bit data" in entry.why
