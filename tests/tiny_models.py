"""Small ONNX models and image folders built in code for the calibration, graph and QDQ tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image


def make_model(nodes, inputs, outputs, initializers=(), opset=17, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "tiny", inputs, outputs, list(initializers), value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset < 15 else 8 if opset < 21 else 10
    return model


def conv_relu_gemm(batch=None, opset=17, seed=0) -> onnx.ModelProto:
    """input (batch,3,8,8) -> Conv 3x3 (4 ch, pad 1, bias) -> Clip(0,6) -> GlobalAveragePool -> Flatten
    -> Gemm (transB=1, 5 outputs) -> logits."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    b = rng.normal(0, 0.1, 4).astype(np.float32)
    wg = rng.normal(0, 0.5, (5, 4)).astype(np.float32)
    bg = rng.normal(0, 0.1, 5).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (b, "B"), (wg, "WG"), (bg, "BG"))]
    inits += [numpy_helper.from_array(np.float32(0), "lo"), numpy_helper.from_array(np.float32(6), "hi")]
    nodes = [
        helper.make_node("Conv", ["input", "W", "B"], ["conv"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Clip", ["conv", "lo", "hi"], ["act"], name="clip"),
        helper.make_node("GlobalAveragePool", ["act"], ["pool"], name="pool"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "WG", "BG"], ["logits"], transB=1, name="gemm"),
    ]
    dim0 = batch if batch is not None else "N"
    inp = helper.make_tensor_value_info("input", TensorProto.FLOAT, [dim0, 3, 8, 8])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [dim0, 5])
    return make_model(nodes, [inp], [out], inits, opset=opset)


def write_images(folder: Path, count: int, size=(12, 10), seed=0, prefix="img") -> list[Path]:
    """`count` random RGB images (w x h = size) as PNG/JPEG alternately; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        path = folder / f"{prefix}{k:03d}.{'png' if k % 2 == 0 else 'bmp'}"
        Image.fromarray(arr).save(path)
        paths.append(path)
    return paths


def write_tiny_case(folder: Path, count: int) -> tuple[Path, Path, list[Path]]:
    """The dynamic-batch `conv_relu_gemm` model saved as `folder/tiny.onnx` and `count` 8x8 lossless images in
    `folder/images`: (model path, image folder, image paths)."""
    model = folder / "tiny.onnx"
    onnx.save(conv_relu_gemm(batch=None), model)
    images = folder / "images"
    return model, images, write_images(images, count, size=(8, 8))
