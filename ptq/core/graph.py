"""A small graph IR over ONNX: nodes in topological order, tensors with shapes and dtypes, weights as numpy.

`load_model` runs ONNX shape inference, turns `Constant` nodes into initializers, fixes dynamic spatial
dimensions from `input_shapes`, and classifies every tensor:

- constants: initializers, and tensors computed only from initializers (weights; constant-foldable);
- shape tensors: integer/bool tensors (Shape -> Gather -> Concat -> Reshape and the like), never quantized;
- activations: float tensors that depend on a graph input; these are what calibration collects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper, shape_inference, version_converter

from ptq.core.subgraphs import implicit_inputs

MIN_OPSET, MAX_OPSET = 7, 21
CONVERTED_BELOW = 11  # models of opsets 7-10 are converted to opset 11 by onnx's version converter
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))


class ModelError(ValueError):
    """A model ptq cannot load: malformed, unsupported, or missing information (the message says which)."""


@dataclass
class TensorInfo:
    name: str
    dtype: Optional[np.dtype]
    shape: Optional[tuple]  # ints; None for an unknown dimension; shape None when the rank is unknown

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass
class Node:
    name: str
    op_type: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    opset: int = MAX_OPSET  # the opset version of the node's domain (ops whose semantics changed read it)
    implicit_inputs: list[str] = field(default_factory=list)  # outer-scope tensors its subgraphs read (If, Loop)

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    @property
    def all_inputs(self) -> list[str]:
        """Its inputs followed by the outer-scope tensors its subgraphs read: what it needs to run."""
        return self.inputs + self.implicit_inputs if self.implicit_inputs else self.inputs


@dataclass
class Graph:
    model: onnx.ModelProto  # the shape-inferred model, Constant nodes folded into initializers
    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    initializers: dict[str, np.ndarray]
    inputs: list[str]  # graph inputs that are not initializers
    outputs: list[str]
    opset: int
    activations: list[str]  # float tensors that depend on a graph input, in topological order
    constants: set[str]  # initializers and tensors computed only from them (weights, axes, shapes)
    shape_tensors: set[str]  # non-float tensors (indices, shapes); never quantized

    def producer(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.all_inputs:
                if name:
                    users.setdefault(name, []).append(node)
        return users

    def constant_lookup(self, node: Node) -> Callable[[int], Optional[np.ndarray]]:
        """`constant(i)`: the initializer value of input i of `node`, None when it is omitted or not constant."""
        def constant(i: int) -> Optional[np.ndarray]:
            name = node.inputs[i] if i < len(node.inputs) else ""
            return self.initializers.get(name) if name else None
        return constant


def _dtype_of(elem_type: int) -> Optional[np.dtype]:
    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def tensor_info(value_info: onnx.ValueInfoProto) -> TensorInfo:
    ttype = value_info.type.tensor_type
    shape = None
    if ttype.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
    return TensorInfo(value_info.name, _dtype_of(ttype.elem_type), shape)


def _attr_value(attr: onnx.AttributeProto):
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    return value


def domain_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset per domain ("" for ai.onnx)."""
    return {o.domain if o.domain != "ai.onnx" else "": o.version for o in model.opset_import}


def ir_node(proto: onnx.NodeProto, name: str, opsets: dict[str, int]) -> Node:
    """The IR node of an ONNX node (named `name`), its attributes as Python values (subgraphs as GraphProto)."""
    domain = proto.domain if proto.domain != "ai.onnx" else ""
    return Node(name=name, op_type=proto.op_type, inputs=list(proto.input), outputs=list(proto.output),
                attrs={a.name: _attr_value(a) for a in proto.attribute}, domain=domain,
                opset=opsets.get(domain, 1), implicit_inputs=implicit_inputs(proto))


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    attr = node.attribute[0]
    if attr.name == "value":
        return numpy_helper.to_array(attr.t)
    if attr.name in ("value_float", "value_int"):
        return np.array(helper.get_attribute_value(attr), dtype=np.float32 if attr.name == "value_float" else np.int64)
    if attr.name in ("value_floats", "value_ints"):
        return np.array(helper.get_attribute_value(attr), dtype=np.float32 if attr.name == "value_floats" else np.int64)
    raise ModelError(f"Constant node {node.name!r}: unsupported attribute {attr.name!r}")


def _fold_constant_nodes(model: onnx.ModelProto) -> None:
    """Move `Constant` nodes into initializers (in place), so weights are always initializers."""
    kept = []
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            model.graph.initializer.append(numpy_helper.from_array(_constant_value(node), node.output[0]))
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _set_input_shapes(model: onnx.ModelProto, input_shapes: dict[str, tuple]) -> None:
    init_names = {i.name for i in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in init_names}
    for name, shape in input_shapes.items():
        if name not in graph_inputs:
            raise ModelError(f"the input shapes (`ptq calibrate --input-shape`, recorded in the quant table) name "
                             f"{name!r}, but the model's inputs are {sorted(graph_inputs)}")
        dims = graph_inputs[name].type.tensor_type.shape.dim
        if len(dims) and len(dims) != len(shape):
            raise ModelError(f"input {name!r} has rank {len(dims)}; its shape (`ptq calibrate --input-shape`, "
                             f"recorded in the quant table) gives {len(shape)} dims")
        del dims[:]
        for axis, d in enumerate(shape):
            if d is None:  # left dynamic (axis 0 of shapes taken from --data samples)
                dims.add().dim_param = f"{name}_dim{axis}"
            else:
                dims.add().dim_value = int(d)
    # stale inferred shapes would contradict the new input shapes
    del model.graph.value_info[:]


def _toposort(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """The nodes in rounds: each round, in file order, the pending nodes whose inputs the rounds before it
    (or `available`) produced. Linear in the graph: a node waits on a count of its distinct missing inputs."""
    ready = set(available)
    waiting = [{i for i in list(n.input) + implicit_inputs(n) if i and i not in ready} for n in nodes]
    consumers: dict[str, list[int]] = {}
    for k, missing in enumerate(waiting):
        for name in missing:
            consumers.setdefault(name, []).append(k)
    counts = [len(missing) for missing in waiting]
    ordered, current = [], [k for k, c in enumerate(counts) if c == 0]
    while current:
        nxt = []
        for k in current:
            ordered.append(nodes[k])
            for out in nodes[k].output:
                if out in ready:
                    continue
                ready.add(out)
                for c in consumers.get(out, ()):
                    counts[c] -= 1
                    if counts[c] == 0:
                        nxt.append(c)
        current = sorted(nxt)
    if len(ordered) < len(nodes):
        pending = [n for k, n in enumerate(nodes) if counts[k]]
        missing = sorted({i for n in pending for i in n.input if i and i not in ready})
        raise ModelError(f"graph has a cycle or undefined tensors: {missing[:5]}")
    return ordered


def _opset_of(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise ModelError("model has no default-domain opset import")
    opset = versions[0]
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelError(f"model uses opset {opset}; ptq supports opsets {MIN_OPSET} to {MAX_OPSET}")
    return opset


def _upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Opsets 7-10 go to opset 11 through onnx's version converter (exact for the ops it adapts; it may
    rename the tensors around the nodes it rewrites, e.g. Upsample -> Resize)."""
    if opset >= CONVERTED_BELOW:
        return model
    try:
        return version_converter.convert_version(model, CONVERTED_BELOW)
    except Exception as exc:  # the converter raises RuntimeError or its own C++ errors
        raise ModelError(f"model uses opset {opset}; onnx's version converter cannot bring it to opset "
                         f"{CONVERTED_BELOW}: {exc}") from exc


def read_model(source: Union[str, Path, onnx.ModelProto]) -> onnx.ModelProto:
    """Load (a copy of) an ONNX model, with errors that say what is wrong."""
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        return model
    path = Path(source)
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types on garbage input
        raise ModelError(f"{path} is not a readable ONNX model: {_one_line(exc)}") from exc
    _check_external_data(model, path)
    try:
        external_data_helper.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # a truncated or unreadable data file
        raise ModelError(f"{path}: cannot read its external data: {_one_line(exc)}") from exc
    return model


def _one_line(exc: Exception) -> str:
    """An exception's message on one line (onnx's checker and loader messages span several)."""
    return " ".join(str(exc).split())


def _check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """ModelError naming the first tensor whose external data file is missing."""
    for tensor in model.graph.initializer:
        if not external_data_helper.uses_external_data(tensor):
            continue
        location = {e.key: e.value for e in tensor.external_data}.get("location", "")
        if not (path.parent / location).is_file():
            raise ModelError(f"{path}: the external data file {location!r} of tensor {tensor.name!r} is missing "
                             f"(expected beside the model, in {path.parent})")


def load_model(
    source: Union[str, Path, onnx.ModelProto],
    input_shapes: Optional[dict[str, tuple]] = None,
) -> Graph:
    """Load an ONNX model into the IR. `input_shapes` fixes dynamic input dimensions (name -> shape)."""
    model = read_model(source)
    opset = _opset_of(model)
    if not model.graph.node:
        raise ModelError("model graph has no nodes")
    model = _upgrade_opset(model, opset)
    opset = max(opset, CONVERTED_BELOW)
    opsets = domain_opsets(model)
    _fold_constant_nodes(model)
    if input_shapes:
        _set_input_shapes(model, input_shapes)
    try:
        serialized = model.SerializeToString()  # once for both (each would serialize the model itself)
        onnx.checker.check_model(serialized)
        model = shape_inference.infer_shapes(serialized, strict_mode=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ModelError(f"invalid ONNX model: {_one_line(exc)}") from exc

    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    tensors: dict[str, TensorInfo] = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        tensors[vi.name] = tensor_info(vi)
    for name, arr in initializers.items():
        tensors[name] = TensorInfo(name, arr.dtype, tuple(arr.shape))

    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    if not inputs:
        raise ModelError("model has no inputs")
    for name in inputs:
        shape = tensors[name].shape
        if shape is None:
            raise ModelError(f"input {name!r} has unknown rank; give its shape to `ptq calibrate --input-shape "
                             f"{name}:d0,d1,...` (the quant table records it for the other commands)")
        dynamic = [axis for axis, d in enumerate(shape) if d is None or d == 0]
        if [a for a in dynamic if a != 0]:
            raise ModelError(
                f"input {name!r} has dynamic dimensions {dynamic} (shape {shape}); give them to `ptq calibrate "
                f"--input-shape {name}:1,3,224,224` (for example; the quant table records them for the other commands)"
            )

    proto_nodes = _toposort(list(model.graph.node), set(initializers) | set(inputs))
    names = _unique_node_names(proto_nodes)
    for proto, name in zip(proto_nodes, names):
        proto.name = name  # in ptq's copy of the model too: onnxruntime refuses repeated node names
    nodes = [ir_node(n, names[k], opsets) for k, n in enumerate(proto_nodes)]
    for node in nodes:
        for out in node.outputs:
            if out and out not in tensors:
                tensors[out] = TensorInfo(out, None, None)

    dynamic_tensors = set(inputs)
    activations, constants, shape_tensors = [], set(initializers), set()
    for node in nodes:
        depends_on_input = any(i in dynamic_tensors for i in node.all_inputs if i)
        for out in node.outputs:
            if not out:
                continue
            info = tensors[out]
            if info.dtype is None:
                raise ModelError(f"cannot infer the type of tensor {out!r} (output of {node.op_type} {node.name!r})")
            if not info.is_float:
                shape_tensors.add(out)
            elif depends_on_input:
                activations.append(out)
            else:
                constants.add(out)
            if depends_on_input:
                dynamic_tensors.add(out)
    for name in inputs:
        if not tensors[name].is_float:
            shape_tensors.add(name)
    float_inputs = [n for n in inputs if tensors[n].is_float]

    return Graph(
        model=model,
        nodes=nodes,
        tensors=tensors,
        initializers=initializers,
        inputs=inputs,
        outputs=[o.name for o in model.graph.output],
        opset=opset,
        activations=float_inputs + activations,
        constants=constants,
        shape_tensors=shape_tensors,
    )


def _unique_node_names(nodes: list[onnx.NodeProto]) -> list[str]:
    """Node names as the IR uses them (reports, --float-nodes, errors): the model's own, with an empty name
    becoming `OpType_k` (k = topological position) and a repeated one getting `_2`, `_3`, ... appended."""
    names, seen = [], set()
    for k, node in enumerate(nodes):
        base = node.name or f"{node.op_type}_{k}"
        name, copy = base, 1
        while name in seen:
            copy += 1
            name = f"{base}_{copy}"
        seen.add(name)
        names.append(name)
    return names


def parse_input_shapes(specs: Optional[list[str]]) -> dict[str, tuple]:
    """`["input:1,3,224,224", ...]` -> {"input": (1, 3, 224, 224)}."""
    shapes = {}
    for spec in specs or []:
        name, sep, dims = spec.rpartition(":")
        if not sep or not name:
            raise ValueError(f"--input-shape expects NAME:D0,D1,..., got {spec!r}")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError as exc:
            raise ValueError(f"--input-shape {spec!r}: dimensions must be integers") from exc
        if any(d <= 0 for d in shapes[name]):
            raise ValueError(f"--input-shape {spec!r}: dimensions must be positive")
    return shapes
