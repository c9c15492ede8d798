"""Index and selection ops: ArgMax, ArgMin, TopK, OneHot (ONNX), InTopK and CTCGreedyDecoder (ai.ptq),
ONNX convention.

ArgMax / ArgMin (whitepaper 4.2, 4.3) and TopK (4.76): x_f = (x_q - zp_x) * s_x with one s_x > 0 is strictly
increasing in x_q, so comparisons on the codes order the elements exactly as on the dequantized floats:

    ArgMax(x_f) = ArgMax(x_q),   TopK(x_f) = (dequantize(values_q), indices) with (values_q, indices) = TopK(x_q)

Ties resolve as in ONNX (the first index, or the last with ArgMax's select_last_index; TopK lists equal values
by increasing index). The indices are int64 without qparams (`index_outputs`); TopK's values keep the
input's qparams. Per-tensor qparams are required (per-channel scales would not preserve the order across
channels). LSB bound vs the float op on the dequantized input: 0 (exact, indices equal).

InTopK (ai.ptq, 4.38): predictions (B, classes), targets (B,) integers, attribute k; as TensorFlow's in_top_k,
y[b] = (number of classes whose prediction exceeds predictions[b, targets[b]]) < k, bool without qparams
(classes tied with the target at the boundary count as in the top k). On the codes: exact.

CTCGreedyDecoder (ai.ptq, 4.19): logits (B, T, classes), input 1 the sequence lengths (B,) integers,
attribute merge_repeated (default 1); the blank is the last class (TensorFlow's convention). Per batch b, the
argmax class of each step t < len[b] (first index on ties), repeats merged, blanks removed; output int64
(B, T) padded with -1, no qparams. On the codes: exact.

OneHot (4.49): indices (raw integers, or codes of scale 1 and zero point 0, 4.13), depth, values = [off, on].
The whitepaper quantizes the two values offline with the output's qparams:

    y_q = on_q where one-hot, else off_q,      v_q = clamp(round_half_even(v / s_y) + zp_y, qmin, qmax)

with y's qparams the table's proposal (else the range of [off, on], 8 bits). LSB bound: 0.5 (the rounding of
off and on). When values is a run-time quantized tensor its codes are selected and y keeps its qparams
(exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ops.base import activation_qparams, int_list, optional_input, require_per_tensor
from ops.conformance_case import X, Case, int64s
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.graph import Node
from ptq.core.qparams import QParams, compute_qparams

VALUES_BITS = 8  # OneHot output qparams when the table proposes none


def _axis(node: Node, rank: int, default: int) -> int:
    axis = int(node.attr("axis", default))
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % rank


def _ordered(x: np.ndarray) -> np.ndarray:
    """Codes or floats as an array whose order is the values' order (wide enough to negate)."""
    return x.astype(np.int64) if np.issubdtype(x.dtype, np.integer) else x.astype(np.float64)


def arg_extreme(node: Node, x: np.ndarray, largest: bool) -> np.ndarray:
    """ONNX ArgMax (largest) / ArgMin: int64 indices along `axis`, keepdims, select_last_index."""
    x = np.asarray(x)
    axis = _axis(node, x.ndim, 0)
    values = _ordered(x)
    if node.attr("select_last_index", 0):
        values = np.flip(values, axis=axis)
    index = np.argmax(values, axis=axis) if largest else np.argmin(values, axis=axis)
    if node.attr("select_last_index", 0):
        index = x.shape[axis] - 1 - index
    index = index.astype(np.int64)
    return np.expand_dims(index, axis) if node.attr("keepdims", 1) else index


def top_k(node: Node, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX TopK (axis, largest, sorted): the k largest (smallest) values along `axis` and their int64
    indices, equal values by increasing index (a stable sort)."""
    axis = _axis(node, x.ndim, -1)
    if not 0 <= k <= x.shape[axis]:
        raise ValueError(f"input 1 (K) = {k} must be in [0, {x.shape[axis]}]")
    keys = _ordered(x)
    order = np.argsort(-keys if node.attr("largest", 1) else keys, axis=axis, kind="stable")
    index = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, index, axis=axis), index.astype(np.int64)


class _ArgExtreme(OpDef):
    section = "4.2"
    ranks_input = True
    int_types = "any -> int64 indices"
    largest: bool

    def index_outputs(self, node):
        return frozenset({0})

    def forward_float(self, node, inputs):
        return [arg_extreme(node, np.asarray(inputs[0], dtype=np.float32), self.largest)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, [activation_qparams(ctx)], [None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return [arg_extreme(q.node, np.asarray(inputs[0]), self.largest)]


@register
class ArgMax(_ArgExtreme):
    """ONNX ArgMax on the codes (module docstring). Whitepaper 4.2."""

    op_type = "ArgMax"
    lsb_bound = 0.0
    largest = True
    conformance = Case(attrs={"axis": 1})


@register
class ArgMin(_ArgExtreme):
    """ONNX ArgMin on the codes (module docstring). Whitepaper 4.3."""

    op_type = "ArgMin"
    lsb_bound = 0.0
    section = "4.3"
    largest = False
    conformance = Case(attrs={"axis": -1, "keepdims": 0})


@register
class TopK(OpDef):
    """ONNX TopK (K from input 1, or the attribute k of opset 1) on the codes: values keep the input's qparams,
    indices are int64 without qparams. Whitepaper 4.76."""

    op_type = "TopK"
    ranks_input = True
    lsb_bound = 0.0
    section = "4.76"
    int_types = "any -> same as input, int64 indices"
    keeps_input_qparams = True
    conformance = Case(inputs=(X, "k"), constants={"k": int64s(3)}, outputs=2)

    def index_outputs(self, node):
        return frozenset({1})

    @staticmethod
    def _k(node: Node, inputs) -> int:
        k = int_list(node, inputs, 1, "k")
        if k is None or len(k) != 1:
            raise ValueError(f"input 1 (K) must hold one integer, got {k}")
        return k[0]

    def forward_float(self, node, inputs):
        return list(top_k(node, np.asarray(inputs[0], dtype=np.float32), self._k(node, inputs)))

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        x_qp = activation_qparams(ctx)
        return QuantizedNode(ctx.node, [x_qp, None], [x_qp, None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return list(top_k(q.node, np.asarray(inputs[0]), self._k(q.node, inputs)))


@dataclass
class QuantizedOneHot(QuantizedNode):
    off_on: Optional[np.ndarray]  # the two output codes [off_q, on_q] of constant values; None: run-time values


def one_hot(node: Node, indices: np.ndarray, depth: int, off, on) -> np.ndarray:
    """ONNX OneHot: `on` where the (wrapped) index equals the position along the new `axis`, else `off`;
    an index outside [-depth, depth) gives a row of `off`."""
    if depth < 1:
        raise ValueError(f"input 1 (depth) must be >= 1, got {depth}")
    axis = _axis(node, indices.ndim + 1, -1)
    wrapped = np.where(indices < 0, indices + depth, indices)
    hot = np.expand_dims(wrapped, axis) == np.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    return np.where(hot, on, off)


def _check_index_qparams(qp: Optional[QParams], what: str) -> None:
    """Index codes are the indices: scale 1, zero point 0 (whitepaper 4.13)."""
    if qp is not None and (qp.per_channel or float(qp.scale[0]) != 1.0 or int(qp.zero_point[0]) != 0):
        raise QuantizationError(f"{what} is an index: it must be quantized with scale 1 and zero point 0 "
                                f"(whitepaper 4.13)")


def _index_values(value, what: str) -> np.ndarray:
    """Raw integer indices, or float / code indices that hold integers."""
    if value is None:
        raise ValueError(f"{what} is required")
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.integer):
        if np.any(value != np.round(value)):
            raise ValueError(f"{what} must hold integers")
    return value.astype(np.int64)


@register
class OneHot(OpDef):
    """ONNX OneHot (axis): on/off values quantized with the output's qparams (module docstring). Whitepaper 4.49."""

    op_type = "OneHot"
    lsb_bound = 0.5
    section = "4.49"
    int_types = "indices, depth: integers -> int8/uint8/int16"
    conformance = Case(shape=(1, 4), inputs=(X, "depth", "values"), x_dtype=np.int64,
                       constants={"depth": int64s(5), "values": np.array([-0.5, 2.0], np.float32)}, path="direct",
                       note="integer indices: no float input to calibrate")

    def forward_float(self, node, inputs):
        values = np.asarray(inputs[2], dtype=np.float32).ravel()
        if values.size != 2:
            raise ValueError(f"input 2 (values) must hold [off, on], got {values.size} values")
        indices = _index_values(inputs[0], "input 0 (indices)")
        depth = int(_index_values(inputs[1], "input 1 (depth)").ravel()[0])
        return [one_hot(node, indices, depth, values[0], values[1]).astype(np.float32)]

    def quantize(self, ctx: QuantizeContext) -> QuantizedOneHot:
        in_qp = list(ctx.in_qparams) + [None] * (3 - len(ctx.in_qparams))
        _check_index_qparams(in_qp[0], "input 0 (indices)")
        _check_index_qparams(in_qp[1], "input 1 (depth)")
        if 2 not in ctx.constants:
            values_qp = in_qp[2]
            if not isinstance(values_qp, QParams):
                raise QuantizationError("input 2 (values) is neither a constant nor quantized")
            require_per_tensor(values_qp, "input 2 (values)")
            return QuantizedOneHot(ctx.node, in_qp, [values_qp], None)
        values = np.asarray(ctx.constants[2], dtype=np.float64).ravel()
        if values.size != 2:
            raise QuantizationError(f"input 2 (values) must hold [off, on], got {values.size} values")
        y_qp = ctx.out_qparams[0] if ctx.out_qparams and ctx.out_qparams[0] is not None else None
        if y_qp is None:
            y_qp = compute_qparams(values.min(), values.max(), VALUES_BITS, symmetric=False)
        require_per_tensor(y_qp, "output")
        return QuantizedOneHot(ctx.node, in_qp, [y_qp], y_qp.quantize(values))

    def forward_int(self, q: QuantizedOneHot, inputs, runtime: IntRuntime):
        indices = _index_values(inputs[0], "input 0 (indices)")
        depth = int(_index_values(inputs[1], "input 1 (depth)").ravel()[0])
        off_on = q.off_on if q.off_on is not None else np.asarray(optional_input(inputs, 2)).ravel()
        if off_on.size != 2:
            raise ValueError(f"input 2 (values) must hold [off, on], got {off_on.size} values")
        return [one_hot(q.node, indices, depth, off_on[0], off_on[1]).astype(q.out_qparams[0].dtype)]


def in_top_k(predictions: np.ndarray, targets: np.ndarray, k: int) -> np.ndarray:
    """TensorFlow's in_top_k on codes or floats: count of predictions above the target's < k."""
    if predictions.ndim != 2 or targets.shape != (predictions.shape[0],):
        raise ValueError(f"predictions must be (batch, classes) and targets (batch,), got {predictions.shape} "
                         f"and {targets.shape}")
    if np.any(targets < 0) or np.any(targets >= predictions.shape[1]):
        raise ValueError(f"input 1 (targets) outside [0, {predictions.shape[1]})")
    values = _ordered(predictions)
    target = np.take_along_axis(values, targets[:, None], axis=1)
    return np.count_nonzero(values > target, axis=1) < k


def _integers(value, what: str) -> np.ndarray:
    if value is None:
        raise ValueError(f"{what} is required")
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {value.dtype}")
    return value.astype(np.int64).ravel()


def _in_top_k_reference(x, t):
    """The conformance case's numpy formula (k = 2): fewer than 2 predictions above the target's."""
    target = x[np.arange(x.shape[0]), t]
    return [(x > target[:, None]).sum(axis=1) < 2]


@register
class InTopK(OpDef):
    """ai.ptq InTopK (k): is each target among the top k predictions (module docstring). Whitepaper 4.38."""

    op_type = "InTopK"
    lsb_bound = 0.0
    domain = "ai.ptq"
    section = "4.38"
    int_types = "any (targets: integers) -> bool"
    conformance = Case(path="direct", reference=_in_top_k_reference, shape=(3, 6), inputs=(X, "t"),
                       constants={"t": int64s(0, 5, 2)}, attrs={"k": 2})

    def index_outputs(self, node):
        return frozenset({0})

    @staticmethod
    def _run(node: Node, predictions, targets) -> np.ndarray:
        k = node.attr("k")
        if k is None:
            raise ValueError("attribute k is required")
        return in_top_k(np.asarray(predictions), _integers(targets, "input 1 (targets)"), int(k))

    def forward_float(self, node, inputs):
        return [self._run(node, np.asarray(inputs[0], dtype=np.float32), optional_input(inputs, 1))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, [activation_qparams(ctx), None], [None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        return [self._run(q.node, inputs[0], optional_input(inputs, 1))]


def ctc_greedy(node: Node, logits: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Greedy CTC decoding (module docstring): int64 (B, T), -1 after each decoded sequence."""
    if logits.ndim != 3 or lengths.shape != (logits.shape[0],):
        raise ValueError(f"logits must be (batch, steps, classes) and input 1 (sequence lengths) (batch,), got "
                         f"{logits.shape} and {lengths.shape}")
    batch, steps, classes = logits.shape
    if np.any(lengths < 0) or np.any(lengths > steps):
        raise ValueError(f"input 1 (sequence lengths) outside [0, {steps}]")
    best = np.argmax(_ordered(logits), axis=2)
    out = np.full((batch, steps), -1, dtype=np.int64)
    for b in range(batch):
        path = best[b, :lengths[b]]
        if node.attr("merge_repeated", 1) and path.size:
            path = path[np.concatenate([[True], path[1:] != path[:-1]])]
        path = path[path != classes - 1]
        out[b, :path.size] = path
    return out


def _ctc_reference(x, lengths):
    """The conformance case's numpy formula: per sequence the argmax path, repeats merged, blanks (last class)
    dropped, padded with -1."""
    out = np.full(x.shape[:2], -1, np.int64)
    blank = x.shape[2] - 1
    for b in range(x.shape[0]):
        path = np.argmax(x[b, :lengths[b]], axis=-1)
        kept = [int(c) for t, c in enumerate(path) if c != blank and (t == 0 or c != path[t - 1])]
        out[b, :len(kept)] = kept
    return [out]


@register
class CTCGreedyDecoder(OpDef):
    """ai.ptq CTCGreedyDecoder (merge_repeated): argmax path, repeats merged, blanks (last class) removed
    (module docstring). Whitepaper 4.19."""

    op_type = "CTCGreedyDecoder"
    lsb_bound = 0.0
    domain = "ai.ptq"
    section = "4.19"
    int_types = "any (lengths: integers) -> int64"
    conformance = Case(path="direct", reference=_ctc_reference, shape=(2, 6, 4), inputs=(X, "len"),
                       constants={"len": int64s(6, 4)})

    def index_outputs(self, node):
        return frozenset({0})

    def forward_float(self, node, inputs):
        logits = np.asarray(inputs[0], dtype=np.float32)
        return [ctc_greedy(node, logits, _integers(optional_input(inputs, 1), "input 1 (sequence lengths)"))]

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        return QuantizedNode(ctx.node, [activation_qparams(ctx), None], [None])

    def forward_int(self, q: QuantizedNode, inputs, runtime: IntRuntime):
        lengths = _integers(optional_input(inputs, 1), "input 1 (sequence lengths)")
        return [ctc_greedy(q.node, np.asarray(inputs[0]), lengths)]
