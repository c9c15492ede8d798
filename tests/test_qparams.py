import numpy as np
import pytest

from ptq.core.qparams import QParams, compute_qparams, integer_range


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_asymmetric_covers_range_and_zero_exact(bits):
    qp = compute_qparams(-1.3, 4.1, bits, symmetric=False)
    assert qp.signed
    assert qp.dequantize(qp.quantize(np.array([0.0])))[0] == 0.0
    lo, hi = qp.real_range()
    half = qp.scale[0] / 2
    assert lo[0] <= -1.3 + half and hi[0] >= 4.1 - half
    x = np.linspace(-1.3, 4.1, 1001)
    err = np.abs(qp.dequantize(qp.quantize(x)) - x)
    assert err.max() <= qp.scale[0] / 2 + 1e-6


def test_symmetric_full_and_restricted_range():
    full = compute_qparams(-2.0, 1.0, 8, symmetric=True)
    assert full.qmin == -128 and full.zero_point[0] == 0
    assert full.scale[0] == pytest.approx(2.0 / 127.5, rel=1e-6)
    narrow = compute_qparams(-2.0, 1.0, 8, symmetric=True, narrow=True)
    assert narrow.qmin == -127
    assert narrow.scale[0] == pytest.approx(2.0 / 127, rel=1e-6)


def test_unsigned_chosen_for_non_negative_range():
    qp = compute_qparams(0.0, 6.0, 8, symmetric=True)
    assert not qp.signed and qp.dtype == np.uint8
    assert qp.scale[0] == pytest.approx(6.0 / 255, rel=1e-6)
    assert qp.quantize(np.array([-1.0, 6.0]))[0] == 0


def test_empty_range_gets_scale_one():
    qp = compute_qparams(0.0, 0.0, 8, symmetric=False)
    assert qp.scale[0] == 1.0
    pc = compute_qparams([0.0, -1.0], [0.0, 1.0], 8, axis=0)
    assert pc.scale[0] == 1.0 and pc.scale[1] != 1.0


def test_per_channel_quantize_along_axis():
    w = np.stack([np.linspace(-1, 1, 9), np.linspace(-8, 8, 9)]).reshape(2, 9)
    qp = compute_qparams(w.min(axis=1), w.max(axis=1), 8, axis=0)
    q = qp.quantize(w)
    assert q[0].max() == 127 and q[1].max() == 127
    assert np.abs(qp.dequantize(q) - w).max() <= qp.scale.max() / 2 + 1e-6


def test_pow2_scales():
    qp = compute_qparams(-3.0, 3.0, 8, pow2=True)
    assert np.log2(qp.scale[0]) == np.round(np.log2(qp.scale[0]))
    assert qp.real_range()[1][0] >= 3.0 - qp.scale[0]


def test_round_half_even_and_saturation():
    qp = QParams(scale=[1.0], zero_point=[0], bits=8, signed=True)
    assert list(qp.quantize(np.array([0.5, 1.5, 2.5, -0.5, 300.0, -300.0]))) == [0, 2, 2, 0, 127, -128]


def test_dict_round_trip():
    qp = compute_qparams([-1.0, -2.0], [1.0, 3.0], 4, symmetric=False, axis=1)
    assert QParams.from_dict(qp.to_dict()) == qp


@pytest.mark.parametrize("bad", [dict(scale=[0.0], zero_point=[0]), dict(scale=[np.nan], zero_point=[0]),
                                 dict(scale=[1.0], zero_point=[300]), dict(scale=[1.0], zero_point=[0], bits=1)])
def test_invalid_qparams_rejected(bad):
    with pytest.raises(ValueError):
        QParams(**bad)


def test_nan_range_rejected():
    with pytest.raises(ValueError, match="NaN"):
        compute_qparams(np.nan, 1.0)


def test_integer_range():
    assert integer_range(4, True) == (-8, 7)
    assert integer_range(4, False) == (0, 15)
    assert integer_range(16, True, narrow=True) == (-32767, 32767)


@pytest.mark.parametrize("bits, symmetric, per_channel", [(8, False, False), (8, True, True), (16, False, True)])
def test_quantize_follows_the_onnx_formula_bit_for_bit(bits, symmetric, per_channel):
    """clamp(round_half_even(x / scale) + zp) with x / scale in float64, per tensor and per channel."""
    rng = np.random.default_rng(bits)
    lo, hi = np.array([-1.3, -0.2, -2.0]), np.array([4.1, 0.9, 1.0])
    qp = compute_qparams(lo, hi, bits, symmetric=symmetric, axis=1) if per_channel else \
        compute_qparams(-1.3, 4.1, bits, symmetric=symmetric)
    x = rng.uniform(-3, 6, (2, 3, 5, 7)).astype(np.float32)
    x[0, :, 0, :3] = (np.arange(3) + 0.5) * qp.scale.max()  # near the half-way points, and beyond the range
    shape = (1, 3, 1, 1) if per_channel else ()
    scale, zp = qp.scale.reshape(shape), qp.zero_point.reshape(shape)
    want = np.clip(np.rint(x.astype(np.float64) / scale) + zp, qp.qmin, qp.qmax)
    got = qp.quantize(x)
    assert got.dtype == qp.dtype
    np.testing.assert_array_equal(got, want)
