"""ops/mean_requant.py: the integer mean shared by AveragePool, GlobalAveragePool and ReduceMean."""
from __future__ import annotations

import numpy as np

from op_testing import Check, context, covers, random_qparams, ref_mean_requant, runtime
from ops import get_op
from ptq.core.graph import Node


@covers("GlobalAveragePool", check=Check.INT_REFERENCE)
def test_mean_overflow_is_saturated_and_reported():
    """16-bit codes summed over 256 * 264 elements exceed int32: saturated, counted per node."""
    x_qp = random_qparams(np.random.default_rng(1), -1.0, 1.0, 16, signed=True, symmetric=True)
    x = np.full((1, 1, 256, 264), x_qp.qmax, dtype=x_qp.dtype)
    node = Node("gap", "GlobalAveragePool", ["x"], ["y"])
    op = get_op("GlobalAveragePool")
    rt = runtime()
    (y,) = op.forward_int(op.quantize(context(node, [x_qp], [x_qp])), [x], rt)
    assert rt.overflows == {"gap": 1}
    saturated = np.full((1, 1, 1, 1), 2**31 - 1, dtype=np.int64)
    np.testing.assert_array_equal(y, ref_mean_requant(saturated, 256 * 264, x_qp, x_qp))
    assert y.item() == 31775  # (2^31 - 1) / 67584 = 31775.03, below the true mean 32767
