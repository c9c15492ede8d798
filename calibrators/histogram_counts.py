"""The counting pass of `calibrators.histogram.HistogramCollector.update` in one compiled loop over the values.

For each value x of channel c, with the channel's scale 2^-e_c (0 for a channel that has only seen zeros):

    counts[c, [x < 0], trunc(|x * 2^-e_c|)] += 1        zeros[c] += [x == 0]

the index of `calibrators.histogram.flat_bin_index` counted by `np.bincount`: the same integers. The product is
taken in float64, where it is exact for a float32 or float64 x and a normal 2^-e (the numpy formula's float32
product is exact too wherever it is 1 or more, and below 1 both truncate to 0). The numpy formula makes six
temporaries the size of the batch and a bincount over them; this loop reads each value once. Exact zeros (most
of a Relu's output) are counted apart, and a long row counts into `LANES` histograms in turn, summed at its
end: one count incremented again and again waits for its own previous increment.
"""
from __future__ import annotations

import numba
import numpy as np

LANES = 4  # histograms a long row counts into in turn (a power of two)
LANES_FROM = 8  # rows of at least this many values per bin (both sides) use them: their sum costs 2 * B * LANES


@numba.njit(cache=True, nogil=True)
def add_counts(values, scale, counts, zeros) -> int:
    """Fold `values` (C, n) float32/float64 into `counts` (C, 2, B) int64 and `zeros` (C,) int64 with the per-channel
    `scale` (C,) float64 (module docstring); returns the values whose bin falls past B, left uncounted (none when
    2^e_c bounds the channel's max|x| as `width_exponent` chooses it)."""
    bins = counts.shape[2]
    n = values.shape[1]
    lanes = LANES if n >= LANES_FROM * 2 * bins else 1
    sub = np.zeros((lanes, 2, bins), dtype=np.int64)
    outside = 0
    for c in range(values.shape[0]):
        s = scale[c]
        z = 0
        held = sub if lanes > 1 else counts[c:c + 1]
        for k in range(n):
            x = np.float64(values[c, k])
            if x == 0:
                z += 1
                continue
            j = np.int64(np.trunc(abs(x * s)))
            if j >= bins:
                outside += 1
            else:
                held[k & (lanes - 1), 1 if x < 0 else 0, j] += 1
        if lanes > 1:
            for lane in range(lanes):
                for side in range(2):
                    for j in range(bins):
                        counts[c, side, j] += sub[lane, side, j]
                        sub[lane, side, j] = 0
        counts[c, 0, 0] += z
        zeros[c] += z
    return outside
