"""An op's conformance case: the one-node model on which the harness (`ptq.opdocs.conformance`) measures the op's
integer run against its float op. Every registered op declares one where it is defined, `OpDef.conformance`;
the harness fills in the op type and domain from the op (`Case.for_op`).

The seeded helpers give a case its constants: `seeded_rng(key)` is numpy's generator seeded with the CRC-32 of
`key` (the harness draws the input `x` with the op type as key), `uniform_constant(key, shape, lo, hi)` a float32
array uniform in [lo, hi), `int64s(*values)` an int64 vector (axes, pads, shapes, indices).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

X = "x"  # the one graph input of a case's model


@dataclass(frozen=True)
class Case:
    """One op's conformance case. `inputs` lists the node inputs in order: `X` (the graph input, batch 1,
    drawn from `data`), names of `constants` (initializers), or "" for an omitted optional input.

    `path` "calibrate" runs the model through calibrate and the integer executor and compares it with
    onnxruntime; "direct" runs the op's quantize / forward_int on 8-bit codes (bool- or integer-only inputs,
    no input, or an ai.ptq op, whose `forward_float` is compared with the numpy formula `reference`)."""

    shape: tuple = (1, 3, 4, 5)
    inputs: tuple = (X,)
    constants: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    outputs: int = 1
    opset: int = 17
    data: str = "normal"  # normal | positive | grid (multiples of 1/4: exact ties) | unit (in (-1, 1))
    x_dtype: type = np.float32  # direct path: a non-float x (bool, int64) is passed as it is
    path: str = "calibrate"  # calibrate | direct
    note: str = ""
    reference: Optional[Callable] = None  # custom domain: numpy formula of forward_float, (x, *constants) -> outputs
    activation_constants: tuple = ()  # direct path: float constants quantized as a second activation (8-bit codes)
    op_type: str = ""  # filled in from the op that declares the case (`for_op`)
    domain: str = ""

    def for_op(self, op_type: str, domain: str) -> "Case":
        return replace(self, op_type=op_type, domain=domain)


def seeded_rng(key: str, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()) + salt)


def uniform_constant(key: str, shape, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return seeded_rng(key).uniform(lo, hi, size=shape).astype(np.float32)


def int64s(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)
