"""Packing several low-precision products into one DSP48E2 multiplication, and getting them back out.

Two schemes (port values are built arithmetically, never by OR-ing two's-complement fields):

- `Int8x2` (Xilinx WP486): two operands h, l share a third, s:
      A = h * 2^18,  D = l,  B = s   ->   P = sum h*s * 2^18 + sum l*s      (lanes at bits 0 and 18)
  "Sharing the activation" packs two weights of two output channels, "sharing the weight" two activations
  of two output pixels; the arithmetic is the same. The seed's cases name the shared operand first:
  iii, uii (unsigned shared), iuu (unsigned packed), uuu (all unsigned: unsigned lanes, no sign correction).
- `Int16x1`: one product of operands up to 16 bits (A takes 27 bits, B 18: a signed or unsigned 16-bit code fits
  either), no packing: a 16-bit layer of a mixed-precision model, one MAC per slice and cycle.
- `Int4x4` (Xilinx WP521): two B-side operands x1, x2 (uint4 activations) times two A/D-side operands w1, w2
  (int4 weights):
      B = x2 * 2^11 + x1,  A = w1,  D = w2 * 2^22   ->   AD = w2 * 2^22 + w1 (the pre-adder)
      P = x2w2 * 2^33 + x1w2 * 2^22 + x2w1 * 2^11 + x1w1                 (11-bit lanes, the top one 15 bits)
  w2 sits at D[25:22] with D[26] as the sign guard: at shift 23, w2 = -8 with w1 < 0 overflows the pre-adder.

Extraction of lanes from P (48-bit, wrapped):
- exact, for any number of lanes: peel from the bottom, r = sext_w(R mod 2^w), R = (R - r) >> w (unsigned
  lanes: r = R mod 2^w); the last lane is what remains. For two lanes this is the WP486 correction
  hi = (P >> 18) + P[17].
- naive, as many public designs do: plain bit slicing, r = sext_w(P[shift + w - 1 : shift]); every lane above
  a negative partial sum comes out one too small.

A lane is recoverable iff its *final* sum fits its width. With products in [p_min, p_max] a signed w-bit lane
holds K = min(floor((2^(w-1) - 1) / p_max), floor(2^(w-1) / |p_min|)) of them (an unsigned lane
floor((2^w - 1) / p_max)); the scheme's depth is the smallest K over its lanes: 7 products for int8 x int8,
4 for uint8 x int8, 8 for uint4 x int4, 15 for int4 x int4.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dsp.slice import P_BITS, wrap


class Extraction(enum.Enum):
    EXACT = "exact"
    NAIVE = "naive"


@dataclass(frozen=True)
class CodeRange:
    """The integer codes an operand may take: `bits` wide, signed or unsigned."""

    bits: int
    signed: bool

    @property
    def lo(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def hi(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def name(self) -> str:
        return f"{'' if self.signed else 'u'}int{self.bits}"

    def __str__(self) -> str:
        return f"{self.name} [{self.lo}, {self.hi}]"


def operand_range(x: np.ndarray, bits: int, what: str) -> CodeRange:
    """The code range of an operand array for a `bits`-bit scheme: unsigned for an unsigned dtype or for
    non-negative codes in a wider signed dtype, signed otherwise. Codes outside it raise ValueError."""
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{what} must be an integer array, got {x.dtype}")
    if x.size == 0:
        return CodeRange(bits, True)
    lo, hi = int(x.min()), int(x.max())
    if np.issubdtype(x.dtype, np.unsignedinteger):
        signed = False
    elif np.iinfo(x.dtype).bits == bits:
        signed = True
    else:
        signed = lo < 0
    code = CodeRange(bits, signed)
    if lo < code.lo or hi > code.hi:
        raise ValueError(f"{what} has codes in [{lo}, {hi}]; this scheme takes {CodeRange(bits, True)} "
                         f"or {CodeRange(bits, False)} codes")
    return code


def product_range(x: CodeRange, y: CodeRange) -> tuple[int, int]:
    """(p_min, p_max) of x * y over both code ranges."""
    corners = [a * b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
    return min(corners), max(corners)


@dataclass(frozen=True)
class Lane:
    """One product's field of P: bits [shift, shift + width)."""

    shift: int
    width: int
    signed: bool

    def depth(self, p_min: int, p_max: int) -> int:
        """How many products in [p_min, p_max] this lane can sum without leaving its range (DESIGN formula)."""
        if self.signed:
            limits = [((1 << (self.width - 1)) - 1) // p_max if p_max > 0 else None,
                      (1 << (self.width - 1)) // -p_min if p_min < 0 else None]
        else:
            limits = [((1 << self.width) - 1) // p_max if p_max > 0 else None]
        finite = [k for k in limits if k is not None]
        return min(finite) if finite else 1 << 30


def _peel(r: np.ndarray, lane: Lane) -> np.ndarray:
    """r = sext_w(R mod 2^w) for a signed lane, R mod 2^w for an unsigned one."""
    return wrap(r, lane.width) if lane.signed else r & np.int64((1 << lane.width) - 1)


def extract(p: np.ndarray, lanes: Sequence[Lane], mode: Extraction) -> list[np.ndarray]:
    """The lane values of P (int64, 48-bit wrapped), bottom lane first."""
    p = np.asarray(p, dtype=np.int64)
    if mode is Extraction.NAIVE:
        out = [_peel(p >> lane.shift, lane) for lane in lanes[:-1]]
        top = lanes[-1]
        width = P_BITS - top.shift
        out.append(wrap(p >> top.shift, width) if top.signed else (p >> top.shift) & np.int64((1 << width) - 1))
        return out
    out, rest = [], p
    for lane in lanes[:-1]:
        r = _peel(rest, lane)
        out.append(r)
        rest = (rest - r) >> lane.width
    out.append(rest)
    return out


def extract_sum(p: np.ndarray, lanes: Sequence[Lane], mode: Extraction, axis: int) -> list[np.ndarray]:
    """`extract(p)` summed over `axis` (the chunks of a long dot product), as int64 arrays.

    Exact mode never materializes the top lane per chunk: sum_c ((R_c - r_c) >> w) = (sum R_c - sum r_c) >> w,
    exactly, because every R_c - r_c is a multiple of 2^w.
    """
    p = np.asarray(p, dtype=np.int64)
    if mode is Extraction.NAIVE:
        return [lane.sum(axis=axis) for lane in extract(p, lanes, mode)]
    sums, rest = [], p
    for index, lane in enumerate(lanes[:-1]):
        r = _peel(rest, lane)
        r_sum = r.sum(axis=axis)
        sums.append(r_sum)
        if index == len(lanes) - 2:
            sums.append((rest.sum(axis=axis) - r_sum) >> lane.width)
        else:
            rest = (rest - r) >> lane.width
    return sums


@dataclass(frozen=True)
class Int8x2:
    """WP486: two products sharing one operand; `packed` codes go to A (x 2^18) and D, `shared` to B."""

    packed: CodeRange
    shared: CodeRange
    shift: int = 18
    lanes_per_op: int = 2

    def __post_init__(self):
        if self.packed.bits > 8 or self.shared.bits > 8:
            raise ValueError(f"Int8x2 packs codes of at most 8 bits, got {self.packed.name} x {self.shared.name}")

    @property
    def case(self) -> str:
        """The seed's name: shared operand first, then the two packed ones (i signed, u unsigned)."""
        s, p = ("i" if self.shared.signed else "u"), ("i" if self.packed.signed else "u")
        return s + p + p

    @property
    def lanes(self) -> tuple[Lane, Lane]:
        signed = self.packed.signed or self.shared.signed
        return Lane(0, self.shift, signed), Lane(self.shift, P_BITS - self.shift, signed)

    @property
    def depth(self) -> int:
        p_min, p_max = product_range(self.packed, self.shared)
        return min(lane.depth(p_min, p_max) for lane in self.lanes)

    def ports(self, low: np.ndarray, high: np.ndarray, shared: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A, D, B) port values: A = high * 2^18, D = low, B = shared; lane 0 is low * shared."""
        a = np.asarray(high, dtype=np.int64) * np.int64(1 << self.shift)
        return a, np.asarray(low, dtype=np.int64), np.asarray(shared, dtype=np.int64)


@dataclass(frozen=True)
class Int4x4:
    """WP521: B = x2 * 2^11 + x1 (activations), AD = w2 * 2^22 + w1 (weights, through the pre-adder)."""

    x: CodeRange
    w: CodeRange
    x_shift: int = 11
    w_shift: int = 22
    lanes_per_op: int = 4

    def __post_init__(self):
        if self.x.bits > 4 or self.w.bits > 4:
            raise ValueError(f"Int4x4 packs codes of at most 4 bits, got {self.x.name} x {self.w.name}")

    @property
    def lanes(self) -> tuple[Lane, Lane, Lane, Lane]:
        """x1w1 at bit 0, x2w1 at 11, x1w2 at 22, x2w2 at 33 (15 bits up to the top of P)."""
        signed = self.x.signed or self.w.signed
        top = 3 * self.x_shift
        return (Lane(0, self.x_shift, signed), Lane(self.x_shift, self.x_shift, signed),
                Lane(self.w_shift, self.x_shift, signed), Lane(top, P_BITS - top, signed))

    @property
    def depth(self) -> int:
        p_min, p_max = product_range(self.x, self.w)
        return min(lane.depth(p_min, p_max) for lane in self.lanes)

    def ports(self, w1, w2, x1, x2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A, D, B) port values: A = w1, D = w2 * 2^22, B = x2 * 2^11 + x1."""
        a = np.asarray(w1, dtype=np.int64)
        d = np.asarray(w2, dtype=np.int64) * np.int64(1 << self.w_shift)
        b = np.asarray(x2, dtype=np.int64) * np.int64(1 << self.x_shift) + np.asarray(x1, dtype=np.int64)
        return a, d, b


@dataclass(frozen=True)
class Int16x1:
    """One product per slice: A = a, B = b, P = sum a*b (48-bit accumulator); codes of up to 16 bits."""

    a: CodeRange
    b: CodeRange
    lanes_per_op: int = 1

    def __post_init__(self):
        if self.a.bits > 16 or self.b.bits > 16:
            raise ValueError(f"Int16x1 takes codes of at most 16 bits, got {self.a.name} x {self.b.name}")

    @property
    def lanes(self) -> tuple[Lane]:
        return (Lane(0, P_BITS, self.a.signed or self.b.signed),)

    @property
    def depth(self) -> int:
        """Products the 48-bit accumulator sums without overflow (131,071 for int16 x int16)."""
        return self.lanes[0].depth(*product_range(self.a, self.b))
