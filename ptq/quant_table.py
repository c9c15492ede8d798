"""The quantization table: calibrated ranges and QParams per tensor, saved as `<stem>.quant.json`.

    {"ptq_version": "0.1.0",
     "options": {...the calibration options...},
     "tensors": {name: {"kind": "activation" | "weight", "calibrator": "extrema",
                        "min": [...], "max": [...],                 # calibrated range, per channel
                        "scale": [...], "zero_point": [...],        # ONNX convention x_f = (x_q - zp) * scale
                        "bits": 8, "signed": true, "axis": null, "narrow": false}}}

`min`, `max`, `scale` and `zero_point` are always lists (length 1 per-tensor, C per-channel along `axis`).
Loading validates everything and names the offending tensor and key in its error.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ptq import __version__
from ptq.atomic import atomic_write_text
from ptq.core.qparams import MAX_BITS, MIN_BITS, QParams

KINDS = ("activation", "weight")


class QuantTableError(ValueError):
    """A quantization table file that is missing, not JSON, or inconsistent (the message says where)."""


@dataclass(frozen=True)
class CalibrationOptions:
    """The options a table was calibrated with (recorded for reproducibility)."""

    calibrator: str = "extrema"
    weight_calibrator: str = "extrema"
    bits: int = 8
    weight_bits: int = 8
    symmetric: bool = False
    weight_symmetric: bool = True
    narrow: bool = False
    weight_narrow: bool = True
    per_channel: bool = True
    pow2: bool = False
    fold_clip: bool = True
    num_images: Optional[int] = None
    batch_size: int = 8
    seed: int = 0
    preprocess: Optional[dict] = None
    input_shapes: Optional[dict] = None
    equalize: bool = False  # cross-layer equalization (ptq.equalize)
    bias_correction: bool = False  # empirical bias correction (ptq.bias_correction)
    adaround: bool = False  # learned weight rounding (ptq.adaround)
    analytic_bias_correction: bool = False  # bias correction from BatchNorm statistics (ptq.analytic_bias_correction)
    range_search: bool = False  # each activation's range chosen by its consumers' error (ptq.range_search)
    adjusted_model: Optional[str] = None  # the adjusted float model, relative to the table (ptq.adjusted_model)
    adjusted_sha256: Optional[str] = None

    def __post_init__(self):
        for name in ("bits", "weight_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not MIN_BITS <= value <= MAX_BITS:
                raise ValueError(f"{name} must be an integer in [{MIN_BITS}, {MAX_BITS}], got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CalibrationOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown options {unknown}")
        return cls(**data)


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One tensor's calibrated range [min, max] (per channel) and the QParams derived from it."""

    kind: str
    calibrator: str
    min: np.ndarray
    max: np.ndarray
    qparams: QParams

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        lo = np.atleast_1d(np.asarray(self.min, dtype=np.float64)).ravel()
        hi = np.atleast_1d(np.asarray(self.max, dtype=np.float64)).ravel()
        if lo.shape != hi.shape or lo.size != self.qparams.scale.size:
            raise ValueError(f"min/max have {lo.size}/{hi.size} values, scale has {self.qparams.scale.size}")
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise ValueError("min/max must be finite")
        if np.any(lo > hi):
            raise ValueError(f"min > max: {lo} > {hi}")
        object.__setattr__(self, "min", lo)
        object.__setattr__(self, "max", hi)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "calibrator": self.calibrator,
            "min": [float(v) for v in self.min],
            "max": [float(v) for v in self.max],
            **self.qparams.to_dict(),
        }

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (
            (self.kind, self.calibrator) == (other.kind, other.calibrator)
            and np.array_equal(self.min, other.min)
            and np.array_equal(self.max, other.max)
            and self.qparams == other.qparams
        )

    __hash__ = None


@dataclass
class QuantTable:
    options: CalibrationOptions
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    ptq_version: str = __version__

    def qparams(self, name: str) -> Optional[QParams]:
        entry = self.tensors.get(name)
        return None if entry is None else entry.qparams

    def to_dict(self) -> dict:
        return {
            "ptq_version": self.ptq_version,
            "options": self.options.to_dict(),
            "tensors": {name: entry.to_dict() for name, entry in self.tensors.items()},
        }


_ENTRY_TYPES = {
    "kind": str, "calibrator": str, "min": list, "max": list, "scale": list, "zero_point": list,
    "bits": int, "signed": bool,
}


def _real(values: list, where: str) -> list:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise QuantTableError(f"{where}: expected finite numbers, got {v!r}")
    return values


def _entry_from_dict(name: str, data, source: str) -> TensorEntry:
    where = f"{source}: tensor {name!r}"
    if not isinstance(data, dict):
        raise QuantTableError(f"{where}: expected an object, got {type(data).__name__}")
    for key, typ in _ENTRY_TYPES.items():
        if key not in data:
            raise QuantTableError(f"{where}: missing key {key!r}")
        value = data[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise QuantTableError(f"{where}: {key!r} must be {typ.__name__}, got {value!r}")
    for key in ("min", "max", "scale"):
        _real(data[key], f"{where}, {key!r}")
    if not all(isinstance(z, int) and not isinstance(z, bool) for z in data["zero_point"]):
        raise QuantTableError(f"{where}: 'zero_point' must be a list of integers, got {data['zero_point']}")
    axis = data.get("axis")
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        raise QuantTableError(f"{where}: 'axis' must be an integer or null, got {axis!r}")
    if axis is None and len(data["scale"]) != 1:
        raise QuantTableError(f"{where}: per-tensor entry (axis null) has {len(data['scale'])} scales")
    if not (len(data["min"]) == len(data["max"]) == len(data["scale"]) == len(data["zero_point"])):
        raise QuantTableError(f"{where}: 'min', 'max', 'scale' and 'zero_point' must have the same length")
    narrow = data.get("narrow", False)
    if not isinstance(narrow, bool):
        raise QuantTableError(f"{where}: 'narrow' must be true or false, got {narrow!r}")
    try:
        qparams = QParams(
            scale=np.asarray(data["scale"], dtype=np.float64),
            zero_point=np.asarray(data["zero_point"], dtype=np.int64),
            bits=data["bits"], signed=data["signed"], axis=axis, narrow=narrow,
        )
        if not np.array_equal(qparams.scale, np.asarray(data["scale"], dtype=np.float64)):
            raise ValueError("scale values must be float32-representable")
        return TensorEntry(data["kind"], data["calibrator"], np.asarray(data["min"]), np.asarray(data["max"]), qparams)
    except ValueError as exc:
        raise QuantTableError(f"{where}: {exc}") from exc


def table_from_dict(data, source: str = "quant table") -> QuantTable:
    if not isinstance(data, dict):
        raise QuantTableError(f"{source}: expected a JSON object at the top level")
    for key in ("ptq_version", "options", "tensors"):
        if key not in data:
            raise QuantTableError(f"{source}: missing key {key!r}")
    if not isinstance(data["tensors"], dict):
        raise QuantTableError(f"{source}: 'tensors' must be an object")
    if not isinstance(data["options"], dict):
        raise QuantTableError(f"{source}: 'options' must be an object")
    try:
        options = CalibrationOptions.from_dict(data["options"])
    except (TypeError, ValueError) as exc:
        raise QuantTableError(f"{source}: 'options': {exc}") from exc
    tensors = {name: _entry_from_dict(name, entry, source) for name, entry in data["tensors"].items()}
    return QuantTable(options=options, tensors=tensors, ptq_version=str(data["ptq_version"]))


def save_quant_table(table: QuantTable, path: Union[str, Path]) -> Path:
    """Write the table as JSON (atomically), one line per tensor. Floats are written with repr, so they load
    back exactly."""
    data = table.to_dict()
    tensors = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in data["tensors"].items())
    text = (
        "{\n"
        f' "ptq_version": {json.dumps(data["ptq_version"])},\n'
        f' "options": {json.dumps(data["options"])},\n'
        f' "tensors": {{\n{tensors}\n }}\n'
        "}\n"
    )
    return atomic_write_text(path, text)


def load_quant_table(path: Union[str, Path]) -> QuantTable:
    """Read and validate a `.quant.json` file; raises QuantTableError naming the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise QuantTableError(f"quantization table not found: {path}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantTableError(f"{path} is not valid JSON: {exc}") from exc
    return table_from_dict(data, str(path))
