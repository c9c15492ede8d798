"""Edits of a quantization table: bit widths per tensor (mixed precision) and range scaling (debug tests).

Both return a new `QuantTable`; the input table is not modified.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from ptq.core.qparams import QParams, compute_qparams
from ptq.core.names import did_you_mean
from ptq.table.quant_table import QuantTable, TensorEntry


def _entry(table: QuantTable, name: str) -> TensorEntry:
    entry = table.tensors.get(name)
    if entry is None:
        raise ValueError(f"tensor {name!r} is not in the quantization table{did_you_mean(name, table.tensors)}")
    return entry


def with_bits(table: QuantTable, tensors: Iterable[str], bits: int) -> QuantTable:
    """A copy of `table` whose listed activations use `bits`: their qparams are recomputed from the calibrated
    [min, max] with the table's activation options (symmetric, narrow, pow2) and each tensor's signedness."""
    entries = dict(table.tensors)
    opts = table.options
    for name in tensors:
        entry = _entry(table, name)
        if entry.kind != "activation":
            raise ValueError(f"tensor {name!r} is a {entry.kind}; only activations change bit width here")
        qp = compute_qparams(entry.min, entry.max, bits, symmetric=opts.symmetric, signed=entry.qparams.signed,
                             narrow=entry.qparams.narrow, pow2=opts.pow2)
        entries[name] = dataclasses.replace(entry, qparams=qp)
    return dataclasses.replace(table, tensors=entries)


def scale_range(table: QuantTable, name: str, factor: float) -> QuantTable:
    """A copy of `table` whose tensor `name` has its calibrated range and its scale multiplied by `factor`
    (zero point kept): factor 1/20 shrinks the range 20x, so values beyond it saturate."""
    if not np.isfinite(factor) or factor <= 0:
        raise ValueError(f"range factor must be positive, got {factor}")
    entry = _entry(table, name)
    qp = entry.qparams
    scaled = QParams(scale=qp.scale * factor, zero_point=qp.zero_point, bits=qp.bits, signed=qp.signed,
                     axis=qp.axis, narrow=qp.narrow)
    entries = dict(table.tensors)
    entries[name] = dataclasses.replace(entry, min=entry.min * factor, max=entry.max * factor, qparams=scaled)
    return dataclasses.replace(table, tensors=entries)
