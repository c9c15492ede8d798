"""The quantization table: calibrated ranges and QParams per tensor, saved as `<stem>.quant.json`.

    {"ptq_version": "0.1.0",
     "options": {...the calibration options...},
     "tensors": {name: {"kind": "activation" | "weight", "calibrator": "extrema",
                        "min": [...], "max": [...],                 # calibrated range, per channel
                        "scale": [...], "zero_point": [...],        # ONNX convention x_f = (x_q - zp) * scale
                        "bits": 8, "signed": true, "axis": null, "narrow": false,
                        "float": true,                              # only when set: its layer runs in float
                        "why": "...",                               # only when set: why ptq chose this grid
                        "check": "3f2a9c1e-77b0d2aa"}}}             # written by ptq: which fields were edited

`min`, `max`, `scale` and `zero_point` are lists (length 1 per-tensor, C per-channel along `axis`).

The table is a document people edit. Loading validates every entry and rejects only what cannot describe a
grid (non-finite or non-positive scale, zero point outside the bits' range, bits not an integer in 2..16,
lists of different lengths, min > max, unknown keys), naming the tensor, the key and the fix in one line.
What it accepts but changes or infers is said in a `ptq.core.notes.Note` warning, one per tensor.

**Which fields were edited.** ptq writes each entry with `check`, two fingerprints (8 hex digits of sha256
each) of the values as saved: the *range* side (`min`, `max`, `bits`) and the *grid* side (`scale`,
`zero_point`, `signed`, `narrow`). A saved entry is consistent by construction, so on load:

- both fingerprints match: the entry is used as saved (a table ptq wrote loads and saves back byte for byte);
- only the range side differs (`min`/`max` or `bits` were edited): scale and zero point are recomputed from
  the range as calibration derives them (`CalibrationOptions.derive_qparams`: the table's symmetric, narrow
  and pow2 options for that kind, signedness from the range), with a note;
- the grid side differs (`scale`, `zero_point`, `signed` or `narrow` were edited, with or without the range):
  the grid is used as written, with a note;
- no `check` (a table from before fingerprints, or an entry written by hand): every field as written;
- `scale` and `zero_point` both deleted: recomputed from the range, with a note (works without `check`).

A scale that is not a float32 value is rounded to the nearest float32 (the QDQ model holds float32 scales, and
the integer executor must describe the same grid), with a note. The next save writes fresh fingerprints.
`why` says why ptq gave an entry a grid other than the calibrator's 8-bit per-tensor one (a Concat output
joining parts of widely different ranges, `ptq.calibration.joined_ranges`); it is a note for the reader, kept on load and
save, and takes no part in the fingerprints.
`float: true` on an activation runs the layer that computes it in float (dequantize its inputs, float op,
quantize its output with this entry), as `ptq debug --fake-quant TENSOR` does; see `ptq.engine.executor.prepare`.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ptq import __version__
from ptq.core.atomic import atomic_write_text
from ptq.core.qparams import MAX_BITS, MIN_BITS, QParams, compute_qparams, integer_range
from ptq.core.notes import Note

KINDS = ("activation", "weight")
ENTRY_KEYS = ("kind", "calibrator", "min", "max", "scale", "zero_point", "bits", "signed", "axis", "narrow",
              "float", "why", "check")
_CHECK = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{8}$")
RECOMPUTE_FIX = "or delete 'scale' and 'zero_point' to have them recomputed from 'min'/'max'"


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
    equalize: bool = False  # cross-layer equalization (ptq.adjust.equalize)
    bias_correction: bool = False  # empirical bias correction (ptq.adjust.bias_correction)
    adaround: bool = False  # learned weight rounding (ptq.adjust.adaround)
    analytic_bias_correction: bool = False  # bias correction from BatchNorm statistics (ptq.adjust.analytic_bias_correction)
    range_search: bool = False  # each activation's range chosen by its consumers' error (ptq.calibration.range_search)
    adjusted_model: Optional[str] = None  # the adjusted float model, relative to the table (ptq.adjust.adjusted_model)
    adjusted_sha256: Optional[str] = None
    scheme: str = "default"  # "int4-dsp": ptq.calibration.int4_dsp's rules (the adjusted model carries its Requantize nodes)

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

    def derive_qparams(self, kind: str, rmin, rmax, bits: int, axis: Optional[int] = None) -> QParams:
        """The QParams calibration derives from a range [rmin, rmax] for a tensor of this `kind`: the table's
        symmetric / narrow options of that kind, `pow2`, signedness from the range (`compute_qparams`)."""
        weight = kind == "weight"
        return compute_qparams(rmin, rmax, bits, symmetric=self.weight_symmetric if weight else self.symmetric,
                               narrow=self.weight_narrow if weight else self.narrow, pow2=self.pow2, axis=axis)


def _fingerprint(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode("ascii")).hexdigest()[:8]


def _range_fingerprint(lo, hi, bits: int) -> str:
    return _fingerprint([list(map(float, lo)), list(map(float, hi)), int(bits)])


def _grid_fingerprint(scale, zero_point, signed: bool, narrow: bool) -> str:
    return _fingerprint([list(map(float, scale)), list(map(float, zero_point)), bool(signed), bool(narrow)])


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One tensor's calibrated range [min, max] (per channel) and the QParams derived from it. `run_in_float`
    (an activation only; JSON `"float": true`): the layer computing the tensor runs in float."""

    kind: str
    calibrator: str
    min: np.ndarray
    max: np.ndarray
    qparams: QParams
    run_in_float: bool = False
    why: str = ""  # why ptq chose this grid, when it is not the calibrator's plain one (JSON `"why"`)

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
        if self.run_in_float and self.kind != "activation":
            raise ValueError("only an activation can run in float (the layer computing it); this is a weight")
        object.__setattr__(self, "min", lo)
        object.__setattr__(self, "max", hi)

    def check(self) -> str:
        """The fingerprints `ptq` saves with the entry (module docstring): range side, then grid side."""
        qp = self.qparams
        return (f"{_range_fingerprint(self.min, self.max, qp.bits)}-"
                f"{_grid_fingerprint(qp.scale, qp.zero_point, qp.signed, qp.narrow)}")

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "calibrator": self.calibrator,
            "min": [float(v) for v in self.min],
            "max": [float(v) for v in self.max],
            **self.qparams.to_dict(),
            **({"float": True} if self.run_in_float else {}),
            **({"why": self.why} if self.why else {}),
            "check": self.check(),
        }

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorEntry):
            return NotImplemented
        return (
            (self.kind, self.calibrator, self.run_in_float) == (other.kind, other.calibrator, other.run_in_float)
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

    def float_tensors(self) -> list[str]:
        """The activations marked float: the layers computing them run in float."""
        return [name for name, entry in self.tensors.items() if entry.run_in_float]

    def to_dict(self) -> dict:
        return {
            "ptq_version": self.ptq_version,
            "options": self.options.to_dict(),
            "tensors": {name: entry.to_dict() for name, entry in self.tensors.items()},
        }


def _fmt(values) -> str:
    """Per-tensor values as a number, per-channel ones as a count."""
    values = list(values)
    return f"{values[0]:.9g}" if len(values) == 1 else f"{len(values)} values"


class _EntryReader:
    """Validates one entry of a table (a dict as in the JSON) and builds its TensorEntry, collecting notes."""

    def __init__(self, name: str, data: dict, options: CalibrationOptions, source: str):
        self.where = f"{source}: tensor {name!r}"
        self.data, self.options = data, options
        self.notes: list[str] = []

    def fail(self, message: str) -> QuantTableError:
        return QuantTableError(f"{self.where}: {message}")

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{key!r} must be true or false, got {value!r}; write true or false (no quotes)")
        return value

    def integer(self, key: str, value, fix: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value):
            raise self.fail(f"{key!r} must be an integer, got {value!r}; {fix}")
        return int(value)

    def numbers(self, key: str, fix: str) -> list:
        """A list of finite numbers (a bare number counts as a list of one)."""
        value = self.data[key]
        values = value if isinstance(value, list) else [value]
        if not values:
            raise self.fail(f"{key!r} is empty; {fix}")
        types = set(map(type, values))  # the check of every value at numpy's speed (a table holds 10^5 numbers)
        if types <= {int, float} and (float not in types or np.isfinite(np.asarray(values, float)).all()):
            return values
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise self.fail(f"{key!r} must hold finite numbers, got {v!r}; {fix}")
        return values

    def header(self) -> tuple[str, str, int, Optional[int]]:
        data = self.data
        unknown = [k for k in data if k not in ENTRY_KEYS]
        if unknown:
            raise self.fail(f"unknown key {unknown[0]!r}; the keys are {', '.join(ENTRY_KEYS)}")
        for key in ("kind", "calibrator", "min", "max", "bits"):
            if key not in data:
                raise self.fail(f"missing key {key!r}; add it (every entry has kind, calibrator, min, max, bits)")
        kind = data["kind"]
        if kind not in KINDS:
            raise self.fail(f"'kind' must be \"activation\" or \"weight\", got {kind!r}; use \"weight\" for a "
                            "constant, \"activation\" for a tensor computed at run time")
        if not isinstance(data["calibrator"], str):
            raise self.fail(f"'calibrator' must be a string, got {data['calibrator']!r}; write e.g. \"extrema\"")
        bits = data["bits"]
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not MIN_BITS <= bits <= MAX_BITS \
                or bits != int(bits):
            raise self.fail(f"'bits' must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}; use e.g. 8 or 16")
        axis = data.get("axis")
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise self.fail(f"'axis' must be an integer (the channel axis) or null (per-tensor), got {axis!r}")
        return kind, data["calibrator"], int(bits), axis

    def range(self, axis: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
        fix = "write e.g. [-1.5] (one value per channel)"
        lo, hi = np.asarray(self.numbers("min", fix), float), np.asarray(self.numbers("max", fix), float)
        if lo.size != hi.size:
            raise self.fail(f"'min' has {lo.size} values, 'max' {hi.size}; give one of each per channel")
        if axis is None and lo.size != 1:
            raise self.fail(f"'min'/'max' have {lo.size} values but the entry is per-tensor ('axis' null); give "
                            "one value each, or set 'axis' to the channel axis")
        bad = np.flatnonzero(lo > hi)
        if bad.size:
            c = int(bad[0])
            at = f" (channel {c})" if lo.size > 1 else ""
            raise self.fail(f"'min' {lo[c]:g} > 'max' {hi[c]:g}{at}; swap them, or give min <= max")
        return lo, hi

    def grid(self, channels: int, bits: int, signed: bool, narrow: bool) -> tuple[np.ndarray, np.ndarray]:
        """The written scale (as float64, unrounded) and zero point, validated against the bits."""
        scale = np.asarray(self.numbers("scale", f"give the step between codes, {RECOMPUTE_FIX}"), float)
        zp = self.numbers("zero_point", f"give one integer per channel, {RECOMPUTE_FIX}")
        zp = np.asarray(zp if set(map(type, zp)) == {int} else  # as written by ptq: no value to check
                        [self.integer("zero_point", z, "codes are integers: round it") for z in zp])
        for key, n in (("scale", scale.size), ("zero_point", zp.size)):
            if n != channels:
                raise self.fail(f"{key!r} has {n} values, 'min'/'max' have {channels} (one per channel); give one "
                                f"{key} per channel, {RECOMPUTE_FIX}")
        bad = np.flatnonzero(scale <= 0)
        if bad.size:
            raise self.fail(f"'scale' {scale[bad[0]]:g} is not positive; give the step between codes (> 0), "
                            f"{RECOMPUTE_FIX}")
        as_f32 = scale.astype(np.float32)
        if not (np.all(np.isfinite(as_f32)) and np.all(as_f32 > 0)):
            raise self.fail(f"'scale' {scale[~(np.isfinite(as_f32) & (as_f32 > 0))][0]:g} is outside float32's range "
                            f"(1.4e-45 to 3.4e38); give a usable step, {RECOMPUTE_FIX}")
        qmin, qmax = integer_range(bits, signed, narrow)
        bad = np.flatnonzero((zp < qmin) | (zp > qmax))
        if bad.size:
            kind = f"{'signed' if signed else 'unsigned'} {bits} bits{', narrow' if narrow else ''}"
            raise self.fail(f"'zero_point' {zp[bad[0]]} is outside [{qmin}, {qmax}] ({kind}); use a value in that range")
        return scale, zp

    def rounding_note(self, scale: np.ndarray) -> None:
        rounded = scale.astype(np.float32).astype(np.float64)
        changed = np.flatnonzero(rounded != scale)
        if not changed.size:
            return
        if scale.size == 1:
            self.notes.append(f"'scale' {float(scale[0])!r} is not a float32 value: using the nearest one, "
                              f"{rounded[0]:.9g} (scales are float32, as in the QDQ model)")
        else:
            worst = float(np.max(np.abs(rounded - scale) / scale))
            self.notes.append(f"{changed.size} of {scale.size} 'scale' values are not float32 values: using the "
                              f"nearest ones (largest relative change {worst:.1e})")

    def entry(self) -> TensorEntry:
        data = self.data
        kind, calibrator, bits, axis = self.header()
        lo, hi = self.range(axis)
        run_in_float = self.flag("float", False)
        why = data.get("why", "")
        if not isinstance(why, str):
            raise self.fail(f"'why' must be a string (a note on the grid), got {why!r}")
        if run_in_float and kind != "activation":
            raise self.fail("'float' is true on a weight; mark the output of the layer using it (an activation) "
                            "float instead")
        has_scale, has_zp = "scale" in data, "zero_point" in data
        if has_scale != has_zp:
            missing = "zero_point" if has_scale else "scale"
            raise self.fail(f"missing key {missing!r}; give it with {'scale' if has_scale else 'zero_point'!r}, or "
                            "delete both to have them recomputed from 'min'/'max'")
        check = data.get("check")
        if check is not None and not (isinstance(check, str) and _CHECK.match(check)):
            raise self.fail(f"'check' {check!r} is not a fingerprint ptq wrote; delete it (every field is then "
                            "taken as written)")
        if not has_scale:
            qparams = self.options.derive_qparams(kind, lo, hi, bits, axis)
            self.notes.append(f"no 'scale'/'zero_point': computed from 'min'/'max' (scale {_fmt(qparams.scale)}, "
                              f"zero_point {_fmt(qparams.zero_point)})")
            return TensorEntry(kind, calibrator, lo, hi, qparams, run_in_float, why)
        if "signed" not in data:
            raise self.fail("missing key 'signed'; add it (true for a signed integer grid, false for unsigned)")
        signed, narrow = self.flag("signed", True), self.flag("narrow", False)
        # the written grid, before any validation against the bits: the recomputation after an edit of `bits`
        # replaces a zero point the new bits could not hold
        written = [data[key] if isinstance(data[key], list) else [data[key]] for key in ("scale", "zero_point")]
        range_edited = grid_edited = False
        if check is not None:
            saved_range, saved_grid = check.split("-")
            range_edited = saved_range != _range_fingerprint(lo, hi, bits)
            try:
                grid_edited = saved_grid != _grid_fingerprint(*written, signed, narrow)
            except (TypeError, ValueError):  # not numbers: edited (and reported as invalid below)
                grid_edited = True
        if range_edited and not grid_edited:
            old_scale, old_zp = written
            qparams = self.options.derive_qparams(kind, lo, hi, bits, axis)
            self.notes.append(f"'min'/'max'/'bits' changed: scale and zero_point recomputed from them (scale "
                              f"{_fmt(old_scale)} -> {_fmt(qparams.scale)}, zero_point {_fmt(old_zp)} -> "
                              f"{_fmt(qparams.zero_point)})")
            return TensorEntry(kind, calibrator, lo, hi, qparams, run_in_float, why)
        scale, zp = self.grid(lo.size, bits, signed, narrow)
        if grid_edited:
            also = "; 'min'/'max'/'bits' changed too and are kept as written" if range_edited else ""
            self.notes.append(f"'scale'/'zero_point'/'signed'/'narrow' edited: used as written{also}")
        self.rounding_note(scale)
        qparams = QParams(scale=scale, zero_point=zp, bits=bits, signed=signed, axis=axis, narrow=narrow)
        return TensorEntry(kind, calibrator, lo, hi, qparams, run_in_float, why)


def entry_from_dict(name: str, data, options: CalibrationOptions, source: str = "quant table") \
        -> tuple[TensorEntry, list[str]]:
    """One tensor's entry from its JSON form (module docstring: validation, edits, fingerprints); returns the
    entry and its note (what was rounded, recomputed or taken as written, prefixed with the tensor) as a list
    of at most one."""
    if not isinstance(data, dict):
        raise QuantTableError(f"{source}: tensor {name!r}: expected an object {{...}}, got {type(data).__name__}")
    reader = _EntryReader(name, data, options, source)
    entry = reader.entry()
    return entry, [f"{reader.where}: {'; '.join(reader.notes)}"] if reader.notes else []


def table_from_dict(data, source: str = "quant table") -> QuantTable:
    """The table from its JSON form; each note on an edited entry is issued as a `ptq.core.notes.Note` warning."""
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
    tensors = {}
    for name, item in data["tensors"].items():
        tensors[name], notes = entry_from_dict(name, item, options, source)
        for note in notes:
            warnings.warn(note, Note, stacklevel=2)
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
    """Read and validate a `.quant.json` file; raises QuantTableError naming the problem, warns (`Note`) about
    what it rounded, recomputed or took as written in edited entries."""
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
