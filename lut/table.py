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
  table mirrors when S is within `MIRROR_SUM_TOLERANCE` of an integer.

Every build measures `max_error_lsb` over all input codes against the formula above (0 for direct tables).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from lut.functions import Symmetry, get_function
from lut.interp import fit_nodes, interpolate
from ptq.qparams import QParams

MAX_FULL_TABLE_BITS = 10
DEFAULT_WIDE_ENTRIES = 257
INTERP_FRAC_BITS = 8
# Mirror sum allowed off an integer in an interpolated half table (its error is measured and reported anyway).
MIRROR_SUM_TOLERANCE = 1.0 / 64


@dataclass(frozen=True)
class TableReport:
    entries: int  # entries stored
    bytes: int
    max_error_lsb: int  # vs dequantize -> f -> quantize, over every input code, in output LSB
    mean_error_lsb: float
    half: bool
    interpolated: bool
    note: str  # why a requested half table fell back to a full one ("" otherwise)

    def __str__(self) -> str:
        kind = ("half " if self.half else "") + ("interpolated" if self.interpolated else "direct")
        text = (f"{kind} table: {self.entries} entries, {self.bytes} bytes, max error {self.max_error_lsb} LSB,"
                f" mean {self.mean_error_lsb:.4f} LSB")
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

    if half:
        half_codes = np.arange(0, -in_qparams.qmin + 1, dtype=np.int64)
        half_real = _real_codes(fn, in_qparams, out_qparams, half_codes)
        table = _make_entries(half_real, out_qparams, shift)
    else:
        table = _make_entries(real, out_qparams, shift)
    result = LookupTable(in_qparams, out_qparams, table, half=half, mirror=symmetry if half else None,
                         mirror_sum=mirror_sum, shift=shift, frac_bits=INTERP_FRAC_BITS if shift else 0)
    err = np.abs(result.lookup(codes).astype(np.int64) - reference)
    if half and not shift and err.any():
        note = (f"mirroring y(-x) = {mirror_sum} - y(x) differs from direct quantization at "
                f"{np.count_nonzero(err)} of {codes.size} input codes (2*center/scale + 2*zp = {mirror_real:.6f})"
                if symmetry == "odd" else
                f"mirroring y(-x) = y(x) differs from direct quantization at {np.count_nonzero(err)} input codes")
        result = LookupTable(in_qparams, out_qparams, reference.astype(out_qparams.dtype))
        err = np.zeros_like(err)
    return replace(result, note=note, max_error_lsb=int(err.max()), mean_error_lsb=float(err.mean()))


def _make_entries(real: np.ndarray, out_q: QParams, shift: int) -> np.ndarray:
    """Direct: the rounded, clamped codes in the output dtype. Interpolated: fitted int32 nodes."""
    if not shift:
        return _round_clamp(real, out_q).astype(out_q.dtype)
    nodes = -(-(real.size - 1) >> shift) + 1  # ceil((size - 1) / 2^s) + 1
    # The lookup clamps to [qmin, qmax] anyway; fitting the unclamped curve (bounded to one output range
    # beyond each end, for poles and infinities) keeps the saturation kink out of the interpolated segments.
    span = out_q.qmax - out_q.qmin
    target = np.clip(real + int(out_q.zero_point[0]), out_q.qmin - span, out_q.qmax + span)
    fitted = fit_nodes(target, shift, nodes)
    return np.rint(fitted * (1 << INTERP_FRAC_BITS)).astype(np.int32)
