"""Convolution arithmetic shared by the float and the integer Conv / ConvTranspose: geometry, im2col, col2im.

N-d (1-d, 2-d, 3-d) NC* layout. The kernels are dtype-agnostic: the caller passes a `matmul` (float
np.matmul, or an integer `DotBackend.matmul`) and an accumulator dtype, so the float forward and the integer
forward share one piece of indexing code.

    Conv:          y[n, m, o] = sum_{c in group(m), t} xp[n, c, o*s + t*d] * w[m, c, t]
    ConvTranspose: y[n, m, o] = sum_{c in group(m), i, t : i*s + t*d - pad_begin = o} x[n, c, i] * w[c, m, t]

`xp` is the input padded with `pad_value` (the input zero point for integer codes: padding is a real 0).
Grouped convolution is a batched matmul over groups; depthwise convolution (one input channel per group) is
a multiply-accumulate per kernel tap over strided views (no im2col copy; a Python loop over taps only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MatmulFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ConvGeometry:
    """Kernel size, strides, dilations and explicit begin/end pads of an N-d convolution (auto_pad resolved)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]

    @property
    def effective_kernel(self) -> tuple[int, ...]:
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    def out_shape(self, in_spatial: Sequence[int]) -> tuple[int, ...]:
        """Output size for an unpadded input of spatial size `in_spatial`."""
        padded = tuple(i + b + e for i, b, e in zip(in_spatial, self.pads_begin, self.pads_end))
        return self.padded_out_shape(padded)

    def padded_out_shape(self, padded: Sequence[int]) -> tuple[int, ...]:
        """Output size for an input already padded to `padded`."""
        out = tuple((p - ek) // s + 1 for p, ek, s in zip(padded, self.effective_kernel, self.strides))
        if any(o < 1 for o in out):
            raise ValueError(f"convolution output would be empty: padded input {tuple(padded)}, geometry {self}")
        return out

    @property
    def is_pointwise(self) -> bool:
        return all(k == 1 for k in self.kernel) and all(s == 1 for s in self.strides) and not any(
            self.pads_begin + self.pads_end
        )


def _ints(value, n: int, default: int, what: str) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    value = tuple(int(v) for v in value)
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} values, expected {n}")
    return value


def conv_geometry(attrs: dict, in_spatial: Sequence[int], kernel: Sequence[int]) -> ConvGeometry:
    """Resolve ONNX Conv attributes (kernel_shape, strides, dilations, pads, auto_pad) for an input size."""
    n = len(kernel)
    if attrs.get("kernel_shape") is not None and tuple(attrs["kernel_shape"]) != tuple(kernel):
        raise ValueError(f"Conv kernel_shape {attrs['kernel_shape']} disagrees with the weight's {tuple(kernel)}")
    strides = _ints(attrs.get("strides"), n, 1, "strides")
    dilations = _ints(attrs.get("dilations"), n, 1, "dilations")
    auto_pad = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    eff = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [max(0, (-(-i // s) - 1) * s + ek - i) for i, s, ek in zip(in_spatial, strides, eff)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        begin = end = [0] * n
    elif auto_pad == "NOTSET":
        pads = _ints(attrs.get("pads"), 2 * n, 0, "pads")
        begin, end = pads[:n], pads[n:]
    else:
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    return ConvGeometry(tuple(int(k) for k in kernel), strides, dilations, tuple(begin), tuple(end))


def pad_input(x: np.ndarray, geom: ConvGeometry, value) -> np.ndarray:
    """x with its spatial axes padded by the geometry's begin/end pads, filled with `value`."""
    if not any(geom.pads_begin + geom.pads_end):
        return x
    shape = x.shape[:2] + tuple(s + b + e for s, b, e in zip(x.shape[2:], geom.pads_begin, geom.pads_end))
    xp = np.full(shape, value, dtype=x.dtype)  # np.pad costs several times this fill-and-copy
    xp[(slice(None), slice(None)) + tuple(slice(b, b + s) for b, s in zip(geom.pads_begin, x.shape[2:]))] = x
    return xp


def _tap_view(xp: np.ndarray, geom: ConvGeometry, tap: tuple[int, ...], out: tuple[int, ...]) -> np.ndarray:
    """xp[:, :, t*d + o*s] for every output position o: a strided view, no copy."""
    index = [slice(None), slice(None)]
    for t, d, s, o in zip(tap, geom.dilations, geom.strides, out):
        start = t * d
        index.append(slice(start, start + (o - 1) * s + 1, s))
    return xp[tuple(index)]


def im2col(xp: np.ndarray, geom: ConvGeometry) -> np.ndarray:
    """(N, C, *S) padded input -> (N, C * prod(kernel), P) columns, rows ordered (c, taps), P = prod(out)."""
    n, c = xp.shape[:2]
    spatial = tuple(range(2, xp.ndim))
    out = geom.padded_out_shape(xp.shape[2:])
    if geom.is_pointwise:
        return xp.reshape(n, c, -1)
    windows = sliding_window_view(xp, geom.effective_kernel, axis=spatial)  # (N, C, *out_full, *eff_kernel)
    index = [slice(None), slice(None)]
    index += [slice(0, (o - 1) * s + 1, s) for o, s in zip(out, geom.strides)]
    index += [slice(None, None, d) for d in geom.dilations]
    windows = windows[tuple(index)]  # (N, C, *out, *kernel)
    k = len(spatial)
    order = [0, 1] + [2 + k + i for i in range(k)] + [2 + i for i in range(k)]
    return windows.transpose(order).reshape(n, c * int(np.prod(geom.kernel)), -1)


def conv_padded(
    xp: np.ndarray,
    w: np.ndarray,
    geom: ConvGeometry,
    groups: int,
    matmul: MatmulFn,
    acc_dtype,
    direct_depthwise: bool = True,
) -> np.ndarray:
    """Convolution of an already padded input: (N, C, *S) x (M, C/groups, *kernel) -> (N, M, *out).

    `direct_depthwise` computes depthwise convolution by taps in `acc_dtype` arithmetic (which must hold
    the sums exactly); without it, depthwise goes through `matmul` like any grouped convolution.
    """
    n, c = xp.shape[:2]
    m = w.shape[0]
    if c % groups or m % groups or w.shape[1] != c // groups:
        raise ValueError(f"Conv: input channels {c}, weight {w.shape} and group={groups} are inconsistent")
    out = geom.padded_out_shape(xp.shape[2:])
    if direct_depthwise and groups > 1 and w.shape[1] == 1:
        return _depthwise(xp, w, geom, groups, out, acc_dtype)
    cols = im2col(xp, geom)  # (N, C*kk, P)
    if groups == 1:
        acc = matmul(w.reshape(m, -1), cols)  # (M, K) @ (N, K, P) -> (N, M, P)
    else:
        kg = cols.shape[1] // groups
        acc = matmul(w.reshape(groups, m // groups, kg), cols.reshape(n, groups, kg, -1))  # (N, G, M/G, P)
    return acc.reshape((n, m) + out)


def _depthwise(xp, w, geom, groups, out, acc_dtype) -> np.ndarray:
    """One input channel per group: y[n, m] = sum_t xp[n, m // mult, tap t] * w[m, 0, t], per tap.

    numpy's inner loop runs along the last axis: when the output rows are shorter than the channel count
    (deep, small layers), the taps run channels-last, which keeps that loop long and contiguous.
    """
    n = xp.shape[0]
    m = w.shape[0]
    mult = m // groups
    if mult > 1:
        xp = np.repeat(xp, mult, axis=1)
    wk = w.reshape(m, -1).astype(acc_dtype, copy=False)
    channels_last = out[-1] < m
    # one conversion pass up front: per-tap multiplies of matching dtypes run without casting buffers
    if channels_last:
        rank = xp.ndim
        moved = xp.transpose((0,) + tuple(range(2, rank)) + (1,))
        xp = np.empty(moved.shape, dtype=acc_dtype)
        np.copyto(xp, moved)
        acc = np.empty((n,) + out + (m,), dtype=acc_dtype)
        weight_shape = (m,)
    else:
        xp = xp.astype(acc_dtype, copy=False)
        acc = np.empty((n, m) + out, dtype=acc_dtype)
        weight_shape = (1, m) + (1,) * len(out)
    product = np.empty_like(acc)
    for t, tap in enumerate(np.ndindex(*geom.kernel)):
        view = _tap_view_last(xp, geom, tap, out) if channels_last else _tap_view(xp, geom, tap, out)
        # in-place: fresh full-size temporaries per tap would cost more than the arithmetic
        np.multiply(view, wk[:, t].reshape(weight_shape), out=acc if t == 0 else product)
        if t:
            np.add(acc, product, out=acc)
    if channels_last:
        return acc.transpose((0, acc.ndim - 1) + tuple(range(1, acc.ndim - 1)))
    return acc


def _tap_view_last(xp: np.ndarray, geom: ConvGeometry, tap: tuple[int, ...], out: tuple[int, ...]) -> np.ndarray:
    """Channels-last (N, *S, C) version of `_tap_view`."""
    index = [slice(None)]
    for t, d, s, o in zip(tap, geom.dilations, geom.strides, out):
        start = t * d
        index.append(slice(start, start + (o - 1) * s + 1, s))
    return xp[tuple(index) + (slice(None),)]


def conv_transpose_full(
    x: np.ndarray, w: np.ndarray, geom: ConvGeometry, groups: int, full: tuple[int, ...], matmul: MatmulFn, acc_dtype
) -> np.ndarray:
    """Transposed convolution before cropping: (N, C, *S) x (C, M/groups, *kernel) -> (N, M, *full).

    full[i] = (S[i] - 1) * s[i] + (k[i] - 1) * d[i] + 1 (+ any output_padding); the caller crops the pads.
    """
    n, c = x.shape[:2]
    mg = w.shape[1]
    if c % groups or w.shape[0] != c:
        raise ValueError(f"ConvTranspose: input channels {c}, weight {w.shape} and group={groups} are inconsistent")
    cg = c // groups
    kk = int(np.prod(geom.kernel))
    # (G, M/G * kk, C/G) @ (N, G, C/G, P_in) -> (N, G, M/G * kk, P_in)
    wg = w.reshape(groups, cg, mg * kk).transpose(0, 2, 1)
    cols = matmul(np.ascontiguousarray(wg), x.reshape(n, groups, cg, -1))
    cols = cols.reshape((n, groups * mg, kk) + x.shape[2:])
    y = np.zeros((n, groups * mg) + tuple(full), dtype=acc_dtype)
    for t, tap in enumerate(np.ndindex(*geom.kernel)):
        index = [slice(None), slice(None)]
        for ti, d, s, i in zip(tap, geom.dilations, geom.strides, x.shape[2:]):
            index.append(slice(ti * d, ti * d + (i - 1) * s + 1, s))
        y[tuple(index)] += cols[:, :, t]
    return y
