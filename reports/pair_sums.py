"""One read of a float reference tensor x and its test tensor y (integer codes dequantized on the fly, or floats):
the similarity sums, and for the report's cumulative comparison the clipped counts and the value histogram too.

Per element, with x first clamped to a folded range [a, b] when given (in x's dtype, as `np.clip` does):

    y    = (float32(y_q) - float32(zp[c])) * float32(scale[c])   in float32 (`reports.grid.dequantize32`),
           or y as it is when the test tensor is float
    d    = x - y                                                  in the common dtype, rounded once as numpy does
    dot += x*y,  xx += x*x,  yy += y*y,  se += d*d                each product in float64
    max_err = max |d|,  below += x < grid_lo[c],  above += x > grid_hi[c]   (x in float64 against float64 bounds)
    counts[bin(x)] += 1                                           (`reports.value_histogram.bin_index`)

How, without changing a result: the products of float32 values are exact in float64, so a fused multiply-add
rounds as the product and the sum apart would. The bounds are rounded outward to x's dtype once (v < lo exactly
when v < grid_lo in float64); for a per-tensor grid, which is the histogram's [low, high], the clipped counts are
the histogram's counts beyond low and high (exact: `reports.value_histogram`). The bin is computed in x's dtype
with an error bound (`_bin_steps`): values whose quotient lies near a bin edge are binned by `bin_index` itself,
so the counts are those of the float64 formula. The extremes and max |d| are taken on order keys (integers that
order as the floats do, -0.0 below +0.0) in the keys' own width per chunk.

Summation order, fixed by the shape and the qparams alone: the codes are read in C order (channels-last 8-bit
codes, the compiled convolutions' views, are transposed first by `reports.channels_first`), so the same codes
give the same bits on both backends. The tensor is one flat row (per channel: one row per channel and outer
index, in C order), read in chunks of CHUNK elements; a chunk's four sums are added in the order the compiler
picks to vectorize them (the only reassociation), and the totals add the chunk sums in order. The same process
and machine give the same bits every time, so `--workers N` merges into the one-process report
(`reports.evaluate_shards` re-adds each sample's sums); another CPU may vectorize with other widths and differ in
the last bits, as the BLAS block sums before did. Products of float32 values are exact in float64, so a sum
carries only float64 roundings of its additions (relative error below 1e-12, tested), where the former float32
block sums carried ~1e-8. The clipped counts, histogram counts and extremes do not depend on the order at all.

Measured on EfficientNet-Lite0 (62 tensors, 7.1 M values per image, 58 channels-last; a loaded 2-core machine,
CPU per image): `bench/report_compare.py` 15 ms on 20 images where float64 binning, the extremes in the sums loop
and numpy's transposes took 37 ms; on one image's tensors, best of 25, 13 ms with the histogram (28-29 before)
and 6.5 ms for the sums alone (14.5). Of the 13: transposing the codes 1.3, reading the tensors into the chunk
buffers ~2, the sums ~2.5, the bins ~1.5, tallying them ~3.3 (one scalar increment per value: eight interleaved
tallies), Python ~1.2.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np
from numba import types
from llvmlite import ir
from numba.extending import intrinsic, overload

from ptq.core.qparams import QParams
from reports.channels_first import channels_first
from reports.value_histogram import ValueHistogram, bin_index

CHUNK = 1024  # elements summed together (in a vectorized order), then added to the totals in order
TALLIES = 8  # interleaved histogram tallies (`_count_bins`)


@dataclass(frozen=True)
class PairSums:
    """The sums of one (reference, test) tensor pair (module docstring)."""

    dot: float
    xx: float
    yy: float
    se: float
    max_err: float
    n: int


@dataclass(frozen=True)
class GridCounts:
    """What the cumulative comparison counts besides the sums: values beyond the grid, the value histogram's
    counts (int64, its layout) and the extremes of the (clamped) reference."""

    below: int
    above: int
    counts: np.ndarray
    min: float
    max: float


def _test_value(v, zp, scale):
    """A test element as a float: integer codes dequantized (compiled through the overload below)."""
    return v


@overload(_test_value)
def _test_value_typed(v, zp, scale):
    if isinstance(v, types.Integer):
        return lambda v, zp, scale: (np.float32(v) - zp) * scale
    return lambda v, zp, scale: v


@intrinsic
def _order_key(typingctx, value):
    """A float's bits as a signed integer of its width, flipped for negative floats so that the integers order
    as the floats do (-0.0 just below +0.0; NaN beyond +inf): integer minima and maxima vectorize where float
    ones do not (they must keep NaN). `from_order_key` inverts it."""
    if not isinstance(value, types.Float):
        return None
    width = value.bitwidth
    ret = types.int32 if width == 32 else types.int64

    def codegen(context, builder, signature, args):
        itype = ir.IntType(width)
        bits = builder.bitcast(args[0], itype)
        sign = builder.ashr(bits, ir.Constant(itype, width - 1))
        return builder.xor(bits, builder.and_(sign, ir.Constant(itype, (1 << (width - 1)) - 1)))

    return ret(value), codegen


def from_order_key(key: int, dtype) -> float:
    """The float (of `dtype`, float32 or float64) whose `_order_key` is `key`."""
    single = np.dtype(dtype) == np.float32
    key = int(key)
    bits = key ^ ((1 << (31 if single else 63)) - 1) if key < 0 else key
    return struct.unpack("<f" if single else "<d", struct.pack("<i" if single else "<q", bits))[0]


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})  # the four float sums only (module docstring)
def _chunk_sums(xb, yb, n, keys):
    """(sum x*y, sum x*x, sum y*y, sum d*d) over the first n elements, in float64; the order key of max |d| folded
    into keys[0] (taken per chunk in the key's own width: int32 for float32)."""
    dot = 0.0
    xx = 0.0
    yy = 0.0
    se = 0.0
    err = _order_key(np.abs(xb[0] - yb[0]))
    for i in range(n):
        x = np.float64(xb[i])
        y = np.float64(yb[i])
        e = xb[i] - yb[i]
        d = np.float64(e)
        dot += x * y
        xx += x * x
        yy += y * y
        se += d * d
        k = _order_key(np.abs(e))
        err = k if k > err else err
    keys[0] = max(keys[0], np.int64(err))
    return dot, xx, yy, se


@numba.njit(cache=True, nogil=True)
def _chunk_bins(xb, n, steps, jb, keys):
    """Each element's bin into jb, computed in xb's dtype: floor((v - start) * inv) + 1 clamped to [0, last], or -1
    where (v - start) * inv lies within `near` of a whole number (`_bin_steps`: the exact bin may then be either
    neighbour, or v is NaN or infinite). The order keys of min x and max x folded into keys[1:3]. Returns whether
    any bin is -1."""
    start = steps[0]
    inv = steps[1]
    near = steps[2]
    far = steps[3]
    last = steps[4]
    zero = steps[5]
    one = steps[6]
    lowest = np.int32(0)
    smallest = _order_key(xb[0])
    largest = smallest
    for i in range(n):
        key = _order_key(xb[i])
        smallest = key if key < smallest else smallest
        largest = key if key > largest else largest
        q = (xb[i] - start) * inv
        f = np.floor(q)
        frac = q - f
        j = f + one
        j = j if j > zero else zero
        j = j if j < last else last
        k = np.int32(j) if (frac >= near) & (frac <= far) else np.int32(-1)
        jb[i] = k
        lowest = min(lowest, k)
    keys[1] = min(keys[1], np.int64(smallest))
    keys[2] = max(keys[2], np.int64(largest))
    return lowest < 0


@numba.njit(cache=True, nogil=True)
def _exact_bins(xb, n, jb, low, high, inv, inner, margin):
    """The bins `_chunk_bins` left at -1, by the exact `bin_index`."""
    for i in range(n):
        if jb[i] < 0:
            jb[i] = bin_index(np.float64(xb[i]), low, high, inv, inner, margin)


@numba.njit(cache=True, nogil=True)
def _count_bins(jb, n, sub, stride):
    """sub[k * stride + jb[i]] += 1, k = i % TALLIES: interleaved tallies, so that runs of one bin do not
    serialize the increments (unsigned indices: no negative-index wraparound)."""
    s = np.uint64(stride)
    for k in range(n // TALLIES):
        i = np.uint64(TALLIES * k)
        for t in range(TALLIES):
            u = np.uint64(t)
            sub[u * s + np.uint64(jb[i + u])] += 1
    for i in range(n - n % TALLIES, n):
        sub[np.uint64(jb[i])] += 1


@numba.njit(cache=True, nogil=True)
def _chunk_clipped(xb, n, lo, hi):
    """(values below lo, values above hi)."""
    below = 0
    above = 0
    for i in range(n):
        below = np.int32(below + (xb[i] < lo))
        above = np.int32(above + (xb[i] > hi))
    return below, above


@numba.njit(cache=True, nogil=True)
def _narrow_bounds(grid_lo, grid_hi, like):
    """(C, 2) bounds (lo, hi) in like's dtype such that, for every v of that dtype, v < lo and v > hi exactly when
    v < grid_lo[c] and v > grid_hi[c] in float64: lo rounded up, hi rounded down."""
    bounds = np.empty((grid_lo.size, 2), dtype=like.dtype)
    top = np.empty(2, dtype=like.dtype)
    top[0] = -np.inf
    top[1] = np.inf
    for c in range(grid_lo.size):
        bounds[c, 0] = grid_lo[c]
        if bounds[c, 0] < grid_lo[c]:
            bounds[c, 0] = np.nextafter(bounds[c, 0], top[1])
        bounds[c, 1] = grid_hi[c]
        if bounds[c, 1] > grid_hi[c]:
            bounds[c, 1] = np.nextafter(bounds[c, 1], top[0])
    return bounds


@numba.njit(cache=True, nogil=True)
def _fold_chunk(xs, yb, n, sums, keys, binned, clipped, lo, hi, steps, jb, sub, stride, counts, low, high, inv, inner,
                margin):
    """One chunk's sums, clipped counts (when not read off the histogram) and bins into the running totals."""
    dot, xx, yy, se = _chunk_sums(xs, yb, n, keys)
    sums[0] += dot
    sums[1] += xx
    sums[2] += yy
    sums[3] += se
    if binned:
        if clipped:
            below, above = _chunk_clipped(xs, n, lo, hi)
            counts[-2] += below
            counts[-1] += above
        if _chunk_bins(xs, n, steps, jb, keys):
            _exact_bins(xs, n, jb, low, high, inv, inner, margin)
        _count_bins(jb, n, sub, stride)


@numba.njit(cache=True, nogil=True)
def _compare(x, test, zp, scale, clip_lo, clip_hi, grid_lo, grid_hi, binned, clipped, low, high, inv, inner, margin,
             steps, bins, xb, yb):
    """x and test (rows, C, length), C-contiguous; zp, scale, grid_lo, grid_hi: one value per channel, or one for
    all (the zero points and scales are read as float32, as `reports.grid.dequantize32` reads them). Returns
    (sums [dot, xx, yy, se], order keys [max |d|, min x, max x], counts: `bins` histogram counts, below, above).
    Without `clipped` the grid is the histogram's [low, high]: below and above are its counts beyond them."""
    sums = np.zeros(4)
    keys = np.array([0, np.iinfo(np.int64).max, np.iinfo(np.int64).min], dtype=np.int64)
    counts = np.zeros(bins + 2, dtype=np.int64)
    stride = bins + 2
    sub = np.zeros(TALLIES * stride, dtype=np.int64)
    jb = np.zeros(CHUNK, dtype=np.int32)
    bounds = _narrow_bounds(grid_lo, grid_hi, xb)
    clamped = clip_lo > -np.inf or clip_hi < np.inf
    rows, channels, length = x.shape
    for r in range(rows):
        for c in range(channels):
            z = np.float32(zp[c] if zp.size == channels else zp[0])
            s = np.float32(scale[c] if scale.size == channels else scale[0])
            b = c if grid_lo.size == channels else 0
            lo = bounds[b, 0]
            hi = bounds[b, 1]
            for start in range(0, length, CHUNK):
                n = min(CHUNK, length - start)
                # the test values into a chunk buffer (loops over unit-stride slices vectorize)
                values = test[r, c, start:start + n]
                for i in range(n):
                    yb[i] = _test_value(values[i], z, s)
                row = x[r, c, start:start + n]  # read in place, or:
                if clamped:  # x clamped (NaN stays NaN) into the other chunk buffer
                    for i in range(n):
                        v = row[i]
                        v = clip_lo if v < clip_lo else v
                        xb[i] = clip_hi if v > clip_hi else v
                    row = xb
                _fold_chunk(row, yb, n, sums, keys, binned, clipped, lo, hi, steps, jb, sub, stride, counts, low, high,
                            inv, inner, margin)
    for k in range(TALLIES):
        for b in range(bins):
            counts[b] += sub[k * stride + b]
    if binned and not clipped:
        counts[bins] = counts[:1 + margin].sum()
        counts[bins + 1] = counts[1 + margin + inner:bins].sum()
    return sums, keys, counts


@functools.lru_cache(maxsize=1024)
def _bin_steps(low: float, high: float, inner: int, margin: int, dtype: str) -> np.ndarray:
    """The constants of `_chunk_bins` in `dtype` for the bins of a `ValueHistogram` (read only, cached):
    (start, inv, near, 1 - near, last, 0, 1).

    With Q = (v - low) / w + margin in exact arithmetic (w, 1 / w and start = low - margin * w as float64 computes
    them), `bin_index` gives clamp(floor(Q) + 1, 0, last) unless Q lies within 2^-48 (R + S) of a whole number,
    R = |low| / w + |high| / w, S = last + 2 (its two float64 roundings; beyond high it measures from high, and
    (high - low) / w differs from the inner bin count by a few 2^-53 of it). q = (v - start) * inv computed in
    `dtype` (unit roundoff u) carries the roundings of start, of 1 / w, of the difference and of the product:
    |q - Q| <= 1.01 u |start| / w + 3.02 u |Q| + 2^-51 (|start| / w + margin). So for |Q| <= S, `near`, twice the
    sum of both bounds, separates q from every whole number whenever floor(q) = floor(Q) is in doubt. For
    |Q| > S, q has the sign of Q and |q| > S - 1/4, so both clamp to the same end bin (this needs near < 1/4;
    a grid farther from zero, in bin widths, gets near = 1 and every value is binned by `bin_index`). NaN and
    infinite values give a NaN fraction: marked too."""
    width = (high - low) / inner  # as ValueHistogram.width
    inv = 1.0 / width
    last = inner + 2 * margin + 1
    start = low - margin * width
    unit = 2.0 ** -24 if np.dtype(dtype) == np.float32 else 2.0 ** -53
    span = last + 2.0
    reach = (abs(low) + abs(high)) * inv
    near = 2 * (unit * (1.01 * abs(start) * inv + 3.02 * span) + 2.0 ** -51 * (abs(start) * inv + margin)
                + 2.0 ** -48 * (reach + span))
    near = near if near < 0.25 else 1.0
    steps = np.array([start, inv, near, 1.0 - near, last, 0.0, 1.0], dtype=dtype)
    steps.flags.writeable = False
    return steps


def _rows(a: np.ndarray, qp: Optional[QParams]) -> np.ndarray:
    """`a` as (rows, C, length), C-contiguous: around a per-channel grid's axis, else one flat row."""
    a = channels_first(a)  # channels-last codes (the compiled convolutions') are transposed here
    if qp is None or qp.axis is None or qp.scale.size == 1:
        return a.reshape(1, 1, -1)
    axis = qp.axis % a.ndim
    return a.reshape(math.prod(a.shape[:axis]), a.shape[axis], -1)


_UNIT = (np.zeros(1, dtype=np.float32), np.ones(1, dtype=np.float32))  # zero point and scale of float tests
_UNBOUNDED = (np.full(1, -np.inf), np.full(1, np.inf))  # grid bounds without a histogram


def compare(reference: np.ndarray, test: np.ndarray, qp: Optional[QParams] = None, *,
            clamp: Optional[tuple[float, float]] = None, histogram: Optional[ValueHistogram] = None,
            grid: Optional[tuple[np.ndarray, np.ndarray]] = None) -> tuple[PairSums, Optional[GridCounts]]:
    """The sums of `reference` against `test` in one pass (module docstring): `test` holds integer codes
    dequantized with `qp`, or floats (then `qp` only chooses the row layout). `clamp`: the folded range the
    reference is clamped to first. With `histogram` (its bins) and `grid` (`reports.grid.grid_bounds` of qp): the
    `GridCounts` too; the caller folds them in (nothing is changed here). Raises on NaN or infinite values."""
    x = np.asarray(reference)
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float64)
    y = np.asarray(test)
    if y.shape != x.shape:
        raise ValueError(f"similarity: reference shape {x.shape} differs from test shape {y.shape}")
    if x.size == 0:
        raise ValueError("similarity: empty tensor")
    if y.dtype.kind not in "iuf" or (y.dtype.kind == "f" and y.dtype not in (np.float32, np.float64)):
        y = y.astype(np.float64)
    integer = y.dtype.kind in "iu"
    if integer and qp is None:
        raise ValueError("similarity: integer codes need their qparams")
    x3 = _rows(x, qp)
    y3 = _rows(y, qp)
    zp, scale = (np.ravel(qp.zero_point), np.ravel(qp.scale)) if integer else _UNIT
    binned = histogram is not None
    if binned != (grid is not None):
        raise ValueError("compare: give the histogram and the grid bounds together")
    lo, hi = (np.ravel(np.asarray(bound, dtype=np.float64)) for bound in grid) if binned else _UNBOUNDED
    low, high, inv, inner, margin, bins = ((histogram.low, histogram.high, 1.0 / histogram.width, histogram.inner,
                                            histogram.margin, histogram.counts.size) if binned else
                                           (0.0, 1.0, 1.0, 1, 0, 0))
    # a per-tensor grid is the histogram's [low, high]: its clipped counts are the counts beyond them
    clipped = binned and not (lo.size == 1 == hi.size and lo.item() == low and hi.item() == high)
    clip_lo, clip_hi = (-np.inf, np.inf) if clamp is None else clamp
    xb = np.empty(CHUNK, dtype=x.dtype)
    yb = np.empty(CHUNK, dtype=np.float32 if integer else y.dtype)
    sums, keys, counts = _compare(x3, y3, zp, scale, x.dtype.type(clip_lo), x.dtype.type(clip_hi), lo, hi, binned,
                                   clipped, low, high, inv, inner, margin,
                                   _bin_steps(low, high, inner, margin, x.dtype.char), bins, xb, yb)
    dot, xx, yy, se = sums.tolist()
    if not (math.isfinite(xx) and math.isfinite(yy) and math.isfinite(se)):
        raise ValueError("similarity: tensors must be finite (found NaN or Inf)")
    pair = PairSums(dot=dot, xx=xx, yy=yy, se=se, max_err=from_order_key(keys[0], np.result_type(xb, yb)), n=x.size)
    if not binned:
        return pair, None
    return pair, GridCounts(below=int(counts[-2]), above=int(counts[-1]), counts=counts[:-2],
                            min=from_order_key(keys[1], x.dtype), max=from_order_key(keys[2], x.dtype))
