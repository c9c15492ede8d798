"""Quantized nodes kept across `prepare` calls whose graphs and tables differ in a few entries (`ptq tune`'s
candidates), so that a node whose quantize rule sees what it saw before is not quantized again.

A node's quantize rule (`OpDef.quantize`) is a function of its `QuantizeContext` alone: the node (its op, attributes
and tensor names), its input qparams (the final qparams of the tensors it reads and its weight's), the table's
proposals for its outputs, the values of its constant inputs, the quantize options and the static shapes.
`QuantizeMemo` keeps the `QuantizedNode` each rule returned under a digest of all of that (`context_key`), and
`prepare(..., memo=...)` hands a node whose context has the same digest the node kept instead of running the rule
again: the same object, so what the compiled kernels derive from it at its first run and cache per quantized node
(`ops.compiled`: packed weights, offsets, plans) is reused too, and `ptq.tuning.prefix_cache` digests it once. The
quantized node is never written after its rule returned it, so sharing it between integer graphs shares nothing
that changes. A rule that raised is not kept (it runs again, and raises again).

Equal digests mean equal pickles of the contexts (numpy arrays, dataclasses and builtins pickle by value), so a
kept node is what the rule would return again; equal contents pickled with different sharing of sub-objects may
digest differently, which only loses a reuse. A context with something that does not pickle is not kept. A
constant's digest is computed once per array object (the candidates share the user's weights, graph after graph).

What it holds: the nodes used by the last `KEPT_PREPARES` prepares (older ones are dropped when a prepare begins).
"""
from __future__ import annotations

import hashlib
import pickle
import weakref
from dataclasses import dataclass, field
from typing import Optional

from ops.registry import QuantizeContext, QuantizedNode

KEPT_PREPARES = 8  # measured on the bundled model's tune: 1238 of 1769 nodes reused with 4, 1288 with 8, 1303 with all


def digest(obj) -> Optional[bytes]:
    """A digest of `obj`'s pickle; None when `obj` does not pickle."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return hashlib.blake2b(data, digest_size=20).digest()


@dataclass
class ObjectDigests:
    """`digest` of objects that do not change (constant arrays, quantized nodes), each computed once while the
    object lives: the entry is dropped with it, so an id is never read for another object."""

    by_id: dict = field(default_factory=dict)  # id(obj) -> digest

    def __reduce__(self):
        return ObjectDigests, ()  # ids name nothing in another process: a copy starts empty

    def __call__(self, obj) -> Optional[bytes]:
        key = id(obj)
        if key not in self.by_id:
            self.by_id[key] = digest(obj)
            weakref.finalize(obj, self.by_id.pop, key, None)
        return self.by_id[key]


@dataclass
class QuantizeMemo:
    """The quantized nodes of the last `kept` prepares, by the digest of their quantize context."""

    kept: int = KEPT_PREPARES
    nodes: dict = field(default_factory=dict)  # context key -> [quantized node, the prepare that last used it]
    constants: ObjectDigests = field(default_factory=ObjectDigests)
    prepares: int = 0
    hits: int = 0  # nodes handed out again (for the tests and the bench)

    def begin(self) -> None:
        """A prepare begins: drop the nodes none of the last `kept` prepares used."""
        self.prepares += 1
        oldest = self.prepares - self.kept
        self.nodes = {key: entry for key, entry in self.nodes.items() if entry[1] >= oldest}

    def context_key(self, ctx: QuantizeContext) -> Optional[bytes]:
        """The digest of everything the quantize rule reads (module docstring); None: not kept."""
        constants = [(index, self.constants(value)) for index, value in sorted(ctx.constants.items())]
        if any(d is None for _, d in constants):
            return None
        return digest((ctx.node, ctx.in_qparams, ctx.out_qparams, constants, ctx.options, ctx.in_shapes,
                       ctx.out_shapes))

    def get(self, key: Optional[bytes]) -> Optional[QuantizedNode]:
        entry = self.nodes.get(key) if key is not None else None
        if entry is None:
            return None
        entry[1] = self.prepares
        self.hits += 1
        return entry[0]

    def put(self, key: Optional[bytes], node: QuantizedNode) -> None:
        if key is not None:
            self.nodes[key] = [node, self.prepares]
