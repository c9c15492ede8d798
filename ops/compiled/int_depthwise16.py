"""Depthwise 2-D convolution on 16-bit input codes through the 8-bit tap kernels (`ops.compiled.int_depthwise`),
exactly, as two byte planes (`ops.compiled.int_dense16`'s split):

    u = 256 * h + l   (u = x_q, or x_q + 32768 for int16; zp_u likewise; h, l in 0..255)
    H[c, oh, ow] = sum_{kh, kw} h[c, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl] * w[c, kh, kw]    (L likewise)
    A = 256 * H + L + (b_q[c] - zp_u * sum w[c])                                                (int64)
    y_q = epilogue(A)      (`ops.compiled.requant`: saturation if unproven, M/2^N, zp, clamp)

Each plane is padded with its byte of zp_u (so that the padded u is zp_u, the real zero), and each plane's
sum obeys the bound the 8-bit kernel checks when it packs the weight (255 * max_c sum |w[c]| < 2^31): exact
int32, combined in int64 (|256 H + L| < 2^47). A is the numpy path's int64 accumulator, the epilogue its
formula (`requant.requant_positions`; the 64-bit lanes in the common case): the same codes, the LSB bound of
`ops.conv` unchanged.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import numba
import numpy as np

from ops.compiled.int_dense16 import _combine, _rows64_pair, zero_point16
from ops.compiled.int_depthwise import KERNEL3, _init_line, _load_slot, _packed, _taps_row, pack_taps
from ops.compiled.layout import channels_first
from ops.compiled.requant import FAST, HI, LO, SUB, lane_params, requant_positions
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANES


@numba.njit(cache=True, nogil=True)
def _split_planes(u, high_flip, low, high) -> None:
    """low[i], high[i] = the low byte and the high byte ^ high_flip of u[i] (flat uint16; whole 16-bit loads
    narrowed, which vectorizes)."""
    for k in range(u.shape[0]):
        i = np.uint64(k)
        v = u[i]
        low[i] = np.uint8(v & np.uint16(0xFF))
        high[i] = np.uint8(v >> np.uint16(8)) ^ high_flip


@numba.njit(cache=True, nogil=True)
def depthwise_planes(low, high, zp_low, zp_high, w, kh_count, sh, sw, dh, dw, pt, pl, offset, prm, lim, lines,
                     ring8, ring32, acc_low, acc_high, wide, out) -> int:
    """out (N, OH, OW, C) = epilogue(256 * depthwise(high) + depthwise(low) + offset) of the byte planes low,
    high (N, H, W, C) uint8, padded with zp_low, zp_high, with the packed weight quads w (flat); returns the
    overflow count. lines (2, Lw, Cp) uint8, ring32 (2, R, OW, Q, Cp) uint32 with ring8 its bytes (flat),
    acc_low, acc_high (OW * Cp,) int32, wide (OW, C) int64: scratch."""
    height = low.shape[1]
    width = low.shape[2]
    channels = out.shape[3]
    slots, ow_count, taps, cp = ring32.shape[1:]
    groups = cp // LANES
    w_group = kh_count * taps * LANES * ELEMENTS
    slot_size = ow_count * taps * cp
    plane_size = slots * slot_size
    x_step = cp * 4
    x_stride = taps * cp * 4
    lanes = lane_params(offset, prm)
    kernel3 = kh_count == KERNEL3[0] and taps == KERNEL3[1]
    _init_line(lines[0], pl, width, channels, zp_low)
    _init_line(lines[1], pl, width, channels, zp_high)
    line_low = lines[0].reshape(-1)
    line_high = lines[1].reshape(-1)
    ring_flat = ring32.reshape(-1)
    low_flat = low.reshape(-1)
    high_flat = high.reshape(-1)
    spread = np.uint32(0x01010101 if ELEMENTS == 4 else 0x00010001)
    pad_low = np.uint32(zp_low) * spread
    pad_high = np.uint32(zp_high) * spread
    held = np.empty(slots, dtype=np.int64)
    rows_low = np.empty(kh_count, dtype=np.int64)  # byte offsets of the kernel rows' slots in ring8, per plane
    rows_high = np.empty(kh_count, dtype=np.int64)
    over = 0
    for n in range(low.shape[0]):
        held[:] = -1
        flat = out[n].reshape(-1)
        for oh in range(out.shape[1]):
            for kh in range(kh_count):
                ip = oh * sh + kh * dh
                slot = ip % slots
                rows_low[kh] = slot * slot_size * 4
                rows_high[kh] = (plane_size + slot * slot_size) * 4
                if held[slot] != ip:
                    held[slot] = ip
                    _load_slot(low_flat, n, ip, pt, height, width, channels, np.uint8(0), pl, sw, dw, line_low, cp,
                               ring_flat, slot * slot_size, ow_count, taps, pad_low)
                    _load_slot(high_flat, n, ip, pt, height, width, channels, np.uint8(0), pl, sw, dw, line_high, cp,
                               ring_flat, plane_size + slot * slot_size, ow_count, taps, pad_high)
            for g in range(groups):
                _taps_row(ring8, rows_low, x_step, taps, w, g * w_group, acc_low, g * LANES, cp, g * LANES * 4,
                          x_stride, ow_count, kernel3)
                _taps_row(ring8, rows_high, x_step, taps, w, g * w_group, acc_high, g * LANES, cp, g * LANES * 4,
                          x_stride, ow_count, kernel3)
            if lim[FAST] != 0:
                _rows64_pair(acc_low, acc_high, cp, ow_count, channels, lanes, prm[SUB], lim[LO], lim[HI], flat,
                             oh * ow_count * channels)
            else:
                _combine(acc_low, acc_high, cp, ow_count, channels, wide)
                over += requant_positions(wide[:ow_count], offset, prm, lim, lanes, out[n, oh])
    return over


def depthwise16(x: np.ndarray, q, weight: np.ndarray, zx: int, strides, dilations, pads, packed_stage,
                out_hw) -> Optional[tuple[np.ndarray, int]]:
    """(output codes (N, C, OH, OW), the view of channels-last data; overflow count) of a depthwise Conv on
    16-bit codes x (N, C, H, W; `int_depthwise.plan_depthwise`'s other arguments); None when the kernel does
    not cover it (no VNNI, a weight outside the instruction's range or past the int32 bound)."""
    if LANES == 0 or x.dtype.itemsize != 2 or x.dtype.kind not in "iu" or x.shape[1] != weight.shape[0]:
        return None
    zp_u = zero_point16(x, zx)
    operands = _packed(q, weight, zp_u)
    if operands is None:
        return None
    quads_w, offset = operands
    channels, kh, _ = weight.shape
    taps = quads_w.shape[2]
    cp = quads_w.shape[0] * LANES
    u = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).view(np.uint16)  # (N, H, W, C); no copy when channels-last
    low = np.empty(u.shape, dtype=np.uint8)
    high = np.empty(u.shape, dtype=np.uint8)
    _split_planes(u.reshape(-1), np.uint8(0x80 if x.dtype == np.int16 else 0), low.reshape(-1), high.reshape(-1))
    lw = max((out_hw[1] - 1) * strides[1] + (ELEMENTS * taps - 1) * dilations[1] + 1, pads[1] + x.shape[3])
    slots = (kh - 1) * dilations[0] + 1
    ring_shape = (2, slots, out_hw[1], taps, cp)
    ring = scratch("dw16_quads", (math.prod(ring_shape),), np.uint32)
    data = np.empty((x.shape[0], out_hw[0], out_hw[1], channels), dtype=q.stage.dtype)
    over = depthwise_planes(low, high, np.uint8(zp_u & 0xFF), np.uint8(zp_u >> 8), quads_w.reshape(-1), kh,
                            strides[0], strides[1], dilations[0], dilations[1], pads[0], pads[1], offset,
                            packed_stage[0], packed_stage[1], scratch("dw16_lines", (2, lw, cp), np.uint8),
                            ring.view(np.uint8), ring.reshape(ring_shape),
                            scratch("dw16_acc_low", (out_hw[1] * cp,), np.int32),
                            scratch("dw16_acc_high", (out_hw[1] * cp,), np.int32),
                            scratch("dw16_wide", (out_hw[1], channels), np.int64), data)
    return channels_first(data), int(over)


# A 16-bit weight (`ops.compiled.int_wide_weight`'s split, per tap): w = 256 * wh + (wl - 128) + 128, three packs
# of int8 taps (wh, wl - 128, ones) whose tap sums T_j combine as sum_j scale_j * T_j, scales (256, 1, 128)
WIDE_SCALES = np.array([256, 1, 128], dtype=np.int64)
_WIDE: dict = {}


def _wide_packs(q, weight: np.ndarray, zp_u: int) -> Optional[tuple[np.ndarray, int, np.ndarray]]:
    """(the three packs of `pack_taps` one after another (flat), one pack's size, the int64 offset
    b_q - zp_u * sum w per channel) of a depthwise weight (C, KH, KW) within int16; cached per node and zp_u,
    None where a pack is refused."""
    key = (id(q), zp_u)
    if key not in _WIDE:
        w = weight.astype(np.int64)
        high = w >> 8
        packs = [pack_taps(p) for p in (high, w - 256 * high - 128, np.ones_like(w))]
        offset = q.bias - zp_u * w.reshape(w.shape[0], -1).sum(axis=1)
        _WIDE[key] = None if any(p is None for p in packs) else (
            np.concatenate([p.reshape(-1) for p in packs]), packs[0].size, offset)
        weakref.finalize(q, _WIDE.pop, key, None)
    return _WIDE[key]


@numba.njit(cache=True, nogil=True, inline="always")
def _add_terms(acc, acc_size, ow_count, cp, channels, w_scales, x_scale, first, wide) -> None:
    """wide[ow * channels + c] (= if first, else +=) x_scale * sum_j w_scales[j] * acc[j * acc_size + ow * cp + c]
    (three packs, `WIDE_SCALES`), flat unsigned indices: the loop along the channels vectorizes."""
    s0 = x_scale * w_scales[0]
    s1 = x_scale * w_scales[1]
    s2 = x_scale * w_scales[2]
    b1 = np.uint64(acc_size)
    b2 = np.uint64(2 * acc_size)
    for ow in range(ow_count):
        a0 = np.uint64(ow * cp)
        o0 = np.uint64(ow * channels)
        for c in range(channels):
            i = np.uint64(c)
            t = s0 * np.int64(acc[a0 + i]) + s1 * np.int64(acc[b1 + a0 + i]) + s2 * np.int64(acc[b2 + a0 + i])
            if first:
                wide[o0 + i] = t
            else:
                wide[o0 + i] += t


@numba.njit(cache=True, nogil=True)
def depthwise_terms(planes, zps, x_scales, w, w_size, w_scales, kh_count, sh, sw, dh, dw, pt, pl, offset, prm, lim,
                    lines, ring8, ring32, acc, wide, out) -> int:
    """out (N, OH, OW, C) = epilogue(sum_{i, j} x_scales[i] * w_scales[j] * depthwise(planes[i], pack j) + offset)
    of the byte planes (P, N, H, W, C) uint8, plane i padded with zps[i], and the weight packs j (w: flat, packs
    of w_size one after another; three, `WIDE_SCALES`); returns the overflow count. lines (P, Lw, Cp) uint8, ring32
    (P, R, OW, Q, Cp) uint32 with ring8 its bytes (flat), acc (3 * OW * Cp,) int32 (one row of sums per pack),
    wide (OW, C) int64: scratch."""
    n_planes = planes.shape[0]
    height = planes.shape[2]
    width = planes.shape[3]
    channels = out.shape[3]
    slots, ow_count, taps, cp = ring32.shape[1:]
    groups = cp // LANES
    w_group = kh_count * taps * LANES * ELEMENTS
    slot_size = ow_count * taps * cp
    plane_size = slots * slot_size
    x_step = cp * 4
    x_stride = taps * cp * 4
    lanes = lane_params(offset, prm)
    kernel3 = kh_count == KERNEL3[0] and taps == KERNEL3[1]
    spread = np.uint32(0x01010101 if ELEMENTS == 4 else 0x00010001)
    for i in range(n_planes):
        _init_line(lines[i], pl, width, channels, zps[i])
    ring_flat = ring32.reshape(-1)
    n_packs = w_scales.shape[0]
    acc_size = acc.shape[0] // n_packs
    wide_flat = wide.reshape(-1)
    held = np.empty((n_planes, slots), dtype=np.int64)
    rows = np.empty((n_planes, kh_count), dtype=np.int64)
    over = 0
    for n in range(planes.shape[1]):
        held[:, :] = -1
        for oh in range(out.shape[1]):
            for i in range(n_planes):
                for kh in range(kh_count):
                    ip = oh * sh + kh * dh
                    slot = ip % slots
                    rows[i, kh] = (i * plane_size + slot * slot_size) * 4
                    if held[i, slot] != ip:
                        held[i, slot] = ip
                        _load_slot(planes[i].reshape(-1), n, ip, pt, height, width, channels, np.uint8(0), pl, sw, dw,
                                   lines[i].reshape(-1), cp, ring_flat, i * plane_size + slot * slot_size, ow_count,
                                   taps, np.uint32(zps[i]) * spread)
            for i in range(n_planes):
                for j in range(n_packs):
                    for g in range(groups):
                        _taps_row(ring8, rows[i], x_step, taps, w, j * w_size + g * w_group, acc,
                                  j * acc_size + g * LANES, cp, g * LANES * 4, x_stride, ow_count, kernel3)
                _add_terms(acc, acc_size, ow_count, cp, channels, w_scales, x_scales[i], i == 0, wide_flat)
            over += requant_positions(wide[:ow_count], offset, prm, lim, lanes, out[n, oh])
    return over


def depthwise_wide(x: np.ndarray, q, weight: np.ndarray, zx: int, strides, dilations, pads, packed_stage,
                   out_hw) -> Optional[tuple[np.ndarray, int]]:
    """`depthwise16` for a weight within int16 (past int8) on 8- or 16-bit codes x: three int8 packs per tap
    (`WIDE_SCALES`), two byte planes for a 16-bit x; None where not covered (no `vpdpbusd`)."""
    if LANES == 0 or ELEMENTS != 4 or x.dtype.kind not in "iu" or x.dtype.itemsize > 2 or x.shape[1] != weight.shape[0]:
        return None
    if weight.min() < -(1 << 15) or weight.max() >= (1 << 15):
        return None
    if x.dtype.itemsize == 2:
        zp_u = zero_point16(x, zx)
        u = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).view(np.uint16)
        planes = np.empty((2,) + u.shape, dtype=np.uint8)
        _split_planes(u.reshape(-1), np.uint8(0x80 if x.dtype == np.int16 else 0), planes[1].reshape(-1),
                      planes[0].reshape(-1))  # planes[0]: the high bytes (x 256), planes[1]: the low ones
        zps, x_scales = np.array([zp_u >> 8, zp_u & 0xFF], dtype=np.uint8), np.array([256, 1], dtype=np.int64)
    else:
        zp_u = zx + 128 if x.dtype == np.int8 else zx
        planes = (x.transpose(0, 2, 3, 1).view(np.uint8) ^ np.uint8(0x80 if x.dtype == np.int8 else 0))[None]
        zps, x_scales = np.array([zp_u], dtype=np.uint8), np.array([1], dtype=np.int64)
    operands = _wide_packs(q, weight, zp_u)
    if operands is None:
        return None
    w, w_size, offset = operands
    channels, kh, kw = weight.shape
    taps = -(-kw // ELEMENTS)
    cp = -(-channels // LANES) * LANES
    lw = max((out_hw[1] - 1) * strides[1] + (ELEMENTS * taps - 1) * dilations[1] + 1, pads[1] + x.shape[3])
    slots = (kh - 1) * dilations[0] + 1
    ring_shape = (planes.shape[0], slots, out_hw[1], taps, cp)
    ring = scratch("dw_wide_quads", (math.prod(ring_shape),), np.uint32)
    data = np.empty((x.shape[0], out_hw[0], out_hw[1], channels), dtype=q.stage.dtype)
    over = depthwise_terms(np.ascontiguousarray(planes), zps, x_scales, w, w_size, WIDE_SCALES, kh, strides[0],
                           strides[1], dilations[0], dilations[1], pads[0], pads[1], offset, packed_stage[0],
                           packed_stage[1], scratch("dw_wide_lines", (planes.shape[0], lw, cp), np.uint8),
                           ring.view(np.uint8), ring.reshape(ring_shape),
                           scratch("dw_wide_acc", (len(WIDE_SCALES) * out_hw[1] * cp,), np.int32),
                           scratch("dw_wide_sum", (out_hw[1], channels), np.int64), data)
    return channels_first(data), int(over)
