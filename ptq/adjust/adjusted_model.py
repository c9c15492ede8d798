"""The adjusted float model: weights and biases changed by calibration (equalization, bias correction,
AdaRound), written beside the quant table as `<stem>.adjusted.onnx` and recorded in the table's options
(`adjusted_model`: path relative to the table; `adjusted_sha256`: the file's content hash).

The user keeps passing the original MODEL to `ptq run/report/debug`; `load_model_for_table` loads the
adjusted weights instead when the table names them (with a one-line note on stderr), and refuses a file
whose hash does not match the table. The user's model is never overwritten.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Optional, Union

import onnx

from ptq.core.atomic import atomic_write_bytes
from ptq.core.graph import Graph, load_model
from ptq.table.quant_table import QuantTable, QuantTableError

SUFFIX = ".adjusted.onnx"


def adjusted_path(table_path: Union[str, Path]) -> Path:
    table_path = Path(table_path)
    stem = table_path.name[: -len(".quant.json")] if table_path.name.endswith(".quant.json") else table_path.stem
    return table_path.with_name(stem + SUFFIX)


def save_adjusted(model: onnx.ModelProto, table_path: Union[str, Path]) -> tuple[Path, str, str]:
    """Write the adjusted model beside the table (atomically); returns (path, path relative to the table's
    folder, sha256 of the file)."""
    data = model.SerializeToString()
    path = atomic_write_bytes(adjusted_path(table_path), data)
    return path, path.name, hashlib.sha256(data).hexdigest()


def resolve_adjusted(table: QuantTable, table_path: Union[str, Path, None]) -> Optional[Path]:
    """The adjusted model the table names (checked against its hash), or None when it names none."""
    relative = table.options.adjusted_model
    if relative is None:
        return None
    if table_path is None:
        raise QuantTableError(f"the table uses adjusted weights ({relative}) but its path is unknown")
    path = Path(table_path).parent / relative
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise QuantTableError(f"{table_path}: adjusted model {path} not found (written by calibration)") from exc
    if hashlib.sha256(data).hexdigest() != table.options.adjusted_sha256:
        raise QuantTableError(f"{table_path}: adjusted model {path} does not match the table's hash")
    return path


def load_model_for_table(model: Union[str, Path, onnx.ModelProto], table: QuantTable,
                         table_path: Union[str, Path, None], *, note: bool = True) -> Graph:
    """The graph every command runs with `table`: the adjusted model when the table names one, else `model`."""
    path = resolve_adjusted(table, table_path)
    if path is None:
        return load_model(model, table.options.input_shapes)
    if note:
        print(f"ptq: note: using the adjusted weights {path} recorded in the quant table", file=sys.stderr)
    return load_model(path, table.options.input_shapes)
