"""The requant epilogue of the integer dot-product kernels, on a block of int32 accumulator rows.

Per accumulator A (int32, the exact dot product) of channel c, with T = A * M[c] + K[c] (K = offset * M +
2^(N-1) + zp * 2^N, `ops.compiled.requant.lane_params`), the output code is clamp(floor(T / 2^N[c]), lo, hi):
`ops.compiled.requant`'s FAST case, computed here in one of two ways that give the same integers:

- 64-bit lanes (`requant.requant_positions`' arithmetic, 8 per 512-bit vector), always valid in the FAST case;
- 32-bit lanes (16 per vector) when every channel has 0 <= M < 2^15, 16 <= N <= 47 and |K| < 2^46
  (`params32`, checked per call): with A = Ah * 2^16 + Al (0 <= Al < 2^16) and K = Kh * 2^16 + Kl
  (0 <= Kl < 2^16),

      T = (Ah * M + Kh) * 2^16 + L,   L = Al * M + Kl,   0 <= L <= (2^16 - 1)(2^15 - 1) + 2^16 - 1 < 2^31
      floor(T / 2^N) = floor((Ah * M + Kh + floor(L / 2^16)) / 2^(N - 16))

  (floor(a * 2^16 + b) / 2^16 = a + floor(b / 2^16) for integers), and |Ah * M| < 2^30, |Kh| < 2^30,
  floor(L / 2^16) < 2^15 keep every term and the sum inside int32.

Outside the FAST case (a saturating accumulator, a LeakyRelu's negative side, pre-rounding) the rows go
through `requant.requant_positions`.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.compiled.requant import FAST, HI, LO, SIGN_BIT, SUB, K, M, N, requant_positions

M32_LIMIT = 1 << 15
K32_LIMIT = 1 << 46


@numba.njit(cache=True, nogil=True)
def params32(offset, prm):
    """(valid, M, Kl, Kh, N - 16) per channel as int32 arrays for the 32-bit lanes (module docstring); valid is
    False when a channel is outside their conditions (the other arrays are then meaningless)."""
    channels = prm.shape[1]
    m = np.empty(channels, dtype=np.int32)
    k_low = np.empty(channels, dtype=np.int32)
    k_high = np.empty(channels, dtype=np.int32)
    shift = np.empty(channels, dtype=np.int32)
    valid = True
    for c in range(channels):
        mc = prm[M, c]
        nc = prm[N, c]
        k = offset[c] * mc + prm[K, c]
        if mc < 0 or mc >= M32_LIMIT or nc < 16 or nc > 47 or k >= K32_LIMIT or k <= -K32_LIMIT:
            valid = False
        m[c] = np.int32(mc)
        k_low[c] = np.int32(k & 0xFFFF)
        k_high[c] = np.int32(k >> 16)
        shift[c] = np.int32(nc - 16)
    return valid, m, k_low, k_high, shift


@numba.njit(cache=True, nogil=True, inline="always")
def _rows64(acc, width, count, channels, lanes, sub, lo, hi, out, out_at) -> None:
    """out[out_at + r * channels + c] = clamp(floor(T / 2^N), lo, hi) of acc[r * width + c], 64-bit lanes.
    (Unsigned indices: no negative-index wrap-around, no array views per row, so the loop along the channels
    vectorizes without reference counting.)"""
    m32, k_row, shift = lanes
    for r in range(count):
        a0 = np.uint64(r * width)
        o0 = np.uint64(out_at + r * channels)
        for c in range(channels):
            i = np.uint64(c)
            y = np.int64((np.uint64(np.int64(acc[a0 + i]) * np.int64(m32[i]) + k_row[i]) ^ SIGN_BIT) >> shift[i])
            out[o0 + i] = min(max(y - sub[i], lo), hi)


@numba.njit(cache=True, nogil=True, inline="always")
def _rows32(acc, width, count, channels, lanes32, lo, hi, out, out_at) -> None:
    """`_rows64` in 32-bit lanes (module docstring; every intermediate cast back to int32 so that the loop
    stays in 32-bit vector lanes, the casts never wrap under its conditions)."""
    _, m, k_low, k_high, shift = lanes32
    lo32 = np.int32(lo)
    hi32 = np.int32(hi)
    for r in range(count):
        a0 = np.uint64(r * width)
        o0 = np.uint64(out_at + r * channels)
        for c in range(channels):
            i = np.uint64(c)
            a = acc[a0 + i]
            low = np.int32(np.int32(np.int32(a & 0xFFFF) * m[i]) + k_low[i])
            high = np.int32(np.int32(np.int32(a >> 16) * m[i]) + k_high[i])
            y = np.int32(np.int32(high + np.int32(low >> 16)) >> (shift[i] & 31))
            out[o0 + i] = min(max(y, lo32), hi32)


@numba.njit(cache=True, nogil=True, inline="always")
def requant_rows(acc, width, count, channels, offset, prm, lim, lanes, lanes32, out, out_at, rows) -> int:
    """The epilogue of accumulator rows acc[r * width + c] (r < count, c < channels) into the flat output codes
    out[out_at + r * channels + c], which `rows` (count, channels) also views; `lanes` =
    `requant.lane_params(offset, prm)`, `lanes32` = `params32(offset, prm)`. Returns the overflow count."""
    if lim[FAST] == 0:
        return requant_positions(acc.reshape(-1, width)[:count, :channels], offset, prm, lim, lanes, rows)
    if lanes32[0]:
        _rows32(acc, width, count, channels, lanes32, lim[LO], lim[HI], out, out_at)
    else:
        _rows64(acc, width, count, channels, lanes, prm[SUB], lim[LO], lim[HI], out, out_at)
    return 0
