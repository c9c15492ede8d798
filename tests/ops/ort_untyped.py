"""One ONNX node in onnxruntime with its output types left to onnxruntime (int64 indices, bool masks): the
ops with index outputs cannot use `op_testing.ort_single`, which declares every output float."""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def ort_run(op_type: str, inputs: dict, attrs: Optional[dict] = None, constants: Optional[dict] = None,
            outputs: int = 1, opset: int = 17) -> list[np.ndarray]:
    """`inputs` are float32 graph inputs, `constants` initializers of any dtype; outputs as onnxruntime types them."""
    constants = constants or {}
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op_type, list(inputs) + list(constants), out_names, **(attrs or {}))
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, np.shape(v)) for k, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in out_names],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})
