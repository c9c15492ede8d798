"""ops/base.py: the checks shared by the op modules (activations quantized per tensor)."""
from __future__ import annotations

import numpy as np
import pytest

from op_testing import context, random_qparams
from ops import get_op
from ops.registry import QuantizationError
from ptq.core.graph import Node


def test_per_channel_activations_are_rejected():
    per_channel = random_qparams(np.random.default_rng(1), np.array([-1.0, -2.0]), np.array([1.0, 2.0]), axis=1)
    for op_type in ("Pad", "Concat", "MaxPool", "AveragePool", "ReduceMean", "Resize"):
        inputs, constants = ["x"], {}
        if op_type == "Resize":
            inputs, constants = ["x", "", "s"], {2: np.array([1, 1, 2, 2], np.float32)}
        node = Node("n", op_type, inputs, ["y"], {"axis": 0, "kernel_shape": [1, 1]})
        with pytest.raises(QuantizationError, match="per tensor"):
            get_op(op_type).quantize(context(node, [per_channel, None, None][:len(inputs)], [None], constants))


def test_a_code_moving_op_takes_a_per_channel_input_only_where_the_channels_stay_whole():
    """Identity and Transpose carry a per-channel grid to the axis the channels move to (`OpDef.moved_axis`), which
    needs the static shapes; without them they cannot tell, and refuse."""
    per_channel = random_qparams(np.random.default_rng(1), np.array([-1.0, -2.0]), np.array([1.0, 2.0]), axis=1)
    for op_type in ("Identity", "Transpose"):
        node = Node("n", op_type, ["x"], ["y"], {})
        with pytest.raises(QuantizationError, match="does not keep whole along one output axis"):
            get_op(op_type).quantize(context(node, [per_channel], [None], {}))
