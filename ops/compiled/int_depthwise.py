"""Depthwise 2-D convolution on the CPU's multiply-add instructions (`ops.compiled.vnni.taps_kernel`).

Per image, output channel c (input channel c: one channel per group), output position (oh, ow):

    A[c, oh, ow] = sum_{kh, kw} u[c, oh*sh + kh*dh - pt, ow*sw + kw*dw - pl] * w[c, kh, kw]
                   + (b_q[c] - zp_u * sum w[c])
    y_q[c, oh, ow] = epilogue(A)      (`ops.compiled.epilogue`: M/2^N, zp, clamp; saturation if unproven)

u are the input codes as unsigned values (x_q, or x_q + 128 for int8, zp_u likewise: u - zp_u = x_q - zp_x), the
padding holds zp_u (the real zero), w = w_q - zp_w must fit the instruction's weight type (int8 for
`vpdpbusd`, int16 for `vpmaddwd`). The taps of a kernel row go E at a time (E = 4 bytes, or 2 16-bit values)
into a 32-bit lane: each input row is loaded once as the groups its output columns read, j = ow*sw + E*q*dw,

    vpdpbusd:  group[ow, q, c] = u[c, j] | u[c, j + dw] << 8 | u[c, j + 2dw] << 16 | u[c, j + 3dw] << 24
    vpmaddwd:  group[ow, q, c] = u[c, j] | u[c, j + dw] << 16                       (columns of the padded row)

and one instruction adds taps E*q..E*q+E-1 of kernel row kh for a vector of channels (the weight's groups zero
past KW): a 3x3 kernel takes three `vpdpbusd` (six `vpmaddwd`) per vector of channels and pixel.
|A - offset| <= 255 * max_c sum |w[c]| < 2^31, checked when the weight is packed: int32 is exact. The
channels run innermost (channels-last in and out, the layout of `ops.compiled.layout`), padded to a multiple
of the vector's lanes with zero weights.
The same integers as the numpy path (`ops.conv`), so its LSB bound holds unchanged.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np

from ops.compiled.epilogue import params32, requant_rows
from ops.compiled.layout import channels_first, channels_last
from ops.compiled.requant import lane_params
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANES, WEIGHT_DTYPE, WEIGHT_RANGE, taps_kernel

POSITIONS = 4  # output pixels per call of the tap kernel (their accumulators stay in registers)
U8_MAX = 255
INT32_LIMIT = 1 << 31

_taps_many = taps_kernel(POSITIONS)
_taps_one = taps_kernel(1)
# a 3x3 kernel, the common one, straight-line: (3 rows, 1 group of 4 taps) or (3 rows, 2 groups of 2 taps)
KERNEL3 = (3, 1 if ELEMENTS == 4 else 2)
_taps3_many = taps_kernel(POSITIONS, KERNEL3)
_taps3_one = taps_kernel(1, KERNEL3)

_PACKED: dict = {}


def pack_taps(weight: np.ndarray) -> Optional[np.ndarray]:
    """A depthwise weight (C, KH, KW) as WEIGHT_DTYPE groups (G, KH, Q, LANES, E), G = ceil(C / LANES),
    Q = ceil(KW / E): packed[g, kh, q, l, j] = weight[g * LANES + l, kh, E * q + j], zero past C and KW; None
    when a value is outside the instruction's weight range or 255 * max_c sum |w[c]| >= 2^31."""
    if weight.min() < WEIGHT_RANGE[0] or weight.max() > WEIGHT_RANGE[1]:
        return None
    if U8_MAX * int(np.abs(weight.astype(np.int64)).reshape(weight.shape[0], -1).sum(axis=1).max()) >= INT32_LIMIT:
        return None
    channels, kh, kw = weight.shape
    groups, quads = -(-channels // LANES), -(-kw // ELEMENTS)
    padded = np.zeros((groups * LANES, kh, quads * ELEMENTS), dtype=WEIGHT_DTYPE)
    padded[:channels, :, :kw] = weight
    return np.ascontiguousarray(padded.reshape(groups, LANES, kh, quads, ELEMENTS).transpose(0, 2, 3, 1, 4))


def _packed(q, weight: np.ndarray, zp_u: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(`pack_taps` of the weight, the int64 offset b_q - zp_u * sum w per channel) of the node q, cached
    per node (dropped with it) and zp_u; None where `pack_taps` is."""
    key = (id(q), zp_u)
    if key not in _PACKED:
        quads = pack_taps(weight)
        offset = q.bias - zp_u * weight.reshape(weight.shape[0], -1).sum(axis=1, dtype=np.int64)
        _PACKED[key] = None if quads is None else (quads, offset)
        weakref.finalize(q, _PACKED.pop, key, None)
    return _PACKED[key]


@numba.njit(cache=True, nogil=True, inline="always")
def _load_quads(x, row_at, width, channels, flip, pl, sw, dw, line, cp, quads, quads_at, ow_count, taps):
    """quads[quads_at + (ow * taps + q) * cp + c] = the group at column ow * sw + E * q * dw of a padded input row
    (module docstring), for each output column ow and group q of a kernel row. x (flat bytes) holds the row's
    `width` x `channels` codes from row_at; line (flat, rows of cp bytes) the padded row, its border already
    zp_u, the row's codes ^ flip written into its interior first. Flat unsigned indices: the loops along the
    channels vectorize, with no array view (and no reference count) per column."""
    for j in range(width):
        s0 = np.uint64(row_at + j * channels)
        d0 = np.uint64((pl + j) * cp)
        for c in range(channels):
            i = np.uint64(c)
            line[d0 + i] = x[s0 + i] ^ flip
    for ow in range(ow_count):
        for q in range(taps):
            j = ow * sw + ELEMENTS * q * dw
            a0 = np.uint64(j * cp)
            b0 = np.uint64((j + dw) * cp)
            o0 = np.uint64(quads_at + (ow * taps + q) * cp)
            if ELEMENTS == 4:
                e0 = np.uint64((j + 2 * dw) * cp)
                f0 = np.uint64((j + 3 * dw) * cp)
                for c in range(cp):
                    i = np.uint64(c)
                    quads[o0 + i] = (np.uint32(line[a0 + i]) | (np.uint32(line[b0 + i]) << 8)
                                     | (np.uint32(line[e0 + i]) << 16) | (np.uint32(line[f0 + i]) << 24))
            else:  # two taps as zero-extended 16-bit values
                for c in range(cp):
                    i = np.uint64(c)
                    quads[o0 + i] = np.uint32(line[a0 + i]) | (np.uint32(line[b0 + i]) << 16)


@numba.njit(cache=True, nogil=True, inline="always")
def _init_line(line, pl, width, channels, zp) -> None:
    """A padded row's buffer: zp in its border columns (the first pl and those past pl + width), zeros else."""
    line[:, :] = 0
    for j in range(line.shape[0]):
        if j < pl or j >= pl + width:
            line[j, :channels] = zp


@numba.njit(cache=True, nogil=True, inline="always")
def _load_slot(x_flat, n, ip, pt, height, width, channels, flip, pl, sw, dw, line_flat, cp, ring_flat, at,
               ow_count, taps, pad_quad) -> None:
    """Ring slot `at` = the groups of input row ip of image n (`_load_quads`, codes ^ flip), or the padding's."""
    if pt <= ip < pt + height:
        _load_quads(x_flat, ((n * height) + ip - pt) * width * channels, width, channels, flip, pl, sw, dw,
                    line_flat, cp, ring_flat, at, ow_count, taps)
    else:
        for k in range(ow_count * taps):
            o0 = np.uint64(at + k * cp)
            for c in range(channels):
                ring_flat[o0 + np.uint64(c)] = pad_quad


@numba.njit(cache=True, nogil=True, inline="always")
def _taps_row(ring8, rows, x_step, taps, w, w_at, acc, acc_at, cp, x_at, x_stride, ow_count, kernel3) -> None:
    """acc for one vector of channels of every output column of a row (`depthwise_quads`' loop)."""
    ow = 0
    if kernel3:
        while ow + POSITIONS <= ow_count:
            _taps3_many(ring8, rows, x_step, taps, w, w_at, acc, ow * cp + acc_at, cp, ow * x_stride + x_at, x_stride)
            ow += POSITIONS
        while ow < ow_count:
            _taps3_one(ring8, rows, x_step, taps, w, w_at, acc, ow * cp + acc_at, cp, ow * x_stride + x_at, x_stride)
            ow += 1
    while ow + POSITIONS <= ow_count:
        _taps_many(ring8, rows, x_step, taps, w, w_at, acc, ow * cp + acc_at, cp, ow * x_stride + x_at, x_stride)
        ow += POSITIONS
    while ow < ow_count:
        _taps_one(ring8, rows, x_step, taps, w, w_at, acc, ow * cp + acc_at, cp, ow * x_stride + x_at, x_stride)
        ow += 1


@numba.njit(cache=True, nogil=True)
def depthwise_quads(x, flip, zp, w, kh_count, sh, sw, dh, dw, pt, pl, offset, prm, lim, line, ring8, ring32,
                    acc, out) -> int:
    """out (N, OH, OW, C) = epilogue(depthwise conv of the uint8 codes x (N, H, W, C) ^ flip, padded with zp,
    with the packed weight quads w (flat: G, KH, Q, LANES, 4) + offset); returns the overflow count.
    line (Lw, Cp) uint8, ring32 (R, OW, Q, Cp) uint32 (`_load_quads`) with ring8 its bytes, acc (OW * Cp,)
    int32: scratch."""
    height = x.shape[1]
    width = x.shape[2]
    channels = out.shape[3]
    slots, ow_count, taps, cp = ring32.shape
    groups = cp // LANES
    w_group = kh_count * taps * LANES * ELEMENTS
    slot_size = ow_count * taps * cp
    x_step = cp * 4
    x_stride = taps * cp * 4
    lanes = lane_params(offset, prm)
    lanes32 = params32(offset, prm)
    kernel3 = kh_count == KERNEL3[0] and taps == KERNEL3[1]
    _init_line(line, pl, width, channels, zp)
    line_flat = line.reshape(-1)
    ring_flat = ring32.reshape(-1)
    x_flat = x.reshape(-1)
    pad_quad = np.uint32(zp) * np.uint32(0x01010101 if ELEMENTS == 4 else 0x00010001)
    held = np.empty(slots, dtype=np.int64)
    rows = np.empty(kh_count, dtype=np.int64)
    over = 0
    for n in range(x.shape[0]):
        held[:] = -1
        flat = out[n].reshape(-1)
        for oh in range(out.shape[1]):
            for kh in range(kh_count):
                ip = oh * sh + kh * dh
                slot = ip % slots
                rows[kh] = slot * slot_size * 4
                if held[slot] != ip:
                    held[slot] = ip
                    _load_slot(x_flat, n, ip, pt, height, width, channels, flip, pl, sw, dw, line_flat, cp, ring_flat,
                               slot * slot_size, ow_count, taps, pad_quad)
            for g in range(groups):
                _taps_row(ring8, rows, x_step, taps, w, g * w_group, acc, g * LANES, cp, g * LANES * 4, x_stride,
                          ow_count, kernel3)
            over += requant_rows(acc, cp, ow_count, channels, offset, prm, lim, lanes, lanes32, flat,
                                 oh * ow_count * channels, out[n, oh])
    return over


@dataclass(frozen=True)
class DepthwisePlan:
    """`depthwise_quads` for one layer and input shape, its operands ready (`ops.compiled.conv_plan`)."""

    weight: np.ndarray  # flat packed quads
    kernel_rows: int
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int]  # top, left
    offset: np.ndarray
    stage: tuple[np.ndarray, np.ndarray]
    signed: bool
    zp_u: int
    out_shape: tuple[int, ...]  # (N, OH, OW, C)
    out_dtype: np.dtype
    line_shape: tuple[int, int]
    ring_shape: tuple[int, int, int, int]

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """Run on x (N, C, H, W), laid out channels-last (`ops.compiled.layout`)."""
        rows = x.transpose(0, 2, 3, 1).view(np.uint8)
        ring = scratch("dw_quads", (math.prod(self.ring_shape),), np.uint32)
        data = np.empty(self.out_shape, dtype=self.out_dtype)
        over = depthwise_quads(rows, np.uint8(0x80 if self.signed else 0), np.uint8(self.zp_u), self.weight,
                               self.kernel_rows, self.strides[0], self.strides[1], self.dilations[0],
                               self.dilations[1], self.pads[0], self.pads[1], self.offset, self.stage[0],
                               self.stage[1], scratch("dw_line", self.line_shape, np.uint8), ring.view(np.uint8),
                               ring.reshape(self.ring_shape),
                               scratch("dw_quad_acc", (self.out_shape[2] * self.ring_shape[3],), np.int32), data)
        return channels_first(data), int(over)


def plan_depthwise(x: np.ndarray, q, weight: np.ndarray, zx: int, strides, dilations, pads, packed_stage,
                   out_hw) -> Optional[DepthwisePlan]:
    """The plan of a depthwise Conv (one input channel per output channel; weight (C, KH, KW) centered) on
    8-bit codes shaped as x (N, C, H, W); None when this kernel does not cover it (no VNNI, a 16-bit input,
    a weight outside int8). pads: (top, left, bottom, right)."""
    if LANES == 0 or x.dtype.itemsize != 1 or x.dtype.kind not in "iu" or x.shape[1] != weight.shape[0]:
        return None
    signed = x.dtype == np.int8
    zp_u = zx + 128 if signed else zx
    operands = _packed(q, weight, zp_u)
    if operands is None:
        return None
    quads_w, offset = operands
    channels, kh, kw = weight.shape
    taps = quads_w.shape[2]
    cp = quads_w.shape[0] * LANES
    lw = max((out_hw[1] - 1) * strides[1] + (ELEMENTS * taps - 1) * dilations[1] + 1, pads[1] + x.shape[3])
    slots = (kh - 1) * dilations[0] + 1
    return DepthwisePlan(quads_w.reshape(-1), kh, tuple(strides), tuple(dilations), (pads[0], pads[1]), offset,
                         packed_stage, signed, zp_u, (x.shape[0], out_hw[0], out_hw[1], channels),
                         q.stage.dtype, (lw, cp), (slots, out_hw[1], taps, cp))


def depthwise_int(x: np.ndarray, q, weight: np.ndarray, zx: int, strides, dilations, pads, packed_stage,
                  out_hw) -> Optional[tuple[np.ndarray, int]]:
    """(output codes (N, C, OH, OW), the view of channels-last data; overflow count) of a depthwise Conv
    (`plan_depthwise`'s arguments) on x, read channels-last when it is laid out so (else copied so first);
    None when the kernel does not cover it."""
    plan = plan_depthwise(x, q, weight, zx, strides, dilations, pads, packed_stage, out_hw)
    if plan is None:
        return None
    if channels_last(x) is None:
        x = channels_first(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    return plan(x)
