"""Integer lookup tables for scalar functions (whitepaper 3.3.2.2).

Offline, in float64 (ONNX convention x_f = (x_q - zp) * scale):

    y_q = clamp(round_half_even(f((x_q - zp_x) * s_x) / s_y) + zp_y, qmin_y, qmax_y)

At run time `LookupTable.lookup` uses integer numpy operations only (indexing, abs, shifts, integer
multiply/add, clip). Three layouts:

- full table (inputs of at most 10 bits): one entry per input code, indexed by `x_q - qmin`;
- half table (`symmetry="odd"|"even"`, input zero point 0): entries for x_q = 0..|qmin| only, indexed by
  |x_q|; negative codes mirror: odd about c gives y_q(-x) = S - y_q(x) with S = 2c/s_y + 2 zp_y, even gives
  y_q(-x) = y_q(x). When S is not an integer, or the clamp [qmin_y, qmax_y] is not symmetric about S/2 over
  the codes that reach it, mirroring is inexact; a direct table is then checked code by code against the
  full table and the build falls back to the full table, saying why in `report().note`;
- interpolated table (wide inputs, `entries = 2^k + 1`): see `lut.interp`; the index is split into high
  bits (node) and low bits (fraction). Nodes are int32 with `INTERP_FRAC_BITS` fractional bits (more than
  the output dtype holds, which keeps the node rounding far below one output LSB). A half interpolated
  table mirrors when S is within `MIRROR_SUM_TOLERANCE` of an integer. The nodes are fitted, not sampled:
  least squares on the real-valued output codes, then the minimax LP on the reference codes of every input
  code (mirrored and clamped as the lookup does) bounds the max error; when least squares misses that
  bound, the nodes nearest it that meet the bound are fitted too, and the build keeps whichever of the
  candidates has the smallest (max, mean) error after rounding the nodes.

Every build measures `max_error_lsb` over all input codes against the formula above (0 for direct tables),
and for interpolated tables `error_floor_lsb`: the LP's lower bound, below which no choice of storable
nodes of this layout gets (`lut.interp`); the fitted table usually reaches it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from lut.functions import Symmetry, get_function
from lut.interp import Rows, closest_nodes, fit_nodes, interpolate, minimax_nodes
from ptq.core.qparams import QParams

MAX_FULL_TABLE_BITS = 10
DEFAULT_WIDE_ENTRIES = 257
INTERP_FRAC_BITS = 8
# Mirror sum allowed off an integer in an interpolated half table (its error is measured and reported anyway).
MIRROR_SUM_TOLERANCE = 1.0 / 64
# Rounding a node to 1 / 2^INTERP_FRAC_BITS moves an interpolated value by at most half that; a fit kept this
# far inside the band |v - r| < k + 1/2 still rounds to within k LSB.
_BAND_MARGIN = 0.5 ** (INTERP_FRAC_BITS + 1) + 1e-9
_FLOOR_SLACK = 1e-6  # LSB: the LP's tolerance, taken off its bound so the floor stays a lower bound
# Node values (output LSB) that int32 nodes with INTERP_FRAC_BITS fractional bits can store.
_NODE_BOX = (-(2.0**31) / (1 << INTERP_FRAC_BITS), (2.0**31 - 1) / (1 << INTERP_FRAC_BITS))


@dataclass(frozen=True)
class TableReport:
    entries: int  # entries stored
    bytes: int
    max_error_lsb: int  # vs dequantize -> f -> quantize, over every input code, in output LSB
    mean_error_lsb: float
    half: bool
    interpolated: bool
    note: str  # why a requested half table fell back to a full one ("" otherwise)
    error_floor_lsb: int = 0  # no nodes of this layout reach a smaller max error (interpolated; 0 for direct)

    def __str__(self) -> str:
        kind = ("half " if self.half else "") + ("interpolated" if self.interpolated else "direct")
        text = (f"{kind} table: {self.entries} entries, {self.bytes} bytes, max error {self.max_error_lsb} LSB"
                + (f" (floor {self.error_floor_lsb})" if self.interpolated else "")
                + f", mean {self.mean_error_lsb:.4f} LSB")
        return text + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True, eq=False)
class LookupTable:
    """An integer table for y_q = T(x_q); build it with `build_table`."""

    in_qparams: QParams
    out_qparams: QParams
    table: np.ndarray
    half: bool = False
    mirror: Symmetry = None  # how negative codes mirror (half tables only)
    mirror_sum: int = 0  # S in y_q(-x) = S - y_q(x) (odd half tables)
    shift: int = 0  # low index bits interpolated (0: direct table)
    frac_bits: int = 0  # fractional bits of the stored nodes
    note: str = ""
    max_error_lsb: int = 0
    mean_error_lsb: float = 0.0
    error_floor_lsb: int = 0

    @property
    def interpolated(self) -> bool:
        return self.shift > 0

    def lookup(self, q) -> np.ndarray:
        """Integer input codes (any shape) -> output codes in the output dtype. Integer operations only."""
        q = np.asarray(q)
        if not np.issubdtype(q.dtype, np.integer):
            raise TypeError(f"lookup takes integer codes, got dtype {q.dtype}")
        x = q.astype(np.int64)
        iq = self.in_qparams
        if x.size and (x.min() < iq.qmin or x.max() > iq.qmax):
            raise ValueError(f"lookup: codes outside the input range [{iq.qmin}, {iq.qmax}]")
        index = np.abs(x) if self.half else x - iq.qmin
        if self.interpolated:
            y = interpolate(self.table, index, self.shift, self.frac_bits)
        else:
            y = self.table[index].astype(np.int64)
        if self.half and self.mirror == "odd":
            y = np.where(x < 0, self.mirror_sum - y, y)
        oq = self.out_qparams
        return np.clip(y, oq.qmin, oq.qmax).astype(oq.dtype)

    def report(self) -> TableReport:
        return TableReport(
            entries=int(self.table.size),
            bytes=int(self.table.nbytes),
            max_error_lsb=self.max_error_lsb,
            mean_error_lsb=self.mean_error_lsb,
            half=self.half,
            interpolated=self.interpolated,
            note=self.note,
            error_floor_lsb=self.error_floor_lsb,
        )


def _check_per_tensor(qp: QParams, what: str) -> None:
    if not isinstance(qp, QParams):
        raise TypeError(f"build_table: {what} must be a QParams, got {type(qp).__name__}")
    if qp.per_channel:
        raise ValueError(f"build_table: {what} must be per-tensor (axis=None), got axis={qp.axis}")


def _real_codes(fn, in_q: QParams, out_q: QParams, codes: np.ndarray) -> np.ndarray:
    """f(dequantize(codes)) / s_y in float64 (unrounded, no zero point); NaN is an error."""
    x = (codes - int(in_q.zero_point[0])) * float(in_q.scale[0])
    y = np.broadcast_to(fn(x), x.shape)
    bad = np.isnan(y)
    if np.any(bad):
        raise ValueError(
            f"build_table: {fn.name} is NaN at x = {x[bad][0]:g} (input code {codes[bad][0]}); "
            "restrict the input range to the function's domain"
        )
    return y / float(out_q.scale[0])


def _round_clamp(real: np.ndarray, out_q: QParams) -> np.ndarray:
    """ONNX quantization: round half to even *before* adding the zero point (an odd zp flips ties), clamp."""
    return np.clip(np.rint(real) + int(out_q.zero_point[0]), out_q.qmin, out_q.qmax).astype(np.int64)


def _table_shape(in_q: QParams, entries: Optional[int]) -> int:
    """The interpolation shift s (0 for a direct table) for `entries` = 2^k + 1 over a `bits`-wide input."""
    bits = in_q.bits
    if entries is None:
        if bits <= MAX_FULL_TABLE_BITS:
            return 0
        entries = DEFAULT_WIDE_ENTRIES
    k = int(entries - 1).bit_length() - 1
    if entries < 3 or (1 << k) + 1 != entries or k >= bits:
        raise ValueError(
            f"build_table: entries must be 2^k + 1 with 1 <= k < {bits} (input bits), got {entries}; "
            f"leave it None for a full table of a <= {MAX_FULL_TABLE_BITS}-bit input"
        )
    return bits - k


def _half_obstacle(in_q: QParams) -> str:
    if int(in_q.zero_point[0]) != 0:
        return f"input zero point {int(in_q.zero_point[0])} != 0: codes are not symmetric about x = 0"
    if in_q.qmin >= 0:
        return "unsigned input has no negative codes to mirror"
    return ""


def build_table(fn, in_qparams: QParams, out_qparams: QParams, *, symmetry: Symmetry = None,
                center: float = 0.0, entries: Optional[int] = None) -> LookupTable:
    """A lookup table for y = fn(x) from `in_qparams` codes to `out_qparams` codes.

    fn: a callable on float64 arrays, a `LutFunction` or a registry name (its own symmetry is *not* implied:
    pass `symmetry=f.symmetry, center=f.center` to ask for a half table).
    symmetry: None (full table), "odd" about `center` (f(-x) = 2*center - f(x)) or "even" (f(-x) = f(x)).
    entries: None for a full table (inputs of at most 10 bits) or 257 nodes for wider inputs;
    2^k + 1 (k < input bits) for an interpolated table. A half interpolated table keeps the same node
    spacing and stores 2^(k-1) + 1 nodes.
    """
    fn = get_function(fn)
    _check_per_tensor(in_qparams, "in_qparams")
    _check_per_tensor(out_qparams, "out_qparams")
    if symmetry not in (None, "odd", "even"):
        raise ValueError(f"build_table: symmetry must be None, 'odd' or 'even', got {symmetry!r}")
    shift = _table_shape(in_qparams, entries)
    codes = np.arange(in_qparams.qmin, in_qparams.qmax + 1, dtype=np.int64)
    real = _real_codes(fn, in_qparams, out_qparams, codes)
    reference = _round_clamp(real, out_qparams)

    note = _half_obstacle(in_qparams) if symmetry else ""
    mirror_real = 2.0 * center / float(out_qparams.scale[0]) + 2 * int(out_qparams.zero_point[0])
    mirror_sum = int(np.rint(mirror_real))
    if symmetry == "odd" and not note and shift and abs(mirror_real - mirror_sum) > MIRROR_SUM_TOLERANCE:
        note = f"mirror sum 2*center/scale + 2*zp = {mirror_real:.6f} is not an integer"
    half = bool(symmetry) and not note

    table_real = real
    if half:
        table_real = _real_codes(fn, in_qparams, out_qparams, np.arange(0, -in_qparams.qmin + 1, dtype=np.int64))
    layout = LookupTable(in_qparams, out_qparams, np.zeros(0, np.int32), half=half,
                         mirror=symmetry if half else None, mirror_sum=mirror_sum, shift=shift,
                         frac_bits=INTERP_FRAC_BITS if shift else 0)
    if shift:
        result, floor = _fit_interpolated(layout, table_real, codes, reference)
    else:
        result, floor = replace(layout, table=_round_clamp(table_real, out_qparams).astype(out_qparams.dtype)), 0
    err = np.abs(result.lookup(codes).astype(np.int64) - reference)
    if half and not shift and err.any():
        note = (f"mirroring y(-x) = {mirror_sum} - y(x) differs from direct quantization at "
                f"{np.count_nonzero(err)} of {codes.size} input codes (2*center/scale + 2*zp = {mirror_real:.6f})"
                if symmetry == "odd" else
                f"mirroring y(-x) = y(x) differs from direct quantization at {np.count_nonzero(err)} input codes")
        result = LookupTable(in_qparams, out_qparams, reference.astype(out_qparams.dtype))
        err = np.zeros_like(err)
    return replace(result, note=note, max_error_lsb=int(err.max()), mean_error_lsb=float(err.mean()),
                   error_floor_lsb=floor)


def _lookup_rows(layout: LookupTable, codes: np.ndarray, reference: np.ndarray, level: int) -> Rows:
    """What the lookup must produce for every input code, as constraints on the interpolated value v at the
    code's table index: v ~ r, or v ~ S - r for negative codes of an odd half table (y = S - v there). A side
    is left open where the clamp keeps any overshoot on it within `level` LSB of r (r + level >= qmax for the
    side the lookup saturates to qmax, r - level <= qmin for qmin)."""
    oq = layout.out_qparams
    flip = (codes < 0) if layout.mirror == "odd" else np.zeros(codes.shape, bool)
    near_max, near_min = reference + level >= oq.qmax, reference - level <= oq.qmin
    return Rows(index=np.abs(codes) if layout.half else codes - layout.in_qparams.qmin,
                target=np.where(flip, layout.mirror_sum - reference, reference).astype(np.float64),
                upper_open=np.where(flip, near_min, near_max), lower_open=np.where(flip, near_max, near_min))


def _fit_interpolated(layout: LookupTable, real: np.ndarray, codes: np.ndarray,
                      reference: np.ndarray) -> tuple[LookupTable, int]:
    """(table, floor): interpolated nodes for `real` (unrounded output codes at table index 0..len-1; module
    doc) and a lower bound on the max error of any storable nodes of this layout."""
    oq, shift = layout.out_qparams, layout.shift
    nodes = -(-(real.size - 1) >> shift) + 1  # ceil((size - 1) / 2^s) + 1
    # The lookup clamps to [qmin, qmax] anyway; fitting the unclamped curve (bounded to one output range
    # beyond each end, for poles and infinities) keeps the saturation kink out of the interpolated segments.
    span = oq.qmax - oq.qmin
    least_squares = fit_nodes(np.clip(real + int(oq.zero_point[0]), oq.qmin - span, oq.qmax + span), shift, nodes)
    candidate = _rounded(layout, least_squares, codes, reference)
    worst = candidate[1][0]
    if worst == 0:
        return candidate[0], 0
    # Rows opened for a max error of worst - 1 relax the rows of every better table, so the LP's t bounds them
    # all: none has a max error below ceil(t - 1/2). The LP may stop once that proves least squares optimal.
    rows = _lookup_rows(layout, codes, reference, worst - 1)
    minimax, t = minimax_nodes(rows, shift, least_squares, _NODE_BOX, enough=worst - 0.5 + 2 * _FLOOR_SLACK)
    floor = min(worst, max(0, int(np.ceil(t - 0.5 - _FLOOR_SLACK))))
    if floor < worst:
        if floor < worst - 1:  # (at floor = worst - 1 the LP above already ran to the end on these rows)
            rows = _lookup_rows(layout, codes, reference, floor)
            minimax, _ = minimax_nodes(rows, shift, least_squares, _NODE_BOX)
        near = closest_nodes(rows, shift, least_squares, minimax, floor + 0.5 - _BAND_MARGIN, _NODE_BOX)
        candidate = min(candidate, *(_rounded(layout, v, codes, reference) for v in (near, minimax)),
                        key=lambda c: c[1])
    return candidate[0], floor


def _rounded(layout: LookupTable, values: np.ndarray, codes: np.ndarray,
             reference: np.ndarray) -> tuple[LookupTable, tuple[int, float]]:
    """The table with `values` rounded to int32 nodes, and its (max, mean) error over `codes`."""
    table = replace(layout, table=np.rint(values * (1 << INTERP_FRAC_BITS)).astype(np.int32))
    err = np.abs(table.lookup(codes).astype(np.int64) - reference)
    return table, (int(err.max()), float(err.mean()))
