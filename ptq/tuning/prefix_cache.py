"""Validation passes that rerun only the part of the integer graph a candidate changed.

The tuner's candidates differ from one another in a few table entries (and the biases re-corrected with
them): every step of the prepared integer graph before the first step they change computes what it computed
for the candidate before, on the same validation sample. So each pass keeps, per sample, the tensors live at
a few *checkpoints* (step indices where the tensors computed so far and read later are few; `checkpoints`),
and a later candidate resumes each sample at the last checkpoint before its first changed step, from those
tensors, instead of from the input.

A step is the same as another when its *key* is: a digest of everything its outputs depend on besides its
inputs' values (the node, how it runs, its input and output qparams, its quantized constants, the initializers
it reads; `step_key`); a step holding something that cannot be pickled has no key and matches nothing. The first changed step of a candidate is the first whose key differs from that of
a pass kept here (the graph inputs' qparams first); the kept pass sharing the longest prefix is resumed from.
The steps are deterministic functions of their inputs, so a resumed pass gives the full run's outputs bit for
bit (tests compare them).

The graph inputs' codes are kept per sample too, for the latest input key (a candidate that changes no input qparams
reads them instead of quantizing the sample again).

What it costs: the live tensors at the checkpoints, per sample and kept pass (`KEPT_PASSES`, the most
recent), at most `DEFAULT_CHECKPOINTS` checkpoints spread over the steps, and no more than `DEFAULT_LIMIT`
bytes in all (a checkpoint that would pass it is not saved: a later pass resumes from an earlier one).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ptq.engine.executor import IntegerGraph
from ptq.engine.quantize_memo import ObjectDigests, digest

DEFAULT_CHECKPOINTS = 24  # per pass: where a later candidate may resume
KEPT_PASSES = 3  # the current state, the candidate before and the one before it: a bisection alternates them
DEFAULT_LIMIT = 1 << 30  # bytes of saved tensors, all kept passes together: a checkpoint past it is not saved


def step_key(prepared: IntegerGraph, index: int, constant_digest=digest, quantized_digest=digest) -> Optional[bytes]:
    """The digest of step `index`'s node, kind, qparams, quantized node (by `quantized_digest`: `prepare` with a
    `ptq.engine.quantize_memo.QuantizeMemo` hands unchanged nodes the same object, digested once) and the
    initializers it reads (each by `constant_digest`, the digest of an array); None when something in it cannot be
    digested (it then matches no other step)."""
    step = prepared.steps[index]
    constants = prepared.graph.initializers
    read = [constant_digest(constants[name]) for name in step.node.all_inputs if name in constants]
    quantized = quantized_digest(step.quantized) if step.quantized is not None else b""
    if any(d is None for d in read) or quantized is None:
        return None
    return digest((step.node, step.kind, step.in_qparams, step.out_qparams, quantized, step.reason,
                   step.control, read))


def input_key(prepared: IntegerGraph) -> Optional[bytes]:
    """The digest of how the graph inputs enter (their names and qparams), the backend and the outputs."""
    return digest(([(name, prepared.qparams.get(name)) for name in prepared.graph.inputs],
                   type(prepared.backend).__qualname__, list(prepared.graph.outputs)))


def live_tensors(prepared: IntegerGraph) -> list[frozenset]:
    """For each step index i (and len(steps)): the tensors a run holds before step i that steps from i on, or
    the graph's outputs, read (constants excluded)."""
    steps, constants = prepared.steps, prepared.graph.initializers
    needed: set = set(prepared.graph.outputs)
    needed_from = [frozenset()] * (len(steps) + 1)
    needed_from[len(steps)] = frozenset(needed)
    for i in range(len(steps) - 1, -1, -1):
        needed |= {name for name in steps[i].node.all_inputs if name and name not in constants}
        needed_from[i] = frozenset(needed)
    available = set(prepared.graph.inputs)
    live = []
    for i in range(len(steps) + 1):
        live.append(frozenset(available & needed_from[i]))
        if i < len(steps):
            available |= {name for name in steps[i].node.outputs if name}
    return live


def checkpoints(live: list[frozenset], count: int = DEFAULT_CHECKPOINTS) -> frozenset:
    """Up to `count` step indices (0 excluded: the input is the sample itself) spread evenly over the steps,
    each the index with the fewest live tensors among the steps of its stretch."""
    steps = len(live) - 1
    if steps < 2 or count < 1:
        return frozenset()
    chosen = set()
    for j in range(count):
        lo, hi = 1 + j * (steps - 1) // count, 1 + (j + 1) * (steps - 1) // count
        if hi > lo:
            chosen.add(min(range(lo, hi), key=lambda i: (len(live[i]), i)))
    return frozenset(chosen)


@dataclass
class _Pass:
    """A pass kept: its step keys and, per sample, the live tensors at its checkpoints (index -> name -> codes)."""

    keys: list
    saved: dict = field(default_factory=dict)
    nbytes: int = 0  # of the arrays in `saved` (those shared with the pass it resumed from included)


@dataclass
class PrefixRun:
    """One candidate's integer graph, run sample by sample from the latest checkpoint its prefix allows."""

    prepared: IntegerGraph
    live: list
    marks: frozenset  # its checkpoints
    prefix: int  # steps before this index are those of `source`
    source: Optional[_Pass]
    record: _Pass
    room: int  # bytes `record` may hold
    input_codes: dict = field(default_factory=dict)  # sample -> the graph inputs' codes (shared by equal input keys)
    resumed_steps: int = 0  # steps skipped over the samples run (for the tests and the bench)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def outputs(self, sample: int, inputs: dict) -> dict[str, np.ndarray]:
        """The dequantized graph outputs on `inputs`, validation sample number `sample` (samples may run in
        threads at once: what they record is counted under `lock`)."""
        start, values = 0, None
        inherited = self.source.saved.get(sample, {}) if self.source is not None else {}
        for index in sorted((i for i in inherited if i <= self.prefix), reverse=True):
            if self.live[index] <= inherited[index].keys():
                start, values = index, dict(inherited[index])
                break
        mine = {i: v for i, v in inherited.items() if i <= start}
        with self.lock:
            self.record.nbytes += sum(a.nbytes for v in mine.values() for a in v.values())
        if values is None:  # from the input: its codes as an earlier pass with the same input key quantized them
            if sample not in self.input_codes:
                self.input_codes[sample] = self.prepared.quantized_inputs(inputs)
            values = dict(self.input_codes[sample])

        def keep(index: int, held: dict) -> None:
            if index in self.marks and index > start:
                tensors = {name: held[name] for name in self.live[index]}
                size = sum(a.nbytes for a in tensors.values())
                with self.lock:
                    if self.record.nbytes + size <= self.room:
                        mine[index] = tensors
                        self.record.nbytes += size

        result = self.prepared.run_from(values, start, keep)
        with self.lock:
            self.record.saved[sample] = mine
            self.resumed_steps += start
        return result


@dataclass
class PrefixCache:
    """The passes kept (the most recent last) for validation samples run again and again."""

    kept: int = KEPT_PASSES
    count: int = DEFAULT_CHECKPOINTS
    limit: int = DEFAULT_LIMIT  # bytes all kept passes may hold together
    passes: list = field(default_factory=list)
    current: Optional[PrefixRun] = None
    constants: ObjectDigests = field(default_factory=ObjectDigests)  # of the initializers, once per array
    quantized: ObjectDigests = field(default_factory=ObjectDigests)  # of the steps' quantized nodes, while they live
    input_codes: dict = field(default_factory=dict)  # input key -> sample -> codes, for the latest input key only

    def runner(self, prepared: IntegerGraph) -> PrefixRun:
        """The run of `prepared` (the same one for every call with that integer graph: its samples may come
        photo by photo, or one at a time on a worker)."""
        if self.current is None or self.current.prepared is not prepared:
            self.current = self._new_run(prepared)
        return self.current

    def _new_run(self, prepared: IntegerGraph) -> PrefixRun:
        keys = [input_key(prepared)] + [step_key(prepared, i, self.constants, self.quantized)
                                        for i in range(len(prepared.steps))]
        best, prefix = None, 0
        for kept in self.passes:
            shared = _shared_prefix(keys, kept.keys)
            if shared > prefix:
                best, prefix = kept, shared
        record = _Pass(keys)
        self.passes = (self.passes + [record])[-self.kept:]
        live = live_tensors(prepared)
        room = self.limit - sum(p.nbytes for p in self.passes[:-1])
        if keys[0] not in self.input_codes:
            self.input_codes = {keys[0]: {}} if keys[0] is not None else {}
        codes = self.input_codes.get(keys[0], {})
        # keys[0] is the inputs': `prefix` keys shared = the inputs and steps before index prefix - 1
        return PrefixRun(prepared, live, checkpoints(live, self.count), max(prefix - 1, 0), best, record, room,
                         codes)


def _shared_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x is None or x != y:
            break
        n += 1
    return n
