"""LUT accuracy and size: 16-bit interpolated tables (129..1025 entries), half-table savings, softmax.

    python3 bench/lut.py

Errors are measured over every 16-bit input code against dequantize -> f (float64) -> quantize, in LSB of
the 16-bit output; "floor" is the build's LP lower bound (no nodes of that layout do better). Input ranges:
the whitepaper's tuned ranges (sigmoid +-6, tanh +-3) and exp over a calibrated [-4, 0.5] and a wider
[-8, 0]; then exp with 257 entries over [lo, 0] for a range of widths, with the range `tune_input_range`
keeps for a 16-bit output. Build times are the best of 3 builds.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lut import FUNCTIONS, build_softmax, build_table, tune_input_range  # noqa: E402
from ptq.core.qparams import QParams, compute_qparams  # noqa: E402

ENTRIES = (129, 257, 513, 1025)
EXP_WIDTHS = (3, 4, 4.5, 5, 5.5, 6, 8, 12)
CASES = [
    ("sigmoid [-6, 6]", "sigmoid", compute_qparams(-6, 6, 16), QParams(1 / 65535, 0, 16, False)),
    ("tanh [-3, 3]", "tanh", compute_qparams(-3, 3, 16), QParams(1 / 32767, 0, 16, True, narrow=True)),
    ("exp [-4, 0.5]", "exp", compute_qparams(-4, 0.5, 16, symmetric=False), compute_qparams(0, math.exp(0.5), 16)),
    ("exp [-8, 0]", "exp", compute_qparams(-8, 0, 16, symmetric=False), compute_qparams(0, 1, 16)),
]
HALF_8BIT = [
    ("sigmoid", QParams(1 / 255, 0, 8, False)),
    ("tanh", QParams(1 / 127, 0, 8, True, narrow=True)),
    ("sin", QParams(1 / 127, 0, 8, True, narrow=True)),
    ("cos", QParams(1 / 127, 0, 8, True, narrow=True)),
]


def _timed_build(f, in_q, out_q, entries):
    """(report, best-of-3 build time in ms) of the interpolated table, half where f has a symmetry."""
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        rep = build_table(f, in_q, out_q, symmetry=f.symmetry, center=f.center, entries=entries).report()
        best = min(best, time.perf_counter() - t0)
    return rep, 1e3 * best


def interpolation_table() -> None:
    print("16-bit input -> 16-bit output, interpolated tables (error in output LSB, all 65536 codes)")
    print(f"{'function':18s} {'entries':>7s} {'stored':>7s} {'bytes':>6s} {'max':>4s} {'floor':>5s} {'mean':>7s}"
          f" {'build ms':>9s}")
    for label, name, in_q, out_q in CASES:
        for entries in ENTRIES:
            rep, ms = _timed_build(FUNCTIONS[name], in_q, out_q, entries)
            print(f"{label:18s} {entries:7d} {rep.entries:7d} {rep.bytes:6d} {rep.max_error_lsb:4d}"
                  f" {rep.error_floor_lsb:5d} {rep.mean_error_lsb:7.4f} {ms:9.1f}" + ("  half" if rep.half else ""))


def exp_range_widths() -> None:
    print("\nexp over [lo, 0], 257 entries, uint16 output over [0, 1] (error in output LSB)")
    print(f"{'range':10s} {'max':>4s} {'floor':>5s} {'mean':>7s}  tuned range (16-bit output)")
    for width in EXP_WIDTHS:
        in_q = compute_qparams(-width, 0, 16, symmetric=False)
        rep, _ = _timed_build(FUNCTIONS["exp"], in_q, compute_qparams(0, 1, 16), 257)
        lo, hi = tune_input_range("exp", -width, 0, out_bits=16)
        print(f"[{-width:g}, 0]{'':{10 - len(f'[{-width:g}, 0]')}s} {rep.max_error_lsb:4d} {rep.error_floor_lsb:5d}"
              f" {rep.mean_error_lsb:7.4f}  [{lo:.2f}, {hi:g}]")


def half_savings() -> None:
    print("\nhalf tables: bytes saved")
    for label, name, in_q, out_q in CASES[:2]:
        full = build_table(name, in_q, out_q, entries=257).report()
        f = FUNCTIONS[name]
        half = build_table(f, in_q, out_q, symmetry=f.symmetry, center=f.center, entries=257).report()
        print(f"  16-bit {label:16s} full {full.bytes:5d} B, half {half.bytes:5d} B,"
              f" saved {full.bytes - half.bytes:5d} B (max error {full.max_error_lsb} -> {half.max_error_lsb} LSB)")
    in_q = QParams(8 / 127.5, 0, 8, True)
    for name, out_q in HALF_8BIT:
        f = FUNCTIONS[name]
        full = build_table(f, in_q, out_q).report()
        half = build_table(f, in_q, out_q, symmetry=f.symmetry, center=f.center).report()
        print(f"  8-bit  {name:16s} full {full.bytes:5d} B, half {half.bytes:5d} B,"
              f" saved {full.bytes - half.bytes:5d} B (exact: {half.max_error_lsb == 0})")


def softmax_accuracy() -> None:
    print("\nsoftmax, uint8 output vs round(255 * softmax(dequantized x))")
    rng = np.random.default_rng(0)
    for n in (2, 16, 256, 1000, 4096, 18710, 65536):
        errs, devs, ref_devs, seconds = [], [], [], 0.0
        for std in (0.3, 1.5, 4.0, 12.0):
            x = rng.normal(0.0, std, (32, n))
            in_q = compute_qparams(x.min(), x.max(), 8)
            q = in_q.quantize(x)
            t0 = time.perf_counter()
            y = build_softmax(in_q, row_length=n).forward(q).astype(np.int64)
            seconds += time.perf_counter() - t0
            xf = (q.astype(np.int64) - int(in_q.zero_point[0])) * float(in_q.scale[0])
            p = np.exp(xf - xf.max(axis=-1, keepdims=True))
            ref = np.rint(255 * p / p.sum(axis=-1, keepdims=True))
            errs.append(np.abs(y - ref).ravel())
            devs.append(np.abs(y.sum(axis=-1) - 255))
            ref_devs.append(np.abs(ref.sum(axis=-1) - 255))
        err = np.concatenate(errs)
        print(f"  rows of {n:5d}: exact {np.mean(err == 0):.5f}, within 1 LSB {np.mean(err <= 1):.5f},"
              f" max {int(err.max())} LSB, max |row sum - 255| {int(np.concatenate(devs).max())}"
              f" (float reference rounded: {int(np.concatenate(ref_devs).max())}),"
              f" {1e3 * seconds / 4:.2f} ms per 32-row forward")


def main() -> None:
    interpolation_table()
    exp_range_widths()
    half_savings()
    softmax_accuracy()


if __name__ == "__main__":
    main()
