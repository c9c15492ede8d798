"""The bounds of an ONNX Clip node, read one way everywhere (range folding, activation fusion, the Clip op).

Opset < 11 gives them as attributes `min`/`max`; opset >= 11 as optional inputs 1 and 2. An omitted bound is
unbounded (-inf / +inf).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ptq.core.graph import Node


def clip_bounds(node: Node, constant: Callable[[int], Optional[np.ndarray]]) -> Optional[tuple[float, float]]:
    """(min, max) of a Clip node; `constant(i)` is the value of input i when it is a constant, else None.

    None when a given bound is not a constant scalar (it is computed at run time)."""
    bounds = [float(node.attr("min", -np.inf)), float(node.attr("max", np.inf))]
    for i in (1, 2):
        if len(node.inputs) > i and node.inputs[i]:
            value = constant(i)
            if value is None or np.asarray(value).size != 1:
                return None
            bounds[i - 1] = float(np.asarray(value).reshape(()))
    return bounds[0], bounds[1]
