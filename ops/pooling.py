"""AveragePool, GlobalAveragePool, MaxPool, GlobalMaxPool over N-d spatial axes (NCHW...), ONNX convention.

AveragePool (whitepaper 4.4): y_f = sum(x_f) / c over a window of c counted elements. The whitepaper keeps
s_y = s_x and divides by c with an (M, N) pair; here the division and the scale change share one requant
(`ops.common.MeanRequant`), so the output may take the quant table's (narrower) proposal:

    acc[p] = saturate_int32(sum over the window's real elements of (x_q - zp_x))     (padding adds 0)
    y_q[p] = clamp(((acc[p] * M_c + 2^(N_c-1)) >> N_c) + zp_y, qmin, qmax),  M_c / 2^N_c ~= s_x / (s_y * c[p])

c[p] counts the window taps inside the padded input (count_include_pad=1) or inside the input itself
(count_include_pad=0, the default): with padding excluded, or with ceil_mode windows that run past the
padding, c varies per output position and so does (M_c, N_c), one pair per distinct count.
GlobalAveragePool is the same with one window covering all spatial axes.
LSB bound vs the float op on the dequantized input: 0.5 + |y_f| / s_y * 2^-mbits.

MaxPool (4.43) and GlobalMaxPool: s_y = s_x and zp_y = zp_x (the rule overrides the table's proposal), so

    y_q[p] = max over the window of x_q          (padding never wins)

exactly (LSB bound 0). MaxPool's optional Indices output (whitepaper 4.44, MaxPoolingWithArgMax) is int64
without qparams: the flat index into the input of each window's first maximum in scan order (row-major
(n*C + c)*H*W + h*W + w, or column-major over the spatial axes with storage_order=1); the codes order the
elements as the floats do, so the indices are exact too.
"""
from __future__ import annotations

# imports inside functions: `ops.compiled`'s numba kernels, imported by the first run that takes the compiled path
# (numba's import costs about half a second; `ops.compiled.enabled` decides)

from dataclasses import dataclass
from functools import partial

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ops import compiled
from ops.base import activation_qparams, centered
from ops.conformance_case import Case
from ops.mean_requant import QuantizedMean, quantize_mean
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node


@dataclass(frozen=True)
class PoolGeometry:
    """Per spatial axis: kernel, stride, dilation, declared begin/end pads and output size."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def extent(self) -> tuple[int, ...]:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def pool_geometry(node: Node, spatial: tuple[int, ...]) -> PoolGeometry:
    """ONNX output size and padding of a pooling node (auto_pad, pads, strides, dilations, ceil_mode)."""
    kernel = node.attr("kernel_shape")
    if kernel is None:
        raise ValueError("kernel_shape is required")
    kernel = tuple(int(k) for k in kernel)
    nd = len(kernel)
    if nd != len(spatial):
        raise ValueError(f"kernel {kernel} for {len(spatial)} spatial axes")
    strides = tuple(int(s) for s in node.attr("strides", [1] * nd))
    dilations = tuple(int(d) for d in node.attr("dilations", [1] * nd))
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = _text(node.attr("auto_pad"), "NOTSET")
    ceil_mode = bool(node.attr("ceil_mode", 0))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max((o - 1) * s + e - n, 0) for o, s, e, n in zip(out, strides, extent, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad in ("NOTSET", "VALID"):
        pads = [0] * (2 * nd) if auto_pad == "VALID" else [int(p) for p in node.attr("pads", [0] * (2 * nd))]
        begin, end = pads[:nd], pads[nd:]
        out = []
        for n, b, e, ext, s in zip(spatial, begin, end, extent, strides):
            span = n + b + e - ext
            if span < 0:
                raise ValueError(f"window {ext} larger than padded input {n + b + e}")
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= n + b:  # the last window must start inside the input or its begin pad
                o -= 1
            out.append(o)
    else:
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    return PoolGeometry(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))


def windows(x: np.ndarray, g: PoolGeometry, fill) -> np.ndarray:
    """View (N, C, *out, *kernel) of the pooling windows of `x`, padded with `fill` (also past the declared
    end pads, where ceil_mode windows overhang)."""
    nd = len(g.kernel)
    spatial = x.shape[2:]
    ends = [max((o - 1) * s + e - (n + b), 0)
            for o, s, e, n, b in zip(g.out, g.strides, g.extent, spatial, g.pads_begin)]
    padded = np.pad(x, [(0, 0), (0, 0)] + list(zip(g.pads_begin, ends)), constant_values=fill)
    view = sliding_window_view(padded, g.extent, axis=tuple(range(2, 2 + nd)))
    index = (slice(None), slice(None)) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(g.out, g.strides))
    return view[index + tuple(slice(None, None, d) for d in g.dilations)]


def window_counts(g: PoolGeometry, spatial: tuple[int, ...], include_pad: bool) -> np.ndarray:
    """Elements counted by each averaging window, shape `g.out`: taps inside [-pad_begin, n + pad_end)
    (include_pad) or inside [0, n)."""
    counts = np.ones((), dtype=np.int64)
    for n, k, s, d, b, e, o in zip(spatial, g.kernel, g.strides, g.dilations, g.pads_begin, g.pads_end, g.out):
        taps = (np.arange(o) * s - b)[:, None] + np.arange(k) * d
        lo, hi = (-b, n + e) if include_pad else (0, n)
        per_axis = np.count_nonzero((taps >= lo) & (taps < hi), axis=1)
        counts = np.multiply.outer(counts, per_axis)
    return counts


def _spatial_input(x) -> np.ndarray:
    """`x` as an array; ValueError unless it is (N, C, spatial...)."""
    x = np.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"expected an (N, C, spatial...) input, got shape {x.shape}")
    return x


def _quantize_max(ctx: QuantizeContext) -> QuantizedNode:
    node = ctx.node
    return QuantizedNode(node, list(ctx.in_qparams), [activation_qparams(ctx)] + [None] * (len(node.outputs) - 1))


def max_with_indices(x: np.ndarray, g: PoolGeometry, storage_order: int, fill) -> tuple[np.ndarray, np.ndarray]:
    """The window maxima and, int64 (N, C, *out), the flat input index of each window's first maximum in scan
    order. One pass of elementwise maxima over the kernel taps (strided views), one of comparisons; a tap in
    the padding never counts, even when `fill` equals the window's real maximum."""
    nd = len(g.kernel)
    win = windows(x, g, fill)
    spatial = x.shape[2:]
    taps = list(np.ndindex(*g.kernel))
    top = win[(Ellipsis,) + taps[0]].copy()
    for tap in taps[1:]:
        np.maximum(top, win[(Ellipsis,) + tap], out=top)
    starts = [(np.arange(o) * s - b).reshape((-1,) + (1,) * (nd - 1 - a))
              for a, (o, s, b) in enumerate(zip(g.out, g.strides, g.pads_begin))]
    first = np.full(top.shape, -1, dtype=np.int64)
    for t, tap in enumerate(taps):
        inside = np.ones((1,) * nd, dtype=bool)
        for a in range(nd):
            position = starts[a] + tap[a] * g.dilations[a]
            inside = inside & (position >= 0) & (position < spatial[a])
        np.copyto(first, t, where=(first < 0) & inside & (win[(Ellipsis,) + tap] == top))
    tap_of = np.unravel_index(first, g.kernel)
    flat = np.zeros(first.shape, dtype=np.int64)
    for a in (range(nd) if storage_order == 0 else reversed(range(nd))):
        flat = flat * spatial[a] + starts[a] + tap_of[a] * g.dilations[a]
    plane = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(x.shape[:2] + (1,) * nd)
    return top, plane * int(np.prod(spatial, dtype=np.int64)) + flat


def _max_pool(node: Node, x: np.ndarray, fill) -> list[np.ndarray]:
    """MaxPool's outputs: the window maxima, and their indices when the node asks for them."""
    g = pool_geometry(node, x.shape[2:])
    if len(node.outputs) > 1 and node.outputs[1]:
        storage_order = int(node.attr("storage_order", 0))
        if storage_order not in (0, 1):
            raise ValueError(f"storage_order must be 0 or 1, got {storage_order}")
        return list(max_with_indices(x, g, storage_order, fill))
    return [windows(x, g, fill).max(axis=tuple(range(-len(g.kernel), 0)))]


@register
class AveragePool(OpDef):
    """ONNX AveragePool (pads, auto_pad, strides, dilations, ceil_mode, count_include_pad).
    Integer formula and LSB bound: module docstring."""

    op_type = "AveragePool"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    section = "4.4"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"
    conformance = Case(attrs={"kernel_shape": [2, 2], "strides": [1, 2]})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        _spatial_input(x)
        g = pool_geometry(node, x.shape[2:])
        nd = len(g.kernel)
        total = windows(x.astype(np.float64), g, 0.0).sum(axis=tuple(range(-nd, 0)))
        counts = window_counts(g, x.shape[2:], bool(node.attr("count_include_pad", 0)))
        return [(total / counts).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMean:
        return quantize_mean(ctx)

    def forward_int(self, q: QuantizedMean, inputs, runtime: IntRuntime):
        node = q.node
        x = _spatial_input(inputs[0])
        g = pool_geometry(node, x.shape[2:])
        nd = len(g.kernel)
        acc = None
        if compiled.enabled(runtime):
            from ops.compiled.pooling import window_sums_2d

            acc = window_sums_2d(x, int(q.in_qparams[0].zero_point[0]), g)
        if acc is None:
            acc = windows(centered(x, q.in_qparams[0]), g, 0).sum(axis=tuple(range(-nd, 0)))
        counts = window_counts(g, x.shape[2:], bool(node.attr("count_include_pad", 0)))
        return [q.mean.apply(acc, counts, partial(runtime.record_overflow, node))]


@register
class GlobalAveragePool(OpDef):
    """ONNX GlobalAveragePool: the mean over all spatial axes (count = their product), module docstring."""

    op_type = "GlobalAveragePool"
    lsb_bound = 0.51  # 0.5 + |y_q - zp_y| * 2^-(mbits-1) or less, 8-bit
    preserves_channel_mean = True
    section = "4.4"
    int_types = "int8/uint8/int16/uint16 -> int8/uint8/int16/uint16"
    conformance = Case()

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        _spatial_input(x)
        return [x.astype(np.float64).mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedMean:
        return quantize_mean(ctx)

    def forward_int(self, q: QuantizedMean, inputs, runtime: IntRuntime):
        x = _spatial_input(inputs[0])
        acc = centered(x, q.in_qparams[0]).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
        count = int(np.prod(x.shape[2:], dtype=np.int64))
        return [q.mean.apply(acc, count, partial(runtime.record_overflow, q.node))]


@register
class MaxPool(OpDef):
    """ONNX MaxPool (pads, auto_pad, strides, dilations, ceil_mode): y_q = window max of x_q, qparams = input's."""

    op_type = "MaxPool"
    lsb_bound = 0.0
    section = "4.43/4.44"  # 4.44 MaxPoolingWithArgMax: the optional Indices output
    int_types = "any -> same as input"
    keeps_input_qparams = True
    conformance = Case(attrs={"kernel_shape": [2, 2]}, outputs=2, note="with the Indices output (4.44)")

    def index_outputs(self, node):
        return frozenset({1})

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        _spatial_input(x)
        return _max_pool(node, x, -np.inf)

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return _quantize_max(ctx)

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = _spatial_input(inputs[0])
        if compiled.enabled(runtime) and not (len(q.node.outputs) > 1 and q.node.outputs[1]):
            from ops.compiled.pooling import max_pool_2d

            y = max_pool_2d(x, pool_geometry(q.node, x.shape[2:]))
            if y is not None:
                return [y]
        return _max_pool(q.node, x, np.iinfo(x.dtype).min)


@register
class GlobalMaxPool(OpDef):
    """ONNX GlobalMaxPool: y_q = max of x_q over all spatial axes, qparams = input's (4.43)."""

    op_type = "GlobalMaxPool"
    lsb_bound = 0.0
    section = "4.43"
    int_types = "any -> same as input"
    keeps_input_qparams = True
    conformance = Case()

    def forward_float(self, node, inputs):
        x = np.asarray(inputs[0], dtype=np.float32)
        _spatial_input(x)
        return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return _quantize_max(ctx)

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = _spatial_input(inputs[0])
        return [x.max(axis=tuple(range(2, x.ndim)), keepdims=True)]
