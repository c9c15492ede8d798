"""Packed-DSP48E2 arithmetic: a bit-exact slice model, the WP486 (INT8 x 2) and WP521 (INT4 x 4) packings with
exact and naive lane extraction (and the one unpacked 16-bit product, `Int16x1`), and `DspBackend`, a dot-product
backend for the integer executor.

A lower layer: it imports only numpy (and nothing of ptq above `ptq.core`).
"""
from dsp.backend import DspBackend, DspStats
from dsp.packing import CodeRange, Extraction, Int16x1, Int4x4, Int8x2, Lane, extract, extract_sum, product_range
from dsp.plan import DotPlan, plan_dot

__all__ = ["CodeRange", "DotPlan", "DspBackend", "DspStats", "Extraction", "Int16x1", "Int4x4", "Int8x2", "Lane",
           "extract", "extract_sum", "plan_dot", "product_range"]
