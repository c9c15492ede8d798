"""Operator registry; importing this package registers every op module."""
from ops.registry import REGISTRY, OpDef, QuantizedNode, QuantizeContext, get_op, register
from ops import conv  # noqa: F401  (registers Conv, ConvTranspose)
from ops import gemm  # noqa: F401  (registers Gemm, MatMul)
from ops import batchnorm  # noqa: F401  (registers BatchNormalization)
from ops import elementwise  # noqa: F401  (registers Add, Sub, Mul)
from ops import activation  # noqa: F401  (registers Relu, Clip, LeakyRelu, PRelu)
from ops import lut_ops  # noqa: F401  (registers Sigmoid, Tanh, HardSwish, HardSigmoid)
from ops import softmax  # noqa: F401  (registers Softmax)
from ops import layout  # noqa: F401  (registers Identity, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Split, Slice)
from ops import concat  # noqa: F401  (registers Concat)
from ops import pad  # noqa: F401  (registers Pad)
from ops import pooling  # noqa: F401  (registers AveragePool, GlobalAveragePool, MaxPool, GlobalMaxPool)
from ops import reduce  # noqa: F401  (registers ReduceMean)
from ops import resize  # noqa: F401  (registers Resize)

__all__ = ["REGISTRY", "OpDef", "QuantizedNode", "QuantizeContext", "get_op", "register"]
