"""The operator registry: per op type a float forward, a quantize rule and an integer forward.

An op is a subclass of `OpDef` registered with `@register`. The executor calls, per node:

    q = op.quantize(QuantizeContext(...))        # once: output qparams, integer constants, (M, N), tables
    outs = op.forward_int(q, int_inputs, runtime) # per run: integer arrays in, integer arrays out

`quantize` returns a `QuantizedNode` (or an op-specific subclass holding that op's integer constants as typed
fields). `check_quantized` then verifies that every output has complete qparams.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Protocol, Union

import numpy as np

from ops.conformance_case import Case
from ptq.core.graph import Node
from ptq.core.qparams import QParams
from ptq.core.requant import DEFAULT_MBITS
from ops.index import OP_MODULES
from ptq.core.roles import BiasRole, BiasSlot, LayerKind, WeightRole


# `constant(i)`: the value of input i of a node when it is a constant, else None (see OpDef.clip_range)
ConstantLookup = Callable[[int], Optional[np.ndarray]]
# the bounds `OpDef.clamp_bounds` gives: floats, or arrays of per-channel bounds
Bound = Union[float, np.ndarray]


class DotBackend(Protocol):
    """The integer dot product under Conv, Gemm and MatMul: (..., M, K) @ (..., K, N) -> int64 (..., M, N),
    batch dimensions broadcast as in numpy.matmul (grouped conv and activation @ activation use them).
    The result must be a new array: the ops requantize it in place."""

    name: str

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray: ...


@dataclass
class IntRuntime:
    """What an integer forward may use besides its inputs: the dot-product backend and an overflow log."""

    backend: DotBackend
    overflows: dict[str, int] = field(default_factory=dict)  # node name -> saturated accumulator count

    def record_overflow(self, node: Node, count: int) -> None:
        if count:
            self.overflows[node.name] = self.overflows.get(node.name, 0) + count


@dataclass(frozen=True)
class QuantizeOptions:
    mbits: int = DEFAULT_MBITS  # multiplier width of (M, N) pairs
    accumulator_bits: int = 32
    bn_weight_bits: int = 16  # standalone BatchNormalization weights (whitepaper 4.5 advises 16)
    reciprocal_div: bool = False  # Div by a run-time divisor through a reciprocal table (4.23's LUT variant)


@dataclass
class QuantizeContext:
    node: Node
    in_qparams: list[Optional[QParams]]  # per input; None for index/shape inputs, omitted inputs and biases
    out_qparams: list[Optional[QParams]]  # the calibrated proposal from the quant table, per output
    constants: dict[int, np.ndarray]  # float (or index) values of the constant inputs, by input position
    options: QuantizeOptions = field(default_factory=QuantizeOptions)
    # static shapes of the inputs, as far as shape inference knows them (None: unknown rank or missing; an
    # unknown dimension is None): limits a rule can check at prepare (a softmax row's length)
    in_shapes: list[Optional[tuple]] = field(default_factory=list)
    out_shapes: list[Optional[tuple]] = field(default_factory=list)

    def in_shape(self, index: int) -> Optional[tuple]:
        return self.in_shapes[index] if index < len(self.in_shapes) else None

    def out_shape(self, index: int) -> Optional[tuple]:
        return self.out_shapes[index] if index < len(self.out_shapes) else None


@dataclass
class QuantizedNode:
    """The result of a quantize rule. Ops that need integer constants subclass it with typed fields."""

    node: Node
    in_qparams: list[Optional[QParams]]
    out_qparams: list[Optional[QParams]]


class OpDef:
    """One operator: its float forward, its quantize rule, its integer forward, and the facts the rest of
    the code asks about it (so that nothing outside `ops/` switches on op types).

    Facts, as class attributes or methods a subclass overrides:
    - `section`, `int_types`, `granularity`: the whitepaper chapter 4 rule, for `ptq ops` and the docs;
    - `weight_role(node)` / `bias_role(node)`: which constant inputs are weights (per-channel along an axis)
      and int32 biases; calibration, the executor and the QDQ export all read them here;
    - `absorbs_activation`: the op's output stage can take a following activation's clamp (Conv, Gemm);
    - `absorbable`: the op can be absorbed that way, with `activation_params(node, constant)` giving the
      FusedConv parameters ([min, max] for Clip, [alpha] for LeakyRelu);
    - `absorbs_batchnorm`: a following BatchNormalization folds into the op's weight and bias (Conv);
    - `clip_range(node, constant)`: an interval [lo, hi] with op(x) == op(clamp(x, lo, hi)) for every x: the
      interval the op clamps its input to (Relu, Clip), or outside which its output is flat (HardSwish below
      -3, HardSigmoid outside its linear part); calibration folds its input's range to it;
    - `clamp_bounds(node, constant)`: the same clamp of input 0 with bounds that may be per channel (arrays in
      the shape of the constant giving them): `clip_range`, and a Min with a constant (the per-channel bound of
      an equalized Clip); analytic bias correction carries a channel's mean through it;
    - `positively_homogeneous`: f(x / s) = f(x) / s for every s > 0 (Relu, LeakyRelu, PRelu), so cross-layer
      equalization scales a channel through the op unchanged (a Clip(0, b) needs its bound scaled too:
      `ptq.adjust.equalize` rewrites it);
    - `preserves_channel_mean`: each channel's mean over the data is the same at the output as at input 0
      (GlobalAveragePool, Flatten, Identity), so analytic bias correction looks through the op;
    - `layer_kind`: a convolution, a fully connected layer or a batch normalization (`LayerKind`): the weight
      layout and output formula the weight adjustments' per-layer algebra is written for; None otherwise;
    - `channel_groups(node)`: the groups a grouped convolution splits its channels into (1: dense; as many as
      channels: depthwise);
    - `keeps_input_qparams`: the output takes input 0's qparams by rule (data movement, max pooling);
    - `rearranges`: the output holds input 0's elements, each exactly once, only moved (Identity, Reshape,
      Flatten, Squeeze, Unsqueeze, Transpose): reports follow an output's parts back through it;
    - `selects_boxes`: the op is a non-max suppression over boxes [B, A, 4] (input 0) and scores [B, C, A]
      (input 1), ONNX's form: `ptq report --task detect` compares the detections it selects;
    - `gives_scores`: the output is a probability, or its log, from logits (Softmax and LogSoftmax over a row,
      Sigmoid per element): at a graph output an argmax or a threshold reads it, so calibration keeps it, its
      logits and the tail feeding only them at 16 bits (`ptq.calibration.output_scores`);
    - `ranks_input`: the output is decided by which of input 0's values lead and by how much (Softmax,
      LogSoftmax, Hardmax, ArgMax, ArgMin, TopK): clipping the leaders ties them, so the default calibrator
      never clips such an input (`ptq.calibration.ranked_inputs`, `calibrators.methods.auto`);
    - `sums_inputs`: the output is an elementwise sum of the inputs (Add, Sub), so inputs and output on one
      scale make the op a plain integer add (the int4-dsp scheme's ShareQuantize, `ptq.calibration.int4_dsp`);
      `sum_signs` the sign each input takes in it ((1, 1) for Add, (1, -1) for Sub);
    - `joins_along(node)`: the axis along which the op joins its inputs into its output (Concat), None for
      other ops; calibration gives a join of widely different ranges one grid per part (`ptq.calibration.joined_ranges`),
      reports judge each input's part of a graph output on its own (`reports.output_breakdown`);
    - `wide_input`: the op carries its input 0's error through a recurrence (LSTM, GRU): calibration gives
      that input 16 bits (`ptq.calibration.recurrent_inputs`);
    - `summed_input_axis(node)`: the axis of input 0 (an activation) that the op sums over against its constant
      weight (MatMul: the last; Gemm: by transA), None for other ops: calibration gives such an input whose
      channels along it have widely different ranges (outlier features) 16 bits
      (`ptq.calibration.outlier_channels`);
    - `moved_axis(node, axis, in_shape, out_shape)`: for an op that only moves codes (`keeps_input_qparams`),
      the output axis that holds input 0's `axis` whole, so a per-channel grid follows it (Transpose, Reshape);
      None when the channels do not stay whole along one axis;
    - `bias_slot(node)`: where the op can take a constant per-output-channel bias (Conv, ConvTranspose; Gemm
      with beta = 1; MatMul, in ptq's integer graph only): a constant added after it folds into that bias
      (`ptq.engine.bias_add_fold`);
    - `is_noop(node)`: the output holds exactly the input's codes (Identity, inference Dropout, a Cast between
      float types): reports name the layer the node feeds instead of giving it a row of its own;
    - `index_outputs(node)`: the outputs that are indices or booleans (int64/bool as in ONNX: Equal, Cast to
      an integer type, ArgMax): they have no qparams (`None` in `out_qparams`), and the executor runs the
      op's `forward_int` on quantized inputs and passes those outputs on as they are;
    - `lsb_bound`: the largest error, in output LSBs, that the conformance harness (`ptq.opdocs.conformance`: one-node
      graph, 8-bit codes, calibrated on random data) allows between the integer output and the float op run on
      the dequantized inputs, as the op's docstring states it; 0 = exact (index and bool outputs always are);
      None = not stated;
    - `conformance`: the op's conformance case (`ops.conformance_case.Case`: a one-node model, its constants and
      seeded data), declared by the op's own class (not inherited: Einsum is a MatMul subclass with a case of its
      own); the harness runs it for every registered op and fails for an op without one.
    """

    op_type: ClassVar[str]
    domain: ClassVar[str] = ""
    section: ClassVar[str] = ""  # the whitepaper chapter 4 section of the quantization rule
    int_types: ClassVar[str] = "int8/uint8/int16"
    granularity: ClassVar[str] = "per-tensor"
    absorbs_activation: ClassVar[bool] = False
    absorbable: ClassVar[bool] = False
    absorbs_batchnorm: ClassVar[bool] = False
    keeps_input_qparams: ClassVar[bool] = False
    wide_input: ClassVar[bool] = False
    rearranges: ClassVar[bool] = False
    selects_boxes: ClassVar[bool] = False
    gives_scores: ClassVar[bool] = False
    ranks_input: ClassVar[bool] = False
    sums_inputs: ClassVar[bool] = False
    sum_signs: ClassVar[Optional[tuple[int, ...]]] = None
    positively_homogeneous: ClassVar[bool] = False
    preserves_channel_mean: ClassVar[bool] = False
    layer_kind: ClassVar[Optional[LayerKind]] = None
    lsb_bound: ClassVar[Optional[float]] = None
    conformance: ClassVar[Optional[Case]] = None

    def weight_role(self, node: Node) -> Optional[WeightRole]:
        return None

    def bias_role(self, node: Node) -> Optional[BiasRole]:
        return None

    def bias_slot(self, node: Node) -> Optional[BiasSlot]:
        return None

    def joins_along(self, node: Node) -> Optional[int]:
        return None

    def moved_axis(self, node: Node, axis: int, in_shape: Optional[tuple], out_shape: Optional[tuple]) -> Optional[int]:
        return None

    def summed_input_axis(self, node: Node) -> Optional[int]:
        return None

    def index_outputs(self, node: Node) -> frozenset[int]:
        return frozenset()

    def is_noop(self, node: Node) -> bool:
        return False

    def clip_range(self, node: Node, constant: ConstantLookup) -> Optional[tuple[float, float]]:
        return None

    def clamp_bounds(self, node: Node, constant: ConstantLookup) -> Optional[tuple[Bound, Bound]]:
        return self.clip_range(node, constant)

    def channel_groups(self, node: Node) -> int:
        return 1

    def activation_params(self, node: Node, constant: ConstantLookup) -> Optional[list[float]]:
        """The FusedConv `activation_params` of an absorbable op; None when they are not constant."""
        return None

    def forward_float(self, node: Node, inputs: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def quantize(self, ctx: QuantizeContext) -> QuantizedNode:
        raise NotImplementedError

    def forward_int(self, q: QuantizedNode, inputs: list[np.ndarray], runtime: IntRuntime) -> list[np.ndarray]:
        raise NotImplementedError


class OpRegistry(Mapping):
    """The registered ops by (domain, op_type). Looking an op up imports the module that defines it
    (`ops.index.OP_MODULES`); iterating imports every module of the package first. A model's run thus imports
    the modules of its own ops, not the forty of the package (their import is most of `import ops`)."""

    def __init__(self) -> None:
        self._ops: dict[tuple[str, str], OpDef] = {}
        self._complete = False

    def add(self, op: OpDef) -> None:
        key = (op.domain, op.op_type)
        if key in self._ops:
            raise ValueError(f"op {op.domain or 'ai.onnx'}::{op.op_type} registered twice")
        self._ops[key] = op

    def __getitem__(self, key: tuple[str, str]) -> OpDef:
        op = self._ops.get(key)
        if op is None and key in OP_MODULES:
            importlib.import_module(OP_MODULES[key])
            op = self._ops.get(key)
        if op is None:
            raise KeyError(key)
        return op

    def __iter__(self) -> Iterator[tuple[str, str]]:
        self._import_all()
        return iter(dict(self._ops))

    def __len__(self) -> int:
        self._import_all()
        return len(self._ops)

    def _import_all(self) -> None:
        """Every module of the `ops` package (subpackages, kernel collections, are imported by their users)."""
        if not self._complete:
            package = importlib.import_module("ops")
            for module in pkgutil.iter_modules(package.__path__):
                if not module.ispkg:
                    importlib.import_module(f"ops.{module.name}")
            self._complete = True


REGISTRY = OpRegistry()


def register(cls: type[OpDef]) -> type[OpDef]:
    REGISTRY.add(cls())
    return cls


def get_op(op_type: str, domain: str = "") -> Optional[OpDef]:
    return REGISTRY.get((domain, op_type))


def absorbable_ops() -> list[str]:
    """The op types a Conv/Gemm output stage may absorb (`OpDef.absorbable`)."""
    return sorted(op.op_type for op in REGISTRY.values() if op.absorbable)


def is_absorbable(op_type: str) -> bool:
    """`op_type` is one of `absorbable_ops()` (importing only the modules of the ops of that type)."""
    return any(REGISTRY[key].absorbable for key in OP_MODULES if key[1] == op_type)


def conformance_case(op: OpDef) -> Optional[Case]:
    """The conformance case the op's own class declares (an inherited one belongs to another op), bound to the op's
    type and domain; None when it declares none."""
    case = vars(type(op)).get("conformance")
    return None if case is None else case.for_op(op.op_type, op.domain)


def op_of(node: Node) -> Optional[OpDef]:
    """The registered op of a node, None when its type is not registered."""
    return REGISTRY.get((node.domain, node.op_type))


def weight_role(node: Node) -> Optional[WeightRole]:
    """The weight input of a node (with its output-channel axis), as its op declares it."""
    op = op_of(node)
    return op.weight_role(node) if op is not None else None


def bias_role(node: Node) -> Optional[BiasRole]:
    """The int32 bias input of a node, as its op declares it."""
    op = op_of(node)
    return op.bias_role(node) if op is not None else None


def summed_input_axis(node: Node) -> Optional[int]:
    """The axis of input 0 the node sums over against its constant weight (`OpDef.summed_input_axis`)."""
    op = op_of(node)
    return op.summed_input_axis(node) if op is not None else None


def bias_slot(node: Node) -> Optional[BiasSlot]:
    """Where a node can take a constant per-output-channel bias, as its op declares it."""
    op = op_of(node)
    return op.bias_slot(node) if op is not None else None


def layer_kind(node: Node) -> Optional[LayerKind]:
    """What the node is to the weight adjustments (`OpDef.layer_kind`), None for an unregistered op."""
    op = op_of(node)
    return op.layer_kind if op is not None else None


def channel_groups(node: Node) -> int:
    """The channel groups of a grouped convolution (`OpDef.channel_groups`), 1 for any other node."""
    op = op_of(node)
    return op.channel_groups(node) if op is not None else 1


SHAPE_READERS = frozenset({"Shape", "Size"})  # ONNX ops whose output depends on their input's shape only


def reads_values(node: Node) -> bool:
    """Whether a node's outputs depend on the values of its inputs, not only on their shapes (Shape, Size):
    a node that reads a quantized activation's values and has no integer kernel runs in float, reported."""
    return node.domain != "" or node.op_type not in SHAPE_READERS


def node_label(node: Node) -> str:
    """How every error names a node: `OpType 'name'` (the executor prefixes op errors with it, once)."""
    return f"{node.op_type} {node.name!r}"


class QuantizationError(ValueError):
    """A quantize rule left an output without complete qparams, or got inputs it cannot handle."""


def check_quantized(q: QuantizedNode) -> None:
    """Every output has complete qparams, except the op's index outputs, which have none."""
    op = op_of(q.node)
    index = op.index_outputs(q.node) if op is not None else frozenset()
    for i, (name, qp) in enumerate(zip(q.node.outputs, q.out_qparams)):
        if name and i in index:
            if qp is not None:
                raise QuantizationError(f"output {name!r} is an index output and must have no qparams")
        elif name and not isinstance(qp, QParams):
            raise QuantizationError(f"output {name!r} has no qparams after quantize")
