"""Edits of one tensor's entry in a quant table, as `ptq table set` makes them.

An edit goes through the same path as a hand edit of the JSON: the entry's saved form (with its fingerprints)
gets the new values and is read back by `ptq.table.quant_table.entry_from_dict`, so `set --range` recomputes scale
and zero point exactly as editing `min`/`max` does, `set --scale` keeps the range as editing `scale` does, and
both give the same table.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ptq.core.names import did_you_mean
from ptq.table.quant_table import QuantTable, TensorEntry, entry_from_dict


def table_entry(table: QuantTable, name: str) -> TensorEntry:
    """The entry of `name`; a ValueError naming the closest tensor names when there is none."""
    entry = table.tensors.get(name)
    if entry is None:
        raise ValueError(f"tensor {name!r} is not in the quant table{did_you_mean(name, table.tensors)}")
    return entry


def edit_entry(
    table: QuantTable,
    name: str,
    *,
    bits: Optional[int] = None,
    value_range: Optional[tuple[float, float]] = None,
    scale: Optional[float] = None,
    zero_point: Optional[int] = None,
    run_in_float: Optional[bool] = None,
    source: str = "quant table",
) -> QuantTable:
    """A copy of `table` with tensor `name` changed: `bits` or `value_range` alone recompute scale and zero
    point from the range (with the table's options); `scale` / `zero_point` set the grid as given (the range
    stays as it is); `run_in_float` marks the layer computing the tensor float or not. `value_range`, `scale`
    and `zero_point` are per-tensor values: a per-channel entry is edited in the JSON. `source` prefixes errors."""
    entry = table_entry(table, name)
    if all(v is None for v in (bits, value_range, scale, zero_point, run_in_float)):
        raise ValueError("nothing to change: give --bits, --range, --scale, --zero-point, --float or --no-float")
    channels = entry.qparams.scale.size
    if channels > 1 and (value_range is not None or scale is not None or zero_point is not None):
        raise ValueError(f"tensor {name!r} is per-channel ({channels} channels along axis {entry.qparams.axis}): "
                         "--range, --scale and --zero-point set one value; edit its lists in the JSON instead")
    data = entry.to_dict()
    if bits is not None:
        data["bits"] = bits
    if value_range is not None:
        data["min"], data["max"] = [float(value_range[0])], [float(value_range[1])]
    if scale is not None:
        data["scale"] = [float(scale)]
    if zero_point is not None:
        data["zero_point"] = [int(zero_point)]
    if run_in_float is not None:
        data["float"] = run_in_float
    edited, _ = entry_from_dict(name, data, table.options, source)
    return dataclasses.replace(table, tensors={**table.tensors, name: edited})


def with_float(table: QuantTable, tensors) -> QuantTable:
    """A copy of `table` with the listed activations marked float (the layers computing them run in float)."""
    marked = {name: dataclasses.replace(table_entry(table, name), run_in_float=True) for name in tensors}
    return dataclasses.replace(table, tensors={**table.tensors, **marked})


def _show(values: np.ndarray) -> str:
    values = np.asarray(values).ravel()
    if values.size == 1:
        return f"{values[0]:.9g}"
    return f"{values.size} values in [{values.min():.6g}, {values.max():.6g}]"


def entry_changes(old: TensorEntry, new: TensorEntry) -> list[str]:
    """One `field: old -> new` line per field that differs, in the order of the JSON."""
    pairs = [
        ("min", old.min, new.min), ("max", old.max, new.max),
        ("scale", old.qparams.scale, new.qparams.scale), ("zero_point", old.qparams.zero_point, new.qparams.zero_point),
        ("bits", old.qparams.bits, new.qparams.bits), ("signed", old.qparams.signed, new.qparams.signed),
        ("narrow", old.qparams.narrow, new.qparams.narrow), ("float", old.run_in_float, new.run_in_float),
    ]
    lines = []
    for key, a, b in pairs:
        if isinstance(a, np.ndarray):
            if not np.array_equal(a, b):
                lines.append(f"{key}: {_show(a)} -> {_show(b)}")
        elif a != b:
            lines.append(f"{key}: {str(a).lower() if isinstance(a, bool) else a} -> "
                         f"{str(b).lower() if isinstance(b, bool) else b}")
    return lines
