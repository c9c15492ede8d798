"""ops/linear.py: the output stage shared by the linear ops (Conv, ConvTranspose, Gemm, MatMul, BatchNormalization)."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import ref_requant
from ptq.core.qparams import QParams


@pytest.mark.parametrize("r, mbits, want_shift", [(2.0 ** -20, 15, 3), (2.0 ** -17, 15, 0), (2.0 ** -10, 31, 0),
                                                  (2.0 ** -19.5, 31, 3), (2.0 ** -30, 8, 6)])
def test_tiny_requant_factors_pre_round_the_accumulator(r, mbits, want_shift):
    """r below min(2^(mbits-32), 2^-17) gets P pre-shift bits so that M keeps its width; the real factor
    M / 2^(N+P) stays within M's precision of r, and the pre-rounding costs below 2^-17 LSB."""
    from ops.linear import output_stage

    y_qp = QParams(scale=1.0, zero_point=0, bits=16, signed=True)
    stage = output_stage(np.array([r]), y_qp, mbits, None)
    shift = 0 if stage.pre_shift is None else int(stage.pre_shift[0])
    assert shift == want_shift
    assert int(stage.m[0]) >= 2 ** (min(mbits, 15) - 1)
    assert abs(stage.m[0] / 2.0 ** (stage.n[0] + shift) - r) <= r * 2.0 ** -(min(mbits, 15) - 1)
    assert 0.5 * r * 2 ** shift < 2.0 ** -17 or shift == 0
    acc = np.array([-(1 << 40) - 12345, -7, 0, 5, (1 << 40) + 99], dtype=np.int64)
    pre = ref_requant(acc, 1, shift, 0, -2 ** 62, 2 ** 62) if shift else acc
    np.testing.assert_array_equal(stage.apply(acc.copy()), ref_requant(pre, stage.m, stage.n, 0, -32768, 32767))
