"""Metrics of a graph output by group of elements, so that a dead part cannot hide behind the whole.

Groups of an output (`output_groups`):
- parts: when the output is a join (an op with `joins_along`, a Concat, possibly followed by ops that only
  `rearranges` its elements: Reshape, Transpose, ...), each joined input is a part: the elements it put there.
  The parts are found by running the join on label arrays (input k filled with k) and the rearranging ops on
  the result, so any axis and any reshape/transpose after the join map exactly;
- channels: axis 1 of an output of rank >= 3 with 2..MAX_CHANNELS channels (each channel one group).

Per group, over all samples (`GroupAccumulator`), with x the float values and y the dequantized integer values:

    cosine    = sum(x*y) / sqrt(sum(x^2) * sum(y^2))   over every element of the group in every sample (1 when
                both are all zero, 0 when one is): pooled, not averaged per sample, as a channel may hold
                a handful of values per image
    mse       = sum((x - y)^2) / n,  sqnr_db = 10 log10(sum x^2 / sum (x - y)^2),  max_abs_err = max |x - y|
    codes     = the distinct integer codes the group takes over all samples (counted up to DEAD_CODES + 1)
    needed    = the most distinct codes the group's float values take, in one sample, on a 256-step grid of
                their own (that sample's min..max of the group): how many codes its values need at least
    dead      = codes <= DEAD_CODES while the float values vary: needed > DEAD_CODES and
                max(x) - min(x) > VARY * max(|x|)

`needed` keeps values that are few by nature from counting as dead: a confident softmax row (one class near 1,
the rest near 0) takes 2 or 3 codes on any grid; VARY keeps a constant with rounding noise from counting either.
A dead group is what a grid too coarse for that part of the tensor leaves (detection scores 0..1 on a grid
sized for pixel boxes: codes 0 and 1 only); the report warns about it. Per-sample sums are kept and added in
sample order, so shards merge into the one-process result exactly (`merge`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ops.registry import op_of
from ptq.core.graph import Graph
from ptq.core.qparams import QParams
from reports.grid import dequantize32

MAX_CHANNELS = 256
DEAD_CODES = 4
VARY = 1e-3  # relative spread below which a group's float values count as constant
OWN_GRID_STEPS = 255  # the grid of the group's own values that `needed` counts on


@dataclass(frozen=True)
class OutputGroups:
    """How an output's elements fall into groups: `labels` (the output's shape, one sample, batch axis of 1
    included when the model has it) holds each element's group index; `names[k]` names group k."""

    kind: str  # "parts" or "channels"
    names: list[str]
    labels: np.ndarray
    spans: list[str] = field(default_factory=list)  # per group, where it lies ("axis 1 rows 0:4")


def _static_shape(graph: Graph, name: str) -> Optional[tuple[int, ...]]:
    info = graph.tensors.get(name)
    if info is None or info.shape is None or any(not isinstance(d, int) or d <= 0 for d in info.shape):
        return None
    return tuple(info.shape)


def _joined_shapes(graph: Graph, inputs: list[str]) -> Optional[list[tuple[int, ...]]]:
    """The static shapes of a join's inputs, a dimension unknown in one input taken from the others where they
    all agree on it (joined inputs share every dimension but the join's axis: an exporter's dynamic batch
    dimension on one branch)."""
    shapes = []
    for name in inputs:
        info = graph.tensors.get(name)
        if info is None or info.shape is None:
            return None
        shapes.append(list(info.shape))
    if len({len(s) for s in shapes}) != 1:
        return None
    for axis in range(len(shapes[0])):
        known = {s[axis] for s in shapes if isinstance(s[axis], int) and s[axis] > 0}
        for s in shapes:
            if not (isinstance(s[axis], int) and s[axis] > 0):
                if len(known) != 1:
                    return None
                s[axis] = next(iter(known))
    return [tuple(s) for s in shapes]


def _spans(labels: np.ndarray, count: int) -> list[str]:
    """Where each label lies along the first axis that separates them, as 'axis A a:b' (contiguous) or ''."""
    for axis in range(labels.ndim):
        moved = np.moveaxis(labels, axis, 0).reshape(labels.shape[axis], -1)
        if not np.all(moved == moved[:, :1]):
            continue
        along = moved[:, 0]
        spans = []
        for k in range(count):
            where = np.flatnonzero(along == k)
            contiguous = where.size and where[-1] - where[0] + 1 == where.size
            spans.append(f"axis {axis} [{where[0]}:{where[-1] + 1}]" if contiguous else "")
        return spans
    return [""] * count


def join_parts(graph: Graph, output: str) -> Optional[OutputGroups]:
    """The parts of `output` when it is a join followed only by rearranging ops; None otherwise (or when a
    shape is not static)."""
    producer = graph.producer()
    chain = []
    name = output
    while name in producer:
        node = producer[name]
        op = op_of(node)
        if op is None:
            return None
        if op.joins_along(node) is not None:
            break
        if not op.rearranges or len(node.outputs) != 1:
            return None
        chain.append(node)
        name = node.inputs[0]
    else:
        return None
    join = producer[name]
    inputs = [i for i in join.inputs if i]
    shapes = _joined_shapes(graph, inputs)
    if len(inputs) < 2 or shapes is None:
        return None
    labels = op_of(join).forward_float(join, [np.full(s, k, np.float32) for k, s in enumerate(shapes)])[0]
    for node in reversed(chain):
        args = [labels] + [graph.initializers.get(i) if i else None for i in node.inputs[1:]]
        if any(a is None for i, a in zip(node.inputs[1:], args[1:]) if i):
            return None  # a shape computed at run time
        labels = op_of(node).forward_float(node, args)[0]
    labels = labels.astype(np.int32)
    return OutputGroups("parts", inputs, labels, _spans(labels, len(inputs)))


def channel_groups(graph: Graph, output: str) -> Optional[OutputGroups]:
    """Axis 1 of an output of rank >= 3 with 2..MAX_CHANNELS channels."""
    shape = _static_shape(graph, output)
    if shape is None or len(shape) < 3 or not 2 <= shape[1] <= MAX_CHANNELS:
        return None
    labels = np.broadcast_to(np.arange(shape[1], dtype=np.int32).reshape((1, -1) + (1,) * (len(shape) - 2)), shape)
    return OutputGroups("channels", [str(c) for c in range(shape[1])], np.ascontiguousarray(labels),
                        [f"axis 1 [{c}:{c + 1}]" for c in range(shape[1])])


def output_groups(graph: Graph, output: str) -> list[OutputGroups]:
    """The parts (when the output is a join) and the channels (when it has up to MAX_CHANNELS) of `output`."""
    return [g for g in (join_parts(graph, output), channel_groups(graph, output)) if g is not None]


@dataclass(frozen=True)
class GroupMetrics:
    """One group's metrics over all samples (module docstring)."""

    name: str
    span: str
    elements: int
    cosine: float
    mse: float
    sqnr_db: float
    max_abs_err: float
    codes: int  # distinct integer codes, counted up to DEAD_CODES + 1
    float_min: float
    float_max: float
    needed: int = 0  # distinct codes of its float values on their own grid, one sample, up to DEAD_CODES + 1

    @property
    def dead(self) -> bool:
        spread = self.float_max - self.float_min
        return (self.codes <= DEAD_CODES < self.needed
                and spread > VARY * max(abs(self.float_min), abs(self.float_max)))

    def to_dict(self) -> dict:
        return {"name": self.name, "span": self.span, "elements": self.elements, "cosine": self.cosine,
                "mse": self.mse, "sqnr_db": self.sqnr_db, "max_abs_err": self.max_abs_err,
                "distinct_codes": self.codes if self.codes <= DEAD_CODES else f">{DEAD_CODES}",
                "codes_needed": self.needed if self.needed <= DEAD_CODES else f">{DEAD_CODES}",
                "float_range": [self.float_min, self.float_max], "dead": self.dead}


@dataclass
class GroupAccumulator:
    """Per-sample sums of one `OutputGroups` (rows: dot, xx, yy, se, n), extremes and distinct codes."""

    groups: OutputGroups
    sums: list = field(default_factory=list)  # per sample, [5, G] float64
    max_err: Optional[np.ndarray] = None
    float_min: Optional[np.ndarray] = None
    float_max: Optional[np.ndarray] = None
    codes: list = field(default_factory=list)  # per group, a set of up to DEAD_CODES + 1 codes
    needed: Optional[np.ndarray] = None  # per group, `GroupMetrics.needed`

    def __post_init__(self) -> None:
        count = len(self.groups.names)
        if not self.codes:
            self.codes = [set() for _ in range(count)]
        if self.needed is None:
            self.needed = np.zeros(count, np.int64)
        if self.max_err is None:
            self.max_err = np.zeros(count)
            self.float_min = np.full(count, np.inf)
            self.float_max = np.full(count, -np.inf)

    def update(self, reference: np.ndarray, codes: np.ndarray, qp: QParams) -> None:
        """One sample: the float output and the integer output's codes (the labels' shape)."""
        codes = np.ascontiguousarray(codes)
        if codes.shape != self.groups.labels.shape or np.shape(reference) != codes.shape:
            raise ValueError(f"output of shape {codes.shape} does not match its groups' shape "
                             f"{self.groups.labels.shape}")
        count = len(self.groups.names)
        labels = self.groups.labels.ravel()
        x = np.asarray(reference, dtype=np.float64).ravel()
        y = dequantize32(qp, codes).astype(np.float64).ravel()
        d = x - y
        self.sums.append(np.stack([np.bincount(labels, weights=w, minlength=count)
                                   for w in (x * y, x * x, y * y, d * d, np.ones_like(x))]))
        np.maximum.at(self.max_err, labels, np.abs(d))
        lo, hi = np.full(count, np.inf), np.full(count, -np.inf)
        np.minimum.at(lo, labels, x)
        np.maximum.at(hi, labels, x)
        self.float_min, self.float_max = np.minimum(self.float_min, lo), np.maximum(self.float_max, hi)
        self._count_needed(x, labels, lo, hi)
        open_groups = np.array([len(s) <= DEAD_CODES for s in self.codes])
        if open_groups.any():
            keep = open_groups[labels]
            span = int(qp.qmax) - int(qp.qmin) + 1
            pairs = np.unique(labels[keep].astype(np.int64) * span + (codes.ravel()[keep].astype(np.int64) - qp.qmin))
            for label, code in zip(pairs // span, pairs % span + qp.qmin):
                group = self.codes[label]
                if len(group) <= DEAD_CODES:
                    group.add(int(code))

    def _count_needed(self, x: np.ndarray, labels: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """This sample's distinct codes of each group's values on the grid of their own min..max."""
        count = len(self.groups.names)
        width = hi - lo
        keep = ((self.needed <= DEAD_CODES) & (width > 0))[labels]
        if not keep.any():
            return
        own = labels[keep]
        steps = np.rint((x[keep] - lo[own]) / width[own] * OWN_GRID_STEPS).astype(np.int64)
        pairs = np.unique(own.astype(np.int64) * (OWN_GRID_STEPS + 1) + steps)
        found = np.bincount(pairs // (OWN_GRID_STEPS + 1), minlength=count)
        self.needed = np.maximum(self.needed, np.minimum(found, DEAD_CODES + 1))

    def merge(self, other: "GroupAccumulator") -> "GroupAccumulator":
        """The accumulator of both sample sets, `other`'s samples after this one's (neither is modified)."""
        codes = []
        for mine, theirs in zip(self.codes, other.codes):
            union = set(mine)
            for code in sorted(theirs):
                if len(union) > DEAD_CODES:
                    break
                union.add(code)
            codes.append(union)
        return GroupAccumulator(self.groups, self.sums + other.sums, np.maximum(self.max_err, other.max_err),
                                np.minimum(self.float_min, other.float_min),
                                np.maximum(self.float_max, other.float_max), codes,
                                np.maximum(self.needed, other.needed))

    def result(self) -> list[GroupMetrics]:
        if not self.sums:
            raise ValueError("output groups: no samples were accumulated")
        dot, xx, yy, se, n = np.sum(np.stack(self.sums), axis=0)
        metrics = []
        for k, name in enumerate(self.groups.names):
            if xx[k] == 0.0 and yy[k] == 0.0:
                cosine = 1.0
            elif xx[k] == 0.0 or yy[k] == 0.0:
                cosine = 0.0
            else:
                cosine = float(np.clip(dot[k] / math.sqrt(xx[k] * yy[k]), -1.0, 1.0))
            sqnr = math.inf if se[k] == 0.0 else (-math.inf if xx[k] == 0.0 else 10.0 * math.log10(xx[k] / se[k]))
            metrics.append(GroupMetrics(name, self.groups.spans[k] if self.groups.spans else "", int(n[k]), cosine,
                                        float(se[k] / n[k]), sqnr, float(self.max_err[k]), len(self.codes[k]),
                                        float(self.float_min[k]), float(self.float_max[k]), int(self.needed[k])))
        return metrics


@dataclass(frozen=True)
class OutputBreakdown:
    """An output's parts and channel spread (`to_dict` is what report.json holds under the output)."""

    parts: Optional[list[GroupMetrics]] = None
    channels: Optional[list[GroupMetrics]] = None

    @classmethod
    def of(cls, accumulators: list[GroupAccumulator]) -> "OutputBreakdown":
        found = {acc.groups.kind: acc.result() for acc in accumulators}
        return cls(found.get("parts"), found.get("channels"))

    def spread(self) -> Optional[dict]:
        """min / median / max of the per-channel cosines and the worst channel."""
        if not self.channels:
            return None
        cosines = np.array([c.cosine for c in self.channels])
        worst = int(np.argmin(cosines))
        return {"min": float(cosines.min()), "median": float(np.median(cosines)), "max": float(cosines.max()),
                "worst_channel": worst}

    def dead(self) -> list[tuple[str, GroupMetrics]]:
        """(kind, group) of every dead part and channel."""
        return [(kind, g) for kind, groups in (("part", self.parts), ("channel", self.channels)) if groups
                for g in groups if g.dead]

    def to_dict(self) -> dict:
        out: dict = {}
        if self.parts is not None:
            out["parts"] = [p.to_dict() for p in self.parts]
        if self.channels is not None:
            out["channel_cosine"] = self.spread()
            out["channels"] = [c.to_dict() for c in self.channels]
        return out


def dead_warnings(output: str, breakdown: OutputBreakdown) -> list[str]:
    """One line per dead part, one for the dead channels of an output."""
    lines = []
    dead = breakdown.dead()
    for kind, g in dead:
        if kind == "part":
            lines.append(f"warning: output {output}: part {g.name} ({g.span}) uses {g.codes} integer code(s) over "
                         f"the samples while its float values span {g.float_min:.4g}..{g.float_max:.4g} "
                         f"(cosine {g.cosine:.4f}): its grid is too coarse for it")
    channels = [g for kind, g in dead if kind == "channel"]
    if channels:
        shown = ", ".join(g.name for g in channels[:8]) + (", ..." if len(channels) > 8 else "")
        lines.append(f"warning: output {output}: {len(channels)} channel(s) on axis 1 use {DEAD_CODES} or fewer "
                     f"integer codes while their float values vary ({shown})")
    return lines
