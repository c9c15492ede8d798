"""Transformer blocks recognized in their decomposed ONNX form and replaced by one integer op each.

Each pattern below is replaced by one node that produces the pattern's *output tensor* (same name, so the
quant table entry calibrated on the float model applies and reports name the layer by it); the pattern's
internal tensors disappear. A pattern matches only when every internal tensor has exactly one consumer
(the pattern's own) and is no graph output, and none of its nodes is protected.

- GELU, x * 0.5 * (1 + erf(x / sqrt 2)) and its tanh form -> one `Gelu` table op;
- LayerNorm, ReduceMean -> Sub -> Pow(2) -> ReduceMean -> Add eps -> Sqrt -> Div -> Mul -> Add (1/sqrt also as
  Sqrt -> Reciprocal -> Mul or Pow(-0.5) -> Mul, tf2onnx's forms) -> one integer `LayerNormalization`;
- RMSNorm, x * 1/sqrt(mean(x^2) + eps) [* gamma] in the same forms -> one integer `RMSNormalization`;
- attention scores, MatMul -> Mul/Div by a constant -> `ScaledMatMul` (the constant in the requant), and
  Add mask -> Softmax -> `AddSoftmax` (the 2^20 exp table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ptq.core.graph import Graph, Node
from ptq.engine.graph_edit import drop_activation, make_constant, unique_name

PATTERN_RTOL = 1e-3  # how far a decomposition's constants may be from the exact ones (1.4142 for sqrt(2))


@dataclass
class PatternFusion:
    host: str  # the new node's name (that of the pattern's last node)
    op_type: str  # the new node's op type ("Gelu", "LayerNormalization", "ScaledMatMul")
    removed_nodes: list[str]  # every node of the pattern (the host's name included)
    removed_tensors: list[str]  # the pattern's internal tensors (no longer exist)


class _Patterns:
    """Producer/consumer lookups and small matchers over the current graph (rebuilt after each fusion)."""

    def __init__(self, graph: Graph, protected: frozenset):
        self.graph, self.protected = graph, protected
        self.producer, self.consumers = graph.producer(), graph.consumers()

    def scalar(self, name: str) -> Optional[float]:
        """The value of a constant whose elements are all equal, else None."""
        value = self.graph.initializers.get(name)
        if value is None or np.asarray(value).size == 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
            return None
        flat = np.asarray(value, dtype=np.float64).ravel()
        return float(flat[0]) if np.all(flat == flat[0]) else None

    def is_scalar(self, name: str, want: float) -> bool:
        value = self.scalar(name)
        return value is not None and abs(value - want) <= PATTERN_RTOL * abs(want)

    def only_consumer(self, tensor: str) -> Optional[Node]:
        """The single consumer of an internal tensor (None when shared, unused or a graph output)."""
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or tensor in self.graph.outputs:
            return None
        return users[0]

    def produced_by(self, tensor: str, op_type: str) -> Optional[Node]:
        node = self.producer.get(tensor)
        return node if node is not None and node.op_type == op_type and not node.domain else None

    def scalar_operand(self, node: Node, op_type: str, want: float, commutes: bool = True) -> Optional[str]:
        """t when `node` is op_type(t, c) (or op_type(c, t) if it commutes) with a scalar constant c ~= want."""
        if node is None or node.op_type != op_type or node.domain or len(node.inputs) != 2:
            return None
        a, b = node.inputs
        if self.is_scalar(b, want) and a not in self.graph.initializers:
            return a
        if commutes and self.is_scalar(a, want) and b not in self.graph.initializers:
            return b
        return None

    def other_input(self, node: Node, tensor: str) -> Optional[str]:
        if len(node.inputs) != 2 or tensor not in node.inputs:
            return None
        return node.inputs[1] if node.inputs[0] == tensor else node.inputs[0]

    def free(self, nodes: list[Node]) -> bool:
        return not any(n.name in self.protected for n in nodes)


def _replace(graph: Graph, nodes: list[Node], new: Node) -> list[str]:
    """Put `new` where the last of `nodes` stood (keeps topological order), drop `nodes`; returns the
    internal tensors removed (outputs of `nodes` other than the new node's)."""
    last = max(graph.nodes.index(n) for n in nodes)
    graph.nodes[last] = new
    gone = {id(n) for n in nodes if n is not graph.nodes[last]}
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    removed = [o for n in nodes for o in n.outputs if o and o not in new.outputs]
    for tensor in removed:
        drop_activation(graph, tensor)
    return removed


def _fuse_each(graph: Graph, protected: frozenset, match: Callable) -> list[PatternFusion]:
    """Apply `match(patterns, node) -> (nodes, new_node) | None` until nothing matches."""
    fusions = []
    changed = True
    while changed:
        changed = False
        patterns = _Patterns(graph, protected)
        for node in list(graph.nodes):
            found = match(patterns, node)
            if found is None:
                continue
            nodes, new = found
            removed = _replace(graph, nodes, new)
            fusions.append(PatternFusion(new.name, new.op_type, [n.name for n in nodes], removed))
            changed = True
            break
    return fusions


def _gelu_tail(p: _Patterns, a: str, x: str) -> Optional[list[Node]]:
    """The nodes computing 0.5 * x * a by two Mul (any order and grouping), last node last."""
    m1 = p.only_consumer(a)
    if m1 is None or m1.op_type != "Mul" or m1.domain:
        return None
    other = p.other_input(m1, a)
    if other == x:  # (x * a) * 0.5
        m2 = p.only_consumer(m1.outputs[0])
        return [m1, m2] if p.scalar_operand(m2, "Mul", 0.5) == m1.outputs[0] else None
    if other is not None and p.is_scalar(other, 0.5):  # (a * 0.5) * x
        m2 = p.only_consumer(m1.outputs[0])
        return [m1, m2] if m2 is not None and m2.op_type == "Mul" and p.other_input(m2, m1.outputs[0]) == x else None
    half = p.produced_by(other, "Mul") if other is not None else None  # (x * 0.5) * a
    if half is not None and p.scalar_operand(half, "Mul", 0.5) == x and p.only_consumer(other) is m1:
        return [half, m1]
    return None


def _cube_of(p: _Patterns, tensor: str) -> Optional[tuple[str, list[Node]]]:
    """(x, nodes) when `tensor` is Pow(x, 3) or x * (x * x) in either order."""
    pow_node = p.produced_by(tensor, "Pow")
    if pow_node is not None and p.scalar_operand(pow_node, "Pow", 3.0, commutes=False) is not None:
        return pow_node.inputs[0], [pow_node]
    mul = p.produced_by(tensor, "Mul")
    if mul is None or len(mul.inputs) != 2:
        return None
    for sq_name, x in (mul.inputs, mul.inputs[::-1]):
        sq = p.produced_by(sq_name, "Mul")
        if sq is not None and sq.inputs == [x, x] and p.only_consumer(sq_name) is mul:
            return x, [sq, mul]
    return None


POLYNOMIAL_OPS = ("Add", "Sub", "Mul", "Div", "Pow")
POLYNOMIAL_NODES = 8  # the most nodes a written-out GELU argument takes (x*x*x, two scalings, an add: 5)
PROBE = np.linspace(-6.0, 6.0, 49)


def _tanh_gelu_argument(x: np.ndarray) -> np.ndarray:
    return np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)


def _evaluate(p: _Patterns, nodes: list[Node], x: str, values: np.ndarray) -> Optional[np.ndarray]:
    """The tensor the last of `nodes` (in graph order) computes from x = `values`, in float64."""
    env = {x: values}
    for node in nodes:
        args = [env[i] if i in env else p.scalar(i) for i in node.inputs]
        if any(a is None for a in args):
            return None
        a, b = args
        with np.errstate(all="ignore"):
            env[node.outputs[0]] = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide,
                                    "Pow": np.power}[node.op_type](a, b)
    return env.get(nodes[-1].outputs[0]) if nodes else None


def _polynomial_head(p: _Patterns, tensor: str, want: Callable) -> Optional[tuple[str, list[Node]]]:
    """(x, nodes) when `tensor` is computed from one activation x by at most POLYNOMIAL_NODES Add/Sub/Mul/Div/Pow
    nodes with scalar constants, every internal tensor read only inside, and the result equals want(x) on a
    probe of x in [-6, 6] (within PATTERN_RTOL): a written-out formula recognized by its values, whatever the
    grouping an exporter chose."""
    closure, pending = [], [tensor]
    while pending:
        node = p.producer.get(pending.pop())
        if node is None or node.domain or node.op_type not in POLYNOMIAL_OPS or len(node.inputs) != 2 \
                or node in closure or len(closure) >= POLYNOMIAL_NODES:
            continue
        closure.append(node)
        pending.extend(i for i in node.inputs if i not in p.graph.initializers)
    order = {id(n): k for k, n in enumerate(p.graph.nodes)}
    candidates = {i for n in closure for i in n.inputs if i not in p.graph.initializers}
    for x in sorted(candidates, key=lambda t: order.get(id(p.producer.get(t)), -1)):
        nodes, pending = [], [tensor]
        while pending:  # the nodes between x and `tensor`
            name = pending.pop()
            node = p.producer.get(name)
            if name == x or node is None or node in nodes:
                continue
            if node not in closure:
                break
            nodes.append(node)
            pending.extend(i for i in node.inputs if i not in p.graph.initializers)
        else:
            nodes.sort(key=lambda n: order[id(n)])
            inside = {id(n) for n in nodes}
            if not all(all(id(u) in inside for u in p.consumers.get(n.outputs[0], [])) and n.outputs[0] not in
                       p.graph.outputs for n in nodes if n.outputs[0] != tensor):
                continue
            got = _evaluate(p, nodes, x, PROBE)
            expected = want(PROBE)
            if got is not None and np.allclose(got, expected, rtol=PATTERN_RTOL, atol=PATTERN_RTOL):
                return x, nodes
    return None


def _match_gelu(p: _Patterns, node: Node):
    """Erf form: x * 0.5 * (1 + erf(x / sqrt(2))) (Div by sqrt 2 or Mul by 1/sqrt 2); tanh form:
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) (x^3 as Pow(x, 3) or x * x * x)."""
    if node.domain or node.op_type not in ("Erf", "Tanh"):
        return None
    inner = p.producer.get(node.inputs[0])
    if inner is None or p.only_consumer(node.inputs[0]) is not node:
        return None
    if node.op_type == "Erf":
        x = p.scalar_operand(inner, "Div", np.sqrt(2.0), commutes=False) or p.scalar_operand(
            inner, "Mul", np.sqrt(0.5))
        head = [inner]
        approximate = "none"
    else:
        v = p.scalar_operand(inner, "Mul", np.sqrt(2.0 / np.pi))
        add = p.produced_by(v, "Add") if v is not None else None
        x, head = None, []
        if add is not None and len(add.inputs) == 2 and p.only_consumer(v) is inner:
            for w, candidate in (add.inputs, add.inputs[::-1]):
                scale = p.produced_by(w, "Mul")
                cube_name = p.scalar_operand(scale, "Mul", 0.044715) if scale is not None else None
                cube = _cube_of(p, cube_name) if cube_name is not None else None
                if cube is not None and cube[0] == candidate and p.only_consumer(w) is add \
                        and p.only_consumer(cube_name) is scale:
                    x, head = candidate, cube[1] + [scale, add, inner]
                    break
        if x is None:  # another grouping of the same polynomial (HF FastGELU: x * k * (1 + 0.044715 * x * x))
            x, head = _polynomial_head(p, node.inputs[0], _tanh_gelu_argument) or (None, [])
        approximate = "tanh"
    if x is None:
        return None
    one = p.only_consumer(node.outputs[0])
    if p.scalar_operand(one, "Add", 1.0) != node.outputs[0]:
        return None
    tail = _gelu_tail(p, one.outputs[0], x)
    if tail is None:
        return None
    nodes = head + [node, one] + tail
    if not p.free(nodes):
        return None
    last = tail[-1]
    return nodes, Node(last.name, "Gelu", [x], [last.outputs[0]], attrs={"approximate": approximate})


def fuse_gelu(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """Replace each decomposed GELU (erf or tanh form) by one ONNX Gelu node (`ops.gelu`: one table)."""
    return _fuse_each(graph, protected, _match_gelu)


def _reduce_mean_axes(p: _Patterns, node: Node, rank: Optional[int]) -> Optional[tuple[int, ...]]:
    """The trailing axes a keepdims ReduceMean averages over, as negative numbers (-k..-1); None otherwise."""
    if node is None or node.op_type != "ReduceMean" or node.domain or not node.attr("keepdims", 1):
        return None
    if len(node.inputs) > 1 and node.inputs[1]:
        value = p.graph.initializers.get(node.inputs[1])
        axes = None if value is None else [int(a) for a in np.asarray(value).ravel()]
    else:
        axes = node.attr("axes")
        axes = None if axes is None else [int(a) for a in np.atleast_1d(axes)]
    if not axes:
        return None
    if any(a >= 0 for a in axes):
        if rank is None:
            return None
        axes = [a - rank if a >= 0 else a for a in axes]
    axes = sorted(set(axes))
    return tuple(axes) if axes == list(range(-len(axes), 0)) else None


def _layer_norm_param(p: _Patterns, name: str, normalized: Optional[tuple]) -> Optional[np.ndarray]:
    """A Scale/B constant broadcast to the normalized shape; None when it is no constant or does not fit."""
    value = p.graph.initializers.get(name)
    if value is None or normalized is None:
        return None
    value = np.asarray(value)
    while value.ndim > len(normalized) and value.shape[0] == 1:
        value = value[0]
    try:
        return np.ascontiguousarray(np.broadcast_to(value, normalized), dtype=np.float32)
    except ValueError:
        return None


def _constant_input(graph: Graph, base: str, value: np.ndarray) -> str:
    """`base` when it already holds exactly `value`, else a new initializer named after it."""
    if base in graph.initializers and np.array_equal(graph.initializers[base], value) \
            and np.shape(graph.initializers[base]) == value.shape:
        return base
    name = unique_name(graph, f"{base}_ln")
    make_constant(graph, name, value)
    return name


def _square_of(p: _Patterns, node: Optional[Node], d: str) -> bool:
    """Whether `node` is Pow(d, 2) or Mul(d, d)."""
    if node is None or node.domain:
        return False
    if node.op_type == "Mul":
        return node.inputs == [d, d]
    return node.op_type == "Pow" and p.scalar_operand(node, "Pow", 2.0, commutes=False) == d


def _inverse_root(p: _Patterns, var: str, d: str) -> Optional[tuple[float, list[Node], Node]]:
    """(eps, nodes, normalize) for d / sqrt(var + eps) written as Add eps -> Sqrt -> Div(d, .), Add eps -> Sqrt
    -> Reciprocal -> Mul(d, .), or Add eps -> Pow(., -0.5) -> Mul(d, .); `normalize` is the last node."""
    add_eps = p.only_consumer(var)
    if add_eps is None or add_eps.op_type != "Add" or add_eps.domain or p.other_input(add_eps, var) is None:
        return None
    eps = p.scalar(p.other_input(add_eps, var))
    root = p.only_consumer(add_eps.outputs[0])
    if eps is None or eps < 0 or root is None or root.domain:
        return None
    if root.op_type == "Pow" and p.scalar_operand(root, "Pow", -0.5, commutes=False) == add_eps.outputs[0]:
        inverse = [root]
    elif root.op_type == "Sqrt":
        after = p.only_consumer(root.outputs[0])
        if after is not None and after.op_type == "Div" and not after.domain and after.inputs == [d, root.outputs[0]]:
            return eps, [add_eps, root, after], after
        if after is None or after.op_type != "Reciprocal" or after.domain:
            return None
        inverse = [root, after]
    else:
        return None
    mul = p.only_consumer(inverse[-1].outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain or p.other_input(mul, inverse[-1].outputs[0]) != d:
        return None
    return eps, [add_eps] + inverse + [mul], mul


def _affine_tail(p: _Patterns, normalized_tensor: str, normalized: tuple, with_bias: bool):
    """([Mul gamma] [Add beta] nodes, gamma or None, its name, beta or None, its name) after the normalization."""
    nodes, gamma, gamma_name, beta, beta_name = [], None, "", None, ""
    mul = p.only_consumer(normalized_tensor)
    scale = _layer_norm_param(p, p.other_input(mul, normalized_tensor), normalized) \
        if mul is not None and mul.op_type == "Mul" and not mul.domain else None
    if scale is not None:
        gamma, gamma_name = scale, p.other_input(mul, normalized_tensor)
        nodes.append(mul)
        add = p.only_consumer(mul.outputs[0]) if with_bias else None
        bias = _layer_norm_param(p, p.other_input(add, mul.outputs[0]), normalized) \
            if add is not None and add.op_type == "Add" and not add.domain else None
        if bias is not None:
            beta, beta_name = bias, p.other_input(add, mul.outputs[0])
            nodes.append(add)
    return nodes, gamma, gamma_name, beta, beta_name


def _normalized_shape(info, rank: Optional[int], axes: tuple) -> Optional[tuple]:
    normalized = tuple(info.shape[rank + axes[0]:]) if rank is not None else None
    if normalized is None or not all(dim is not None and dim > 0 for dim in normalized):
        return None  # Scale and B need the normalized shape
    return normalized


def _match_layer_norm(p: _Patterns, node: Node):
    """ReduceMean -> Sub -> Pow(2) (or Mul(d, d)) -> ReduceMean -> Add eps -> Sqrt -> Div (or Sqrt ->
    Reciprocal -> Mul, or Pow(-0.5) -> Mul) -> [Mul gamma] -> [Add beta] over trailing axes ->
    LayerNormalization(axis = -k, epsilon)."""
    x = node.inputs[0] if node.inputs else ""
    info = p.graph.tensors.get(x)
    rank = len(info.shape) if info is not None and info.shape is not None else None
    axes = _reduce_mean_axes(p, node, rank)
    sub = p.only_consumer(node.outputs[0]) if axes else None
    if sub is None or sub.op_type != "Sub" or sub.domain or sub.inputs != [x, node.outputs[0]]:
        return None
    d = sub.outputs[0]
    users = list({id(u): u for u in p.consumers.get(d, [])}.values())  # Mul(d, d) reads d twice
    square = next((u for u in users if _square_of(p, u, d)), None)
    if square is None or d in p.graph.outputs or len(users) != 2:
        return None
    mean2 = p.only_consumer(square.outputs[0])
    if mean2 is None or _reduce_mean_axes(p, mean2, rank) != axes:
        return None
    found = _inverse_root(p, mean2.outputs[0], d)
    if found is None or {id(u) for u in users} != {id(square), id(found[2])}:
        return None
    eps, inverse, last = found
    normalized = _normalized_shape(info, rank, axes)
    if normalized is None:
        return None
    tail, gamma, gamma_name, beta, beta_name = _affine_tail(p, last.outputs[0], normalized, with_bias=True)
    nodes = [node, sub, square, mean2] + inverse + tail
    if gamma is None:
        gamma, gamma_name = np.ones(normalized, dtype=np.float32), f"{last.name}_scale"
    if not p.free(nodes):
        return None
    inputs = [x, _constant_input(p.graph, gamma_name, gamma)]
    if beta is not None:
        inputs.append(_constant_input(p.graph, beta_name, beta))
    return nodes, Node(nodes[-1].name, "LayerNormalization", inputs, [nodes[-1].outputs[0]],
                       attrs={"axis": axes[0], "epsilon": float(eps)})


def fuse_layer_norm(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """Replace each decomposed LayerNorm (see `_match_layer_norm`) by one LayerNormalization (opset 17;
    `ops.normalization`: integer statistics, one requant)."""
    return _fuse_each(graph, protected, _match_layer_norm)


def _match_rms_norm(p: _Patterns, node: Node):
    """Pow(x, 2) (or Mul(x, x)) -> ReduceMean over trailing axes -> Add eps -> Sqrt -> Div(x, .) (or Sqrt ->
    Reciprocal -> Mul(x, .), or Pow(-0.5) -> Mul(x, .)) -> [Mul gamma] -> RMSNormalization(axis = -k,
    epsilon) (`ops.normalization`: LayerNormalization's integer kernel without the mean)."""
    if node.domain or node.op_type not in ("Pow", "Mul") or not node.inputs:
        return None
    x = node.inputs[0]
    if not _square_of(p, node, x) or x in p.graph.initializers:
        return None
    info = p.graph.tensors.get(x)
    rank = len(info.shape) if info is not None and info.shape is not None else None
    mean = p.only_consumer(node.outputs[0])
    axes = _reduce_mean_axes(p, mean, rank)
    if not axes:
        return None
    found = _inverse_root(p, mean.outputs[0], x)
    normalized = _normalized_shape(info, rank, axes)
    if found is None or normalized is None:
        return None
    eps, inverse, last = found
    tail, gamma, gamma_name, _, _ = _affine_tail(p, last.outputs[0], normalized, with_bias=False)
    nodes = [node, mean] + inverse + tail
    if gamma is None:
        gamma, gamma_name = np.ones(normalized, dtype=np.float32), f"{last.name}_scale"
    if not p.free(nodes):
        return None
    return nodes, Node(nodes[-1].name, "RMSNormalization", [x, _constant_input(p.graph, gamma_name, gamma)],
                       [nodes[-1].outputs[0]], attrs={"axis": axes[0], "epsilon": float(eps)})


def fuse_rms_norm(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """Replace each decomposed RMSNorm (see `_match_rms_norm`) by one RMSNormalization (ONNX opset 23)."""
    return _fuse_each(graph, protected, _match_rms_norm)


def _match_attention_scale(p: _Patterns, node: Node):
    """MatMul(A, B) of two activations -> Mul/Div by a positive constant -> [Add mask] -> Softmax -> MatMul:
    the MatMul and the scaling become one ScaledMatMul producing the scaled scores."""
    if node.op_type != "Softmax" or node.domain:
        return None
    if not any(u.op_type == "MatMul" and not u.domain for u in p.consumers.get(node.outputs[0], [])):
        return None
    scores = node.inputs[0]
    mask_add = p.produced_by(scores, "Add")
    candidates = list(mask_add.inputs) if mask_add is not None and p.only_consumer(scores) is node else [scores]
    for scaled in candidates:
        scale = p.producer.get(scaled)
        if scale is None or scale.domain or scale.op_type not in ("Mul", "Div") or len(scale.inputs) != 2:
            continue
        if scale.op_type == "Div":
            raw, divisor = scale.inputs[0], p.scalar(scale.inputs[1])
            alpha = 1.0 / divisor if divisor else None
        else:
            raw = next((t for t in scale.inputs if p.scalar(p.other_input(scale, t) or "") is not None), None)
            alpha = p.scalar(p.other_input(scale, raw)) if raw is not None else None
        matmul = p.produced_by(raw, "MatMul") if raw is not None else None
        if alpha is None or alpha <= 0 or matmul is None or p.only_consumer(raw) is not scale:
            continue
        if any(i in p.graph.initializers for i in matmul.inputs) or p.only_consumer(scaled) not in (mask_add, node):
            continue
        if not p.free([matmul, scale]):
            continue
        return [matmul, scale], Node(matmul.name, "ScaledMatMul", list(matmul.inputs), [scaled],
                                     attrs={"alpha": float(alpha)}, domain="ai.ptq")
    return None


def fuse_attention_scale(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """Fold each attention scale (see `_match_attention_scale`) into its MatMul's requant (`ops.scaled_matmul`);
    the Softmax then runs as the existing 2^20-table integer softmax on the scaled scores."""
    return _fuse_each(graph, protected, _match_attention_scale)


def _match_masked_softmax(p: _Patterns, node: Node):
    """Add(scores, mask) -> Softmax -> MatMul: the Add and the Softmax become one AddSoftmax, so the masked
    scores (whose range a -1e4 mask would stretch) are never quantized. The mask is the constant operand, else
    the operand that no MatMul/ScaledMatMul produced."""
    if node.op_type != "Softmax" or node.domain:
        return None
    if not any(u.op_type == "MatMul" and not u.domain for u in p.consumers.get(node.outputs[0], [])):
        return None
    add = p.produced_by(node.inputs[0], "Add")
    if add is None or len(add.inputs) != 2 or p.only_consumer(node.inputs[0]) is not node:
        return None

    def is_scores(name: str) -> bool:
        producer = p.producer.get(name)
        return (name not in p.graph.initializers and producer is not None
                and producer.op_type in ("MatMul", "ScaledMatMul"))

    a, b = add.inputs
    if a in p.graph.initializers or (is_scores(b) and not is_scores(a)):
        scores, mask = b, a
    else:
        scores, mask = a, b
    if not is_scores(scores) or not p.free([add, node]):
        return None
    axis = _single_softmax_axis(p.graph, node)
    if axis is None:
        return None
    return [add, node], Node(node.name, "AddSoftmax", [scores, mask], [node.outputs[0]],
                             attrs={"axis": axis}, domain="ai.ptq")


SOFTMAX_COERCED_BEFORE = 13  # Softmax before opset 13 coerces its input to 2-D at `axis` (default 1)


def _single_softmax_axis(graph: Graph, softmax: Node) -> Optional[int]:
    """The one axis a Softmax reduces over, as AddSoftmax takes it; None when it reduces over several. From
    opset 13 that is `axis` (default -1). Before, the input is coerced to 2-D at `axis` (default 1) and the rows
    span every axis from `axis` on: one axis only when `axis` is the last (known from the input's rank)."""
    if softmax.opset >= SOFTMAX_COERCED_BEFORE:
        return int(softmax.attr("axis", -1))
    info = graph.tensors.get(softmax.inputs[0])
    if info is None or info.shape is None:
        return None
    rank = len(info.shape)
    axis = int(softmax.attr("axis", 1))
    return -1 if rank and axis % rank == rank - 1 else None


def fuse_masked_softmax(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """Fuse each attention mask Add into its Softmax (see `_match_masked_softmax`, `ops.add_softmax`)."""
    return _fuse_each(graph, protected, _match_masked_softmax)


MASK_MAGNITUDE = 1e4  # a constant at or below -1e4 (-1e4, -1e9, finfo(float32).min, -inf) is an additive mask
# the ops an additive mask flows through on its way to the scores: elementwise arithmetic and data movement
MASK_CARRIERS = frozenset({"Add", "Sub", "Mul", "Where", "Min", "Max", "Clip", "Cast", "Identity", "Neg",
                           "Unsqueeze", "Squeeze", "Reshape", "Expand", "Transpose", "Concat", "Tile", "Slice",
                           "Gather", "Flatten"})


def attention_mask_tensors(graph: Graph) -> dict[str, float]:
    """{tensor: threshold} for the float activations an additive attention mask flows into: from each scalar
    constant at or below -MASK_MAGNITUDE (`(1 - mask) * finfo(float32).min`, `Where(mask, -inf, 0)`) forward
    through `MASK_CARRIERS` up to the Softmax (whose probabilities carry no mask). A value at or below the
    threshold (half the mildest mask constant) is a masked position: calibration takes those tensors' ranges
    from the other values (`ptq.engine.float_run.collect_statistics`), so a mask never sets a range."""
    sources = {name: float(np.asarray(value).ravel()[0]) for name, value in graph.initializers.items()
               if np.asarray(value).size == 1 and np.issubdtype(np.asarray(value).dtype, np.floating)
               and float(np.asarray(value).ravel()[0]) <= -MASK_MAGNITUDE}
    if not sources:
        return {}
    threshold = max(sources.values()) / 2
    consumers = graph.consumers()
    activations = set(graph.activations)
    flow: dict[str, float] = {}
    pending = list(sources)
    while pending:
        tensor = pending.pop()
        for node in consumers.get(tensor, []):
            if node.domain or node.op_type not in MASK_CARRIERS:
                continue
            for out in node.outputs:
                if out in activations and out not in flow:
                    flow[out] = threshold
                    pending.append(out)
    return flow


def fuse_transformer(graph: Graph, protected: frozenset = frozenset()) -> list[PatternFusion]:
    """The transformer patterns, in order: GELU, LayerNorm, RMSNorm, attention scale, attention mask."""
    return (fuse_gelu(graph, protected) + fuse_layer_norm(graph, protected) + fuse_rms_norm(graph, protected)
            + fuse_attention_scale(graph, protected) + fuse_masked_softmax(graph, protected))
