"""Compiled grouped (and depthwise) 2-D convolution with the requant epilogue fused.

Per image n, output channel m of group g = m // (M / G), output position (oh, ow), with Cg = C / G input
channels per group and the centered weight w = w_q - zp_w (int32):

    A[n, m, oh, ow] = sum_{ci < Cg, kh, kw} (x_q[n, g*Cg + ci, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl] - zp_x)
                                             * w[m, ci, kh, kw]  +  b_q[m]
    y_q[n, m, oh, ow] = epilogue(A) (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

Taps that fall in the padding contribute (zp_x - zp_x) * w = 0, which is the numpy path's padding with the
code zp_x followed by its zero-point fold (sum x w - zp_x sum w): the same integer A. The sum runs in int32
when Cg * kh * kw * max|x_q - zp_x| * max|w| < 2^31 proves it exact (the wrapped int32 multiply-add is then
the true sum), else in int64. 1-D convolutions run as 2-D ones of height 1. Depthwise layers run channels
innermost (`ops.compiled.layout`): they read a channels-last input as it is and return the (N, M, OH, OW)
view of channels-last codes.
The same integers as the numpy path, so the LSB bound stated in `ops.conv` holds unchanged.
"""
from __future__ import annotations

import math
from typing import Optional

import numba
import numpy as np

from ops.compiled.int_depthwise import depthwise_int
from ops.compiled.int_depthwise16 import depthwise16, depthwise_wide
from ops.compiled.layout import channels_first, channels_last
from ops.compiled.requant import lane_params, pack_stage, requant_positions, requant_row
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
def _load_row(x, x_last, n, i, zx, mult, pl, dst) -> None:
    """dst[pl + j, c * mult + k] = x_q[n, c, i, j] - zx for every column j, channel c and multiplier k < mult:
    one input row, centered, channels innermost. x is (N, H, W, C) when `x_last` (a plain copy along the
    channels), else (N, C, H, W) (transposed in tiles of channels, so that reads and writes stay in cache)."""
    z = np.int32(zx)
    if x_last:
        src = x[n, i]
        for j in range(src.shape[0]):
            s = src[j]
            d = dst[pl + j]
            if mult == 1:
                for c in range(s.shape[0]):
                    d[c] = np.int32(s[c]) - z
            else:
                for c in range(s.shape[0]):
                    for k in range(mult):
                        d[c * mult + k] = np.int32(s[c]) - z
        return
    channels = x.shape[1]
    for c0 in range(0, channels, TILE):
        c1 = min(c0 + TILE, channels)
        for j in range(x.shape[3]):
            d = dst[pl + j]
            for c in range(c0, c1):
                v = np.int32(x[n, c, i, j]) - z
                for k in range(mult):
                    d[c * mult + k] = v


@numba.njit(cache=True, nogil=True)
def depthwise(x, x_last, w, zx, sh, sw, dh, dw, pt, pl, bias, prm, lim, ring, wl, acc, out) -> int:
    """Depthwise conv (w: (M, KH, KW), input channel m // (M / C)) of the codes x, (N, H, W, C) when `x_last`
    else (N, C, H, W), into out (N, OH, OW, M), channels innermost: the SIMD lanes run along the channels,
    whatever the width of the layer.

    ring (R, Wp, M), R = (KH - 1) * dh + 1: the centered input rows one output row reads, channels innermost
    with a zero border (a padded row ip sits in slot ip % R, loaded once: output rows only move down);
    acc (OW, M) one output row's accumulators, computed `span` positions at a time: wl (KH, KW, span * M)
    holds the weight channels-last repeated `span` times (span > 1 needs stride 1: then `span` neighbouring
    positions read one contiguous run of the ring row, and the SIMD loop is long even for few channels)."""
    channels = w.shape[0]
    height = x.shape[1] if x_last else x.shape[2]
    width = x.shape[2] if x_last else x.shape[3]
    mult = channels // (x.shape[3] if x_last else x.shape[1])
    slots = ring.shape[0]
    lanes = lane_params(bias, prm)
    span = wl.shape[2] // channels
    flat_acc = acc.reshape(-1)
    for m in range(channels):
        for kh in range(w.shape[1]):
            for kw in range(w.shape[2]):
                for t in range(span):
                    wl[kh, kw, t * channels + m] = w[m, kh, kw]
    ring[:, :pl] = 0  # the left and right padding; row interiors are written as rows are loaded
    ring[:, pl + width:] = 0
    held = np.empty(slots, dtype=np.int64)
    over = 0
    for n in range(x.shape[0]):
        held[:] = -1
        for oh in range(out.shape[1]):
            for kh in range(w.shape[1]):
                ip = oh * sh + kh * dh
                slot = ip % slots
                if held[slot] != ip:
                    held[slot] = ip
                    if pt <= ip < pt + height:
                        _load_row(x, x_last, n, ip - pt, zx, mult, pl, ring[slot])
                    else:
                        ring[slot, pl:pl + width] = 0
            for ow0 in range(0, acc.shape[0], span):
                count = min(span, acc.shape[0] - ow0) * channels
                a = flat_acc[ow0 * channels:ow0 * channels + count]
                a[:] = 0
                for kh in range(w.shape[1]):
                    xrow = ring[(oh * sh + kh * dh) % slots].reshape(-1)
                    wrow = wl[kh]
                    start = ow0 * sw * channels
                    if w.shape[2] == 3:  # a whole kernel row per pass over the accumulators
                        s0 = xrow[start:start + count]
                        s1 = xrow[start + dw * channels:start + dw * channels + count]
                        s2 = xrow[start + 2 * dw * channels:start + 2 * dw * channels + count]
                        w0, w1, w2 = wrow[0], wrow[1], wrow[2]
                        for i in range(count):
                            a[i] += s0[i] * w0[i] + s1[i] * w1[i] + s2[i] * w2[i]
                    elif w.shape[2] == 5:
                        s0 = xrow[start:start + count]
                        s1 = xrow[start + dw * channels:start + dw * channels + count]
                        s2 = xrow[start + 2 * dw * channels:start + 2 * dw * channels + count]
                        s3 = xrow[start + 3 * dw * channels:start + 3 * dw * channels + count]
                        s4 = xrow[start + 4 * dw * channels:start + 4 * dw * channels + count]
                        w0, w1, w2, w3, w4 = wrow[0], wrow[1], wrow[2], wrow[3], wrow[4]
                        for i in range(count):
                            a[i] += s0[i] * w0[i] + s1[i] * w1[i] + s2[i] * w2[i] + s3[i] * w3[i] + s4[i] * w4[i]
                    else:
                        for kw in range(w.shape[2]):
                            src = xrow[start + kw * dw * channels:start + kw * dw * channels + count]
                            wr = wrow[kw]
                            for i in range(count):
                                a[i] += src[i] * wr[i]
            over += requant_positions(acc, bias, prm, lim, lanes, out[n, oh])
    return over


# Channels per tile of the channels-first row loads (16 int32 values: one 64-byte cache line).
TILE = 16
# Accumulators per SIMD loop of a stride-1 depthwise layer with few channels (positions x channels).
SPAN_LANES = 256


def _depthwise(x, wk, zx, strides, dilations, pads, bias, packed, out_hw, acc_dtype, dtype) -> tuple[np.ndarray, int]:
    """(output codes (N, M, OH, OW), the view of channels-last data; overflow count) of the depthwise kernel
    on (N, C, H, W) codes, read channels-last when they are laid out so."""
    kh, kw = wk.shape[2:]
    channels = wk.shape[0]
    rows = channels_last(x)
    x_last = rows is not None
    if not x_last:
        rows = np.ascontiguousarray(x)
    wp = max(x.shape[3] + pads[1], (out_hw[1] - 1) * strides[1] + (kw - 1) * dilations[1] + 1)
    ring = scratch("dw_ring", ((kh - 1) * dilations[0] + 1, wp, channels), acc_dtype)
    span = max(1, min(out_hw[1], SPAN_LANES // channels)) if strides[1] == 1 else 1
    data = np.empty((x.shape[0], out_hw[0], out_hw[1], channels), dtype=dtype)
    over = depthwise(rows, x_last, wk.reshape(channels, kh, kw), zx, strides[0], strides[1], dilations[0],
                     dilations[1], pads[0], pads[1], bias, packed[0], packed[1], ring,
                     scratch("dw_weights", (kh, kw, span * channels), acc_dtype),
                     scratch("dw_acc", (out_hw[1], channels), acc_dtype), data)
    return channels_first(data), over


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
    done = None
    if w.shape[1] == 1:
        kernel = depthwise16 if x.dtype.itemsize == 2 else depthwise_int
        done = kernel(x, q, w[:, 0], zx, strides, dilations, pads, packed, out_hw)
        if done is None:  # a weight past the instruction's type: 16-bit, as three int8 packs
            done = depthwise_wide(x, q, w[:, 0], zx, strides, dilations, pads, packed, out_hw)
    if done is not None:
        out, over = done
        return (out[:, :, 0, :] if len(geom.kernel) == 1 else out), over
    info = np.iinfo(x.dtype)
    x_dev = max(int(info.max) - zx, zx - int(info.min))
    terms = math.prod(w.shape[1:])
    acc_dtype = np.int32 if terms * x_dev * q.weight_absmax < (1 << 31) else np.int64
    wk = np.ascontiguousarray(w, dtype=acc_dtype)
    if w.shape[1] == 1:
        out, over = _depthwise(x, wk, zx, strides, dilations, pads, q.bias, packed, out_hw, acc_dtype,
                               q.stage.dtype)
    else:
        out = np.empty((n, channels, out_hw[0], out_hw[1]), dtype=q.stage.dtype)
        over = conv_grouped(np.ascontiguousarray(x), wk, zx, groups, strides[0], strides[1], dilations[0],
                            dilations[1], pads[0], pads[1], q.bias, packed[0], packed[1],
                            np.empty(out_hw[1], dtype=acc_dtype), out)
    if len(geom.kernel) == 1:
        out = out[:, :, 0, :]
    return out, int(over)
