"""High-bias absorption (Nagel et al. 2019, "Data-Free Quantization", section 4.1.1), exact and data-free.

After equalization a channel with a large bias keeps a large activation range that per-tensor activation
grids must cover. For a pair `Conv1 -> act -> Conv2` (act = Relu or Clip(0, B_c), the per-channel bound of an
equalized Clip), if Conv1's output channel c can be *proven* never to go below a constant c_c > 0, then

    act(x_c) = act'(x_c - c_c) + c_c,   act' = Relu or Clip(0, B_c - c_c),

so the constant moves through the activation into Conv2's bias, and the activation's range shrinks by c_c:

    b1'[c] = b1[c] - c_c,   B'_c = B_c - c_c,   b2'[o] = b2[o] + sum_{c,i,j} W2[o, c, i, j] c_c
    (depthwise Conv2: b2'[c] = b2[c] + c_c sum_{i,j} W2[c, 0, i, j])

The proof is interval arithmetic on Conv1: with its input channel k bounded to [lo_k, hi_k] (0 included when
Conv1 pads with zeros), channel c is at least L_c = b1[c] + sum min(W1 lo_k, W1 hi_k), and c_c = max(0, L_c).
Input bounds come from a Relu/Clip (or the per-channel Min of an equalized Clip) producing Conv1's input;
an unbounded input gives L_c = -inf and nothing is absorbed. AIMET and the paper absorb max(0, beta - 3 gamma)
from BatchNorm statistics instead, which changes the function for the inputs below that; this module only
absorbs what it can prove, so the float function stays the same. A Conv2 that pads its input is skipped: its
border outputs see the padded zeros, not c_c, so the absorbed constant would be wrong there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ptq.core.graph import Node


@dataclass
class AbsorptionLog:
    absorbed: dict[str, float] = field(default_factory=dict)  # conv1 name -> largest constant absorbed
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        worst = max(self.absorbed.values(), default=0.0)
        return f"bias absorption: {len(self.absorbed)} pairs (largest constant {worst:.3g})"


def output_lower_bound(w: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray, group: int) -> np.ndarray:
    """L_c = b_c + sum over c's input channels k and taps of min(W lo_k, W hi_k) (module docstring);
    w [Cout, Cin/group, ...], lo/hi [Cin] (may be infinite)."""
    cout, k = w.shape[:2]
    taps = w.reshape(cout, k, -1).astype(np.float64)
    lo_g = np.asarray(lo, dtype=np.float64).reshape(group, 1, k, 1)
    hi_g = np.asarray(hi, dtype=np.float64).reshape(group, 1, k, 1)
    t = taps.reshape(group, cout // group, k, -1)
    with np.errstate(invalid="ignore"):
        low = np.where(t > 0, t * lo_g, np.where(t < 0, t * hi_g, 0.0))
    return b.astype(np.float64) + low.reshape(cout, -1).sum(axis=1)


def _pads(node: Node) -> list:
    return list(node.attr("pads", [0] * 4))


def absorb(pairs: list, weight: Callable[[Node], np.ndarray],
           bias: Callable[[Node, int], np.ndarray],
           input_bounds: Callable[[str, int], Optional[tuple[np.ndarray, np.ndarray]]]) -> AbsorptionLog:
    """Absorb each pair's provable constant (module docstring), in graph order, in place on equalization's
    float64 `weight(node)` / `bias(node, channels)` arrays and on `pair.bound` (the per-channel Clip bound).
    `input_bounds(tensor, channels)`: per-channel (lo, hi) of a tensor, or None when unbounded; it sees the bounds
    already lowered by earlier pairs (the pairs chain)."""
    log = AbsorptionLog()
    for pair in pairs:
        if pair.act is None:
            continue
        if any(_pads(pair.conv2)) or pair.conv2.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
            log.skipped.append((pair.conv2.name, "pads its input: an absorbed constant would be wrong at the borders"))
            continue
        w1 = weight(pair.conv1)
        group = int(pair.conv1.attr("group", 1))
        bounds = input_bounds(pair.conv1.inputs[0], w1.shape[1] * group)
        if bounds is None:
            continue
        lo, hi = bounds
        if any(_pads(pair.conv1)) or pair.conv1.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
            lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)  # padded zeros are inputs too
        b1 = bias(pair.conv1, w1.shape[0])
        c = np.maximum(0.0, output_lower_bound(w1, b1, lo, hi, group))
        if pair.bound is not None:
            c = np.minimum(c, pair.bound)  # a channel above its Clip bound is constant: keep it inside
        if not np.any(c > 0):
            continue
        w2 = weight(pair.conv2)
        b2 = bias(pair.conv2, w2.shape[0])
        if int(pair.conv2.attr("group", 1)) > 1:
            b2 += c * w2.reshape(w2.shape[0], -1).sum(axis=1)
        else:
            b2 += np.einsum("ok,k->o", w2.reshape(w2.shape[0], w2.shape[1], -1).sum(axis=2), c)
        b1 -= c
        if pair.bound is not None:
            pair.bound -= c
        log.absorbed[pair.conv1.name] = float(np.max(c))
    return log
