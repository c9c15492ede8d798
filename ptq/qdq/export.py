"""Export a QDQ ONNX model from a graph and its quantization table (onnxruntime runs it).

- Every activation `t` in the table: the producer now writes `t_prequant`, then
  `QuantizeLinear -> DequantizeLinear` (per axis for a per-channel entry: a join of widely different ranges,
  `ptq.calibration.joined_ranges`) writes `t` again, so downstream nodes and graph outputs keep their
  names and see the fake-quantized value `DQ(Q(t))`. A graph input gets its chain at the start and its
  consumers are rewired to `t_dq`.
- Weights are stored quantized (`w_quantized`, integer initializer) + `DequantizeLinear` (with `axis` when
  per-channel) writing `w`.
- Conv/ConvTranspose/Gemm biases are stored as int32 with `scale = s_in * s_w[c]` (float32 product, as
  onnxruntime computes it), zero point 0: `b_q = clamp(round_half_even(b / scale), int32)`. A per-channel
  constant added after such a layer is folded into its bias first, as the integer executor does
  (`ptq.engine.bias_add_fold`): the exported layer has the int32 bias and writes the Add's tensor, the Add is gone.

Fused patterns: the internal tensors of a transformer pattern the integer graph runs as one op (a written-out
GELU's Tanh input, a LayerNorm's variance, the masked scores of an AddSoftmax: `ptq.engine.executor.
pattern_internal_tensors`) get no Q/DQ pair: onnxruntime computes the pattern in float between the Q/DQ of its
input and of its output, as the integer op does in integers (a mask added to the scores keeps its meaning).

BatchNormalization: the ones the integer run folds into their Convs are folded in the exported model too,
each folded weight quantized on the qparams the integer run gives it (`ptq.qdq.batchnorm`).

Float layers: a tensor the table marks float (`"float": true`) has the layer computing it run in float by the
integer executor: the nodes `ptq.engine.executor.table_float_nodes` names (its producer plus the BatchNormalization
and Relu/Clip the rewrites would fuse into it), each dequantizing its inputs, computing in float with the
float weights and bias, and quantizing each output with the table's qparams. The QDQ model does the same:
those nodes keep their float weights and biases (no DequantizeLinear; a weight they share with an integer
node is read from a float copy, `<w>_float`), their inputs are the dequantized codes of their producers' Q/DQ
pairs, and each output the table has an entry for gets its Q/DQ pair like any activation. One detail keeps
that so under onnxruntime's default optimizations: its WeightBiasQuantization pass (onnxruntime >= 1.20)
quantizes the float weight (int8, per tensor) and bias of a Conv/ConvTranspose/Gemm that reads a per-tensor
DequantizeLinear and feeds a QuantizeLinear, which would put the float layer back on an integer grid the table
does not have. So such a float node reads each quantized input through a DequantizeLinear of its own whose
scale and zero point are the tensor's, repeated along a channel axis (`<t>_float_dq`): the same values, and
onnxruntime leaves the node in float (a tensor with no static axis above 1 after the batch keeps its DQ).

Containers: bits <= 8 use int8/uint8, up to 16 int16/uint16. 16-bit Q/DQ needs opset 21 in the default
domain; before that the `com.microsoft` Q/DQ (onnxruntime contrib ops) is used. Per-channel
`DequantizeLinear` needs opset 13, so older models are converted to opset 13 first.

Codes narrower than their container (e.g. 4 bits in int8, or the restricted range [-127, 127]) would
otherwise saturate at the container's limits: a `Clip` to the real range `[(qmin - zp) * s, (qmax - zp) * s]`
before `QuantizeLinear` makes `round(x / s) + zp` land in [qmin, qmax]. Stored weights are already in range.

Targets (`QDQ_TARGETS`): the runtime the model is meant for picks how 8-bit signed codes are stored, never
their values. With optimizations on, onnxruntime's CPU provider fuses each QDQ group into an integer kernel
(QLinearConv, QGemm, QLinearMatMul, QLinearAdd) when its activations are uint8 (on x86 it turns an int8
activation into uint8 itself only where the tensor has a single consumer). Its uint8 x int8 GEMM on x86 CPUs
without VNNI multiplies with `vpmaddubsw`, which adds two u8*s8 products in a saturating int16
(255*127*2 = 64770 > 32767), so the fused model computes something else than the QDQ graph describes
(EfficientNet-Lite0: logits cosine 0.936 instead of 0.993). Its uint8 x uint8 GEMM widens both operands to
int16 and adds pairs in int32 (`vpmaddwd`), which is exact. `ort-cpu` therefore stores every 8-bit signed
weight and activation as uint8, code and zero point moved up by 128: `(q + 128) - (zp + 128) = q - zp`, the
same real values and the same table, and every Conv/Gemm/MatMul is fused into a kernel that computes exactly
the integer products ptq's integer run computes. See docs/qdq_targets.md.
"""
from __future__ import annotations

from typing import Container, Optional, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from ptq.engine.bias_add_fold import fold_bias_adds
from ptq.core.bodies import body_activations, body_weights
from ptq.core.graph import Graph, ModelError
from ptq.engine.rewrites import copy_graph
from ptq.engine.executor import pattern_internal_tensors, table_float_nodes
from ptq.qdq.batchnorm import folded_for_export
from ptq.core.qparams import QParams
from ptq.table.quant_table import QuantTable
from ops.registry import bias_role, bias_slot, weight_role
from ptq.core.bias import bias_scale, quantize_bias
from ptq.qdq.targets import DEFAULT_TARGET, QDQTarget, get_target

MS_DOMAIN = "com.microsoft"
UNSIGNED_SHIFT = 128  # int8 code q is stored as uint8 q + 128, its zero point zp as zp + 128


def _container_range(qp: QParams) -> tuple[int, int]:
    info = np.iinfo(qp.dtype)
    return int(info.min), int(info.max)


def stored_qparams(qp: QParams, unsigned: bool) -> QParams:
    """The QParams a tensor is stored with: the table's, or with `unsigned` an 8-bit signed tensor moved into
    uint8 (zero point + 128; its codes move with it, so `(q - zp) * s` keeps every value)."""
    if not unsigned or qp.dtype != np.int8:
        return qp
    return QParams(qp.scale, qp.zero_point + UNSIGNED_SHIFT, bits=8, signed=False, axis=qp.axis)


def stored_codes(qp: QParams, stored: QParams, x: np.ndarray) -> np.ndarray:
    """The codes of `x` on the table's grid `qp`, in the storage of `stored` (from `stored_qparams`)."""
    codes = qp.quantize(x)
    if stored.dtype == qp.dtype:
        return codes
    return (codes.astype(np.int16) + UNSIGNED_SHIFT).astype(stored.dtype)


class _Builder:
    """Accumulates the new initializers and nodes; hands out unique names."""

    def __init__(self, model: onnx.ModelProto, opset: int):
        self.model = model
        self.opset = opset
        self.used = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
        for node in model.graph.node:
            self.used.update(node.input)
            self.used.update(node.output)
        self.initializers: list[onnx.TensorProto] = []
        self.uses_ms_domain = False
        self.chains: dict[str, tuple[str, QParams]] = {}  # output of a Q/DQ chain -> (its codes, their storage)
        self.reread: set[str] = set()  # chain outputs float layers read through their own DQ instead
        self.chain_dequantize: dict[str, onnx.NodeProto] = {}  # output of a Q/DQ chain -> the chain's DQ node

    def name(self, base: str) -> str:
        candidate, k = base, 1
        while candidate in self.used:
            candidate, k = f"{base}_{k}", k + 1
        self.used.add(candidate)
        return candidate

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.name(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def domain(self, qp_dtype: np.dtype) -> str:
        if qp_dtype.itemsize == 2 and self.opset < 21:
            self.uses_ms_domain = True
            return MS_DOMAIN
        return ""

    def scale_zp(self, base: str, qp: QParams) -> tuple[str, str]:
        shape = () if qp.axis is None else (qp.scale.size,)
        scale = self.constant(f"{base}_scale", qp.scale.astype(np.float32).reshape(shape))
        zp = self.constant(f"{base}_zero_point", qp.zero_point.astype(qp.dtype).reshape(shape))
        return scale, zp

    def dequantize(self, quantized: str, scale: str, zp: str, out: str, qp_dtype, axis: Optional[int]) -> onnx.NodeProto:
        kwargs = {} if axis is None else {"axis": int(axis)}
        return helper.make_node("DequantizeLinear", [quantized, scale, zp], [out], name=self.name(f"{out}_DequantizeLinear"),
                                domain=self.domain(qp_dtype), **kwargs)

    def qdq_chain(self, source: str, out: str, qp: QParams, stored: QParams) -> list[onnx.NodeProto]:
        """[Clip ->] QuantizeLinear -> DequantizeLinear from `source` to `out` (an activation on the grid `qp`,
        per tensor or per axis, stored as `stored`: the same codes up to a shift, so the Clip is decided on `qp`;
        a per-axis grid fills its container, so it needs no Clip)."""
        nodes = []
        scale, zp = self.scale_zp(out, stored)
        x = source
        if (qp.qmin, qp.qmax) != _container_range(qp):
            lo, hi = qp.real_range()
            lo_name = self.constant(f"{out}_clip_min", np.float32(lo[0]))
            hi_name = self.constant(f"{out}_clip_max", np.float32(hi[0]))
            x = self.name(f"{out}_clipped")
            nodes.append(helper.make_node("Clip", [source, lo_name, hi_name], [x], name=self.name(f"{out}_Clip")))
        quantized = self.name(f"{out}_quantized")
        axis = {} if stored.axis is None else {"axis": int(stored.axis)}
        nodes.append(helper.make_node("QuantizeLinear", [x, scale, zp], [quantized],
                                      name=self.name(f"{out}_QuantizeLinear"), domain=self.domain(stored.dtype), **axis))
        self.chain_dequantize[out] = self.dequantize(quantized, scale, zp, out, stored.dtype, stored.axis)
        nodes.append(self.chain_dequantize[out])
        self.chains[out] = (quantized, stored)
        return nodes

    def own_dequantize(self, tensor: str, shape: Optional[tuple]) -> tuple[str, list[onnx.NodeProto]]:
        """`tensor` (the output of a Q/DQ chain) read again from its codes by a DequantizeLinear of its own
        whose scale and zero point repeat along a channel axis (the first axis after the batch with a static
        size above 1): the same values, but not a per-tensor DQ (see the module docstring). With no such
        axis, `tensor` as it is."""
        quantized, stored = self.chains[tensor]
        axis = next((a for a, d in enumerate(shape or ()) if a > 0 and d is not None and d > 1), None)
        if axis is None:
            return tensor, []
        size = shape[axis]
        self.reread.add(tensor)
        scale = self.constant(f"{tensor}_float_scale", np.full(size, stored.scale[0], np.float32))
        zp = self.constant(f"{tensor}_float_zero_point", np.full(size, stored.zero_point[0], stored.dtype))
        out = self.name(f"{tensor}_float_dq")
        return out, [self.dequantize(quantized, scale, zp, out, stored.dtype, axis)]


def _prepare_model(graph: Graph, table: QuantTable, per_axis: bool) -> onnx.ModelProto:
    """A copy of the model, converted to opset 13 when a DequantizeLinear will have an axis (per-channel
    weights, or `per_axis`: the own DQs of float layers)."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    per_channel = any(e.qparams.axis is not None for e in table.tensors.values())
    if (per_channel or per_axis) and graph.opset < 13:
        try:
            model = version_converter.convert_version(model, 13)
        except Exception as exc:  # the converter raises bare RuntimeErrors from C++
            raise ModelError(f"per-channel QDQ needs opset 13; converting this opset {graph.opset} model failed "
                             f"({exc}); use per-tensor weights") from exc
    return model


def _opset(model: onnx.ModelProto) -> int:
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _quantize_weights(graph: Graph, table: QuantTable, b: _Builder, initializers: dict,
                      target: QDQTarget, float_nodes: Container[str]) -> tuple[list, set]:
    """DequantizeLinear nodes for the weights and biases of every node but `float_nodes`; returns (nodes,
    names of replaced float initializers)."""
    nodes, replaced = [], set()
    consumers = graph.consumers()
    for node in graph.nodes:
        if node.name in float_nodes:
            continue
        role = weight_role(node)
        if role is None or len(node.inputs) <= role.input_index:
            continue
        w = node.inputs[role.input_index]
        entry = table.tensors.get(w)
        if w not in initializers or entry is None or entry.kind != "weight":
            continue
        if initializers[w].dtype != np.float32:
            raise ModelError(f"QDQ export supports float32 weights; {w!r} is {initializers[w].dtype}")
        qp = entry.qparams
        if qp.axis is not None and (qp.axis >= initializers[w].ndim or initializers[w].shape[qp.axis] != qp.scale.size):
            raise ModelError(f"weight {w!r} of shape {initializers[w].shape} does not match its table entry "
                             f"({qp.scale.size} scales on axis {qp.axis}); was the table calibrated on this model?")
        if w not in replaced:
            stored = stored_qparams(qp, target.unsigned_weights)
            quantized = b.constant(f"{w}_quantized", stored_codes(qp, stored, initializers[w]))
            scale, zp = b.scale_zp(w, stored)
            nodes.append(b.dequantize(quantized, scale, zp, w, stored.dtype, stored.axis))
            replaced.add(w)
        nodes.extend(_quantize_bias(node, entry.qparams, table, b, initializers, consumers, replaced))
    return nodes, replaced


def _quantize_bias(node, weight_qp: QParams, table: QuantTable, b: _Builder, initializers, consumers, replaced) -> list:
    role = bias_role(node)
    if role is None:
        return []
    bias_name, input_qp = node.inputs[role.input_index], table.qparams(node.inputs[role.data_index])
    if bias_name not in initializers or bias_name in replaced or input_qp is None or len(consumers[bias_name]) != 1:
        return []  # shared or computed biases stay float
    bias = initializers[bias_name]
    scale = bias_scale(input_qp.scale, weight_qp.scale).astype(np.float32)
    if bias.ndim != 1 or scale.size not in (1, bias.size):
        return []
    axis = None if scale.size == 1 else 0
    quantized = b.constant(f"{bias_name}_quantized", quantize_bias(bias, scale).astype(np.int32))
    scale_name = b.constant(f"{bias_name}_scale", scale.reshape(() if axis is None else (scale.size,)))
    zp_name = b.constant(f"{bias_name}_zero_point", np.zeros(() if axis is None else (scale.size,), np.int32))
    replaced.add(bias_name)
    return [b.dequantize(quantized, scale_name, zp_name, bias_name, np.dtype(np.int32), axis)]


def _named(names: list[str], limit: int = 3) -> str:
    return ", ".join(map(repr, names[:limit])) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_table_matches(graph: Graph, table: QuantTable) -> None:
    """A one-line ModelError unless `table` describes `graph`: every tensor it names is one of the model's,
    of the same kind (activation or weight), and every activation of the model has an entry."""
    inner = set(body_activations(graph))  # the float tensors of If / Loop bodies
    activations = set(graph.activations) | inner
    unknown = [n for n in table.tensors if n not in graph.tensors and n not in inner
               and not (table.tensors[n].kind == "weight" and n in body_weights(graph))]
    wrong = [n for n, e in table.tensors.items() if n in graph.tensors
             and (n not in activations if e.kind == "activation" else n not in graph.constants)]
    missing = [n for n in graph.activations if n not in table.tensors]
    hint = "was it calibrated on this model?"
    if unknown:
        raise ModelError(f"the quant table does not match the model: {len(unknown)} of its tensors are not in the "
                         f"model ({_named(unknown)}); {hint}")
    if wrong:
        raise ModelError(f"the quant table does not match the model: the kind (activation or weight) it gives "
                         f"{_named(wrong)} is not the model's; {hint}")
    if missing:
        raise ModelError(f"the quant table does not match the model: {len(missing)} activations of the model have "
                         f"no entry ({_named(missing)}); {hint}")


def _without_unread_dequantize(nodes: list[onnx.NodeProto], b: _Builder, outputs: set[str]) -> list:
    """The nodes but the chain DequantizeLinear of a tensor in `b.reread` that nothing reads any more (only
    float layers read it, through their own DQ)."""
    read = {name for node in nodes for name in node.input} | outputs
    unread = {id(b.chain_dequantize[tensor]) for tensor in b.reread - read}
    return [n for n in nodes if id(n) not in unread]


def _with_bias_adds_folded(graph: Graph, protected: Container[str]) -> Graph:
    """A copy of `graph` (IR and model) with the constant adds after its layers folded into their biases, as
    the integer executor's rewrites fold them (`ptq.engine.bias_add_fold`); nodes in `protected` take no part. A
    layer whose ONNX op has no bias input (MatMul) keeps an Add of its int32 bias right after it, with no
    Q/DQ pair between: the sum the integer graph computes in its accumulator."""
    folded = copy_graph(graph)
    folds = fold_bias_adds(folded, frozenset(protected))
    if not folds:
        return graph
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    nodes = {node.name: node for node in folded.nodes}
    by_host = {fold.host: fold for fold in folds}
    by_adder = {fold.adder: fold for fold in folds if bias_slot(nodes[fold.host]).in_onnx}
    unfused = {fold.adder: fold for fold in folds if not bias_slot(nodes[fold.host]).in_onnx}
    kept = []
    for proto in model.graph.node:
        if proto.name in by_adder:
            continue
        if proto.name in unfused:  # host(x) + bias: the adder now adds the folded int32 bias
            fold = unfused[proto.name]
            proto.op_type = "Add"
            del proto.input[:]
            proto.input.extend([fold.removed_tensor, fold.bias])
        elif proto.name in by_host and proto.name not in {f.host for f in unfused.values()}:
            del proto.input[:]
            proto.input.extend(nodes[proto.name].inputs)
            del proto.output[:]
            proto.output.extend(nodes[proto.name].outputs)
        kept.append(proto)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(folded.initializers[f.bias], f.bias) for f in folds)
    removed = {f.removed_tensor for f in folds}
    info = [v for v in model.graph.value_info if v.name not in removed]
    del model.graph.value_info[:]
    model.graph.value_info.extend(info)
    folded.model = model
    return folded


def export_qdq(graph: Graph, table: QuantTable, target: Union[str, QDQTarget] = DEFAULT_TARGET) -> onnx.ModelProto:
    """The QDQ model of `graph` with the QParams of `table`, its codes stored for `target` (a name of
    `QDQ_TARGETS`; see the module docstring)."""
    target = get_target(target)
    graph, table = folded_for_export(graph, table)
    float_nodes = table_float_nodes(graph, table)
    graph = _with_bias_adds_folded(graph, float_nodes)
    nodes_by_name = {node.name: node for node in graph.nodes}
    float_weighted = {name for name in float_nodes  # (a node a rewrite created has no weights of the model)
                      if name in nodes_by_name and weight_role(nodes_by_name[name]) is not None}
    model = _prepare_model(graph, table, per_axis=bool(float_weighted))
    b = _Builder(model, _opset(model))
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight_nodes, replaced = _quantize_weights(graph, table, b, initializers, target, float_nodes)
    float_copies: dict[str, str] = {}

    fused = pattern_internal_tensors(graph, table)
    activations = {
        name: table.tensors[name].qparams
        for name in graph.activations
        if name in table.tensors and table.tensors[name].kind == "activation" and name not in fused
    }
    for name, qp in activations.items():
        if graph.tensors[name].dtype != np.float32:
            raise ModelError(f"QDQ export supports float32 activations; {name!r} is {graph.tensors[name].dtype}")
        if qp.axis is not None and (qp.qmin, qp.qmax) != _container_range(qp):
            raise ModelError(f"activation {name!r} has per-channel QParams narrower than their container; QDQ "
                             "export quantizes such activations per tensor only")
    stored = {name: stored_qparams(qp, target.unsigned_activations) for name, qp in activations.items()}

    head, input_rename = list(weight_nodes), {}
    for name in graph.inputs:
        if name in activations:
            input_rename[name] = b.name(f"{name}_dq")
            head.extend(b.qdq_chain(name, input_rename[name], activations[name], stored[name]))

    body = []
    for node in model.graph.node:
        for k, inp in enumerate(node.input):
            if inp in input_rename:
                node.input[k] = input_rename[inp]
            elif inp in replaced and node.name in float_nodes:  # shared with an integer node: a float copy
                if inp not in float_copies:
                    float_copies[inp] = b.constant(f"{inp}_float", initializers[inp])
                node.input[k] = float_copies[inp]
            if node.name in float_weighted and node.input[k] in b.chains:
                node.input[k], own = b.own_dequantize(node.input[k], graph.tensors[inp].shape)
                body.extend(own)
        chains = []
        for k, out in enumerate(node.output):
            if out in activations:
                node.output[k] = b.name(f"{out}_prequant")
                chains.extend(b.qdq_chain(node.output[k], out, activations[out], stored[out]))
        body.append(node)
        body.extend(chains)
    for out in model.graph.output:
        if out.name in input_rename:
            raise ModelError(f"graph input {out.name!r} is also a graph output; cannot quantize it in place")

    kept = [t for t in model.graph.initializer if t.name not in replaced]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + b.initializers)
    graph_inputs = [i for i in model.graph.input if i.name not in replaced]
    del model.graph.input[:]
    model.graph.input.extend(graph_inputs)
    del model.graph.node[:]
    model.graph.node.extend(_without_unread_dequantize(head + body, b, {o.name for o in model.graph.output}))
    if b.uses_ms_domain and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"internal error: the exported QDQ model is invalid: {exc}") from exc
    return model
