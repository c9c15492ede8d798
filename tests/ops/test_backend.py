"""ops/backend.py: the exact-BLAS dot product and the default backend."""
from __future__ import annotations

import numpy as np
import pytest

from ops.backend import FLOAT32_EXACT, FLOAT64_EXACT, NumpyBackend, absmax, exact_matmul, matmul_method
from ops.registry import DotBackend


def _int64_ref(a, b):
    """Python-integer matmul (no float, no int64 wrap): the ground truth."""
    a = a.astype(object)
    b = b.astype(object)
    return np.array([[sum(a[i, k] * b[k, j] for k in range(a.shape[1])) for j in range(b.shape[1])]
                     for i in range(a.shape[0])], dtype=object)


@pytest.mark.parametrize("k, a_range, b_range, method", [
    (300, (-128, 128), (0, 256), "float32"),         # 300 * 128 * 255 < 2^24
    (4096, (-128, 128), (-128, 128), "float64"),     # 2^12 * 2^14 > 2^24
    (2048, (0, 65536), (-32768, 32768), "float64"),  # 16-bit x 16-bit, 2^11 * 2^31 < 2^53
])
def test_exact_matmul_equals_int64_on_large_k(k, a_range, b_range, method):
    rng = np.random.default_rng(k)
    a = rng.integers(*a_range, size=(5, k))
    b = rng.integers(*b_range, size=(k, 7))
    # extreme values everywhere in one row/column: the largest possible partial sums
    a[0] = a_range[0] if abs(a_range[0]) >= abs(a_range[1] - 1) else a_range[1] - 1
    b[:, 0] = b_range[0] if abs(b_range[0]) >= abs(b_range[1] - 1) else b_range[1] - 1
    assert matmul_method(k, absmax(a), absmax(b)) == method
    got = exact_matmul(a.astype(np.int32), b.astype(np.int32))
    # int32 exactly when the bound proves the product fits it
    assert got.dtype == (np.int32 if k * absmax(a) * absmax(b) < (1 << 31) else np.int64)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_float32_bound_is_tight_at_the_limit():
    k = 1024
    a = np.full((1, k), 127, dtype=np.int8)
    b = np.full((k, 1), 128, dtype=np.int16)  # K * 127 * 128 = 16,646,144 < 2^24
    assert k * 127 * 128 < FLOAT32_EXACT
    assert matmul_method(k, 127, 128) == "float32"
    assert exact_matmul(a, b)[0, 0] == k * 127 * 128
    b[0, 0] = 130  # now the bound fails for float32: 1024 * 127 * 130 > 2^24
    assert k * 127 * 130 >= FLOAT32_EXACT
    assert matmul_method(k, 127, 130) == "float64"
    assert exact_matmul(a, b)[0, 0] == k * 127 * 128 + 2 * 127


def test_int64_fallback_when_float64_bound_fails():
    rng = np.random.default_rng(1)
    a = rng.integers(-(1 << 30), 1 << 30, size=(3, 16), dtype=np.int64)
    b = rng.integers(-(1 << 30), 1 << 30, size=(16, 4), dtype=np.int64)
    a[:, 0] = (1 << 30) + 1  # odd products whose sums need all 62 bits
    b[0, :] = (1 << 30) - 1
    assert 16 * absmax(a) * absmax(b) >= FLOAT64_EXACT
    assert matmul_method(16, absmax(a), absmax(b)) == "int64"
    truth = _int64_ref(a, b)
    got = exact_matmul(a, b)
    assert np.array_equal(got.astype(object), truth)
    # the float64 product really is wrong here: the fallback is needed, not decorative
    float_result = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)
    assert not np.array_equal(float_result.astype(object), truth)


def test_exact_matmul_broadcasts_batches_and_validates():
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, size=(2, 3, 4, 5)).astype(np.int8)
    b = rng.integers(0, 256, size=(3, 5, 6)).astype(np.uint8)
    np.testing.assert_array_equal(exact_matmul(a, b), np.matmul(a.astype(np.int64), b.astype(np.int64)))
    with pytest.raises(TypeError, match="integer"):
        exact_matmul(a.astype(np.float32), b)
    with pytest.raises(ValueError, match="inner dimensions"):
        exact_matmul(a, b[:, :4])


def test_absmax_handles_int8_minimum():
    assert absmax(np.array([-128, 5], dtype=np.int8)) == 128
    assert absmax(np.array([], dtype=np.int8)) == 0


def test_numpy_backend_is_a_dot_backend():
    backend: DotBackend = NumpyBackend()
    assert backend.name == "numpy"
    a = np.array([[1, -2]], dtype=np.int8)
    b = np.array([[3], [4]], dtype=np.uint8)
    np.testing.assert_array_equal(backend.matmul(a, b), [[-5]])


def test_narrow_dtypes_with_small_values_still_pick_exact_arithmetic():
    """The dtype bound is only a shortcut: when it fails, the true extrema decide (and stay exact)."""
    rng = np.random.default_rng(3)
    a = rng.integers(-3, 4, size=(4, 5000)).astype(np.int16)  # dtype bound 32768 would force float64
    b = rng.integers(0, 256, size=(5000, 3)).astype(np.uint8)
    np.testing.assert_array_equal(exact_matmul(a, b), a.astype(np.int64) @ b.astype(np.int64))
    big = np.full((2, 5000), 32767, dtype=np.int16)
    np.testing.assert_array_equal(exact_matmul(big, b), big.astype(np.int64) @ b.astype(np.int64))
