"""The named scalar functions that ptq implements with lookup tables, with their mirror symmetry.

Float definitions follow the ONNX operators with their default attributes (Elu alpha=1, Selu
alpha=1.67326319217681884765625 gamma=1.05070102214813232421875, HardSwish x*max(0, min(1, x/6 + 0.5))),
plus the whitepaper's non-ONNX ones (Rsqrt = 1/sqrt(x), BNLL = log(1 + e^x) as in Caffe, Square = x^2).
Each function maps a float64 array to a float64 array; outside its real domain it returns NaN (Log, Sqrt of
negative numbers) or +-inf (Log(0), Reciprocal(+-0)), as numpy does.

`symmetry` / `center` describe the mirror a half table may use:
    "odd"  about c:  f(-x) = 2c - f(x)      (tanh, sin: c = 0; sigmoid: c = 0.5)
    "even":          f(-x) = f(x)           (cos, square)
"""
from __future__ import annotations

# imports inside functions: scipy, at first use (scipy.special, .sparse, .optimize each take about half a second to
# import; `import ops` and the `ptq` command would pay for them otherwise)

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import numpy as np

Symmetry = Optional[Literal["odd", "even"]]

SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


@dataclass(frozen=True)
class LutFunction:
    """A scalar function `fn` (float64 array -> float64 array) and the mirror symmetry of its graph."""

    name: str
    fn: Callable[[np.ndarray], np.ndarray]
    symmetry: Symmetry = None
    center: float = 0.0

    def __post_init__(self):
        if self.symmetry not in (None, "odd", "even"):
            raise ValueError(f"LutFunction {self.name}: symmetry must be None, 'odd' or 'even', got {self.symmetry!r}")

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.asarray(self.fn(x), dtype=np.float64)


def _elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def _selu(x):
    return SELU_GAMMA * np.where(x > 0, x, SELU_ALPHA * np.expm1(np.minimum(x, 0.0)))


def _hardswish(x):
    return x * np.maximum(0.0, np.minimum(1.0, x / 6 + 0.5))


def _softsign(x):
    return x / (1 + np.abs(x))


def _rsqrt(x):
    return 1.0 / np.sqrt(x)


def _reciprocal(x):
    return 1.0 / x


def _log_abs(x):
    return np.log(np.abs(x))


def _square(x):
    return x * x


def _softplus(x):
    return np.logaddexp(0.0, x)


def expit(x: np.ndarray) -> np.ndarray:
    """The logistic sigmoid 1 / (1 + e^-x) (scipy's, imported on first use: scipy.special costs every
    `ptq` command about half a second of import time otherwise)."""
    from scipy.special import expit as scipy_expit

    return scipy_expit(x)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function (scipy's, imported on first use, as `expit`)."""
    from scipy.special import erf as scipy_erf

    return scipy_erf(x)


_ALL = [
    LutFunction("sigmoid", expit, "odd", 0.5),
    LutFunction("tanh", np.tanh, "odd"),
    LutFunction("exp", np.exp),
    LutFunction("log", np.log),
    LutFunction("log_abs", _log_abs, "even"),  # the Log table of Pow with a variable exponent
    LutFunction("sqrt", np.sqrt),
    LutFunction("rsqrt", _rsqrt),
    LutFunction("elu", _elu),
    LutFunction("selu", _selu),
    LutFunction("softplus", _softplus),
    LutFunction("softsign", _softsign, "odd"),
    LutFunction("bnll", _softplus),
    LutFunction("hardswish", _hardswish),
    LutFunction("cos", np.cos, "even"),
    LutFunction("sin", np.sin, "odd"),
    LutFunction("square", _square, "even"),
    LutFunction("reciprocal", _reciprocal, "odd"),
]

FUNCTIONS: dict[str, LutFunction] = {f.name: f for f in _ALL}


def power(alpha: float) -> LutFunction:
    """x^alpha for a constant exponent (ONNX Pow): an even exponent gives an even function, an odd one an odd
    function; a fractional exponent is NaN for x < 0 (so its table needs a non-negative input range)."""
    alpha = float(alpha)
    if not np.isfinite(alpha):
        raise ValueError(f"power: exponent must be finite, got {alpha}")
    symmetry: Symmetry = None
    if alpha == round(alpha):
        symmetry = "even" if int(alpha) % 2 == 0 else "odd"
    return LutFunction(f"pow_{alpha:g}", lambda x: np.power(x, alpha), symmetry)


def get_function(fn) -> LutFunction:
    """A registry name, a LutFunction, or a plain callable (no symmetry) as a LutFunction."""
    if isinstance(fn, LutFunction):
        return fn
    if isinstance(fn, str):
        if fn not in FUNCTIONS:
            raise ValueError(f"unknown LUT function {fn!r}; known: {', '.join(sorted(FUNCTIONS))}")
        return FUNCTIONS[fn]
    if callable(fn):
        return LutFunction(getattr(fn, "__name__", "fn"), fn)
    raise TypeError(f"expected a function name, LutFunction or callable, got {type(fn).__name__}")


def _gelu(x):
    """ONNX Gelu (opset 20), approximate="none": x * 0.5 * (1 + erf(x / sqrt(2)))."""
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def _gelu_tanh(x):
    """ONNX Gelu (opset 20), approximate="tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


FUNCTIONS["gelu"] = LutFunction("gelu", _gelu)
FUNCTIONS["gelu_tanh"] = LutFunction("gelu_tanh", _gelu_tanh)
FUNCTIONS["erf"] = LutFunction("erf", erf, "odd")  # ONNX Erf (the GELU of transformer MLPs)
