"""Build the YOLOv8-style head used by tests/test_joined_ranges.py and bench/joined_ranges.py (issue 24).

    python bench/models/yolo_head.py      # writes bench/models/yolo_head.onnx and yolo_head_t.onnx

image [1, 3, 42, 50] -> Conv 3x3 + Relu (16 channels) -> box branch: Conv 1x1 -> Sigmoid -> Mul 320 (pixel
boxes, 0..320) -> Reshape [1, 4, 2100]; score branch: Conv 1x1 (bias -5) -> Sigmoid -> Reshape [1, 18, 2100];
Concat(axis 1) -> output [1, 22, 2100] (yolo_head_t: then Transpose to [1, 2100, 22]). Weights are set, not
trained: on `images()` (dim noise with three bright blocks, the "objects") most anchors score ~0.01, under 1%
score above 0.25 and the peaks reach ~1, as a trained detector's class scores do; boxes span 0..300 pixels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

H, W = 42, 50  # 2100 anchors, as YOLOv8 at 320 x 320 (40^2 + 20^2 + 10^2)
BOXES, CLASSES = 4, 18
HERE = Path(__file__).resolve().parent
PATHS = {False: HERE / "yolo_head.onnx", True: HERE / "yolo_head_t.onnx"}


def build(transpose: bool = False, opset: int = 17) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    init = {
        "w_stem": rng.normal(0, 0.4, (16, 3, 3, 3)), "b_stem": rng.uniform(-0.2, 0.2, 16),
        "w_box": rng.normal(0, 0.3, (BOXES, 16, 1, 1)), "b_box": np.zeros(BOXES),
        "w_cls": rng.normal(0, 0.5, (CLASSES, 16, 1, 1)), "b_cls": np.full(CLASSES, -5.0),
        "pixels": np.array(320.0),
    }
    tensors = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()]
    tensors += [numpy_helper.from_array(np.array([1, rows, H * W], np.int64), name)
                for name, rows in (("box_shape", BOXES), ("cls_shape", CLASSES))]
    nodes = [
        helper.make_node("Conv", ["image", "w_stem", "b_stem"], ["stem"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["stem"], ["feat"], name="stem_relu"),
        helper.make_node("Conv", ["feat", "w_box", "b_box"], ["box_logit"], name="box_conv"),
        helper.make_node("Sigmoid", ["box_logit"], ["box_unit"], name="box_sigmoid"),
        helper.make_node("Mul", ["box_unit", "pixels"], ["box_px"], name="box_scale"),
        helper.make_node("Reshape", ["box_px", "box_shape"], ["boxes"], name="box_flat"),
        helper.make_node("Conv", ["feat", "w_cls", "b_cls"], ["cls_logit"], name="cls_conv"),
        helper.make_node("Sigmoid", ["cls_logit"], ["cls_score"], name="cls_sigmoid"),
        helper.make_node("Reshape", ["cls_score", "cls_shape"], ["scores"], name="cls_flat"),
        helper.make_node("Concat", ["boxes", "scores"], ["joined"], name="head_concat", axis=1),
    ]
    out_name, out_shape = "joined", [1, BOXES + CLASSES, H * W]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["joined"], ["output"], name="head_transpose", perm=[0, 2, 1]))
        out_name, out_shape = "output", [1, H * W, BOXES + CLASSES]
    graph = helper.make_graph(nodes, "yolo_head", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, H, W])],
                              [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def images(n: int, seed: int) -> np.ndarray:
    """Dim noise with three bright blocks per image (the 'objects'), [n, 3, H, W] float32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.3, (n, 3, H, W))
    for k in range(n):
        for _ in range(3):
            r, c = rng.integers(0, H - 8), rng.integers(0, W - 8)
            h, w = rng.integers(4, 9, 2)
            x[k, :, r:r + h, c:c + w] += rng.uniform(-2.5, 2.5, (3, 1, 1))
    return x.astype(np.float32)


def main() -> None:
    for transpose, path in PATHS.items():
        onnx.save(build(transpose), path)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
