"""Compiled lookup-table gather (`lut.table.LookupTable.lookup`), one pass, integer operations only:

    index = |x_q| (half table) or x_q - qmin_x (full table)
    y     = T[index]                                                        direct table
    y     = ((T[i] << s) + (T[min(i+1, last)] - T[i]) * f + 2^(s+F-1)) >> (s+F)   interpolated:
            i = index >> s, f = index & (2^s - 1), F fractional bits of the nodes
    y     = S - y   when x_q < 0 in an odd half table (mirror sum S)
    y_q   = clamp(y, qmin_y, qmax_y) in the output dtype

Codes outside [qmin_x, qmax_x] are counted and refused, as the numpy lookup refuses them.
The same integers as the numpy path, so the LSB bound stated in `ops.lut_ops` holds unchanged.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def gather(x, table, qmin, qmax, half, odd, mirror_sum, shift, frac_bits, lo, hi, out) -> int:
    """out = the lookup (module docstring) of the flat codes x; returns the count of out-of-range codes
    (out is then incomplete)."""
    last = table.shape[0] - 1
    total = shift + frac_bits
    rounding = (np.int64(1) << total) >> 1
    mask = (np.int64(1) << shift) - 1
    for i in range(x.shape[0]):
        v = np.int64(x[i])
        if v < qmin or v > qmax:
            return 1
        index = (v if v >= 0 else -v) if half else v - qmin
        if shift > 0:
            j = index >> shift
            e0 = np.int64(table[j])
            e1 = np.int64(table[min(j + 1, last)])
            y = ((e0 << shift) + (e1 - e0) * (index & mask) + rounding) >> total
        else:
            y = np.int64(table[index])
        if odd and v < 0:
            y = mirror_sum - y
        out[i] = min(max(y, lo), hi)
    return 0


def lookup(table, q: np.ndarray) -> Optional[np.ndarray]:
    """`table.lookup(q)` of a `lut.table.LookupTable`; None for non-integer codes (the numpy path raises)."""
    q = np.asarray(q)
    if q.dtype.kind not in "iu":
        return None
    iq, oq = table.in_qparams, table.out_qparams
    out = np.empty(q.shape, dtype=oq.dtype)
    bad = gather(np.ascontiguousarray(q).reshape(-1), table.table, iq.qmin, iq.qmax, table.half,
                 table.half and table.mirror == "odd", int(table.mirror_sum), int(table.shift),
                 int(table.frac_bits), oq.qmin, oq.qmax, out.reshape(-1))
    if bad:
        raise ValueError(f"lookup: codes outside the input range [{iq.qmin}, {iq.qmax}]")
    return out
