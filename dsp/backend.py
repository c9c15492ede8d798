"""`DspBackend`: the integer dot product of Conv, ConvTranspose, Gemm and MatMul on emulated packed DSP48E2 slices.

It implements the executor's `DotBackend` protocol (`name`, `matmul(a, b)`: (..., M, K) @ (..., K, N) -> new
int64 (..., M, N), batch dimensions broadcast as in numpy.matmul) and sets `direct_depthwise = False`, so
depthwise convolutions come through it too. Every product goes through the slice model (`dsp.slice`):

- `int8` (WP486, `Int8x2`): two rows of `a` share each element of `b` (two output channels share an
  activation), or two columns of `b` share each element of `a` (two output pixels share a weight), whichever
  wastes fewer lanes on an odd count (a depthwise layer has one output channel per group: it packs pixels).
- `int4` (WP521, `Int4x4`): two rows of `a` (on A/D) times two columns of `b` (on B) give a 2x2 block of the
  output per slice. The unsigned operand goes to B (uint4 activations, int4 weights through the pre-adder).

`dsp.plan.plan_dot` makes these choices from the shapes and code ranges (and counts the slices).

The K-deep dot product runs as MACC chains of at most `depth` products (the scheme's worst-case K for the
operands' code ranges; chunks are balanced, ceil(K / ceil(K / depth)) each); the lanes of each chain's P are
extracted (exact peel, or naive bit slicing) and the chains' lane values are added in int64. An odd row or
column count is padded with a zero lane; `stats` counts the useful MACs, the packed DSP operations and the
lane slots lost to padding and to the last, shorter chain of each dot product.

Operands must be codes of the scheme's width, signed or unsigned (int8 [-128, 127] or uint8 [0, 255];
int4 [-8, 7] or uint4 [0, 15]); anything else raises ValueError naming the range.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from dsp.packing import Extraction, Int4x4, Int8x2, extract_sum, operand_range
from dsp.plan import DotPlan, plan_dot
from dsp.slice import macc_chain, preadd

SCHEMES = {"int8": 8, "int4": 4}
BLOCK_ELEMENTS = 1 << 20  # chain results (int64) per block of output columns: ~8 MB, keeps numpy in cache


@dataclass
class DspStats:
    """Counters over every `matmul` call of a backend (reset with `DspBackend.reset_stats`)."""

    macs: int = 0  # useful products
    ops: int = 0  # packed DSP multiplications (slice cycles), padded lanes included
    chain_ops: int = 0  # ops with every dot product rounded up to whole chains of `depth` slices
    lane_slots: int = 0  # ops * lanes per op

    def add(self, plan: DotPlan) -> None:
        self.macs += plan.macs
        self.ops += plan.ops
        self.chain_ops += plan.chain_ops
        self.lane_slots += plan.lane_slots

    @property
    def padding_loss(self) -> float:
        """Fraction of lane slots that carried a zero pad (odd channel or pixel counts)."""
        return 1 - self.macs / self.lane_slots if self.lane_slots else 0.0

    @property
    def chain_loss(self) -> float:
        """Fraction of slices of fixed `depth`-long chains left idle by dot products not a multiple of depth."""
        return 1 - self.ops / self.chain_ops if self.chain_ops else 0.0


def _chunks(k: int, depth: int) -> tuple[int, int]:
    """(number of chains, products per chain) for a k-deep dot product, at most `depth` per chain."""
    count = max(1, -(-k // depth))
    return count, -(-k // count)


def _pad_axis(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """`x` zero-padded at the end of `axis` to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return np.pad(x, pad)


def _chained(ad: np.ndarray, b: np.ndarray, count: int, per: int) -> tuple[np.ndarray, np.ndarray]:
    """(..., M, count * per) and (..., count * per, N) as per-chain operands (..., count, M, per) and
    (..., count, per, N)."""
    ad = ad.reshape(ad.shape[:-1] + (count, per)).swapaxes(-3, -2)
    b = b.reshape(b.shape[:-2] + (count, per, b.shape[-1]))
    return ad, b


class DspBackend:
    """Packed-DSP48E2 dot products: `DspBackend("int8" | "int4", "exact" | "naive")`."""

    direct_depthwise = False  # depthwise convolutions are dot products of the DSP array too

    def __init__(self, scheme: str = "int8", mode: str = "exact"):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown DSP packing scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
        modes = [m.value for m in Extraction]
        if mode not in modes:
            raise ValueError(f"unknown lane extraction mode {mode!r}; choose one of {', '.join(modes)}")
        self.scheme = scheme
        self.mode = Extraction(mode)
        self.bits = SCHEMES[scheme]
        self.name = f"dsp:{scheme}" + (":naive" if self.mode is Extraction.NAIVE else "")
        self.stats = DspStats()
        self._lock = threading.Lock()  # `ptq report` runs isolated layers in a second thread

    def reset_stats(self) -> None:
        self.stats = DspStats()

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"{self.name}: operands must be at least 2-D, got {a.shape} @ {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"{self.name}: inner dimensions differ: a {a.shape} @ b {b.shape}")
        try:
            np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            raise ValueError(f"{self.name}: batch dimensions do not broadcast: a {a.shape} @ b {b.shape}") from None
        ra = operand_range(a, self.bits, f"{self.name} operand a")
        rb = operand_range(b, self.bits, f"{self.name} operand b")
        plan = plan_dot(self.scheme, a.shape, b.shape, ra, rb)
        count, per = _chunks(a.shape[-1], plan.scheme.depth)
        # zero pads of K to whole chains, in the narrow input dtype and before any transposition (a fast copy)
        a, b = _pad_axis(a, -1, count * per), _pad_axis(b, -2, count * per)
        if plan.swap:  # the packed side transposed once in its narrow dtype: the port arithmetic runs contiguous
            a, b = np.ascontiguousarray(b.swapaxes(-1, -2)), a.swapaxes(-1, -2)
        if self.scheme == "int4":
            out = self._int4(a, b, plan.scheme, count, per)
        else:
            out = self._int8(a, b, plan.scheme, count, per)
        with self._lock:
            self.stats.add(plan)
        return out.swapaxes(-1, -2) if plan.swap else out

    def _int8(self, a: np.ndarray, b: np.ndarray, scheme: Int8x2, count: int, per: int) -> np.ndarray:
        """Rows 2i (D, lane 0) and 2i+1 (A, lane 1) of `a` share each element of `b` (B); K = count * per."""
        m = a.shape[-2]
        n = b.shape[-1]
        a = _pad_axis(a, -2, m + m % 2)
        port_a, port_d, port_b = scheme.ports(a[..., 0::2, :], a[..., 1::2, :], b)
        ad, bc = _chained(preadd(port_d, port_a), port_b, count, per)
        out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], n), dtype=np.int64)
        for start, stop in self._blocks(ad, bc, n):
            low, high = extract_sum(macc_chain(ad, bc[..., start:stop]), scheme.lanes, self.mode, axis=-3)
            out[..., 0::2, start:stop] = low
            out[..., 1::2, start:stop] = high
        return out[..., :m, :]

    def _int4(self, a: np.ndarray, b: np.ndarray, scheme: Int4x4, count: int, per: int) -> np.ndarray:
        """Rows 2i (A: w1) and 2i+1 (D: w2) of `a` times columns 2j (x1) and 2j+1 (x2) of `b` (B); K = count * per."""
        m = a.shape[-2]
        n = b.shape[-1]
        a = _pad_axis(a, -2, m + m % 2)
        b = _pad_axis(b, -1, n + n % 2)
        port_a, port_d, port_b = scheme.ports(a[..., 0::2, :], a[..., 1::2, :], b[..., 0::2], b[..., 1::2])
        ad, bc = _chained(preadd(port_d, port_a), port_b, count, per)
        n2 = bc.shape[-1]
        out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + a.shape[-2:-1] + b.shape[-1:], dtype=np.int64)
        for start, stop in self._blocks(ad, bc, n2):
            lanes = extract_sum(macc_chain(ad, bc[..., start:stop]), scheme.lanes, self.mode, axis=-3)
            cols = slice(2 * start, 2 * stop)
            out[..., 0::2, cols][..., 0::2] = lanes[0]  # x1 w1
            out[..., 0::2, cols][..., 1::2] = lanes[1]  # x2 w1
            out[..., 1::2, cols][..., 0::2] = lanes[2]  # x1 w2
            out[..., 1::2, cols][..., 1::2] = lanes[3]  # x2 w2
        return out[..., :m, :n]

    @staticmethod
    def _blocks(ad: np.ndarray, bc: np.ndarray, n: int):
        """Column ranges [start, stop) whose chain results stay within BLOCK_ELEMENTS."""
        rows = int(np.prod(np.broadcast_shapes(ad.shape[:-1], bc.shape[:-2] + (1,)), dtype=np.int64))
        width = max(1, BLOCK_ELEMENTS // max(rows, 1))
        return [(start, min(n, start + width)) for start in range(0, n, width)]



def _fits(x: np.ndarray, bits: int) -> bool:
    """The codes of `x` are those of a `bits`-bit operand (signed [-2^(b-1), 2^(b-1) - 1] or unsigned [0, 2^b - 1])."""
    if x.size == 0:
        return True
    lo, hi = int(x.min()), int(x.max())
    return lo >= -(1 << (bits - 1)) and hi <= ((1 << bits) - 1 if lo >= 0 else (1 << (bits - 1)) - 1)


class DspLanesBackend:
    """`dsp:lanes`: each dot product on the narrowest packed lanes its operands' codes fit, as a mixed-precision
    model (`ptq tune --scheme int4-dsp`) runs: 4-bit lanes (`DspBackend("int4")`) when both operands are 4-bit
    codes, else 8-bit lanes (`DspBackend("int8")`) when both are 8-bit, else one exact int64 product per DSP
    (a 16-bit layer). A layer quantized to 8 bits whose codes all happen to fit 4 bits runs on 4-bit lanes,
    exactly as well. `lanes` counts the dot products each path took."""

    direct_depthwise = False

    def __init__(self, mode: str = "exact"):
        self.int4, self.int8 = DspBackend("int4", mode), DspBackend("int8", mode)
        self.name = "dsp:lanes" + (":naive" if self.int4.mode is Extraction.NAIVE else "")
        self.lanes = {"int4": 0, "int8": 0, "wide": 0}
        self._lock = threading.Lock()

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a), np.asarray(b)
        for scheme, backend in (("int4", self.int4), ("int8", self.int8)):
            if _fits(a, backend.bits) and _fits(b, backend.bits):
                with self._lock:
                    self.lanes[scheme] += 1
                return backend.matmul(a, b)
        with self._lock:
            self.lanes["wide"] += 1
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
