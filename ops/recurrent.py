"""LSTM and GRU (ONNX, default activations: Sigmoid for the gates, Tanh for the candidates and the cell
output) in integers over whole sequences. No chapter 4 entry of the whitepaper covers recurrent cells; the
parts follow its rules: per-channel weights and integer dot products (4.22 / 4.33; 16-bit weights with a 48-bit
accumulator, as Conv's 16-bit mode), sigmoid and tanh as lookup tables (3.3.2.2), elementwise products
requantized with M / 2^N (4.49).

Fixed internal grids (ONNX convention, zero point 0, int16 codes), so calibration needs no internal tensor:

    gate pre-activations  z   scale 2^-11 (+-16: sigmoid is within 2^-23 of its limits beyond) for the sigmoid
                              gates, 2^-12 (+-8: tanh is within 2^-21 of +-1 beyond) for the tanh candidate
    gates and candidates  g   scale 2^-15 (sigmoid in [0, 1], tanh in [-1, 1]), from direct tables over every
                              16-bit input code (65,536 entries each, exact by construction)
    hidden state          h   scale 2^-15 (h = o * tanh(c) lies in [-1, 1])
    cell state            c   scale 2^-(15-cb), +-2^cb, cb = max(4, the bits that hold the calibrated ranges of
                              Y_c and initial_c, doubled); beyond, c saturates

Only X, initial_h / initial_c and the outputs Y / Y_h / Y_c use the quant table's qparams: the onnxruntime
float run exposes them. W and R are quantized here, per row (one gate unit), symmetric 16-bit (8-bit W gave
1.4-2.2 LSB on the outputs, 16-bit 0.5-0.6); B is folded into the pre-activation grid. With x_c = x_q - zp_x and per row j:

    zx_t[j] = ((sum_k W_q[j,k] x_c[t,k]) * Mx_j + 2^(Nx_j-1)) >> Nx_j      Mx_j / 2^Nx_j ~= s_x s_W[j] / s_z[j]
    zh_t[j] = ((sum_k R_q[j,k] h[t-1,k]) * Mh_j + 2^(Nh_j-1)) >> Nh_j      Mh_j / 2^Nh_j ~= 2^-15 s_R[j] / s_z[j]
    z_t[j]  = clamp(zx_t[j] + zh_t[j] + b_q[j], -2^15, 2^15 - 1),          b_q = round((Wb + Rb) / s_z[j])

LSTM (gate order i, o, f, c in W, R, B):
    i, o, f = SIGMOID[z_i], SIGMOID[z_o], SIGMOID[z_f];  g = TANH_Z[z_c]
    c_t = clamp((((f * c_{t-1}) << cb) + i * g + 2^(14+cb)) >> (15+cb))          (2^-30 -> the c grid)
    h_t = clamp((o * TANH_C[c_t] + 2^14) >> 15)
GRU (gate order z, r, h):
    u, r = SIGMOID[z_z], SIGMOID[z_r]
    linear_before_reset = 0:  n = TANH_Z[clamp(zx_h + ZH(rq(r * h_{t-1})) + b_q(Wbh + Rbh))]
    linear_before_reset = 1:  n = TANH_Z[clamp(zx_h + ((r * (ZH(h_{t-1}) + b_q(Rbh)) + 2^14) >> 15) + b_q(Wbh))]
    h_t = clamp(((2^15 - u) * n + u * h_{t-1} + 2^14) >> 15)
with rq(p) = (p + 2^14) >> 15 and ZH the recurrent term above. Each output is requantized once to its table
qparams: Y, Y_h from the h grid (M / 2^N ~= 2^-15 / s_Y), Y_c from the c grid; positions past a batch entry's
sequence_lens are 0 (ONNX). Every shift above goes through `ptq.core.requant.requantize`.

LSB bound vs the float op (onnxruntime) on the dequantized inputs, over whole sequences, 8-bit outputs: 0.5
(final rounding) plus the weights' and the grids' share carried through the recurrence; measured 0.48-0.54
LSB on random sequences of 20-50 steps with realistic weights (tests/ops/test_recurrent.py), 0.53-0.65 LSB on
the layers of a torch-exported 2-layer LSTM over 40 steps; declared 1 LSB (`lsb_bound`). Peepholes, `clip`, `input_forget` and non-default activations are not supported: such a node
runs in float (visible, with the reason).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from lut.functions import FUNCTIONS
from lut.table import LookupTable
from ops.base import multiplier, require_per_tensor, require_qparams
from ops.conformance_case import X, Case, uniform_constant
from ops.registry import IntRuntime, OpDef, QuantizationError, QuantizeContext, QuantizedNode, register
from ptq.core.qparams import QParams
from ptq.core.requant import requantize

PRE_FRAC = 11  # sigmoid gate pre-activations: scale 2^-11 (+-16)
CANDIDATE_FRAC = 12  # tanh candidate pre-activations: scale 2^-12 (+-8; tanh(8) is within 2^-21 of 1)
GATE_FRAC = 15  # gates, candidates and the hidden state: scale 2^-15
MIN_CELL_BITS = 4  # the cell state spans at least +-2^4
MAX_CELL_BITS = 14
WEIGHT_BITS = 16  # W: 8 bits measured 1.4-2.2 LSB on the outputs, 16 bits 0.5-0.6
RECURRENT_WEIGHT_BITS = 16  # R: its error compounds over the sequence
CODE_MIN, CODE_MAX = -(1 << 15), (1 << 15) - 1
ACCUMULATOR_BITS = 48  # as Conv's 16-bit mode (int16 x int16 products)
WIDE = 1 << 62  # the clamp of an intermediate requant (no saturation there)
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}
GATES = {"LSTM": 4, "GRU": 3}


def _grid(frac: int) -> QParams:
    return QParams(scale=2.0 ** -frac, zero_point=0, bits=16, signed=True)


@dataclass
class _Direction:
    """One direction's integer constants."""

    w_q: np.ndarray  # [G*H, I] int8
    r_q: np.ndarray  # [G*H, H] int8
    mx: np.ndarray  # per row: Mx_j, Nx_j, Mh_j, Nh_j (int64, [G*H])
    nx: np.ndarray
    mh: np.ndarray
    nh: np.ndarray
    bias: np.ndarray  # b_q on the pre-activation grid (int64, [G*H]); GRU lbr=1: the h rows hold Wbh only
    recurrent_bias: np.ndarray  # GRU lbr=1: b_q(Rbh) [H] (else empty)
    h0: Optional[np.ndarray]  # constant initial states on their grids (None: zeros or a run-time input)
    c0: Optional[np.ndarray]


@dataclass
class QuantizedRecurrent(QuantizedNode):
    directions: list[_Direction]
    sigmoid: LookupTable  # gate pre-activation grid (2^-11) -> gate grid
    tanh_z: LookupTable  # candidate pre-activation grid (2^-12) -> gate grid
    tanh_c: Optional[LookupTable]  # LSTM: c grid -> gate grid
    cell_bits: int
    # (M, N) of a run-time initial_h / initial_c (input 5 / 6) to the h / c grid, by input index
    initial_ratios: dict[int, tuple[int, int]] = field(default_factory=dict)
    # (M, N) of the h grid to Y / Y_h and of the c grid to Y_c, by output index
    output_ratios: dict[int, tuple[int, int]] = field(default_factory=dict)


def _rows_symmetric(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric narrow `bits`-bit codes of a [rows, K] weight (int16) and the row scales."""
    qmax = (1 << (bits - 1)) - 1
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    return np.clip(np.rint(w / scale[:, None]), -qmax, qmax).astype(np.int16), scale


def _input(ctx: QuantizeContext, index: int) -> Optional[str]:
    inputs = ctx.node.inputs
    return inputs[index] if index < len(inputs) and inputs[index] else None


def _constant(ctx: QuantizeContext, index: int, what: str) -> Optional[np.ndarray]:
    if _input(ctx, index) is None:
        return None
    if index not in ctx.constants:
        raise QuantizationError(f"{what} (input {index}) must be a constant")
    return np.asarray(ctx.constants[index], dtype=np.float64)


def _check_supported(node) -> None:
    defaults = DEFAULT_ACTIVATIONS[node.op_type]
    activations = node.attr("activations")
    if activations is not None:
        per_direction = [str(a) for a in activations]
        if any(a.lower() != b.lower() for a, b in zip(per_direction, defaults * 2)):
            raise QuantizationError(f"activations {per_direction} are not the default {defaults}")
    if node.attr("clip") is not None:
        raise QuantizationError("the clip attribute is not supported")
    if int(node.attr("input_forget", 0)):
        raise QuantizationError("input_forget = 1 is not supported")
    if node.op_type == "LSTM" and len(node.inputs) > 7 and node.inputs[7]:
        raise QuantizationError("peepholes (input P) are not supported")


def _ratio(r: float, mbits: int, what: str) -> tuple[int, int]:
    m, n = multiplier(r, mbits, what)
    return int(m[0]), int(n[0])


def _cell_bits(ctx: QuantizeContext) -> int:
    """The cell grid's range bits: +-2^cb holds the calibrated range of Y_c and the values of initial_c (a
    constant's own values, a run-time input's calibrated range) twice over."""
    reach = 0.0
    if 6 in ctx.constants:
        reach = float(np.abs(np.asarray(ctx.constants[6], dtype=np.float64)).max(initial=0.0))
    for qp in (ctx.out_qparams[2] if len(ctx.out_qparams) > 2 else None,
               ctx.in_qparams[6] if len(ctx.in_qparams) > 6 and 6 not in ctx.constants else None):
        if isinstance(qp, QParams):
            lo, hi = qp.real_range()
            reach = max(reach, float(np.abs(lo).max()), float(np.abs(hi).max()))
    needed = int(np.ceil(np.log2(2 * reach))) if reach > 0 else 0
    return int(min(MAX_CELL_BITS, max(MIN_CELL_BITS, needed)))


def _direct_table(fn, in_qp: QParams, out_qp: QParams) -> LookupTable:
    """T[x_q] = clamp(round_half_even(f(x_q * s_x) / s_y)) for every 16-bit code: 65,536 entries, exact by
    construction (an interpolated table would be off by up to 2 LSB of 2^-15)."""
    codes = np.arange(in_qp.qmin, in_qp.qmax + 1, dtype=np.int64)
    values = fn(codes * float(in_qp.scale[0])) / float(out_qp.scale[0])
    return LookupTable(in_qp, out_qp, np.clip(np.rint(values), out_qp.qmin, out_qp.qmax).astype(out_qp.dtype))


def _check_accumulators(x_qp: QParams, inputs: int, hidden: int) -> None:
    """Both dot products fit the 48-bit accumulator: K * max|codes| * max|weight codes| < 2^47."""
    weight_max = (1 << (WEIGHT_BITS - 1)) - 1
    x_max = (1 << x_qp.bits) - 1
    for depth, operand_max, what in ((inputs, x_max, "X @ W"), (hidden, CODE_MAX, "H @ R")):
        if depth * operand_max * weight_max >= 1 << (ACCUMULATOR_BITS - 1):
            raise QuantizationError(f"{what} over {depth} terms could overflow the {ACCUMULATOR_BITS}-bit accumulator")


def _directions(node) -> int:
    return 2 if node.attr("direction", "forward") == "bidirectional" else 1


def _quantize_recurrent(ctx: QuantizeContext) -> QuantizedRecurrent:
    node = ctx.node
    _check_supported(node)
    gates = GATES[node.op_type]
    x_qp = require_qparams(ctx.in_qparams[0], "input X")
    require_per_tensor(x_qp, "input X")
    w = _constant(ctx, 1, "W")
    r = _constant(ctx, 2, "R")
    if w is None or r is None:
        raise QuantizationError("W and R are required")
    dirs, rows, _ = w.shape
    hidden = r.shape[-1]
    if rows != gates * hidden or dirs != _directions(node):
        raise QuantizationError(f"W of shape {w.shape} does not fit {gates} gates of hidden size {hidden}")
    b = _constant(ctx, 3, "B")
    b = np.zeros((dirs, 2 * rows)) if b is None else b
    lbr = node.op_type == "GRU" and int(node.attr("linear_before_reset", 0)) != 0
    mbits = ctx.options.mbits
    s_g = 2.0 ** -GATE_FRAC
    # per gate row, its pre-activation grid: the candidate rows (LSTM's c, GRU's h) the finer tanh grid
    candidate = slice(3 * hidden, 4 * hidden) if node.op_type == "LSTM" else slice(2 * hidden, 3 * hidden)
    s_z = np.full(rows, 2.0 ** -PRE_FRAC)
    s_z[candidate] = 2.0 ** -CANDIDATE_FRAC
    cell_bits = _cell_bits(ctx) if node.op_type == "LSTM" else 0
    s_c = 2.0 ** -(GATE_FRAC - cell_bits)
    h0_const = _constant(ctx, 5, "initial_h") if 5 in ctx.constants else None
    c0_const = _constant(ctx, 6, "initial_c") if 6 in ctx.constants else None

    directions = []
    for d in range(dirs):
        w_q, s_w = _rows_symmetric(w[d], WEIGHT_BITS)
        r_q, s_r = _rows_symmetric(r[d], RECURRENT_WEIGHT_BITS)
        mx, nx = multiplier(float(x_qp.scale[0]) * s_w / s_z, mbits, "s_x * s_W / s_z")
        mh, nh = multiplier(s_g * s_r / s_z, mbits, "s_h * s_R / s_z")
        wb, rb = b[d, :rows], b[d, rows:]
        bias = wb + rb
        recurrent_bias = np.zeros(0, np.int64)
        if lbr:  # the h rows' recurrent bias sits inside r * (.)
            bias = np.concatenate([bias[:2 * hidden], wb[2 * hidden:]])
            recurrent_bias = np.rint(rb[2 * hidden:] / s_z[candidate]).astype(np.int64)
        bias_q = np.rint(np.clip(bias / s_z, -WIDE, WIDE)).astype(np.int64)
        layout = int(node.attr("layout", 0))
        h0, c0 = (None if v is None else
                  np.clip(np.rint(_direction_state(v, d, layout) / s), CODE_MIN, CODE_MAX).astype(np.int64)
                  for v, s in ((h0_const, s_g), (c0_const, s_c)))
        directions.append(_Direction(w_q, r_q, mx, nx, mh, nh, bias_q, recurrent_bias, h0, c0))

    z_qp, g_qp, c_qp = _grid(PRE_FRAC), _grid(GATE_FRAC), _grid(GATE_FRAC - cell_bits)
    sigmoid = _direct_table(FUNCTIONS["sigmoid"], z_qp, g_qp)
    tanh_z = _direct_table(FUNCTIONS["tanh"], _grid(CANDIDATE_FRAC), g_qp)
    tanh_c = _direct_table(FUNCTIONS["tanh"], c_qp, g_qp) if node.op_type == "LSTM" else None
    _check_accumulators(x_qp, w.shape[-1], hidden)

    in_qp: list[Optional[QParams]] = [x_qp] + [None] * (len(node.inputs) - 1)
    q = QuantizedRecurrent(node, in_qp, [None] * len(node.outputs), directions, sigmoid, tanh_z, tanh_c, cell_bits)
    for index, grid_scale, what in ((5, s_g, "initial_h"), (6, s_c, "initial_c")):
        if _input(ctx, index) is not None and index not in ctx.constants:
            qp = require_qparams(ctx.in_qparams[index], f"input {index} ({what})")
            require_per_tensor(qp, f"input {index} ({what})")
            in_qp[index] = qp
            q.initial_ratios[index] = _ratio(float(qp.scale[0]) / grid_scale, mbits, f"s_{what} / grid scale")
    for index, grid_scale, what in ((0, s_g, "Y"), (1, s_g, "Y_h"), (2, s_c, "Y_c")):
        if index < len(node.outputs) and node.outputs[index]:
            qp = require_qparams(ctx.out_qparams[index] if index < len(ctx.out_qparams) else None,
                                 f"output {index} ({what})")
            require_per_tensor(qp, f"output {index} ({what})")
            q.out_qparams[index] = qp
            q.output_ratios[index] = _ratio(grid_scale / float(qp.scale[0]), mbits, f"grid scale / s_{what}")
    return q


def _shift(acc: np.ndarray, bits: int) -> np.ndarray:
    """(acc + 2^(bits-1)) >> bits, clamped to int16 codes."""
    return requantize(acc, 1, bits, 0, CODE_MIN, CODE_MAX)


def _pre_activation(acc: np.ndarray, m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """An int32 dot product of every gate row on the pre-activation grid (per-row M / 2^N, last axis)."""
    return requantize(acc, m, n, 0, -WIDE, WIDE, axis=acc.ndim - 1)


def _time_index(step: int, lengths: np.ndarray, steps: int, reverse: bool) -> np.ndarray:
    """Per batch entry, the time index of `step` (reverse: counted back from the entry's own length)."""
    if not reverse:
        return np.full(lengths.shape, step, dtype=np.int64)
    return np.clip(lengths - 1 - step, 0, steps - 1)


def _run_direction(q: QuantizedRecurrent, d: int, x_c: np.ndarray, lengths: np.ndarray, h: np.ndarray,
                   c: np.ndarray, runtime: IntRuntime) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One direction over the sequence: (Y on the h grid [T, B, H], last h, last c)."""
    node, const = q.node, q.directions[d]
    steps, batch, _ = x_c.shape
    hidden = const.r_q.shape[1]
    reverse = node.attr("direction", "forward") == "reverse" or d == 1
    acc_x = runtime.backend.matmul(x_c.reshape(steps * batch, -1), const.w_q.T)
    zx = _pre_activation(acc_x, const.mx, const.nx).reshape(steps, batch, -1)
    y = np.zeros((steps, batch, hidden), dtype=np.int64)
    rows = np.arange(batch)
    lbr = node.op_type == "GRU" and int(node.attr("linear_before_reset", 0)) != 0
    for step in range(steps):
        t = _time_index(step, lengths, steps, reverse)
        active = (step < lengths)[:, None]
        zx_t = zx[t, rows]
        if node.op_type == "LSTM":
            zh = _pre_activation(runtime.backend.matmul(h, const.r_q.T), const.mh, const.nh)
            z = np.clip(zx_t + zh + const.bias, CODE_MIN, CODE_MAX)
            i, o, f = (q.sigmoid.lookup(z[:, k * hidden:(k + 1) * hidden]).astype(np.int64) for k in range(3))
            g = q.tanh_z.lookup(z[:, 3 * hidden:]).astype(np.int64)
            c_new = _shift(((f * c) << q.cell_bits) + i * g, GATE_FRAC + q.cell_bits)
            h_new = _shift(o * q.tanh_c.lookup(c_new).astype(np.int64), GATE_FRAC)
            c = np.where(active, c_new, c)
        else:
            two = slice(0, 2 * hidden)
            zh = _pre_activation(runtime.backend.matmul(h, const.r_q[two].T), const.mh[two], const.nh[two])
            z = np.clip(zx_t[:, two] + zh + const.bias[two], CODE_MIN, CODE_MAX)
            u = q.sigmoid.lookup(z[:, :hidden]).astype(np.int64)
            r = q.sigmoid.lookup(z[:, hidden:]).astype(np.int64)
            cand = slice(2 * hidden, 3 * hidden)
            if lbr:
                a = _pre_activation(runtime.backend.matmul(h, const.r_q[cand].T), const.mh[cand], const.nh[cand])
                inner = requantize(r * (a + const.recurrent_bias), 1, GATE_FRAC, 0, -WIDE, WIDE)
            else:
                rh = _shift(r * h, GATE_FRAC)
                inner = _pre_activation(runtime.backend.matmul(rh, const.r_q[cand].T), const.mh[cand], const.nh[cand])
            n_pre = np.clip(zx_t[:, cand] + inner + const.bias[cand], CODE_MIN, CODE_MAX)
            n = q.tanh_z.lookup(n_pre).astype(np.int64)
            h_new = _shift(((1 << GATE_FRAC) - u) * n + u * h, GATE_FRAC)
        h = np.where(active, h_new, h)
        y[t, rows] = np.where(active, h_new, y[t, rows])
    return y, h, c


def _initial(q: QuantizedRecurrent, values, index: int, d: int, batch: int, hidden: int) -> np.ndarray:
    """A direction's initial h (index 5) or c (6) on its grid: a constant, a run-time input, or zeros."""
    const = q.directions[d].h0 if index == 5 else q.directions[d].c0
    if const is not None:
        return np.broadcast_to(const, (batch, hidden)).astype(np.int64)
    qp = q.in_qparams[index] if index < len(q.in_qparams) else None
    if qp is None:
        return np.zeros((batch, hidden), dtype=np.int64)
    m, n = q.initial_ratios[index]
    state = np.asarray(values[index]).astype(np.int64)
    codes = (state[:, d] if int(q.node.attr("layout", 0)) else state[d]) - int(qp.zero_point[0])
    return requantize(codes, m, n, 0, CODE_MIN, CODE_MAX)


def _forward_int(q: QuantizedRecurrent, inputs, runtime: IntRuntime) -> list[Optional[np.ndarray]]:
    node = q.node
    layout = int(node.attr("layout", 0))
    x_c = np.asarray(inputs[0]).astype(np.int64) - int(q.in_qparams[0].zero_point[0])
    if layout:
        x_c = x_c.transpose(1, 0, 2)
    steps, batch, _ = x_c.shape
    hidden = q.directions[0].r_q.shape[1]
    lens_input = inputs[4] if len(inputs) > 4 else None
    lengths = np.full(batch, steps, dtype=np.int64) if lens_input is None else \
        np.minimum(np.asarray(lens_input).astype(np.int64), steps)
    ys, hs, cs = [], [], []
    for d in range(len(q.directions)):
        h0 = _initial(q, inputs, 5, d, batch, hidden)
        c0 = _initial(q, inputs, 6, d, batch, hidden) if node.op_type == "LSTM" else None
        y, h, c = _run_direction(q, d, x_c, lengths, h0, c0, runtime)
        ys.append(y), hs.append(h), cs.append(c)
    y_grid = np.stack(ys, axis=1)  # [T, D, B, H]
    h_grid, c_grid = np.stack(hs), (np.stack(cs) if node.op_type == "LSTM" else None)  # [D, B, H]
    if layout:
        y_grid, h_grid = y_grid.transpose(2, 0, 1, 3), h_grid.transpose(1, 0, 2)
        c_grid = c_grid.transpose(1, 0, 2) if c_grid is not None else None
    results: list[Optional[np.ndarray]] = []
    for index, grid in enumerate((y_grid, h_grid, c_grid)[:len(node.outputs)]):
        qp = q.out_qparams[index]
        if qp is None:
            results.append(None)
            continue
        m, n = q.output_ratios[index]
        results.append(requantize(grid, m, n, qp.zero_point[0], qp.qmin, qp.qmax, dtype=qp.dtype))
    return results


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _activation(name: str, alpha: Optional[float], beta: Optional[float]):
    """An ONNX RNN activation by name (the `activations` attribute), with its alpha / beta."""
    key = name.lower()
    table = {
        "sigmoid": _sigmoid,
        "tanh": np.tanh,
        "relu": lambda x: np.maximum(x, 0.0),
        "hardsigmoid": lambda x: np.clip((0.2 if alpha is None else alpha) * x + (0.5 if beta is None else beta), 0, 1),
        "leakyrelu": lambda x: np.where(x >= 0, x, (0.01 if alpha is None else alpha) * x),
        "thresholdedrelu": lambda x: np.where(x > (1.0 if alpha is None else alpha), x, 0.0),
        "scaledtanh": lambda x: (1.0 if alpha is None else alpha) * np.tanh((1.0 if beta is None else beta) * x),
        "affine": lambda x: (1.0 if alpha is None else alpha) * x + (0.0 if beta is None else beta),
        "elu": lambda x: np.where(x >= 0, x, (1.0 if alpha is None else alpha) * np.expm1(np.minimum(x, 0.0))),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.logaddexp(0.0, x),
    }
    if key not in table:
        raise NotImplementedError(f"activation {name!r}")
    return table[key]


def _activations(node, dirs: int) -> list[list]:
    """Per direction, the node's activation functions (f, g[, h]) with their alpha / beta."""
    defaults = DEFAULT_ACTIVATIONS[node.op_type]
    names = [str(a) for a in node.attr("activations", defaults * dirs)]
    alphas, betas = list(node.attr("activation_alpha", [])), list(node.attr("activation_beta", []))
    count = len(defaults)
    functions = [_activation(n, alphas[k] if k < len(alphas) else None, betas[k] if k < len(betas) else None)
                 for k, n in enumerate(names)]
    return [functions[d * count:(d + 1) * count] for d in range(dirs)]


def _direction_state(state, d: int, layout: int) -> np.ndarray:
    """Direction d of an initial state: [D, B, H] (layout 0) or [B, D, H] (layout 1)."""
    state = np.asarray(state, dtype=np.float64)
    return state[:, d] if layout else state[d]


def _float_recurrent(node, inputs) -> list[np.ndarray]:
    """The ONNX LSTM / GRU in float64, every attribute (activations, clip, input_forget, peepholes): the float
    fallback of the configurations the integer kernel refuses (onnx.reference ignores activations and clip)."""
    layout = int(node.attr("layout", 0))
    x = np.asarray(inputs[0], dtype=np.float64)
    if layout:
        x = x.transpose(1, 0, 2)
    steps, batch, _ = x.shape
    w, r = (np.asarray(v, dtype=np.float64) for v in inputs[1:3])
    dirs, rows, _ = w.shape
    hidden = r.shape[-1]

    def given(index):
        return inputs[index] if len(inputs) > index and inputs[index] is not None else None

    b = np.zeros((dirs, 2 * rows)) if given(3) is None else np.asarray(inputs[3], dtype=np.float64)
    lengths = np.full(batch, steps) if given(4) is None else np.minimum(np.asarray(inputs[4]).astype(np.int64), steps)
    peep = np.zeros((dirs, 3 * hidden)) if given(7) is None else np.asarray(inputs[7], dtype=np.float64)
    lbr = int(node.attr("linear_before_reset", 0)) != 0
    clip = node.attr("clip")
    couple = int(node.attr("input_forget", 0)) != 0

    def clipped(z):
        return z if clip is None else np.clip(z, -float(clip), float(clip))

    ys, hs, cs = [], [], []
    for d, functions in enumerate(_activations(node, dirs)):
        h = np.zeros((batch, hidden)) if given(5) is None else _direction_state(inputs[5], d, layout)
        c = np.zeros((batch, hidden)) if given(6) is None or node.op_type != "LSTM" else \
            _direction_state(inputs[6], d, layout)
        reverse = node.attr("direction", "forward") == "reverse" or d == 1
        wb, rb = b[d, :rows], b[d, rows:]
        y = np.zeros((steps, batch, hidden))
        for step in range(steps):
            t = _time_index(step, lengths, steps, reverse)
            active = (step < lengths)[:, None]
            xt = x[t, np.arange(batch)]
            if node.op_type == "LSTM":
                f_act, g_act, h_act = functions
                p_i, p_o, p_f = np.split(peep[d], 3)
                z = xt @ w[d].T + h @ r[d].T + wb + rb
                i = f_act(clipped(z[:, :hidden] + p_i * c))
                f = 1 - i if couple else f_act(clipped(z[:, 2 * hidden:3 * hidden] + p_f * c))
                g = g_act(clipped(z[:, 3 * hidden:]))
                c_new = f * c + i * g
                o = f_act(clipped(z[:, hidden:2 * hidden] + p_o * c_new))
                h_new = o * h_act(c_new)
                c = np.where(active, c_new, c)
            else:
                f_act, g_act = functions
                zr = xt @ w[d, :2 * hidden].T + h @ r[d, :2 * hidden].T + wb[:2 * hidden] + rb[:2 * hidden]
                u, rg = f_act(clipped(zr[:, :hidden])), f_act(clipped(zr[:, hidden:]))
                wh, rh = w[d, 2 * hidden:], r[d, 2 * hidden:]
                if lbr:
                    n = g_act(clipped(xt @ wh.T + rg * (h @ rh.T + rb[2 * hidden:]) + wb[2 * hidden:]))
                else:
                    n = g_act(clipped(xt @ wh.T + (rg * h) @ rh.T + rb[2 * hidden:] + wb[2 * hidden:]))
                h_new = (1 - u) * n + u * h
            h = np.where(active, h_new, h)
            y[t, np.arange(batch)] = np.where(active, h_new, y[t, np.arange(batch)])
        ys.append(y), hs.append(h), cs.append(c)
    y_all, h_all, c_all = np.stack(ys, axis=1), np.stack(hs), np.stack(cs)
    if layout:
        y_all, h_all, c_all = y_all.transpose(2, 0, 1, 3), h_all.transpose(1, 0, 2), c_all.transpose(1, 0, 2)
    return [v.astype(np.float32) for v in (y_all, h_all, c_all)][:len(node.outputs)]


class _Recurrent(OpDef):
    lsb_bound = 1.0  # measured 0.48-0.65 LSB over 20-50 steps (module docstring)
    section = "no chapter 4 entry (dot products as 4.22, tables as 3.3.2.2, products as 4.49)"
    int_types = "int8/uint8/int16 x int16 weights -> int48 acc -> int16 gates and state -> int8/uint8/int16"
    granularity = "per-row 16-bit weights; fixed 16-bit internal grids"
    wide_input = True  # X at 16 bits: the recurrence carries its error into every later state

    def forward_float(self, node, inputs):
        return _float_recurrent(node, inputs)

    def quantize(self, ctx: QuantizeContext) -> QuantizedRecurrent:
        return _quantize_recurrent(ctx)

    def forward_int(self, q: QuantizedRecurrent, inputs, runtime: IntRuntime):
        return _forward_int(q, inputs, runtime)


@register
class LSTM(_Recurrent):
    """ONNX LSTM (default activations, no peepholes) in integers, cell state at 16 bits. Module docstring."""

    op_type = "LSTM"
    conformance = Case(shape=(1, 8, 4), inputs=(X, "w", "r", "b"), attrs={"hidden_size": 4}, outputs=3,
                       constants={"w": uniform_constant("lstmw", (1, 16, 4), -0.6, 0.6),
                                  "r": uniform_constant("lstmr", (1, 16, 4), -0.6, 0.6),
                                  "b": uniform_constant("lstmb", (1, 32), -0.3, 0.3)},
                       note="X [1, 8, 4]: one step of 8 sequences (whole sequences: tests/ops/test_recurrent.py)")


@register
class GRU(_Recurrent):
    """ONNX GRU (default activations, both linear_before_reset forms) in integers. Module docstring."""

    op_type = "GRU"
    conformance = Case(shape=(1, 8, 4), inputs=(X, "w", "r", "b"), attrs={"hidden_size": 4, "linear_before_reset": 1},
                       outputs=2, constants={"w": uniform_constant("gruw", (1, 12, 4), -0.6, 0.6),
                                             "r": uniform_constant("grur", (1, 12, 4), -0.6, 0.6),
                                             "b": uniform_constant("grub", (1, 24), -0.3, 0.3)},
                       note="X [1, 8, 4]: one step of 8 sequences (whole sequences: tests/ops/test_recurrent.py)")
