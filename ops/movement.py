"""Data movement between axes: DepthToSpace, SpaceToDepth, Tile, Expand, ReverseSequence (ONNX) and, in the
`ai.ptq` domain, the whitepaper's BatchToSpace, SpaceToBatch, BatchToDepth, DataStride and Repeat.

Whitepaper 4.6, 4.7, 4.20, 4.21, 4.56, 4.59, 4.69, 4.70, 4.75, ONNX convention: from y_f = T(x_f),
(y_q - zp_y) * s_y = T((x_q - zp_x) * s_x); with s_y = s_x and zp_y = zp_x

    y_q = T(x_q)

where an element T creates from nothing (SpaceToBatch's padding) is the code of 0.0, zp_x. Every output takes
the input's qparams (overriding the quant table's proposal). LSB bound vs the float op on the dequantized
input: 0 (exact).

The `ai.ptq` ops are laid out NCHW like ONNX (the whitepaper's NHWC descriptions transposed):
- BatchToSpace (4.7): `block_size` [bh, bw] (or one int), `crops` [top, bottom, left, right];
  (bh*bw*N, C, H, W) -> (N, C, H*bh, W*bw), y[n, c, h*bh + i, w*bw + j] = x[(i*bw + j)*N + n, c, h, w],
  then cropped (TensorFlow's batch_to_space).
- SpaceToBatch (4.69): the inverse, after zero padding by `pads` [top, bottom, left, right].
- BatchToDepth (4.6): `block_size` b; (N*b, C, H, W) -> (N, b*C, H, W), y[n, k*C + c] = x[n*b + k, c].
- DataStride (4.20): `kernel_shape`, `strides` per spatial axis; along each spatial axis the k elements
  after every stride are gathered: y[..., o*k + i, ...] = x[..., o*s + i, ...], o < (n - k) // s + 1, i < k.
- Repeat (4.56): input 1 the repeat counts, attribute `axis` (none: the flattened input); numpy.repeat.
- Filter (4.31): inputs x_0 ... x_{k-1} and a selector vector s along `axis` (default 0); outputs y_0 ...
  y_{k-1} and count (int64, no qparams). y_i holds the slices of x_i where s != 0, in order, at the front of
  `axis`, and zeros (zp_i) after them: the shape stays fixed, as hardware wants; count = number of s != 0.
  A quantized selector is nonzero where its code differs from its zero point (its float is then nonzero).
"""
from __future__ import annotations

import numpy as np

from ops.base import activation_qparams, float_or_index, int_list, normalize_axes, optional_input
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams

PTQ_DOMAIN = "ai.ptq"


class _Movement(OpDef):
    """An op that only moves elements (and may create zeros): one `apply` serves the float and the integer
    forward, with `zero` the value of 0.0 (0.0 in float, zp_x on the codes)."""

    int_types = "any -> same as input"
    keeps_input_qparams = True

    def apply(self, node: Node, x: np.ndarray, inputs: list, zero) -> np.ndarray:
        raise NotImplementedError

    def forward_float(self, node, inputs):
        x = float_or_index(inputs[0])
        return [np.asarray(self.apply(node, x, inputs, x.dtype.type(0)), dtype=x.dtype)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, list(ctx.in_qparams), [activation_qparams(ctx)])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        x = np.asarray(inputs[0])
        return [self.apply(q.node, x, inputs, x.dtype.type(q.in_qparams[0].zero_point[0]))]


def _nchw(x: np.ndarray) -> tuple[int, int, int, int]:
    if x.ndim != 4:
        raise ValueError(f"expected an (N, C, H, W) input, got shape {x.shape}")
    return x.shape


def _positive(value: int, what: str) -> int:
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


def _block_hw(node: Node) -> tuple[int, int]:
    """`block_size` as (bh, bw): one int for both axes, or two."""
    block = node.attr("block_size")
    if block is None:
        raise ValueError("block_size is required")
    block = [int(b) for b in np.atleast_1d(block)]
    if len(block) == 1:
        block = block * 2
    if len(block) != 2:
        raise ValueError(f"block_size must hold 1 or 2 values, got {block}")
    return _positive(block[0], "block_size"), _positive(block[1], "block_size")


def _counts(inputs: list, index: int, what: str) -> np.ndarray:
    """Input `index` as a flat int64 array of integers (ValueError naming `what` when absent or not integers)."""
    value = optional_input(inputs, index)
    if value is None:
        raise ValueError(f"input {index} ({what}) is required")
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"input {index} ({what}) must be integers, got {value.dtype}")
    return value.astype(np.int64).ravel()


def _four(node: Node, attr: str) -> list[int]:
    values = [int(v) for v in node.attr(attr, [0, 0, 0, 0])]
    if len(values) != 4 or min(values) < 0:
        raise ValueError(f"{attr} must be 4 non-negative values [top, bottom, left, right], got {values}")
    return values


@register
class DepthToSpace(_Movement):
    """ONNX DepthToSpace (blocksize b, mode DCR or CRD): (N, C, H, W) -> (N, C/b^2, H*b, W*b). Whitepaper 4.21."""

    op_type = "DepthToSpace"
    lsb_bound = 0.0
    section = "4.21"
    conformance = Case(shape=(1, 8, 2, 3), attrs={"blocksize": 2})

    def apply(self, node, x, inputs, zero):
        n, c, h, w = _nchw(x)
        b = _positive(int(node.attr("blocksize", 0)), "blocksize")
        if c % (b * b):
            raise ValueError(f"channels {c} not divisible by blocksize^2 = {b * b}")
        mode = node.attr("mode", "DCR")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode == "DCR":
            y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
        elif mode == "CRD":
            y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        else:
            raise ValueError(f"mode must be DCR or CRD, got {mode!r}")
        return y.reshape(n, c // (b * b), h * b, w * b)


@register
class SpaceToDepth(_Movement):
    """ONNX SpaceToDepth (blocksize b): (N, C, H, W) -> (N, C*b^2, H/b, W/b). Whitepaper 4.70."""

    op_type = "SpaceToDepth"
    lsb_bound = 0.0
    section = "4.70"
    conformance = Case(shape=(1, 2, 4, 6), attrs={"blocksize": 2})

    def apply(self, node, x, inputs, zero):
        n, c, h, w = _nchw(x)
        b = _positive(int(node.attr("blocksize", 0)), "blocksize")
        if h % b or w % b:
            raise ValueError(f"spatial size {h}x{w} not divisible by blocksize {b}")
        y = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
        return y.reshape(n, c * b * b, h // b, w // b)


@register
class Tile(_Movement):
    """ONNX Tile: input 1 holds the repeat count of every axis. Whitepaper 4.75."""

    op_type = "Tile"
    lsb_bound = 0.0
    section = "4.75"
    conformance = Case(inputs=(X, "r"), constants={"r": int64s(1, 2, 1, 2)})

    def apply(self, node, x, inputs, zero):
        repeats = int_list(node, inputs, 1, "repeats")
        if repeats is None or len(repeats) != x.ndim or min(repeats, default=0) < 0:
            raise ValueError(f"input 1 (repeats) must hold {x.ndim} non-negative counts, got {repeats}")
        return np.tile(x, repeats)


@register
class Expand(_Movement):
    """ONNX Expand: broadcast to np.broadcast_shapes(x.shape, shape) (input 1). Whitepaper 4.75 (Tile's rule)."""

    op_type = "Expand"
    lsb_bound = 0.0
    section = "4.75"
    conformance = Case(shape=(1, 3, 1, 5), inputs=(X, "s"), constants={"s": int64s(1, 3, 4, 5)})

    def apply(self, node, x, inputs, zero):
        shape = int_list(node, inputs, 1, "shape")
        if shape is None:
            raise ValueError("input 1 (shape) is required")
        try:
            target = np.broadcast_shapes(x.shape, tuple(shape))
        except ValueError as err:
            raise ValueError(f"input 1 (shape) {shape} does not broadcast with {x.shape}") from err
        return np.broadcast_to(x, target).copy()


@register
class ReverseSequence(_Movement):
    """ONNX ReverseSequence: for every batch index b, the first sequence_lens[b] elements along time_axis are
    reversed, the rest copied. Whitepaper 4.59."""

    op_type = "ReverseSequence"
    lsb_bound = 0.0
    section = "4.59"
    conformance = Case(shape=(1, 4, 3), inputs=(X, "lens"), constants={"lens": int64s(3)},
                       attrs={"batch_axis": 0, "time_axis": 1})

    def apply(self, node, x, inputs, zero):
        lens = _counts(inputs, 1, "sequence_lens")
        axes = [int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))]
        batch_axis, time_axis = normalize_axes(axes, x.ndim)
        steps = x.shape[time_axis]
        if lens.size != x.shape[batch_axis] or np.any(lens < 0) or np.any(lens > steps):
            raise ValueError(f"input 1 (sequence_lens) {lens.tolist()} must give one length in [0, {steps}] "
                             f"per batch element ({x.shape[batch_axis]})")
        t = np.arange(steps)
        source = np.where(t[None, :] < lens[:, None], lens[:, None] - 1 - t[None, :], t[None, :])  # (batch, time)
        moved = np.moveaxis(x, (batch_axis, time_axis), (0, 1))
        y = np.take_along_axis(moved, source.reshape(source.shape + (1,) * (moved.ndim - 2)), axis=1)
        return np.moveaxis(y, (0, 1), (batch_axis, time_axis))


def _batch_to_space_reference(x):
    """The conformance case's numpy formula, block (2, 2), no crops:
    y[n, c, 2h + i, 2w + j] = x[(2i + j) N + n, c, h, w]."""
    n = x.shape[0] // 4
    y = np.zeros((n, x.shape[1], 2 * x.shape[2], 2 * x.shape[3]), x.dtype)
    for i in range(2):
        for j in range(2):
            y[:, :, i::2, j::2] = x[(2 * i + j) * n:(2 * i + j + 1) * n]
    return [y]


@register
class BatchToSpace(_Movement):
    """ai.ptq BatchToSpace (NCHW, `block_size`, `crops`): module docstring. Whitepaper 4.7."""

    op_type = "BatchToSpace"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.7"
    conformance = Case(path="direct", reference=_batch_to_space_reference, shape=(4, 3, 2, 3),
                       attrs={"block_size": [2, 2], "crops": [0, 0, 0, 0]})

    def apply(self, node, x, inputs, zero):
        nb, c, h, w = _nchw(x)
        bh, bw = _block_hw(node)
        top, bottom, left, right = _four(node, "crops")
        if nb % (bh * bw):
            raise ValueError(f"batch {nb} not divisible by the block {bh}x{bw}")
        if top + bottom >= h * bh or left + right >= w * bw:
            raise ValueError(f"crops {[top, bottom, left, right]} leave nothing of {h * bh}x{w * bw}")
        n = nb // (bh * bw)
        y = x.reshape(bh, bw, n, c, h, w).transpose(2, 3, 4, 0, 5, 1).reshape(n, c, h * bh, w * bw)
        return y[:, :, top:h * bh - bottom, left:w * bw - right]


def _space_to_batch_reference(x):
    """The conformance case's numpy formula, block (2, 2), no pads: the inverse of BatchToSpace's."""
    n = x.shape[0]
    return [np.concatenate([x[:, :, i::2, j::2] for i in range(2) for j in range(2)], axis=0)[:4 * n]]


@register
class SpaceToBatch(_Movement):
    """ai.ptq SpaceToBatch (NCHW, `block_size`, `pads`): zero padding, then spatial blocks into the batch
    (module docstring). Whitepaper 4.69."""

    op_type = "SpaceToBatch"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.69"
    conformance = Case(path="direct", reference=_space_to_batch_reference, shape=(1, 3, 4, 4),
                       attrs={"block_size": [2, 2], "pads": [0, 0, 0, 0]})

    def apply(self, node, x, inputs, zero):
        n, c, _, _ = _nchw(x)
        bh, bw = _block_hw(node)
        top, bottom, left, right = _four(node, "pads")
        padded = np.pad(x, [(0, 0), (0, 0), (top, bottom), (left, right)], constant_values=zero)
        h, w = padded.shape[2:]
        if h % bh or w % bw:
            raise ValueError(f"padded size {h}x{w} not divisible by the block {bh}x{bw}")
        y = padded.reshape(n, c, h // bh, bh, w // bw, bw).transpose(3, 5, 0, 1, 2, 4)
        return y.reshape(bh * bw * n, c, h // bh, w // bw)


@register
class BatchToDepth(_Movement):
    """ai.ptq BatchToDepth (NCHW, `block_size` b): (N*b, C, H, W) -> (N, b*C, H, W). Whitepaper 4.6."""

    op_type = "BatchToDepth"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.6"
    conformance = Case(path="direct", reference=lambda x: [x.reshape(1, 2, 3, 4, 5).reshape(1, 6, 4, 5)],
                       shape=(2, 3, 4, 5), attrs={"block_size": 2})

    def apply(self, node, x, inputs, zero):
        nb, c, h, w = _nchw(x)
        b = _positive(int(node.attr("block_size", 0)), "block_size")
        if nb % b:
            raise ValueError(f"batch {nb} not divisible by block_size {b}")
        return x.reshape(nb // b, b * c, h, w)


def _data_stride_reference(x):
    """The conformance case's numpy formula, kernel 2, stride 3 along the last axis: y[..., 2o + i] = x[..., 3o + i]."""
    outs = (x.shape[3] - 2) // 3 + 1
    return [np.concatenate([x[..., 3 * o:3 * o + 2] for o in range(outs)], axis=3)]


@register
class DataStride(_Movement):
    """ai.ptq DataStride (`kernel_shape`, `strides` per spatial axis of an (N, C, spatial...) input): module
    docstring. Whitepaper 4.20."""

    op_type = "DataStride"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.20"
    conformance = Case(path="direct", reference=_data_stride_reference,
                       attrs={"kernel_shape": [1, 2], "strides": [1, 3]})

    def apply(self, node, x, inputs, zero):
        if x.ndim < 3:
            raise ValueError(f"expected an (N, C, spatial...) input, got shape {x.shape}")
        nd = x.ndim - 2
        kernel = [int(k) for k in node.attr("kernel_shape", [])]
        strides = [int(s) for s in node.attr("strides", [1] * nd)]
        if len(kernel) != nd or len(strides) != nd:
            raise ValueError(f"kernel_shape {kernel} and strides {strides} need {nd} values")
        y = x
        for axis, k, s in zip(range(2, x.ndim), kernel, strides):
            _positive(k, "kernel_shape")
            _positive(s, "strides")
            if k > x.shape[axis]:
                raise ValueError(f"kernel {k} larger than axis {axis} ({x.shape[axis]})")
            starts = np.arange((x.shape[axis] - k) // s + 1) * s
            y = np.take(y, (starts[:, None] + np.arange(k)).ravel(), axis=axis)
        return y


@register
class Repeat(_Movement):
    """ai.ptq Repeat: numpy.repeat(x, repeats (input 1), axis); no axis: the flattened input. Whitepaper 4.56."""

    op_type = "Repeat"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.56"
    conformance = Case(path="direct", reference=lambda x, r: [np.repeat(x, r, axis=3)], inputs=(X, "r"),
                       constants={"r": int64s(1, 2, 0, 1, 3)}, attrs={"axis": 3})

    def apply(self, node, x, inputs, zero):
        repeats = _counts(inputs, 1, "repeats")
        axis = node.attr("axis")
        if axis is None:
            x, axis = x.ravel(), 0
        axis = normalize_axes([int(axis)], x.ndim)[0]
        if repeats.size not in (1, x.shape[axis]) or np.any(repeats < 0):
            raise ValueError(f"input 1 (repeats) must hold 1 or {x.shape[axis]} non-negative counts, "
                             f"got {repeats.tolist()}")
        return np.repeat(x, repeats, axis=axis)


def filtered(x: np.ndarray, keep: np.ndarray, axis: int, zero) -> np.ndarray:
    """The slices of x where `keep` (a vector along `axis`), packed at the front; `zero` after them."""
    axis = normalize_axes([axis], x.ndim)[0]
    if keep.shape != (x.shape[axis],):
        raise ValueError(f"the selector (last input) must hold {x.shape[axis]} values along axis {axis}, "
                         f"got shape {keep.shape}")
    chosen = np.nonzero(keep)[0]
    y = np.full(x.shape, zero, dtype=x.dtype)
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, chosen.size)
    y[tuple(index)] = np.take(x, chosen, axis=axis)
    return y


def _filter_reference(a, s):
    """The conformance case's numpy formula: the kept slices of axis 2 first, zeros after; their count."""
    kept = a[:, :, s != 0]
    out = np.zeros_like(a)
    out[:, :, :kept.shape[2]] = kept
    return [out, np.int64(np.count_nonzero(s))]


@register
class Filter(OpDef):
    """ai.ptq Filter (axis): the selected slices of every data input packed at the front, and their count
    (module docstring). Whitepaper 4.31."""

    op_type = "Filter"
    lsb_bound = 0.0
    domain = PTQ_DOMAIN
    section = "4.31"
    int_types = "any (selector: integers or codes) -> same as input, int64 count"
    keeps_input_qparams = True
    conformance = Case(path="direct", reference=_filter_reference, inputs=(X, "s"), constants={"s": int64s(1, 0, 1, 1)},
                       outputs=2, attrs={"axis": 2})

    def index_outputs(self, node):
        return frozenset({len(node.outputs) - 1})

    @staticmethod
    def _check(node: Node, inputs) -> int:
        if len(inputs) < 2 or len(node.outputs) != len(inputs):
            raise ValueError(f"Filter takes k data inputs and a selector and gives k outputs and a count; "
                             f"got {len(inputs)} inputs, {len(node.outputs)} outputs")
        return int(node.attr("axis", 0))

    def forward_float(self, node, inputs):
        axis = self._check(node, inputs)
        keep = np.asarray(inputs[-1]).ravel() != 0
        data = [float_or_index(x) for x in inputs[:-1]]
        return [filtered(x, keep, axis, x.dtype.type(0)) for x in data] + [np.array(np.count_nonzero(keep), np.int64)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        data = [activation_qparams(ctx, i) for i in range(len(ctx.node.inputs) - 1)]
        return QuantizedNode(ctx.node, list(ctx.in_qparams), data + [None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        axis = self._check(q.node, inputs)
        selector, selector_qp = np.asarray(inputs[-1]).ravel(), q.in_qparams[-1]
        if isinstance(selector_qp, QParams):
            keep = selector.astype(np.int64) != int(selector_qp.zero_point[0])
        else:
            keep = selector != 0
        outs = [filtered(np.asarray(x), keep, axis, np.asarray(x).dtype.type(qp.zero_point[0]))
                for x, qp in zip(inputs[:-1], q.out_qparams)]
        return outs + [np.array(np.count_nonzero(keep), np.int64)]
