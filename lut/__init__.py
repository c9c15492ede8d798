"""Lookup tables: scalar functions as integer tables (whitepaper 3.3.2.2 and chapter 4).

- `build_table(fn, in_qparams, out_qparams, *, symmetry=None, center=0.0, entries=None) -> LookupTable`
  full, half (mirrored) and interpolated tables (fitted nodes); `LookupTable.lookup(int_array)`, `.report()`
  (max and mean error over every input code; for interpolated tables also the error floor no nodes beat).
- `FUNCTIONS` / `LutFunction` / `power(alpha)`: the named functions with their symmetry and centre.
- `tune_input_range(fn, rmin, rmax, *, out_bits=8)`: cut flat tails off a calibrated input range.
- `build_softmax(in_qparams, out_bits=8, axis=-1, row_length=None) -> SoftmaxKernel`: integer softmax (`.forward(int_array)`);
  `build_log_softmax(in_qparams, out_qparams, axis=-1, row_length=None) -> LogSoftmaxKernel` likewise.
- `build_divider(a_qp, b_qp, out_qp) -> Divider`, `build_pow(x_qp, y_qp, out_qp) -> PowKernel`: Div through a
  reciprocal table, Pow with a variable exponent through log/exp tables (`.forward(a, b)`).
"""
from lut.arith import Divider, PowKernel, build_divider, build_pow
from lut.functions import FUNCTIONS, LutFunction, get_function, power
from lut.ranges import tune_input_range
from lut.log_softmax import LogSoftmaxKernel, build_log_softmax
from lut.softmax import SoftmaxKernel, build_softmax, softmax_out_qparams
from lut.table import LookupTable, TableReport, build_table

__all__ = [
    "FUNCTIONS",
    "Divider",
    "LogSoftmaxKernel",
    "LookupTable",
    "LutFunction",
    "PowKernel",
    "SoftmaxKernel",
    "TableReport",
    "build_divider",
    "build_log_softmax",
    "build_pow",
    "build_softmax",
    "build_table",
    "get_function",
    "power",
    "softmax_out_qparams",
    "tune_input_range",
]
