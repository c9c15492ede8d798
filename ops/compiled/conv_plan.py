"""Convolutions run as planned calls: the per-call work of the hot cases done once per layer and input layout.

A run of a convolutional network calls each Conv with the same input shape, dtype and memory layout image
after image. For the two layer kinds that dominate (a pointwise convolution and a depthwise one on 8-bit
channels-last codes, on the integer kernels of `ops.compiled.int_dense` and `ops.compiled.int_depthwise`),
the first call resolves everything that depends only on the node and that layout (geometry, packed weight,
zero-point offset, packed requant stage, output shape, scratch sizes) into a plan; later calls only run the
kernel: the Python work around a small layer's kernel otherwise costs as much as the kernel. A layout without
a plan (any other case) returns None and takes the general path (`ops.conv`), which gives the same codes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ops.compiled.int_dense import BLOCK, FLIP_SIGN, NO_FLIP, _dense_codes, dense_operands, kernel_rows, zero_point
from ops.compiled.int_depthwise import plan_depthwise
from ops.compiled.layout import channels_first, channels_last
from ops.compiled.requant import pack_stage
from ops.compiled.scratch import scratch
from ops.compiled.vnni import ELEMENTS, LANE_BYTES, LANES
from ops.conv_kernels import conv_geometry

_NO_PLAN = object()
# plans by (id(q), shape, dtype, strides), dropped with the quantized node
_PLANS: dict = {}

Plan = Callable[[np.ndarray], tuple[np.ndarray, int]]


def planned_conv(x: np.ndarray, q) -> Optional[tuple[np.ndarray, int]]:
    """(output codes, overflow count) of the Conv q on x through its plan for x's layout; None when that
    layout has no plan."""
    key = (id(q), x.shape, x.dtype.char, x.strides)
    plan = _PLANS.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        plan = _PLANS[key] = _make_plan(x, q)
        weakref.finalize(q, _PLANS.pop, key, None)
    return None if plan is None else plan(x)


def _make_plan(x: np.ndarray, q) -> Optional[Plan]:
    if LANES == 0 or x.ndim != 4 or q.weight.ndim != 4 or x.dtype.itemsize != 1 or x.dtype.kind not in "iu":
        return None
    if channels_last(x) is None:
        return None
    geom = conv_geometry(q.node.attrs, x.shape[2:], q.weight.shape[2:])
    channels = q.weight.shape[0]
    packed = pack_stage(q.stage, channels, None if q.acc.safe else q.acc.bits)
    if packed is None:
        return None
    zx = int(q.in_qparams[0].zero_point[0])
    if q.groups == 1 and geom.is_pointwise:
        ops = dense_operands(q, q.weight.reshape(channels, -1))
        if ops is None:
            return None
        in_place = ELEMENTS == 4 and ops.depth == ops.quads * LANE_BYTES  # the codes are the kernel's rows
        flip = (FLIP_SIGN if x.dtype == np.int8 else NO_FLIP) if in_place else None
        return _PointwisePlan(ops.packed.reshape(-1), ops.quads, q.bias - zero_point(x, zx) * ops.weight_sum,
                              packed, (x.shape[0],) + x.shape[2:] + (channels,), q.stage.dtype,
                              ops.packed.shape[0] * LANES, flip)
    if q.groups == channels == x.shape[1] and q.weight.shape[1] == 1:
        return plan_depthwise(x, q, q.weight[:, 0], zx, geom.strides, geom.dilations,
                              geom.pads_begin + geom.pads_end, packed, geom.out_shape(x.shape[2:]))
    return None


@dataclass(frozen=True)
class _PointwisePlan:
    """A pointwise convolution on channels-last 8-bit codes: `ops.compiled.int_dense`'s kernel with its
    operands ready (the rows read in place where the instruction set and the depth allow)."""

    weight: np.ndarray
    quads: int
    offset: np.ndarray
    stage: tuple[np.ndarray, np.ndarray]
    out_shape: tuple[int, ...]
    out_dtype: np.dtype
    width: int
    flip: Optional[np.uint32]  # the kernel's flip when it reads the codes in place, else None (`kernel_rows`)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        if self.flip is not None:
            rows, stride, flip = x.transpose(0, 2, 3, 1).reshape(-1).view(np.uint8), self.quads * LANE_BYTES, self.flip
        else:
            rows, stride, flip = kernel_rows(x.transpose(0, 2, 3, 1).reshape(-1, x.shape[1]), self.quads)
        data = np.empty(self.out_shape, dtype=self.out_dtype)
        over = _dense_codes(rows, stride, flip, self.weight, self.quads, self.offset, self.stage[0], self.stage[1],
                            scratch("int_dense_acc", (BLOCK * self.width,), np.int32),
                            data.reshape(-1, self.out_shape[-1]))
        return channels_first(data), int(over)
