"""`auto`, the calibrator that chooses per tensor: the candidate range with the least expected error on its grid
(issue #26, scope 1)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from calibrators import TensorStatistics, get_calibrator
from calibrators.methods.auto import CANDIDATES, Auto
from ptq.core.qparams import compute_qparams
from ptq.calibration.pipeline import calibrate
from tiny_models import conv_relu_gemm


def statistics(x: np.ndarray, chunks: int = 1) -> TensorStatistics:
    stats = TensorStatistics(Auto.needs)
    for part in np.array_split(x, chunks):
        stats.update(part)
    return stats


def true_error(x: np.ndarray, rmin, rmax, symmetric: bool = False) -> float:
    qp = compute_qparams(rmin, rmax, 8, symmetric=symmetric)
    return float(np.mean((qp.dequantize(qp.quantize(x)) - x) ** 2))


def test_the_expected_error_ranks_candidates_as_their_real_error_does():
    """clip_weight 1: E is the mean squared error itself; on a skewed, heavy-tailed tensor (a GELU-like
    output with rare large values) the chosen range's real error is within 2% of the best candidate's."""
    rng = np.random.default_rng(0)
    z = rng.standard_t(3, 200_000)
    x = np.where(z > 0, z, 0.1 * z)
    stats = statistics(x)
    auto = Auto(clip_weight=1.0)
    ranges, errors = auto.scores(stats, 8, True)
    real = [true_error(x, lo, hi) for lo, hi in ranges]
    assert np.argmin(errors[:, 0]) == np.argmin(real) or min(real) * 1.02 >= real[int(np.argmin(errors[:, 0]))]
    np.testing.assert_allclose(errors[:, 0], real, rtol=0.1)  # s^2/12 assumes values uniform within a step
    rmin, rmax = auto.compute(stats, 8)
    assert true_error(x, rmin, rmax) <= min(real) * 1.02
    assert rmax[0] < x.max()  # a clipping candidate wins over extrema here


def test_a_saturation_spike_at_the_top_is_never_clipped():
    """A hard-sigmoid gate: 16% of the values are exactly 1.0; clipping them costs their full distance."""
    rng = np.random.default_rng(1)
    x = np.clip(rng.normal(0.7, 0.3, 100_000), 0.0, 1.0)
    stats = statistics(x)
    assert get_calibrator("auto").compute(stats, 8)[1][0] == pytest.approx(1.0)


def test_merged_shards_choose_what_one_pass_chooses():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(0, 1, 50_000), rng.normal(0, 1, 50_000) * 3])
    one = statistics(x)
    left, right = statistics(x[:30_000], chunks=3), statistics(x[30_000:], chunks=2)
    got = get_calibrator("auto").compute_explained(left.merge(right), 8)
    want = get_calibrator("auto").compute_explained(one, 8)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]


def test_per_channel_choices_and_the_label():
    rng = np.random.default_rng(3)
    x = np.stack([rng.normal(0, 1, 20_000), np.clip(rng.normal(0.7, 0.3, 20_000), 0, 1)], axis=1)
    stats = TensorStatistics(Auto.needs, axis=1)
    stats.update(x)
    rmin, rmax, label = get_calibrator("auto").compute_explained(stats, 8)
    assert rmin.shape == rmax.shape == (2,)
    assert rmax[1] == pytest.approx(1.0) and rmax[0] < x[:, 0].max()
    choice = label.split(":", 1)[1].split(" ", 1)[0]
    assert label.startswith("auto:") and choice in CANDIDATES and "of extrema's" in label


def test_bad_candidates_raise():
    with pytest.raises(ValueError, match="other calibrators"):
        Auto(candidates=("auto",))
    with pytest.raises(ValueError, match="beyond the histogram"):
        Auto(candidates=("3std",))
    with pytest.raises(ValueError, match="clip_weight"):
        Auto(clip_weight=0)


def test_calibrate_records_each_choice_and_the_summary_counts_them():
    rng = np.random.default_rng(4)
    result = calibrate(conv_relu_gemm(batch=None), rng.uniform(0, 1, (16, 3, 8, 8)).astype(np.float32),
                       calibrator="auto", write_qdq=False)
    labels = [e.calibrator for e in result.table.tensors.values() if e.kind == "activation"]
    assert result.table.options.calibrator == "auto" and labels and all(lab.startswith("auto:") for lab in labels)
    chosen = [lab.split(":", 1)[1].split(" ", 1)[0] for lab in labels]
    line = next(line for line in result.summary().splitlines() if line.startswith("tensors calibrated"))
    for name in set(chosen):
        assert f"{name} {chosen.count(name)}" in line


def test_a_named_calibrator_is_the_one_used():
    rng = np.random.default_rng(4)
    pixels = np.round(rng.uniform(0, 1, (16, 3, 8, 8)) * 255) / 255  # 8-bit data: the input keeps 8 bits
    result = calibrate(conv_relu_gemm(batch=None), pixels.astype(np.float32), calibrator="kld", write_qdq=False)
    assert {e.calibrator for e in result.table.tensors.values() if e.kind == "activation"} == {"kld"}
    assert "(kld, 8-bit)" in result.summary()


def test_a_clamped_tensor_is_scored_as_its_consumer_sees_it():
    """A ReLU6's input, N(2, 4): a quarter of it is above 6, where the consumer saturates it. Scored within
    [0, 6], every candidate's range is folded to [0, 6] or below and the error is that of the clamped values,
    so cutting the spike at 6 is what costs; unclamped, the label named a choice and an E ratio for values the
    folded range never holds (before `within`: `auto:mse (E 0.44 of extrema's ...)`, range then folded to
    [0, 6] all the same)."""
    rng = np.random.default_rng(5)
    x = rng.normal(2.0, 4.0, 200_000)
    stats = statistics(x)
    clamped = np.clip(x, 0.0, 6.0)
    auto = get_calibrator("auto").within(0.0, 6.0)
    ranges, errors = auto.scores(stats, 8, True)
    for (lo, hi), error in zip(ranges, errors[:, 0]):
        assert 0.0 <= lo[0] <= hi[0] <= 6.0
        # the clamped values sit exactly on 6, E spreads them over the bin holding it (+13% here)
        assert error == pytest.approx(true_error(clamped, lo, hi), rel=0.2)
    rmin, rmax, label = auto.compute_explained(stats, 8)
    assert (rmin[0], rmax[0]) == (0.0, pytest.approx(6.0))
    assert "E 1 of extrema's" in label
    assert "E 1 of extrema's" not in get_calibrator("auto").compute_explained(stats, 8)[2]


def test_a_one_sided_clamp_keeps_the_other_side():
    """HardSwish's input: flat below -3 only. The tail below -3 costs nothing beyond the clamp; the top is
    scored (and clipped) as before, on a grid that no longer spends steps below -3."""
    rng = np.random.default_rng(6)
    x = rng.normal(0.0, 3.0, 100_000)
    stats = statistics(x)
    auto = get_calibrator("auto").within(-3.0, np.inf)
    ranges, errors = auto.scores(stats, 8, True)
    for (lo, hi), error in zip(ranges, errors[:, 0]):
        assert lo[0] >= -3.0
        assert error == pytest.approx(true_error(np.maximum(x, -3.0), lo, hi), rel=0.2)
    rmin, rmax = auto.compute(stats, 8)
    assert rmin[0] == pytest.approx(-3.0) and 3.0 < rmax[0] <= x.max()


def test_calibrate_scores_a_clamped_input_within_its_clamp():
    """The pipeline passes each folded tensor's clamp to the calibrator: the Conv output feeding Clip(0, 6)
    records the choice and E that `within(0, 6)` gives on its values (onnxruntime's, one histogram pass)."""
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 1, (16, 3, 8, 8)).astype(np.float32)
    model = conv_relu_gemm(batch=None)
    model.graph.output.append(onnx.helper.make_tensor_value_info("conv", onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    conv = session.run(["conv"], {"input": x})[0]
    del model.graph.output[-1]
    entry = calibrate(model, x, calibrator="auto", write_qdq=False).table.tensors["conv"]
    rmin, rmax, label = get_calibrator("auto").within(0.0, 6.0).compute_explained(statistics(conv.ravel()), 8)
    assert entry.calibrator == label and (entry.min[0], entry.max[0]) == (rmin[0], rmax[0])
    assert label != get_calibrator("auto").compute_explained(statistics(conv.ravel()), 8)[2]
