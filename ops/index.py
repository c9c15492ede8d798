"""Which module of `ops` registers each op, (domain, op_type) -> module: what lets the registry import an op's
module when the op is first looked up instead of every module up front (`ops.registry.OpRegistry`).

Generated: `python -m ops.index --write` imports every module of `ops/` and rewrites `OP_MODULES` from the ops they
really register; `tests/test_op_index.py` fails while the file is stale. Adding an op is its module (or a class in
one) plus its test; never edit `OP_MODULES` by hand.
"""
from __future__ import annotations

import argparse
from pathlib import Path

OP_MODULES = {
    ("", "Clip"): "ops.activation",
    ("", "LeakyRelu"): "ops.activation",
    ("", "PRelu"): "ops.activation",
    ("", "Relu"): "ops.activation",
    ("ai.ptq", "AddSoftmax"): "ops.add_softmax",
    ("", "BatchNormalization"): "ops.batchnorm",
    ("ai.ptq", "BiasAdd"): "ops.bias_add",
    ("", "Cast"): "ops.cast",
    ("", "Concat"): "ops.concat",
    ("", "Constant"): "ops.constant",
    ("", "Conv"): "ops.conv",
    ("", "ConvTranspose"): "ops.conv",
    ("ai.ptq", "Crop"): "ops.crop",
    ("", "Div"): "ops.div",
    ("", "Add"): "ops.elementwise",
    ("", "Mul"): "ops.elementwise",
    ("", "Sub"): "ops.elementwise",
    ("", "Gather"): "ops.gather",
    ("", "GatherND"): "ops.gather",
    ("ai.ptq", "UpsampleByIndex"): "ops.gather",
    ("", "Gelu"): "ops.gelu",
    ("", "Einsum"): "ops.gemm",
    ("", "Gemm"): "ops.gemm",
    ("", "MatMul"): "ops.gemm",
    ("ai.ptq", "Histogram"): "ops.histogram",
    ("", "Dropout"): "ops.layout",
    ("", "Flatten"): "ops.layout",
    ("", "Identity"): "ops.layout",
    ("", "Reshape"): "ops.layout",
    ("", "Slice"): "ops.layout",
    ("", "Split"): "ops.layout",
    ("", "Squeeze"): "ops.layout",
    ("", "Transpose"): "ops.layout",
    ("", "Unsqueeze"): "ops.layout",
    ("", "And"): "ops.logical",
    ("", "Equal"): "ops.logical",
    ("", "Greater"): "ops.logical",
    ("", "GreaterOrEqual"): "ops.logical",
    ("", "Less"): "ops.logical",
    ("", "LessOrEqual"): "ops.logical",
    ("", "Not"): "ops.logical",
    ("", "Or"): "ops.logical",
    ("", "Where"): "ops.logical",
    ("", "Xor"): "ops.logical",
    ("", "HardSigmoid"): "ops.lut_ops",
    ("", "HardSwish"): "ops.lut_ops",
    ("", "Sigmoid"): "ops.lut_ops",
    ("", "Tanh"): "ops.lut_ops",
    ("", "Max"): "ops.minmax",
    ("", "Min"): "ops.minmax",
    ("", "DepthToSpace"): "ops.movement",
    ("", "Expand"): "ops.movement",
    ("", "ReverseSequence"): "ops.movement",
    ("", "SpaceToDepth"): "ops.movement",
    ("", "Tile"): "ops.movement",
    ("ai.ptq", "BatchToDepth"): "ops.movement",
    ("ai.ptq", "BatchToSpace"): "ops.movement",
    ("ai.ptq", "DataStride"): "ops.movement",
    ("ai.ptq", "Filter"): "ops.movement",
    ("ai.ptq", "Repeat"): "ops.movement",
    ("ai.ptq", "SpaceToBatch"): "ops.movement",
    ("", "NonMaxSuppression"): "ops.nms",
    ("", "InstanceNormalization"): "ops.normalization",
    ("", "LayerNormalization"): "ops.normalization",
    ("", "RMSNormalization"): "ops.normalization",
    ("", "Pad"): "ops.pad",
    ("", "AveragePool"): "ops.pooling",
    ("", "GlobalAveragePool"): "ops.pooling",
    ("", "GlobalMaxPool"): "ops.pooling",
    ("", "MaxPool"): "ops.pooling",
    ("", "Pow"): "ops.pow",
    ("", "ReduceMean"): "ops.reduce",
    ("", "ReduceL2"): "ops.reductions",
    ("", "ReduceMax"): "ops.reductions",
    ("", "ReduceMin"): "ops.reductions",
    ("", "ReduceProd"): "ops.reductions",
    ("", "ReduceSum"): "ops.reductions",
    ("ai.ptq", "Moments"): "ops.reductions",
    ("ai.ptq", "Requantize"): "ops.requantize",
    ("", "Resize"): "ops.resize",
    ("", "MaxRoiPool"): "ops.roi_pool",
    ("ai.ptq", "ScaledMatMul"): "ops.scaled_matmul",
    ("", "ArgMax"): "ops.selection",
    ("", "ArgMin"): "ops.selection",
    ("", "OneHot"): "ops.selection",
    ("", "TopK"): "ops.selection",
    ("ai.ptq", "CTCGreedyDecoder"): "ops.selection",
    ("ai.ptq", "InTopK"): "ops.selection",
    ("", "Hardmax"): "ops.softmax",
    ("", "LogSoftmax"): "ops.softmax",
    ("", "Softmax"): "ops.softmax",
    ("", "Abs"): "ops.unary_exact",
    ("", "Neg"): "ops.unary_exact",
    ("", "Sign"): "ops.unary_exact",
    ("ai.ptq", "CRelu"): "ops.unary_exact",
    ("ai.ptq", "Square"): "ops.unary_exact",
    ("", "Cos"): "ops.unary_lut",
    ("", "Elu"): "ops.unary_lut",
    ("", "Erf"): "ops.unary_lut",
    ("", "Exp"): "ops.unary_lut",
    ("", "Log"): "ops.unary_lut",
    ("", "Selu"): "ops.unary_lut",
    ("", "Sin"): "ops.unary_lut",
    ("", "Softplus"): "ops.unary_lut",
    ("", "Softsign"): "ops.unary_lut",
    ("", "Sqrt"): "ops.unary_lut",
    ("ai.ptq", "BNLL"): "ops.unary_lut",
    ("ai.ptq", "Rsqrt"): "ops.unary_lut",
}


def registered_modules() -> dict[tuple[str, str], str]:
    """(domain, op_type) -> the module that registers it: iterating the registry imports every module of the
    package, whatever this file says."""
    from ops.registry import REGISTRY  # imported here: the registry reads OP_MODULES from this module

    return {key: type(op).__module__ for key, op in REGISTRY.items()}


def render(modules: dict[tuple[str, str], str]) -> str:
    """This file with `OP_MODULES` listing `modules`, sorted by module, then domain, then op type."""
    text = Path(__file__).read_text()
    start = text.index("OP_MODULES = {")
    end = text.index("\n}\n", start) + 3
    rows = sorted(modules.items(), key=lambda item: (item[1], item[0]))
    listing = "OP_MODULES = {\n" + "".join(f'    ("{d}", "{t}"): "{m}",\n' for (d, t), m in rows) + "}\n"
    return text[:start] + listing + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.index", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite ops/index.py (default: say whether it is stale)")
    args = parser.parse_args(argv)
    text = render(registered_modules())
    if text == Path(__file__).read_text():
        print("ops/index.py is up to date")
        return 0
    if args.write:
        Path(__file__).write_text(text)
        print("wrote ops/index.py")
        return 0
    print("ops/index.py is stale: run python -m ops.index --write")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
