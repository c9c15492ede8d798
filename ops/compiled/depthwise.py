"""Compiled grouped (and depthwise) 2-D convolution with the requant epilogue fused.

Per image n, output channel m of group g = m // (M / G), output position (oh, ow), with Cg = C / G input
channels per group and the centered weight w = w_q - zp_w (int32):

    A[n, m, oh, ow] = sum_{ci < Cg, kh, kw} (x_q[n, g*Cg + ci, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl] - zp_x)
                                             * w[m, ci, kh, kw]  +  b_q[m]
    y_q[n, m, oh, ow] = epilogue(A) (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

Taps that fall in the padding contribute (zp_x - zp_x) * w = 0, which is the numpy path's padding with the
code zp_x followed by its zero-point fold (sum x w - zp_x sum w): the same integer A. The sum runs in int32
when Cg * kh * kw * max|x_q - zp_x| * max|w| < 2^31 proves it exact (the wrapped int32 multiply-add is then
the true sum), else in int64. 1-D convolutions run as 2-D ones of height 1.
The same integers as the numpy path, so the LSB bound stated in `ops.conv` holds unchanged.
"""
from __future__ import annotations

import math
from typing import Optional

import numba
import numpy as np

from ops.compiled.requant import pack_stage, requant_positions, requant_row
from ops.compiled.scratch import scratch

# Grouped convolutions with more input channels per group than this go through BLAS instead.
MAX_DIRECT_GROUP_CHANNELS = 8


@numba.njit(cache=True, nogil=True)
def _ow_range(off, sw, width, ow_count):
    """The output columns ow with 0 <= ow * sw + off < width."""
    lo = 0 if off >= 0 else (-off + sw - 1) // sw
    hi = (width - off + sw - 1) // sw if width > off else 0
    return lo, min(hi, ow_count)


@numba.njit(cache=True, nogil=True)
def _grouped_rows(x, w, zx, n, m, cin0, oh, sh, sw, dh, dw, pt, pl, row):
    """row[ow] = sum_{ci, kh, kw} (x[n, cin0 + ci, ih, iw] - zx) * w[m, ci, kh, kw] over the taps inside x."""
    height = x.shape[2]
    width = x.shape[3]
    row[:] = 0
    for ci in range(w.shape[1]):
        for kh in range(w.shape[2]):
            ih = oh * sh + kh * dh - pt
            if ih < 0 or ih >= height:
                continue
            xrow = x[n, cin0 + ci, ih]
            for kw in range(w.shape[3]):
                wv = w[m, ci, kh, kw]
                off = kw * dw - pl
                lo, hi = _ow_range(off, sw, width, row.shape[0])
                for ow in range(lo, hi):
                    row[ow] += (xrow[ow * sw + off] - zx) * wv


@numba.njit(cache=True, nogil=True)
def conv_grouped(x, w, zx, groups, sh, sw, dh, dw, pt, pl, bias, prm, lim, row, out) -> int:
    """out = epilogue(grouped conv of x (N, C, H, W) with w (M, C/G, KH, KW) + bias); returns overflows."""
    per_group = w.shape[0] // groups
    cg = w.shape[1]
    over = 0
    for n in range(out.shape[0]):
        for m in range(out.shape[1]):
            cin0 = (m // per_group) * cg
            for oh in range(out.shape[2]):
                _grouped_rows(x, w, zx, n, m, cin0, oh, sh, sw, dh, dw, pt, pl, row)
                over += requant_row(row, bias[m], m, prm, lim, out[n, m, oh])
    return over


@numba.njit(cache=True, nogil=True)
def _centered_phases(x, n, c, zx, pt, pl, phases) -> None:
    """The zero-bordered centered plane p[pt + i, pl + j] = x[n, c, i, j] - zx, stored by column phase of the
    stride s: phases[r, i, q] = p[i, q * s + r], so that every tap reads a contiguous run."""
    stride = phases.shape[0]
    width = x.shape[3]
    for r in range(stride):
        j0 = (r - pl) % stride  # the first input column j whose padded column pl + j is in phase r
        q0 = (j0 + pl) // stride
        count = (width - j0 + stride - 1) // stride if width > j0 else 0
        for i in range(x.shape[2]):
            src = x[n, c, i]
            dst = phases[r, i + pt]
            for t in range(count):  # a branch-free strided copy
                dst[q0 + t] = np.int32(src[j0 + t * stride]) - np.int32(zx)


@numba.njit(cache=True, nogil=True)
def depthwise_rows(x, w, zx, sh, dh, dw, pt, pl, bias, prm, lim, phases, row, out) -> int:
    """Depthwise conv (w: (M, KH, KW), input channel m // (M / C)) of x (N, C, H, W), one output row at a
    time over the zero-bordered centered plane split in column phases of the stride (`_centered_phases`);
    out (N, M, OH * OW). Long rows: wide, shallow layers."""
    mult = w.shape[0] // x.shape[1]
    sw = phases.shape[0]
    ow_count = row.shape[0]
    oh_count = out.shape[2] // ow_count
    over = 0
    phases[:, :, :] = 0
    for n in range(x.shape[0]):
        for m in range(w.shape[0]):
            if m % mult == 0:
                _centered_phases(x, n, m // mult, zx, pt, pl, phases)
            for oh in range(oh_count):
                row[:] = 0
                for kh in range(w.shape[1]):
                    ih = oh * sh + kh * dh
                    if w.shape[2] == 3:  # a whole kernel row per pass over the row accumulators
                        s0 = phases[0, ih, :]
                        s1 = phases[dw % sw, ih, dw // sw:]
                        s2 = phases[2 * dw % sw, ih, 2 * dw // sw:]
                        w0, w1, w2 = w[m, kh, 0], w[m, kh, 1], w[m, kh, 2]
                        for j in range(ow_count):
                            row[j] += s0[j] * w0 + s1[j] * w1 + s2[j] * w2
                        continue
                    for kw in range(w.shape[2]):
                        wv = w[m, kh, kw]
                        start = kw * dw
                        src = phases[start % sw, ih, start // sw:start // sw + ow_count]
                        for j in range(ow_count):
                            row[j] += src[j] * wv
                over += requant_row(row, bias[m], m, prm, lim, out[n, m, oh * ow_count:(oh + 1) * ow_count])
    return over


@numba.njit(cache=True, nogil=True)
def depthwise_channels_last(x, w, zx, sh, sw, dh, dw, pt, pl, bias, prm, lim, ow_count, xl, wl, acc, out) -> int:
    """Depthwise conv as `depthwise_rows`, channels innermost: xl (Hp, Wp, M) the centered input repeated per
    multiplier with a zero border, wl (KH, KW, M), acc (OH * OW, M). Long channel loops: deep, small layers."""
    mult = w.shape[0] // x.shape[1]
    channels = w.shape[0]
    height = x.shape[2]
    width = x.shape[3]
    over = 0
    xl[:pt] = 0  # the padding border; the interior is written below
    xl[pt + height:] = 0
    xl[:, :pl] = 0
    xl[:, pl + width:] = 0
    for m in range(channels):
        for kh in range(w.shape[1]):
            for kw in range(w.shape[2]):
                wl[kh, kw, m] = w[m, kh, kw]
    for n in range(x.shape[0]):
        for i in range(height):
            for c0 in range(0, x.shape[1], TILE):  # tiles of channels: reads and writes stay in cache lines
                c1 = min(c0 + TILE, x.shape[1])
                for j in range(width):
                    dst = xl[i + pt, j + pl]
                    for c in range(c0, c1):
                        v = np.int32(x[n, c, i, j]) - np.int32(zx)
                        for k in range(mult):
                            dst[c * mult + k] = v
        for p in range(acc.shape[0]):
            oh = p // ow_count
            ow = p % ow_count
            a = acc[p]
            a[:] = 0
            for kh in range(w.shape[1]):
                xrow = xl[oh * sh + kh * dh]
                wrow = wl[kh]
                col = ow * sw
                if w.shape[2] == 3:  # a whole kernel row per pass over the accumulators
                    s0, s1, s2 = xrow[col], xrow[col + dw], xrow[col + 2 * dw]
                    w0, w1, w2 = wrow[0], wrow[1], wrow[2]
                    for m in range(channels):
                        a[m] += s0[m] * w0[m] + s1[m] * w1[m] + s2[m] * w2[m]
                elif w.shape[2] == 5:
                    s0, s1, s2, s3, s4 = (xrow[col], xrow[col + dw], xrow[col + 2 * dw], xrow[col + 3 * dw],
                                          xrow[col + 4 * dw])
                    w0, w1, w2, w3, w4 = wrow[0], wrow[1], wrow[2], wrow[3], wrow[4]
                    for m in range(channels):
                        a[m] += s0[m] * w0[m] + s1[m] * w1[m] + s2[m] * w2[m] + s3[m] * w3[m] + s4[m] * w4[m]
                else:
                    for kw in range(w.shape[2]):
                        src = xrow[col + kw * dw]
                        wr = wrow[kw]
                        for m in range(channels):
                            a[m] += src[m] * wr[m]
        over += requant_positions(acc, bias, prm, lim, out[n])
    return over


# Channels per tile of the channels-last transposition (16 int32 values: one 64-byte cache line).
TILE = 16
# Output rows shorter than this run channels-last (measured on EfficientNet-Lite0's layers).
CHANNELS_LAST_BELOW = 48


def _depthwise(x, wk, zx, strides, dilations, pads, bias, packed, out_hw, acc_dtype, out):
    """Run one of the two depthwise kernels on (N, C, H, W) codes into out (N, M, OH, OW)."""
    kh, kw = wk.shape[2:]
    hp = max(x.shape[2] + pads[0], (out_hw[0] - 1) * strides[0] + (kh - 1) * dilations[0] + 1)
    wp = max(x.shape[3] + pads[1], (out_hw[1] - 1) * strides[1] + (kw - 1) * dilations[1] + 1)
    w3 = wk.reshape(wk.shape[0], kh, kw)
    args = (x, w3, zx, strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1], bias, packed[0],
            packed[1])
    out3 = out.reshape(out.shape[0], out.shape[1], -1)
    if out_hw[1] < CHANNELS_LAST_BELOW:
        channels = wk.shape[0]
        return depthwise_channels_last(*args, out_hw[1], scratch("dw_planes", (hp, wp, channels), acc_dtype),
                                       scratch("dw_weights", (kh, kw, channels), acc_dtype),
                                       scratch("dw_acc", (out_hw[0] * out_hw[1], channels), acc_dtype), out3)
    phases = scratch("dw_phases", (strides[1], hp, -(-wp // strides[1])), acc_dtype)
    return depthwise_rows(x, w3, zx, strides[0], dilations[0], dilations[1], pads[0], pads[1], bias, packed[0],
                          packed[1], phases, scratch("dw_row", (out_hw[1],), acc_dtype), out3)


def conv2d_grouped(x: np.ndarray, q, geom, acc_bits: Optional[int]) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of a grouped Conv (`ops.conv.QuantizedConv` q, resolved geometry);
    None when the convolution is not one this kernel covers (not 1-D/2-D, groups of many channels, a
    stage not laid out per channel)."""
    w = q.weight
    groups = q.groups
    if x.ndim not in (3, 4) or groups == 1 or w.shape[1] > MAX_DIRECT_GROUP_CHANNELS:
        return None
    if x.dtype.kind not in "iu" or x.dtype.itemsize > 2:
        return None
    if x.ndim == 3:  # (N, C, W) as (N, C, 1, W)
        x = x[:, :, None, :]
        w = w[:, :, None, :]
        pads = (0, geom.pads_begin[0], 0, geom.pads_end[0])
        strides, dilations, kernel = (1,) + geom.strides, (1,) + geom.dilations, (1,) + geom.kernel
    else:
        pads = geom.pads_begin + geom.pads_end
        strides, dilations, kernel = geom.strides, geom.dilations, geom.kernel
    n, c, height, width = x.shape
    channels = w.shape[0]
    if c != groups * w.shape[1] or channels % groups:
        return None
    out_hw = [(size + pads[i] + pads[i + 2] - ((k - 1) * d + 1)) // s + 1
              for i, (size, k, s, d) in enumerate(zip((height, width), kernel, strides, dilations))]
    if min(out_hw) < 1:
        return None
    packed = pack_stage(q.stage, channels, acc_bits)
    if packed is None:
        return None
    zx = int(q.in_qparams[0].zero_point[0])
    info = np.iinfo(x.dtype)
    x_dev = max(int(info.max) - zx, zx - int(info.min))
    terms = math.prod(w.shape[1:])
    acc_dtype = np.int32 if terms * x_dev * q.weight_absmax < (1 << 31) else np.int64
    wk = np.ascontiguousarray(w, dtype=acc_dtype)
    x = np.ascontiguousarray(x)
    out = np.empty((n, channels, out_hw[0], out_hw[1]), dtype=q.stage.dtype)
    args = (x, wk, zx, groups, strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1],
            q.bias, packed[0], packed[1])
    if w.shape[1] == 1:
        over = _depthwise(x, wk, zx, strides, dilations, pads, q.bias, packed, out_hw, acc_dtype, out)
    else:
        over = conv_grouped(*args, np.empty(out_hw[1], dtype=acc_dtype), out)
    if len(geom.kernel) == 1:
        out = out[:, :, 0, :]
    return out, int(over)
