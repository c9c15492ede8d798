"""The calibrator registry and the name parser.

A calibrator is one small module in `calibrators/methods/` holding a frozen dataclass subclass of
`Calibrator` decorated with `@register_calibrator(name, param=...)`; the package imports every module
there, so nothing else needs editing. Names are spelled `[number]name`: the optional number sets the
calibrator's `param` field (`3std` -> NStd(n=3), `99.99percentile` -> Percentile(percent=99.99),
`0.9mean` -> Mean(momentum=0.9)). Other fields can be passed as keyword options to `get_calibrator`.
"""
from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from typing import ClassVar, Iterable, Optional, Union

import numpy as np

from ptq.core.qparams import MAX_BITS, MIN_BITS

from calibrators.histogram import DEFAULT_BINS
from calibrators.statistics import Stat, TensorStatistics

_REGISTRY: dict = {}
_ALIASES: dict[str, str] = {}  # another name a person types -> the registered name
_SPELLING = re.compile(r"^(?P<number>\d+(?:\.\d*)?|\.\d+)?(?P<name>[a-z_]+)$")


class Calibrator(ABC):
    """Turns the statistics of one tensor into a range (rmin, rmax) per channel.

    Class attributes set by `register_calibrator`: `name`, `param` (the field the numeric prefix sets,
    or None), `param_required`, `usage` (how to spell it). Subclasses declare `needs` (a frozenset of
    `Stat`) and implement `_compute`.
    """

    name: ClassVar[str] = ""
    param: ClassVar[Optional[str]] = None
    param_required: ClassVar[bool] = False
    usage: ClassVar[str] = ""
    needs: ClassVar[frozenset] = frozenset({Stat.MINMAX})
    # chooses by the error of the values read on the tensor's grid: given the statistics of what a grid-keeping
    # reader passes on (`ptq.calibration.read_values`)
    scores_read_values: ClassVar[bool] = False

    @property
    def spelling(self) -> str:
        """The canonical name, e.g. '3std', '99.99percentile', 'kld' (parses back to an equal calibrator)."""
        value = getattr(self, self.param) if self.param else None
        return self.name if value is None else f"{value:.15g}{self.name}"

    def compute(self, stats: TensorStatistics, bits: int = 8, signed: Optional[bool] = None):
        """(rmin, rmax): float64 arrays of length `stats.channels` (1 per-tensor) with rmin <= rmax.

        `bits` is the target width; `signed=None` takes the observed sign (any value < 0 in any channel),
        which decides e.g. KLD's number of levels (2^(bits-1) signed, 2^bits unsigned).
        """
        rmin, rmax, _ = self.compute_explained(stats, bits, signed)
        return rmin, rmax

    def compute_explained(self, stats: TensorStatistics, bits: int = 8, signed: Optional[bool] = None) -> tuple:
        """(rmin, rmax, label): `compute`'s range and what a table records as the tensor's calibrator: the
        spelling, or for a calibrator that chooses among others per tensor (`auto`), its choice and why."""
        if not MIN_BITS <= int(bits) <= MAX_BITS:
            raise ValueError(f"{self.spelling}: bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
        for need in self.needs | {Stat.MINMAX}:
            stats.require(need)
        signed = stats.signed if signed is None else bool(signed)
        rmin, rmax, label = self._explained(stats, int(bits), signed)
        rmin = np.asarray(rmin, dtype=np.float64).reshape(-1)
        rmax = np.asarray(rmax, dtype=np.float64).reshape(-1)
        return np.minimum(rmin, rmax), rmax, label

    def for_grid(self, symmetric: bool) -> "Calibrator":
        """This calibrator for a symmetric or an asymmetric quantization grid (only KLD scores the grid)."""
        return self

    def within(self, lo: float, hi: float) -> "Calibrator":
        """This calibrator for a tensor every consumer clamps to [lo, hi] (`OpDef.clip_range`; the caller
        intersects the range with it afterwards). Only a calibrator that scores ranges by their error (`auto`)
        needs to know: values beyond the clamp cost nothing more than the clamp itself."""
        return self

    def unclipped(self, reason: str) -> "Calibrator":
        """This calibrator for a tensor whose largest values a consumer ranks (a Softmax, an ArgMax:
        `ptq.calibration.ranked_inputs`; `reason` names it). Only a calibrator that chooses its range per tensor
        (`auto`) changes: it keeps the observed extremes; a calibrator a user names is used as named."""
        return self

    @abstractmethod
    def _compute(self, stats: TensorStatistics, bits: int, signed: bool) -> tuple:
        """(rmin, rmax) per channel from collectors that `compute` has checked are present."""

    def _explained(self, stats: TensorStatistics, bits: int, signed: bool) -> tuple:
        """(rmin, rmax, label); a calibrator that chooses per tensor overrides it to say what it chose."""
        rmin, rmax = self._compute(stats, bits, signed)
        return rmin, rmax, self.spelling


def register_calibrator(name: str, param: Optional[str] = None, param_required: bool = False, usage: str = "",
                        aliases: tuple[str, ...] = ()):
    """Class decorator: register a `Calibrator` subclass under `name` (lower case letters and '_') and its
    `aliases` (other names a person types, e.g. `nstd` for `std`)."""
    for spelled in (name, *aliases):
        if not re.fullmatch(r"[a-z_]+", spelled):
            raise ValueError(f"calibrator name must be lower case letters or '_', got {spelled!r}")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, Calibrator)):
            raise TypeError(f"@register_calibrator({name!r}) needs a Calibrator subclass, got {cls!r}")
        known = _REGISTRY.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"calibrator {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name, cls.param, cls.param_required = name, param, param_required
        cls.usage = usage or name
        _REGISTRY[name] = cls
        for alias in aliases:
            _ALIASES[alias] = name
        return cls

    return decorate


def available_calibrators() -> list:
    """How to spell each registered calibrator, e.g. ['extrema', 'kld', 'mean (0.9mean: moving average)', ...]."""
    return [_REGISTRY[n].usage for n in sorted(_REGISTRY)]


def describe_calibrators() -> list[str]:
    """One line per calibrator: how to spell it and what range it gives (the first line of its module's
    docstring, after the spelling it starts with)."""
    lines = []
    for name in sorted(_REGISTRY):
        cls = _REGISTRY[name]
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        meaning = doc[0].split(": ", 1)[-1] if doc else ""
        lines.append(f"{cls.usage}: {meaning}")
    return lines


def get_calibrator(spec: Union[str, Calibrator], **options) -> Calibrator:
    """The calibrator named by `spec` ('extrema', '3std', '99.99percentile', 'kld', ...), or `spec` itself
    if it already is one. Unknown names and bad parameters raise ValueError listing what exists."""
    if isinstance(spec, Calibrator):
        if options:
            raise ValueError(f"options {sorted(options)} given with an already built calibrator {spec.spelling!r}")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"calibrator name must be a string, got {spec!r}")
    match = _SPELLING.match(spec.strip().lower())
    cls = _REGISTRY.get(_ALIASES.get(match.group("name"), match.group("name"))) if match else None
    if cls is None:
        raise ValueError(f"unknown calibrator {spec!r}; available: {', '.join(available_calibrators())}")
    number = match.group("number")
    if number is not None:
        if cls.param is None:
            raise ValueError(f"calibrator {cls.name!r} takes no number, got {spec!r} (spelled: {cls.usage})")
        options[cls.param] = float(number)
    elif cls.param_required and cls.param not in options:
        raise ValueError(f"calibrator {cls.name!r} needs a number, e.g. {cls.usage}; got {spec!r}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for calibrator {cls.name!r}: {exc}") from exc


def required_stats(specs: Iterable[Union[str, Calibrator]]) -> frozenset:
    """The union of the `needs` of several calibrators (to collect once and calibrate several ways)."""
    out = frozenset({Stat.MINMAX})
    for spec in specs:
        out |= get_calibrator(spec).needs
    return out


def calibrate_array(
    spec: Union[str, Calibrator],
    array,
    axis: Optional[int] = None,
    bits: int = 8,
    signed: Optional[bool] = None,
    num_bins: int = DEFAULT_BINS,
):
    """One-shot calibration of a whole array (e.g. a weight): (rmin, rmax), float64 arrays of length 1 or C."""
    calibrator = get_calibrator(spec)
    stats = TensorStatistics(calibrator.needs, axis=axis, num_bins=num_bins)
    stats.update(array)
    return calibrator.compute(stats, bits=bits, signed=signed)


def clip_symmetric(threshold: np.ndarray, stats: TensorStatistics, signed: bool) -> tuple:
    """(-t, t) for a signed tensor, (0, t) for an unsigned one, each side clipped to the observed min/max."""
    lo, hi = stats.minmax.min, stats.minmax.max
    rmax = np.minimum(threshold, np.maximum(hi, 0.0))
    rmin = np.maximum(-threshold, np.minimum(lo, 0.0)) if signed else np.zeros_like(rmax)
    return rmin, rmax
