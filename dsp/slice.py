"""A bit-exact model of the DSP48E2 multiply-accumulate datapath (UG579), vectorized over int64 numpy arrays.

Ports and widths (two's complement throughout):

    A    30 bits in; the pre-adder and the multiplier see A[26:0], i.e. A27 = sext27(A mod 2^27)
    D    27 bits
    AD = wrap27(D + A27)                       the 27-bit pre-adder wraps
    B    18 bits
    M  = AD * B                                45 bits: |AD * B| <= 2^26 * 2^17 = 2^43, never truncated
    P  = wrap48(P_prev + M)                    MACC: the 48-bit post-adder wraps
    P  = wrap48(PCIN + M)                      cascade: PCIN is the previous slice's P (PCOUT)

with wrap_n(x) = ((x + 2^(n-1)) mod 2^n) - 2^(n-1). A port value outside its input width is a caller bug
(the packing built a value the wires cannot carry) and raises.

A chain of K MACC (or cascade) steps computes wrap48(P0 + sum_k AD_k * B_k): reduction mod 2^48 is a ring
homomorphism, so wrapping once at the end gives the same 48 bits as wrapping after every step.
`macc_chain` evaluates that sum as a (batched) matrix product, on float64 BLAS when the bound
K * max|AD| * max|B| + max|P0| < 2^53 proves every partial sum an exactly represented integer, else in int64;
the tests hold it to the step-by-step `macc`.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

A_BITS = 30
A_MULT_BITS = 27  # the multiplier's view of A: A[26:0]
D_BITS = 27
AD_BITS = 27
B_BITS = 18
P_BITS = 48
FLOAT64_EXACT = 1 << 53
INT64_SAFE = 1 << 62


def wrap(x: np.ndarray, bits: int) -> np.ndarray:
    """Two's-complement wrap of int64 values to `bits` bits: ((x + 2^(bits-1)) mod 2^bits) - 2^(bits-1)."""
    half = np.int64(1 << (bits - 1))
    return ((np.asarray(x, dtype=np.int64) + half) & np.int64((1 << bits) - 1)) - half


def _check_port(name: str, x: np.ndarray, bits: int) -> np.ndarray:
    return _checked(name, x, bits)[0]


def _checked(name: str, x: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """(x as int64, max|x|) after checking that x fits a `bits`-wide signed port."""
    x = np.asarray(x, dtype=np.int64)
    if not x.size:
        return x, 0
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    xmin, xmax = int(x.min()), int(x.max())
    if xmin < lo or xmax > hi:
        raise ValueError(f"DSP48E2 port {name} takes {bits}-bit signed values [{lo}, {hi}], got [{xmin}, {xmax}]")
    return x, max(-xmin, xmax)


def _wrap_unless_within(x: np.ndarray, absmax: int, bits: int) -> np.ndarray:
    """wrap(x, bits), skipped when max|x| shows every value already within `bits` (the wrap is then the identity)."""
    return x if absmax < (1 << (bits - 1)) else wrap(x, bits)


def port_a(a: np.ndarray) -> np.ndarray:
    """The A input (30-bit signed) as the pre-adder sees it: A27 = sext27(A mod 2^27), i.e. A[26:0]."""
    return _port_a(a)[0]


def _port_a(a: np.ndarray) -> tuple[np.ndarray, int]:
    """(A27, a bound of max|A27|)."""
    a, amax = _checked("A", a, A_BITS)
    if amax < (1 << (A_MULT_BITS - 1)):
        return a, amax
    return wrap(a, A_MULT_BITS), 1 << (A_MULT_BITS - 1)


def port_d(d: np.ndarray) -> np.ndarray:
    """The D input: 27-bit signed."""
    return _check_port("D", d, D_BITS)


def port_b(b: np.ndarray) -> np.ndarray:
    """The B input: 18-bit signed, the multiplier's short side."""
    return _check_port("B", b, B_BITS)


def preadd(d: np.ndarray, a: np.ndarray) -> np.ndarray:
    """The pre-adder: AD = wrap27(D + A[26:0]) for raw D and A port values."""
    d, dmax = _checked("D", d, D_BITS)
    a, amax = _port_a(a)
    return _wrap_unless_within(d + a, dmax + amax, AD_BITS)


def multiply(ad: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The 27x18 multiplier: M = AD * B, a 45-bit signed product (exact: |M| <= 2^43)."""
    return _check_port("AD", ad, AD_BITS) * port_b(b)


def macc(p: np.ndarray, ad: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One MACC (or PCIN cascade) step: P' = wrap48(P + AD * B), elementwise with broadcasting."""
    return wrap(_check_port("P", p, P_BITS) + multiply(ad, b), P_BITS)


def cascade(pcin: np.ndarray, ad: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A slice fed by its neighbour's PCOUT: P = wrap48(PCIN + AD * B) (the same adder as `macc`)."""
    return macc(pcin, ad, b)


def macc_chain(ad: np.ndarray, b: np.ndarray, p0: Optional[np.ndarray] = None) -> np.ndarray:
    """P after a chain of K MACC steps, for all chains at once: wrap48(P0 + sum_k AD[..., m, k] * B[..., k, n]).

    `ad` (..., M, K) holds pre-adder outputs, `b` (..., K, N) B port values (batch dimensions broadcast as in
    numpy.matmul); chain (m, n) multiplies row m of `ad` into column n of `b`. Returns int64 (..., M, N).
    The final wrap is skipped only when the bound shows the sum already within 48 bits.
    """
    ad, admax = _checked("AD", ad, AD_BITS)
    b, bmax = _checked("B", b, B_BITS)
    k = ad.shape[-1]
    bound = k * admax * bmax
    if p0 is not None:
        p0, pmax = _checked("P", p0, P_BITS)
        bound += pmax
    if bound < FLOAT64_EXACT:
        p = np.matmul(ad.astype(np.float64), b.astype(np.float64)).astype(np.int64)
    elif bound < INT64_SAFE:
        p = np.matmul(ad, b)
    else:
        raise ValueError(f"macc_chain: a {k}-deep chain could overflow the int64 model (bound {bound})")
    if p0 is not None:
        p += p0
    return p if bound < (1 << (P_BITS - 1)) else wrap(p, P_BITS)

