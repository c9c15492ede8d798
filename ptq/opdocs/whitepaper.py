"""The whitepaper's chapter 4 (one quantization rule per operator, sections 4.1-4.79) and which registered ops
implement each section, read from the ops' `section` attributes ("4.43/4.44": both sections; text after a
section number, such as "(MatMul with ...)", is a note; "3.3.2.2 ..." names no chapter 4 section)."""
from __future__ import annotations

import re

from ops.registry import REGISTRY, OpDef

SECTIONS: tuple[tuple[str, str], ...] = tuple((f"4.{i + 1}", name) for i, name in enumerate("""
Abs ArgMax ArgMin AveragePooling2D BatchNormalization BatchToDepth BatchToSpace BiasAdd BNLL Cast Clip Concat
Constant Convolution2D ConvTranspose2D Cosine Crelu Crop CTCGreedyDecoder DataStride DepthToSpace
DepthwiseConvolution Div ElementwiseAdd ElementwiseMax ElementwiseMin ElementwiseMul ElementwiseSub Elu Exp Filter
FullyConnected Gather GatherND GroupConvolution HardSwish Histogram InTopK LeakyRelu Log Logical MatMul
MaxPooling2D MaxPoolingWithArgMax MaxRoiPool Moments Negative NMS OneHot Pad Pow Prelu Reduce Relu Relu6 Repeat
Reshape Resize ReverseSequence Rsqrt Selu Sigmoid Sine Sign Slice Softmax Softplus Softsign SpaceToBatch
SpaceToDepth Split Sqrt Square Tanh Tile TopK Transpose UpsampleByIndex Where""".split()))

_SECTION = re.compile(r"4\.(\d+)(?![\d.])")


def sections_of(op: OpDef) -> list[str]:
    """The chapter 4 sections an op's `section` names: each "/"-separated part that starts with 4.N."""
    found = []
    for part in op.section.split("/"):
        match = _SECTION.match(part.strip())
        if match and 1 <= int(match.group(1)) <= len(SECTIONS):
            found.append(f"4.{match.group(1)}")
    return found


def ops_by_section() -> dict[str, list[OpDef]]:
    """Every section 4.1-4.79 -> the registered ops implementing it (sorted by domain, op type)."""
    table: dict[str, list[OpDef]] = {number: [] for number, _ in SECTIONS}
    for key in sorted(REGISTRY):
        op = REGISTRY[key]
        for number in sections_of(op):
            table[number].append(op)
    return table


def implemented_summary() -> str:
    """"N of 79 whitepaper chapter-4 operators implemented" (and the missing sections, if any)."""
    table = ops_by_section()
    missing = [f"{n} {name}" for n, name in SECTIONS if not table[n]]
    line = f"{len(SECTIONS) - len(missing)} of {len(SECTIONS)} whitepaper chapter-4 operators implemented"
    return line + (f"; missing: {', '.join(missing)}" if missing else "")
