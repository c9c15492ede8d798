"""The integer executor: run a calibrated model the way an integer accelerator computes it.

`prepare(graph, table)` rewrites a copy of the graph (`ptq.engine.rewrites`: shape and weight subgraphs folded,
BatchNormalization folded into Conv, Relu/Clip/LeakyRelu fused into Conv/Gemm), then quantizes every node in
topological order through its op's `quantize` rule: input qparams are the *final* qparams of the upstream
tensors (what the producing op's rule decided), output proposals come from the quant table, weights use the
table's per-channel weight qparams. `IntegerGraph.run(inputs)` quantizes the graph inputs
(x_q = clamp(round_half_even(x_f / scale) + zp)), runs every node's `forward_int` on integer arrays and
dequantizes the graph outputs (x_f = (x_q - zp) * scale).

Weights changed by BN folding: the table's weight qparams were computed on the unfolded weight, so they no
longer fit. Unless the table has an entry for the folded weight's own name, its qparams are recomputed here:
symmetric (zp 0), scale from `max|W'_c|` per output channel (per tensor if the original weight was calibrated
per tensor), with the bit width and narrow flag of the original weight's table entry (which must exist).

Float fallback: a node whose op is not registered, or that the caller marks float (by node name, output
tensor name or op type), runs as dequantize inputs -> float op (the op's `forward_float`, else onnx.reference)
-> quantize outputs with the table's qparams. A tensor the quant table marks float (`"float": true`) has the
layer computing it run so: its producing node plus the BatchNormalization and Relu/Clip the rewrites would have
folded or fused into it (`ptq.engine.fused_layers`; the layer `ptq debug --fake-quant TENSOR` floats), kept apart from
its neighbours. Such nodes are listed in every run's summary. Nodes that
compute only shapes/indices (non-float outputs) from shapes and index tensors at run time are evaluated in
float and never quantized. A node with only non-float outputs that reads the values of a quantized activation
runs its `forward_int` on the codes when its op declares those outputs (`OpDef.index_outputs`: Equal, Cast to
int64, ArgMax), its index outputs passed on unquantized; otherwise (NonZero, IsNaN, an unregistered op) it is a
float node, listed like any other (`Shape` and `Size` read only the shape: `ops.registry.reads_values`).

Control flow (`ptq.engine.control_flow`): an If's branches and a Loop's body are prepared as integer graphs of their
own (a CONTROL step) from the table entries calibration gives their tensors (`ptq.engine.body_float`); the outer
tensors they read (`Node.implicit_inputs`) reach them as codes. Where that cannot be done (a branch no sample
took, a Scan) the node runs in float with the reason, its subgraphs in onnx.reference.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import onnx

from ops.registry import (
    DotBackend,
    IntRuntime,
    OpDef,
    QuantizationError,
    QuantizeContext,
    QuantizedNode,
    QuantizeOptions,
    check_quantized,
    get_op,
    node_label,
)
from ops.registry import bias_role, reads_values, weight_role
from ptq.core.bodies import Body, has_bodies, node_bodies
from ptq.core.graph import Graph, Node, domain_opsets, load_model
from ptq.core.names import did_you_mean
from ptq.core.qparams import QParams, compute_qparams
from ptq.engine.backends import get_backend
from ptq.engine.compile_notice import first_run_notice
from ptq.engine.control_flow import FloatBranch, IfStep, LoopStep, branch_output
from ptq.engine.float_fallback import NodeFloatEvaluator
from ptq.engine.fused_layers import layer_nodes
from ptq.engine.quantize_memo import QuantizeMemo
from ptq.engine.rewrites import RewriteLog, apply_rewrites
from ptq.engine.weight_scale_floor import floor_folded_weight
from ptq.table.quant_table import QuantTable, load_quant_table


class ExecutorError(ValueError):
    """The model, the quant table or the inputs do not allow an integer run (the message says why)."""


class NodeKind(enum.Enum):
    INTEGER = "integer"  # the op's forward_int
    FLOAT = "float"  # float fallback: dequantize -> float op -> quantize
    SHAPE = "shape"  # computes shapes/indices only (non-float outputs), in float, never quantized
    CONTROL = "control"  # an If or a Loop whose bodies run as integer graphs of their own (`ptq.engine.control_flow`)


@dataclass(frozen=True)
class ExecutorOptions:
    """How `prepare` builds the integer graph: the rewrites it applies, and the options every op's quantize
    rule receives as they are (multiplier width, accumulator width, standalone BatchNormalization weight bits)."""

    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    fold_batchnorm: bool = True
    fuse_activations: bool = True
    strict: bool = False  # every node in integers: a float fallback is an error instead of a notice


@dataclass(frozen=True)
class FloatNode:
    name: str
    op_type: str
    reason: str  # "not registered", "marked float", "float in the quant table (<tensor>)", "cannot quantize: <why>"


@dataclass
class Step:
    """One node of the prepared graph and how it runs."""

    node: Node
    kind: NodeKind
    in_qparams: list[Optional[QParams]]  # how integer inputs dequantize (FLOAT/SHAPE), None for raw inputs
    out_qparams: list[Optional[QParams]]
    op: Optional[OpDef] = None
    quantized: Optional[QuantizedNode] = None  # INTEGER steps only
    reason: str = ""
    control: Optional[Union[IfStep, LoopStep]] = None  # CONTROL steps only


@dataclass
class IntRunResult:
    outputs: dict[str, np.ndarray]  # graph outputs, dequantized to float32 (non-float outputs as computed)
    tensors: dict[str, np.ndarray]  # integer codes (and run-time shape tensors) by tensor name
    qparams: dict[str, QParams]  # final qparams of every quantized tensor (activations and weights)
    overflows: dict[str, int]  # node name -> int32 accumulator values saturated in this run
    float_nodes: list[FloatNode]

    def summary(self) -> str:
        return "\n".join(float_node_lines(self.float_nodes, self.overflows))


def float_node_lines(float_nodes: Sequence[FloatNode], overflows: Mapping[str, int]) -> list[str]:
    """The lines that say which nodes run in float, and why (a branch no calibration sample took runs in float only
    when taken: its reason says so), and which nodes saturated their int32 accumulator, by how many values."""
    lines = []
    if float_nodes:
        lines.append(f"{len(float_nodes)} node(s) run in float (dequantize -> float op -> quantize):")
        lines += [f"  {f.name} ({f.op_type}): {f.reason}" for f in float_nodes]
    else:
        lines.append("every node ran in integers")
    if overflows:
        lines.append(f"{len(overflows)} node(s) saturated their int32 accumulator (values):")
        lines += [f"  {name}: {count}" for name, count in sorted(overflows.items())]
    else:
        lines.append("no int32 accumulator overflow")
    return lines


def _resolve_float_nodes(graph: Graph, specs: Iterable[str]) -> frozenset:
    """Node names selected by `specs` (each a node name, an output tensor name or an op type)."""
    by_output = {out: node.name for node in graph.nodes for out in node.outputs if out}
    names = {node.name for node in graph.nodes}
    selected = set()
    for spec in specs:
        if spec in names:
            selected.add(spec)
        elif spec in by_output:
            selected.add(by_output[spec])
        else:
            # the user selecting nodes by op type (--float-node Conv), not code switching on types
            matches = {node.name for node in graph.nodes if node.op_type == spec}
            if not matches:
                known = [*names, *by_output, *(node.op_type for node in graph.nodes)]
                raise ExecutorError(f"float node {spec!r} is neither a node name, a tensor name nor an op type of the "
                                    f"model{did_you_mean(spec, known)}")
            selected |= matches
    return frozenset(selected)


def _folded_weight_qparams(weight: np.ndarray, original: QParams, axis: int) -> QParams:
    """Symmetric qparams of a BN-folded weight, with the bits, narrow flag and granularity of the original's."""
    if original.axis is None:
        amax = np.abs(weight).max()
        return compute_qparams(-amax, amax, original.bits, symmetric=True, signed=True, narrow=original.narrow)
    amax = np.abs(np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)).max(axis=1)
    return compute_qparams(-amax, amax, original.bits, symmetric=True, signed=True, narrow=original.narrow, axis=axis)


@dataclass
class IntegerGraph:
    """A rewritten, quantized graph, ready to run on integer inputs."""

    graph: Graph  # the rewritten copy
    steps: list[Step]
    qparams: dict[str, QParams]  # final qparams by tensor name (activations and weights)
    rewrites: RewriteLog
    backend: DotBackend
    node_float: NodeFloatEvaluator  # float fallback and shape nodes
    last_use: dict[str, int] = field(default_factory=dict)  # tensor -> index of the last step reading it

    @property
    def float_nodes(self) -> list[FloatNode]:
        """The nodes that run in float, those inside If branches and Loop bodies included (named
        `owner/then_branch/node`, `owner/body/node`)."""
        found = []
        for s in self.steps:
            if s.kind is NodeKind.FLOAT:
                found.append(FloatNode(s.node.name, s.node.op_type, s.reason))
            elif s.kind is NodeKind.CONTROL:
                found += s.control.float_nodes()
        return found

    def run_values(self, values: dict[str, np.ndarray], runtime: IntRuntime) -> dict[str, np.ndarray]:
        """Run every step on `values` (codes of the tensors the steps read from outside: an If branch's outer
        tensors), adding each step's outputs; returns `values`."""
        constants = self.graph.initializers
        for step in self.steps:
            node = step.node
            args = [(values[i] if i in values else constants[i]) if i else None for i in node.all_inputs]
            values.update((name, value) for name, value in zip(node.outputs, self._execute(step, args, runtime))
                          if name)
        return values

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        expected, given = set(self.graph.inputs), set(inputs)
        if expected != given:
            raise ExecutorError(
                f"inputs must be exactly {sorted(expected)}; missing {sorted(expected - given)}, "
                f"unexpected {sorted(given - expected)}"
            )
        for name in self.graph.inputs:
            value, info = inputs[name], self.graph.tensors[name]
            if not isinstance(value, np.ndarray):
                raise ExecutorError(f"input {name!r} must be a numpy array, got {type(value).__name__}")
            if info.dtype is not None and value.dtype != info.dtype:
                raise ExecutorError(f"input {name!r} has dtype {value.dtype}, the model expects {info.dtype}")
            shape = info.shape
            if shape is not None and (
                len(shape) != value.ndim or any(d and d != v for d, v in zip(shape, value.shape))
            ):
                raise ExecutorError(f"input {name!r} has shape {value.shape}, the model expects {shape}")
            if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
                raise ExecutorError(f"input {name!r} contains NaN or Inf")

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        keep_all: bool = True,
        on_tensor: Optional[Callable[[str, np.ndarray], None]] = None,
    ) -> IntRunResult:
        """Run in integers. `keep_all=False` drops each intermediate as soon as its last consumer ran.
        `on_tensor(name, codes)` is called for every quantized graph input and every step output as soon as it
        exists (reports fold each tensor into their metrics while it is in cache, without keeping it)."""
        self.check_inputs(inputs)
        with first_run_notice():  # the kernels compile on their first use after installation
            return self._run(inputs, keep_all, on_tensor)

    def _run(self, inputs: Mapping[str, np.ndarray], keep_all: bool,
             on_tensor: Optional[Callable[[str, np.ndarray], None]]) -> IntRunResult:
        values: dict[str, np.ndarray] = {}
        kept: dict[str, np.ndarray] = {}
        for name in self.graph.inputs:
            qp = self.qparams.get(name)
            values[name] = self._quantize_input(qp, inputs[name]) if qp is not None else inputs[name]
            if on_tensor is not None:
                on_tensor(name, values[name])
        if keep_all:
            kept.update(values)
        runtime = IntRuntime(backend=self.backend)
        constants = self.graph.initializers
        outputs = set(self.graph.outputs)
        for index, step in enumerate(self.steps):
            node = step.node
            args = [(values[i] if i in values else constants[i]) if i else None for i in node.all_inputs]
            results = self._execute(step, args, runtime)
            for name, value in zip(node.outputs, results):
                if name:
                    values[name] = value
                    if keep_all:
                        kept[name] = value
                    if on_tensor is not None:
                        on_tensor(name, value)
            if not keep_all:
                for name in node.all_inputs:
                    if name and self.last_use.get(name) == index and name not in outputs:
                        values.pop(name, None)
        float_out = self._float_outputs(values)
        for name in self.graph.outputs:
            kept.setdefault(name, values[name] if name in values else constants[name])
        return IntRunResult(float_out, kept, dict(self.qparams), dict(runtime.overflows), self.float_nodes)

    def _float_outputs(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph outputs from the run's `values`: dequantized where quantized, constants and raw ones as they are."""
        constants = self.graph.initializers
        float_out = {}
        for name in self.graph.outputs:
            value = values[name] if name in values else constants[name]
            qp = self.qparams.get(name)
            float_out[name] = qp.dequantize(value) if qp is not None and name not in constants else value
        return float_out

    def quantized_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph inputs as the first step reads them (codes of quantized inputs), after `check_inputs`."""
        self.check_inputs(inputs)
        return {name: (self._quantize_input(qp, inputs[name]) if (qp := self.qparams.get(name)) is not None
                       else inputs[name])
                for name in self.graph.inputs}

    def run_from(self, values: dict[str, np.ndarray], start: int,
                 before_step: Optional[Callable[[int, dict[str, np.ndarray]], None]] = None) -> dict[str, np.ndarray]:
        """Run steps `start`.. on `values`, the tensors live before step `start` (`quantized_inputs` for 0),
        dropping each intermediate after its last reader as `run(keep_all=False)` does; `before_step(index,
        values)` is called before each step from `start` on. Returns the graph outputs, dequantized, as
        `run(...).outputs`: the same arrays bit for bit when `values` are what a run holds before `start`."""
        runtime = IntRuntime(backend=self.backend)
        constants = self.graph.initializers
        outputs = set(self.graph.outputs)
        with first_run_notice():
            for index in range(start, len(self.steps)):
                if before_step is not None:
                    before_step(index, values)
                node = self.steps[index].node
                args = [(values[i] if i in values else constants[i]) if i else None for i in node.all_inputs]
                values.update((name, value) for name, value in
                              zip(node.outputs, self._execute(self.steps[index], args, runtime)) if name)
                for name in node.all_inputs:
                    if name and self.last_use.get(name) == index and name not in outputs:
                        values.pop(name, None)
        return self._float_outputs(values)

    def _quantize_input(self, qp: QParams, x: np.ndarray) -> np.ndarray:
        """`qp.quantize(x)`, in one compiled pass when the backend runs the compiled kernels (same codes)."""
        if getattr(self.backend, "compiled", False) is True:
            from ops.compiled.quantize import quantize_per_tensor  # numba: only for the compiled backend

            codes = quantize_per_tensor(qp, x)
            if codes is not None:
                return codes
        return qp.quantize(x)

    def _execute(self, step: Step, args: list, runtime: IntRuntime) -> list[np.ndarray]:
        node = step.node
        if step.kind is NodeKind.CONTROL:
            return step.control.run(node.all_inputs, args, runtime)
        if step.kind is NodeKind.INTEGER:
            for index, (name, value, qp) in enumerate(zip(node.inputs, args, step.in_qparams)):
                if qp is not None and value.dtype.kind not in "iu" and name not in self.graph.initializers:
                    raise ExecutorError(f"{node_label(node)}: input {index} {name!r} must be integer codes, "
                                        f"got {value.dtype}")
            try:
                results = step.op.forward_int(step.quantized, args, runtime)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{node_label(node)}: {exc}") from exc
            for name, value, qp in zip(node.outputs, results, step.out_qparams):
                if name and qp is not None and value.dtype != qp.dtype:
                    raise ExecutorError(
                        f"{node.op_type} {node.name!r}: forward_int returned {value.dtype} for {name!r}, "
                        f"its qparams say {qp.dtype}"
                    )
            return results
        floats = [qp.dequantize(a) if qp is not None and a is not None else a for a, qp in zip(args, step.in_qparams)]
        results = self.node_float.run(node, floats)
        if step.kind is NodeKind.SHAPE:
            return results
        quantized = []
        for name, value, qp in zip(node.outputs, results, step.out_qparams):
            if qp is None:
                quantized.append(value)
                continue
            if np.any(np.isnan(value)):
                raise ExecutorError(f"float fallback {node.op_type} {node.name!r} produced NaN in {name!r}")
            quantized.append(qp.quantize(value))
        return quantized

    def run_step(self, step: Step, args: list, runtime: Optional[IntRuntime] = None) -> list[np.ndarray]:
        """Run one step alone. `args` align with `step.node.all_inputs`: integer codes for quantized tensors,
        raw arrays for constants, None for omitted inputs (reports run a layer on its quantized float inputs)."""
        return self._execute(step, args, runtime if runtime is not None else IntRuntime(backend=self.backend))

class _Quantizer:
    """Walks the rewritten graph once, choosing each node's kind and running its quantize rule."""

    def __init__(self, graph: Graph, table: QuantTable, rewrites: RewriteLog, marked: Mapping[str, str],
                 options: ExecutorOptions, memo: Optional[QuantizeMemo] = None):
        self.graph, self.table, self.marked = graph, table, marked
        self.memo = memo  # quantized nodes of earlier prepares (`ptq.engine.quantize_memo`; None: none)
        self.folded = rewrites.folded_weights
        self.qparams: dict[str, QParams] = {}
        self.options = options
        self.quantize_options = options.quantize
        self.strict = options.strict
        self.node_float: Optional[NodeFloatEvaluator] = None  # set by `prepare`: the bodies' graphs share it

    def _table_qparams(self, name: str) -> Optional[QParams]:
        return self.table.qparams(name)

    def _require(self, name: str, what: str) -> QParams:
        qp = self._table_qparams(name)
        if qp is None:
            raise ExecutorError(f"{what} {name!r} has no qparams in the quant table (was the table calibrated on this model?)")
        return qp

    def _weight_qparams(self, node: Node, index: int, axis: Optional[int]) -> QParams:
        name = node.inputs[index]
        own = self._table_qparams(name)
        if own is not None:
            weight = self.graph.initializers[name]
            if own.axis is not None and (own.axis >= weight.ndim or own.scale.size != weight.shape[own.axis]):
                channels = f"{weight.shape[own.axis]} channels along axis {own.axis}" if own.axis < weight.ndim \
                    else f"no axis {own.axis} (shape {weight.shape})"
                raise ExecutorError(f"quant table: tensor {name!r}: 'scale' has {own.scale.size} values but the "
                                    f"weight has {channels}; give one scale, zero_point, min and max per channel")
            return own
        source = self.folded.get(name, name)
        original = self._table_qparams(source)
        if original is None:
            raise ExecutorError(f"weight {source!r} of {node.op_type} {node.name!r} has no qparams in the quant table")
        weight = self.graph.initializers[name]
        folded = _folded_weight_qparams(weight, original, axis % weight.ndim)
        return floor_folded_weight(node, self.graph, self.table.tensors, folded)

    def _input_qparams(self, node: Node) -> list[Optional[QParams]]:
        wrole, brole = weight_role(node), bias_role(node)
        result: list[Optional[QParams]] = []
        for index, name in enumerate(node.inputs):
            if not name or name in self.graph.shape_tensors:
                result.append(None)
            elif name in self.qparams:
                result.append(self.qparams[name])
            elif name not in self.graph.initializers:
                raise ExecutorError(f"{node.op_type} {node.name!r}: input {name!r} has no qparams")
            elif wrole is not None and index == wrole.input_index:
                qp = self._weight_qparams(node, index, wrole.channel_axis if wrole.channel_axis is not None else 0)
                self.qparams[name] = qp
                result.append(qp)
            elif brole is not None and index == brole.input_index:
                result.append(None)
            else:
                result.append(self._table_qparams(name))
        return result

    def _kind(self, node: Node, op: Optional[OpDef]) -> tuple[NodeKind, str]:
        float_outputs = [o for o in node.outputs if o and o not in self.graph.shape_tensors]
        if not float_outputs and not self._reads_activation(node):
            return NodeKind.SHAPE, ""
        if node.name in self.marked:
            return NodeKind.FLOAT, self.marked[node.name]
        if op is None:
            return NodeKind.FLOAT, "not registered"  # a node with bodies may still run them in integers (`step`)
        if not float_outputs and not op.index_outputs(node):
            return NodeKind.FLOAT, "no integer kernel for its non-float outputs"
        return NodeKind.INTEGER, ""

    def _reads_activation(self, node: Node) -> bool:
        """The node reads the values of a quantized activation: an op with an integer kernel for its index
        outputs (Equal, ArgMax) runs on the codes; any other op (NonZero, IsNaN, CastLike to int) runs in float
        on the dequantized values and is reported as a float node, whatever its output dtype."""
        return reads_values(node) and any(i in self.qparams and i not in self.graph.initializers
                                           for i in node.all_inputs if i)

    def step(self, node: Node) -> Step:
        """How `node` runs: its op's integer forward, or float with the reason (not registered, marked by the
        user, or a quantize rule that cannot handle this node), or as a shape computation."""
        op = get_op(node.op_type, node.domain)
        kind, reason = self._kind(node, op)
        if kind is NodeKind.INTEGER:
            in_qp = self._input_qparams(node)
            try:
                return self._integer_step(node, op, in_qp)
            except QuantizationError as exc:
                if self.strict:
                    raise QuantizationError(f"{node_label(node)}: {exc}") from exc
                kind, reason = NodeKind.FLOAT, f"cannot quantize: {exc}"
        # float and shape nodes take constants as they are; only run-time tensors get dequantized
        in_qp = [self.qparams.get(name) if name not in self.graph.initializers else None for name in node.all_inputs]
        if kind is NodeKind.SHAPE:
            return Step(node, kind, in_qp, [None] * len(node.outputs))
        if kind is NodeKind.FLOAT and op is None and has_bodies(node) and node.name not in self.marked:
            try:
                return self._control_step(node, in_qp)
            except (QuantizationError, ExecutorError) as exc:
                if self.strict:
                    raise ExecutorError(f"{node_label(node)}: {exc}") from exc
                reason = f"control flow: {exc}; its subgraphs run in float (onnx.reference)"
        if self.strict and node.name not in self.marked:
            raise ExecutorError(f"{node_label(node)} would run in float ({reason}); strict mode wants every "
                                "node in integers")
        out_qp = [
            self._require(o, f"output of float node {node.name!r}: tensor") if o and o not in self.graph.shape_tensors else None
            for o in node.outputs
        ]
        self._record(node, out_qp)
        return Step(node, kind, in_qp, out_qp, reason=reason)

    def _integer_step(self, node: Node, op: OpDef, in_qp: list[Optional[QParams]]) -> Step:
        """Run the op's quantize rule; QuantizationError (unprefixed) when the rule cannot handle the node."""
        proposal = [self._table_qparams(o) if o else None for o in node.outputs]
        constants = {i: self.graph.initializers[n] for i, n in enumerate(node.inputs) if n in self.graph.initializers}
        shapes = [[self.graph.tensors[n].shape if n in self.graph.tensors else None for n in names]
                  for names in (node.inputs, node.outputs)]
        ctx = QuantizeContext(node, in_qp, proposal, constants, self.quantize_options, *shapes)
        key = self.memo.context_key(ctx) if self.memo is not None else None
        q = self.memo.get(key) if key is not None else None
        if q is None:
            try:
                q = op.quantize(ctx)
                check_quantized(q)
            except Exception as exc:  # whatever the rule raised: the node falls back to float, or strict fails
                raise QuantizationError(str(exc)) from exc
            if key is not None:
                self.memo.put(key, q)
        self._record(node, q.out_qparams)
        return Step(node, NodeKind.INTEGER, in_qp, list(q.out_qparams), op=op, quantized=q)

    def _control_step(self, node: Node, in_qp: list[Optional[QParams]]) -> Step:
        """An If whose branches, or a Loop whose body, run as integer graphs (`ptq.engine.control_flow`);
        QuantizationError / ExecutorError when it cannot (a Scan, a body tensor without table qparams, ...)."""
        bodies = {b.attribute: b for b in node_bodies(node, domain_opsets(self.graph.model))}
        out_qp = [self._table_qparams(o) if o and o not in self.graph.shape_tensors else None for o in node.outputs]
        if set(bodies) == {"body"} and node.attr("num_scan_inputs") is None:
            return self._loop_step(node, bodies["body"], in_qp, out_qp)
        if set(bodies) != {"then_branch", "else_branch"}:
            raise QuantizationError("only If branches and Loop bodies run in integers")
        untaken = "no calibration sample took that branch"
        taken = [a for a in ("then_branch", "else_branch") if not self._missing_qparams(bodies[a])]
        if not taken:
            missing = self._missing_qparams(bodies["then_branch"])
            raise QuantizationError(f"then_branch tensor {missing[0]!r} has no qparams in the quant table ({untaken})")
        if len(taken) == 1 and self.strict:
            untaken_branch = "else_branch" if taken == ["then_branch"] else "then_branch"
            raise QuantizationError(f"{untaken_branch} would run in float ({untaken})")
        branches, routes = [], []
        for attribute in ("then_branch", "else_branch"):
            body = bodies[attribute]
            if attribute not in taken:
                reason = f"{untaken}: it runs in float when taken"
                branches.append(FloatBranch(node, in_qp, out_qp, self.node_float,
                                            FloatNode(f"{node.name}/{attribute}", node.op_type, reason)))
                routes.append([])
                continue
            branch, child = self._body_graph(body, f"{attribute} tensor", untaken)
            branches.append(branch)
            routes.append([branch_output(self._float_qparams(branch, child, name), target,
                                         self.quantize_options.mbits, name)
                           for name, target in zip(body.outputs, out_qp)])
        self._record(node, out_qp)
        control = IfStep(branches[0], branches[1], routes[0], routes[1])
        return Step(node, NodeKind.CONTROL, in_qp, out_qp, control=control)

    def _loop_step(self, node: Node, body: Body, in_qp: list[Optional[QParams]],
                   out_qp: list[Optional[QParams]]) -> Step:
        loop, child = self._body_graph(body, "body tensor", "the loop never ran during calibration")
        mbits = self.quantize_options.mbits
        carried = len(node.inputs) - 2
        initial = node.inputs[2:]
        carried_in = body.inputs[2:2 + carried]
        carried_out = body.outputs[1:1 + carried]
        grid = [self._float_qparams(loop, child, name) for name in carried_in]
        initial_codes, initial_qp = [], []
        for name, target in zip(initial, grid):
            value = self.graph.initializers.get(name)
            constant = value is not None and target is not None and np.issubdtype(np.asarray(value).dtype, np.floating)
            initial_codes.append(target.quantize(np.asarray(value)) if constant else None)
            initial_qp.append(target if constant else self.qparams.get(name))
        out_grid = [self._float_qparams(loop, child, name) for name in carried_out]
        scan_names = body.outputs[1 + carried:]
        control = LoopStep(
            loop, len(node.inputs), initial_codes,
            [branch_output(s, t, mbits, n) for s, t, n in zip(initial_qp, grid, initial)],
            [branch_output(s, t, mbits, n) for s, t, n in zip(out_grid, grid, carried_out)],
            [branch_output(s, t, mbits, n) for s, t, n in zip(out_grid, out_qp[:carried], carried_out)],
            [branch_output(s, t, mbits, n) for s, t, n in zip(initial_qp, out_qp[:carried], initial)],
            [branch_output(self._float_qparams(loop, child, n), t, mbits, n)
             for n, t in zip(scan_names, out_qp[carried:])])
        self._record(node, out_qp)
        return Step(node, NodeKind.CONTROL, in_qp, out_qp, control=control)

    def _missing_qparams(self, body: Body) -> list[str]:
        """The body's float tensors without qparams in the table (a body no calibration sample ran)."""
        return [t for t in body.float_tensors if self._table_qparams(t) is None]

    def _body_graph(self, body: Body, what: str, why_missing: str) -> tuple[IntegerGraph, "_Quantizer"]:
        """A body quantized by a child quantizer that sees the outer tensors' qparams (its inputs: the table's)."""
        missing = self._missing_qparams(body)
        if missing:
            raise QuantizationError(f"{what} {missing[0]!r} has no qparams in the quant table ({why_missing})")
        sub = self._branch_graph(body)
        child = _Quantizer(sub, self.table, RewriteLog(), self.marked, self.options)
        child.qparams = dict(self.qparams)
        child.qparams.update((name, self._table_qparams(name)) for name in body.inputs if body.is_float(name))
        child.node_float = self.node_float
        steps = [child.step(n) for n in body.nodes]
        self.qparams.update((k, v) for k, v in child.qparams.items() if k not in self.qparams)
        return IntegerGraph(sub, steps, child.qparams, RewriteLog(), None, self.node_float), child

    @staticmethod
    def _float_qparams(body: IntegerGraph, child: "_Quantizer", name: str) -> Optional[QParams]:
        """The final qparams of a body tensor, None for a non-float one (a condition, a counter)."""
        info = body.graph.tensors.get(name)
        return child.qparams.get(name) if info is None or info.is_float else None

    def _branch_graph(self, body: Body) -> Graph:
        """A body as a graph of its own: the outer tensors and constants visible, its own added."""
        tensors = {**self.graph.tensors, **body.tensors}
        return dataclasses.replace(
            self.graph, nodes=list(body.nodes), tensors=tensors,
            initializers={**self.graph.initializers, **body.initializers}, inputs=list(body.inputs),
            outputs=list(body.outputs),
            activations=body.float_tensors, constants=set(self.graph.constants) | set(body.initializers),
            shape_tensors=set(self.graph.shape_tensors) | {n for n, t in body.tensors.items() if not t.is_float})

    def _record(self, node: Node, out_qparams: list[Optional[QParams]]) -> None:
        for name, qp in zip(node.outputs, out_qparams):
            if name and qp is not None:
                self.qparams[name] = qp

    def graph_inputs(self) -> None:
        for name in self.graph.inputs:
            if self.graph.tensors[name].is_float:
                self.qparams[name] = self._require(name, "graph input")


def _rewriter(graph: Graph, node_float: NodeFloatEvaluator, options: ExecutorOptions):
    """`apply_rewrites` on `graph` with `options`, leaving the nodes it is given (`protected`) apart."""

    def rewrite(protected: Iterable[str]) -> tuple[Graph, RewriteLog]:
        return apply_rewrites(graph, node_float, fold_bn=options.fold_batchnorm, fuse=options.fuse_activations,
                              can_host=lambda node: get_op(node.op_type, node.domain) is not None,
                              protected=frozenset(protected))

    return rewrite


def _table_float_layers(table: QuantTable, rewrite, protected: Iterable[str]) -> dict[str, str]:
    """Node name -> the tensor marked float in `table` whose layer it belongs to. Which nodes make up each
    marked layer shows once the rewrites ran without them protected (`protected`: nodes floated otherwise)."""
    table_float = table.float_tensors()
    if not table_float:
        return {}
    probe, probe_log = rewrite(protected)
    layers: dict[str, str] = {}
    for tensor in table_float:
        try:
            nodes = layer_nodes(probe, probe_log, tensor)
        except ValueError as exc:
            raise ExecutorError(f"quant table: tensor {tensor!r} is marked float, but {exc}; remove its "
                                "'float' flag") from exc
        for name in nodes:
            layers.setdefault(name, tensor)
    return layers


def table_float_nodes(graph: Graph, table: QuantTable, options: Optional[ExecutorOptions] = None) -> dict[str, str]:
    """The nodes of `graph` that `prepare(graph, table)` runs in float because the table marks a tensor float
    (the layer computing it), each with that tensor: node name -> tensor name."""
    options = options or ExecutorOptions()
    return _table_float_layers(table, _rewriter(graph, NodeFloatEvaluator(graph.opset), options), ())


def pattern_internal_tensors(graph: Graph, table: QuantTable, options: Optional[ExecutorOptions] = None) -> set[str]:
    """The activations of `graph` inside a transformer pattern that `prepare(graph, table)` fuses into one op
    (`ptq.engine.transformer_patterns`: a GELU's Tanh input, a LayerNorm's variance, masked attention scores): the
    integer graph never quantizes them, so neither does the QDQ export."""
    options = options or ExecutorOptions()
    rewrite = _rewriter(graph, NodeFloatEvaluator(graph.opset), options)
    _, log = rewrite(_table_float_layers(table, rewrite, ()))
    return {tensor for fusion in log.patterns for tensor in fusion.removed_tensors}


def prepare(
    graph: Graph,
    quant_table: QuantTable,
    *,
    float_nodes: Iterable[str] = (),
    backend: Union[str, DotBackend, None] = None,
    options: Optional[ExecutorOptions] = None,
    memo: Optional[QuantizeMemo] = None,
) -> IntegerGraph:
    """Rewrite a copy of `graph` and quantize every node with `quant_table` (see the module docstring).

    `float_nodes`: node names, output tensor names or op types to run in float (fake-quant debugging), besides
    the layers computing the tensors the table marks float.
    `backend`: the dot product under Conv, Gemm and MatMul, a `DotBackend` or a name of `ptq.engine.backends`.
    `memo`: the quantized nodes of earlier prepares, a node whose quantize rule would see the same context taken
    from it (`ptq.engine.quantize_memo`: the same steps, fewer rules run; None: every rule runs).
    """
    options = options or ExecutorOptions()
    backend = get_backend(backend)  # None: the default; a name; or a backend object as it is
    marked = dict.fromkeys(_resolve_float_nodes(graph, float_nodes), "marked float")
    node_float = NodeFloatEvaluator(graph.opset)
    rewrite = _rewriter(graph, node_float, options)
    for name, tensor in _table_float_layers(quant_table, rewrite, marked).items():
        marked.setdefault(name, f"float in the quant table ({tensor!r})")
    rewritten, log = rewrite(marked)
    if memo is not None:
        memo.begin()
    quantizer = _Quantizer(rewritten, quant_table, log, marked, options, memo)
    quantizer.node_float = node_float
    quantizer.graph_inputs()
    steps = [quantizer.step(node) for node in rewritten.nodes]
    for step in steps:
        if step.kind in (NodeKind.FLOAT, NodeKind.SHAPE) and get_op(step.node.op_type, step.node.domain) is None:
            node_float.reference_evaluator(step.node)  # fail now, not in the middle of a run, if nothing can run it
    last_use = {name: index for index, step in enumerate(steps) for name in step.node.all_inputs if name}
    return IntegerGraph(rewritten, steps, quantizer.qparams, log, backend, node_float, last_use)


def _as_graph(model: Union[str, Path, onnx.ModelProto, Graph], inputs: Mapping[str, np.ndarray]) -> Graph:
    if isinstance(model, Graph):
        return model
    graph = load_model(model)
    dynamic = {
        name: tuple(np.shape(inputs[name]))
        for name in graph.inputs
        if name in inputs and any(d is None or d == 0 for d in (graph.tensors[name].shape or ()))
    }
    return load_model(model, input_shapes=dynamic) if dynamic else graph


def run_int(
    model: Union[str, Path, onnx.ModelProto, Graph],
    quant_table: Union[str, Path, QuantTable],
    inputs: Mapping[str, np.ndarray],
    *,
    float_nodes: Iterable[str] = (),
    keep_all: bool = True,
    options: Optional[ExecutorOptions] = None,
    backend: Union[str, DotBackend, None] = None,
) -> IntRunResult:
    """Prepare and run `model` in integers once. `quant_table` is a QuantTable or a `.quant.json` path;
    `backend` as for `prepare`."""
    table = quant_table if isinstance(quant_table, QuantTable) else load_quant_table(quant_table)
    graph = _as_graph(model, inputs)
    prepared = prepare(graph, table, float_nodes=float_nodes, backend=backend, options=options)
    return prepared.run(inputs, keep_all=keep_all)
