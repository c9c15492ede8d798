"""Graph rewrites applied before quantization, on a copy of the IR (the caller's Graph is never mutated).

1. `fold_static`: shape subgraphs (Shape of a statically shaped tensor, and everything computed only from
   constants and such shapes: Gather, Concat, Cast, Unsqueeze, Slice, ConstantOfShape, ...) and weight-only
   subgraphs (a Transpose or DequantizeLinear on a weight) are evaluated once; their outputs become constants.
1a. `drop_zero_states`: a recurrent cell's initial state (LSTM/GRU/RNN inputs 5 and 6) computed by a
   ConstantOfShape of zeros (torch's export of a state left out, sized from a dynamic batch) is dropped: an
   omitted initial state is zeros (ONNX), so the cell runs with its integer kernel's zero state instead of
   a float ConstantOfShape whose degenerate range no grid can hold. The shape subgraph only it used goes too.
1b. `fuse_transformer` (`ptq.engine.transformer_patterns`): decomposed GELU, LayerNorm and attention-score patterns
   become one integer op each, producing the pattern's output tensor; `RewriteLog.patterns` lists them.
2. `fold_batchnorm`: a BatchNormalization whose input is the output of an op that absorbs it
   (`OpDef.absorbs_batchnorm`: Conv) with no other consumer is folded into that node (seed 003), per output
   channel c:
       k_c = gamma_c / sqrt(var_c + eps),  W'_c = W_c * k_c,  b'_c = (b_c - mean_c) * k_c + beta_c
   The Conv then produces the BatchNormalization's output tensor.
2b. `fold_bias_adds` (`ptq.engine.bias_add_fold`): a per-channel constant added after a Conv/ConvTranspose/Gemm/
   MatMul with a constant weight (`Conv -> Add(c)`, c of shape [C,1,1], [1,C,1,1], ...; [N] after a MatMul)
   becomes the layer's bias (`OpDef.bias_slot`); the layer then produces the Add's output tensor.
3. `fuse_activations`: an absorbable activation (`OpDef.absorbable`: Relu, Clip with constant bounds,
   LeakyRelu) whose input is the output of an op that absorbs activations (`OpDef.absorbs_activation`:
   Conv, Gemm) with no other consumer is fused into that node with onnxruntime's FusedConv attributes
   `activation` and `activation_params` (`OpDef.activation_params`: [min, max] for Clip, [alpha] for
   LeakyRelu); the host then produces the activation's output tensor, so its quantize rule uses that
   tensor's qparams.

Nodes listed in `protected` (by node name) are never folded into or fused with another node: the user wants
to run them on their own (e.g. in float).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from ops.registry import op_of
from ptq.engine.bias_add_fold import BiasAddFold, fold_bias_adds
from ptq.engine.float_fallback import NodeFloatEvaluator, node_proto
from ptq.core.graph import Graph, Node, TensorInfo
from ptq.engine.transformer_patterns import PatternFusion, fuse_transformer
from ptq.engine.graph_edit import drop_activation, make_constant, single_consumer, unique_name

NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


@dataclass
class BatchNormFold:
    conv: str  # node names
    batchnorm: str
    weight: str  # the new (folded) weight and bias initializers
    bias: str
    original_weight: str
    removed_tensor: str  # the Conv's former output (no longer exists; the Conv now outputs the BN's tensor)


@dataclass
class ActivationFusion:
    host: str  # the Conv/Gemm node name
    activation: str  # the removed activation node's name
    op_type: str
    removed_tensor: str  # the host's former output (no longer exists)


@dataclass
class RewriteLog:
    folded_nodes: list[str] = field(default_factory=list)  # nodes evaluated once (shape and weight subgraphs)
    batchnorm_folds: list[BatchNormFold] = field(default_factory=list)
    bias_adds: list[BiasAddFold] = field(default_factory=list)  # constant adds folded into a layer's bias
    fusions: list[ActivationFusion] = field(default_factory=list)
    patterns: list["PatternFusion"] = field(default_factory=list)  # transformer patterns (`fuse_transformer`)
    zero_states: list[str] = field(default_factory=list)  # nodes removed with a zero initial state (`drop_zero_states`)

    @property
    def folded_weights(self) -> dict[str, str]:
        """New weight initializer -> the weight it was derived from by BN folding."""
        return {f.weight: f.original_weight for f in self.batchnorm_folds}


def copy_graph(graph: Graph) -> Graph:
    """A copy of the IR that rewrites may change freely (arrays are shared: rewrites replace, never modify)."""
    nodes = [
        dataclasses.replace(n, inputs=list(n.inputs), outputs=list(n.outputs), attrs=dict(n.attrs)) for n in graph.nodes
    ]
    return dataclasses.replace(
        graph,
        nodes=nodes,
        tensors=dict(graph.tensors),
        initializers=dict(graph.initializers),
        inputs=list(graph.inputs),
        outputs=list(graph.outputs),
        activations=list(graph.activations),
        constants=set(graph.constants),
        shape_tensors=set(graph.shape_tensors),
    )


def _static_shape(graph: Graph, name: str) -> Optional[tuple]:
    info = graph.tensors.get(name)
    if info is None or info.shape is None or any(d is None or d <= 0 for d in info.shape):
        return None
    return tuple(int(d) for d in info.shape)




def _infer_output_shapes(graph: Graph, node: Node) -> None:
    """Fill in the unknown output shapes of `node` by onnx shape inference over the node alone, its constant
    inputs given as initializers (their values, e.g. Pad's pads, decide the shape) and the others by their
    static shapes. Leaves them unknown when an input is not static or inference cannot tell."""
    outputs = [o for o in node.outputs if o]
    if node.domain or not outputs or all(_static_shape(graph, o) is not None for o in outputs):
        return
    if any(isinstance(v, onnx.GraphProto) for v in node.attrs.values()):
        return  # If/Loop/Scan bodies would need their outer scope
    names = list(dict.fromkeys(i for i in node.inputs if i))
    variable = [n for n in names if n not in graph.initializers]
    if any(_static_shape(graph, n) is None or graph.tensors[n].dtype is None for n in variable):
        return  # checked before any initializer is serialized: dynamic-batch models have many such nodes
    typed = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(graph.tensors[n].dtype)),
                                           _static_shape(graph, n)) for n in variable]
    inits = [numpy_helper.from_array(np.asarray(graph.initializers[n]), n) for n in names if n in graph.initializers]
    model = helper.make_model(
        helper.make_graph([node_proto(node)], "node", typed, [], initializer=inits),
        opset_imports=[helper.make_opsetid("", graph.opset)])
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True).graph.value_info
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return
    for vi in inferred:
        dims = vi.type.tensor_type.shape.dim
        if vi.name in outputs and vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            info = graph.tensors.get(vi.name)
            dtype = info.dtype if info is not None and info.dtype is not None else \
                helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            graph.tensors[vi.name] = TensorInfo(vi.name, dtype, tuple(d.dim_value for d in dims))


def fold_static(graph: Graph, node_float: NodeFloatEvaluator) -> list[str]:
    """Evaluate every node whose inputs are constants or static shapes; returns the folded node names.

    Protection does not apply here: a constant subgraph evaluated in float is exactly what it computes.
    `Shape`/`Size` of a tensor with a fully known shape is evaluated on a zero-strided view of that shape (their
    result depends on the shape only), so shape subgraphs reduce to constants.
    A kept node whose output shapes the model's shape inference left unknown (a Pad or Reshape fed by a shape
    subgraph: torch's legacy exporter writes Swin's window padding so) gets them inferred again from its now
    constant inputs (`_infer_output_shapes`), so the shape subgraphs after it fold too.
    """
    folded, kept = [], []
    for node in graph.nodes:
        present = [i for i in node.all_inputs if i]
        foldable = node.op_type not in NONDETERMINISTIC and bool(present)
        values: Optional[list] = None
        if foldable and node.op_type in ("Shape", "Size") and not node.domain:
            shape = _static_shape(graph, node.inputs[0])
            if shape is not None:
                dtype = graph.tensors[node.inputs[0]].dtype or np.float32
                values = node_float.run_reference(node, [np.broadcast_to(np.zeros((), dtype=dtype), shape)])  # no allocation
        elif foldable and all(i in graph.initializers for i in present):
            values = node_float.run(node, [graph.initializers[i] if i else None for i in node.all_inputs])
        if values is None:
            _infer_output_shapes(graph, node)
            kept.append(node)
            continue
        for out, value in zip(node.outputs, values):
            if out:
                make_constant(graph, out, value)
        folded.append(node.name)
    graph.nodes = kept
    return folded






RECURRENT_STATES = {"LSTM": (5, 6), "GRU": (5,), "RNN": (5,)}  # input indices of the initial states


def _is_zero_fill(node: Optional[Node]) -> bool:
    """A ConstantOfShape whose value is 0 (its default)."""
    if node is None or node.op_type != "ConstantOfShape" or node.domain:
        return False
    value = node.attr("value")
    return value is None or not np.any(np.asarray(value))


def drop_zero_states(graph: Graph) -> list[str]:
    """Omit the initial states of recurrent cells that are ConstantOfShape zeros; remove the nodes that then
    feed nothing (the ConstantOfShape and the shape subgraph it alone used). Returns the removed node names."""
    producer = graph.producer()
    dropped = set()
    for node in graph.nodes:
        if node.domain:
            continue
        for index in RECURRENT_STATES.get(node.op_type, ()):
            if index < len(node.inputs) and _is_zero_fill(producer.get(node.inputs[index])):
                dropped.add(producer[node.inputs[index]].name)
                node.inputs[index] = ""
    removed: list[str] = []
    candidates = [n for n in graph.nodes if n.name in dropped]
    while candidates:
        used = {name for n in graph.nodes for name in n.all_inputs if name} | set(graph.outputs)
        dead = [n for n in candidates if not any(o in used for o in n.outputs if o)]
        if not dead:
            break
        gone = {n.name for n in dead}
        graph.nodes = [n for n in graph.nodes if n.name not in gone]
        removed += [n.name for n in dead]
        for n in dead:
            for o in n.outputs:
                drop_activation(graph, o)
        kept = {n.name for n in graph.nodes}
        candidates = [producer[i] for n in dead for i in n.all_inputs if i in producer and producer[i].name in kept]
    return removed


def fold_batchnorm(graph: Graph, protected: frozenset = frozenset()) -> list[BatchNormFold]:
    """Fold each BatchNormalization into the Conv producing its input (see the module docstring)."""
    folds, removed = [], set()
    producer, consumers = graph.producer(), graph.consumers()
    for bn in graph.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain or bn.name in protected:
            continue
        conv = producer.get(bn.inputs[0])
        conv_op = op_of(conv) if conv is not None else None
        if conv_op is None or not conv_op.absorbs_batchnorm or conv.name in protected:
            continue
        if bn.attr("training_mode", 0) or len([o for o in bn.outputs if o]) != 1:
            continue
        params = bn.inputs[1:5]
        conv_consts = [i for i in conv.inputs[1:] if i]
        if not all(p in graph.initializers for p in params + conv_consts):
            continue
        if not single_consumer(graph, consumers, bn.inputs[0]) or "activation" in conv.attrs:
            continue
        gamma, beta, mean, var = (graph.initializers[p].astype(np.float64) for p in params)
        weight = graph.initializers[conv.inputs[1]]
        bias = (
            graph.initializers[conv.inputs[2]].astype(np.float64)
            if len(conv.inputs) > 2 and conv.inputs[2]
            else np.zeros(weight.shape[0])
        )
        k = gamma / np.sqrt(var + float(bn.attr("epsilon", 1e-5)))
        new_w = weight.astype(np.float64) * k.reshape((-1,) + (1,) * (weight.ndim - 1))
        new_b = (bias - mean) * k + beta
        w_name = unique_name(graph, f"{conv.inputs[1]}_bnfold")
        b_name = unique_name(graph, f"{w_name}_bias")
        make_constant(graph, w_name, new_w.astype(weight.dtype))
        make_constant(graph, b_name, new_b.astype(weight.dtype))
        old_out, original_weight = conv.outputs[0], conv.inputs[1]
        conv.inputs = [conv.inputs[0], w_name, b_name]
        conv.outputs[0] = bn.outputs[0]
        drop_activation(graph, old_out)
        removed.add(bn.name)
        folds.append(BatchNormFold(conv.name, bn.name, w_name, b_name, original_weight, old_out))
    graph.nodes = [n for n in graph.nodes if n.name not in removed]
    return folds




def fuse_activations(
    graph: Graph, can_host: Callable[[Node], bool] = lambda node: True, protected: frozenset = frozenset()
) -> list[ActivationFusion]:
    """Fuse absorbable activations into the producing host (see the module docstring).

    `can_host(node)` lets the caller refuse a host (the executor refuses hosts that will not run as integer
    ops, since onnx's own Conv/Gemm know nothing of fused activations).
    """
    fusions, removed = [], set()
    producer, consumers = graph.producer(), graph.consumers()
    for act in graph.nodes:
        act_op = op_of(act)
        if act_op is None or not act_op.absorbable or act.name in protected:
            continue
        host = producer.get(act.inputs[0])
        host_op = op_of(host) if host is not None else None
        if host_op is None or not host_op.absorbs_activation or host.name in protected:
            continue
        if "activation" in host.attrs or not single_consumer(graph, consumers, act.inputs[0]) or not can_host(host):
            continue
        params = act_op.activation_params(act, graph.constant_lookup(act))
        if params is None:
            continue
        host.attrs["activation"] = act.op_type
        if params:
            host.attrs["activation_params"] = params
        old_out = host.outputs[0]
        host.outputs[0] = act.outputs[0]
        drop_activation(graph, old_out)
        removed.add(act.name)
        fusions.append(ActivationFusion(host.name, act.name, act.op_type, old_out))
    graph.nodes = [n for n in graph.nodes if n.name not in removed]
    return fusions


def apply_rewrites(
    graph: Graph,
    node_float: NodeFloatEvaluator,
    *,
    fold_bn: bool = True,
    fuse: bool = True,
    can_host: Callable[[Node], bool] = lambda node: True,
    protected: frozenset = frozenset(),
) -> tuple[Graph, RewriteLog]:
    """All rewrites, in order, on a copy of `graph`: (static folding, zero initial states, transformer patterns,
    BN folding, bias-add folding, activation fusion)."""
    graph = copy_graph(graph)
    log = RewriteLog()
    log.folded_nodes = fold_static(graph, node_float)
    log.zero_states = drop_zero_states(graph)
    log.patterns = fuse_transformer(graph, protected)
    if fold_bn:
        log.batchnorm_folds = fold_batchnorm(graph, protected)
    log.bias_adds = fold_bias_adds(graph, protected)
    if fuse:
        log.fusions = fuse_activations(graph, can_host, protected)
    return graph, log
