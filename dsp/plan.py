"""How a dot product maps onto packed DSP48E2 slices, from shapes and code ranges alone (no arithmetic).

For (..., M, K) @ (..., K, N) with `batch` = the product of the broadcast batch dimensions:

- `int8` (Int8x2): two rows of `a` per slice sharing each element of `b`, or two columns of `b` sharing each
  element of `a` (`swap`), whichever pads fewer lanes: ceil(M/2) * N against M * ceil(N/2) slices per k.
- `int16` (Int16x1): one product per slice, no packing: M * N slices per k, each a single chain of K (no lane
  to extract before the 48-bit accumulator overflows).
- `int4` (Int4x4): two rows of the A/D operand times two columns of the B operand: ceil(M/2) * ceil(N/2)
  slices per k; `swap` puts an unsigned `a` on B (WP521: uint4 activations on B, int4 weights on A/D).

Each slice runs a K-deep MACC chain, cut into chains of at most `depth` products (the scheme's worst-case K):

    ops        = batch * slices * K                        slice cycles actually used
    chain_ops  = batch * slices * ceil(K / depth) * depth  with every chain a full cascade of `depth` slices
    lane_slots = ops * lanes per slice;   macs = batch * M * K * N
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from dsp.packing import CodeRange, Int16x1, Int4x4, Int8x2

Scheme = Union[Int8x2, Int4x4, Int16x1]


@dataclass(frozen=True)
class DotPlan:
    scheme: Scheme  # with the code ranges of the operands as they land on the ports
    swap: bool  # compute (b^T @ a^T)^T: the roles of a and b exchanged
    macs: int
    ops: int
    chain_ops: int
    lane_slots: int


def plan_dot(scheme: str, a_shape: tuple, b_shape: tuple, a_code: CodeRange, b_code: CodeRange) -> DotPlan:
    """The slice mapping of a (..., M, K) @ (..., K, N) dot product under `scheme` ("int8", "int4" or "int16")."""
    m, k = a_shape[-2:]
    n = b_shape[-1]
    batch = int(np.prod(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])), dtype=np.int64))
    if scheme == "int4":
        swap = not a_code.signed and b_code.signed
        if swap:
            a_code, b_code = b_code, a_code
        packed: Scheme = Int4x4(x=b_code, w=a_code)
        slices = -(-m // 2) * -(-n // 2)
    elif scheme == "int8":
        swap = m * -(-n // 2) < -(-m // 2) * n
        if swap:
            a_code, b_code = b_code, a_code
        packed = Int8x2(packed=a_code, shared=b_code)
        slices = min(m * -(-n // 2), -(-m // 2) * n)
    elif scheme == "int16":
        swap = False
        packed = Int16x1(a=a_code, b=b_code)
        slices = m * n
    else:
        raise ValueError(f"unknown DSP packing scheme {scheme!r}; choose int8, int4 or int16")
    depth = packed.depth if scheme != "int16" else min(packed.depth, max(k, 1))  # no lanes to extract: one chain
    ops = batch * slices * k
    return DotPlan(packed, swap, batch * m * k * n, ops, batch * slices * -(-k // depth) * depth,
                   ops * packed.lanes_per_op)
