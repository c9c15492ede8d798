"""The whole-model float run: `FloatRunner`, onnxruntime on a copy of the model whose listed activations are
outputs, returning named float tensors. Calibration folds them into statistics (`collect_statistics`); the
reports compare the integer graph against them (`reports.evaluate`, `reports.dump`).

Each batch's activations are folded into per-tensor `TensorStatistics` and dropped, so memory stays at one
batch of activations however many images are used (onnxruntime's own calibration keeps all of them).
A model whose batch dimension is fixed at 1 is run sample by sample; a model with an input whose axis 0 is
fixed at another size (a recurrent state) is only given single samples, at their full shape. When a calibrator needs per-batch
statistics (`mean`), each tensor's per-sample activations are concatenated along axis 0 into the batch
before folding, so statistics see the same batches as with a dynamic-batch model; otherwise every sample
is folded on its own (the result is the same, the memory one sample's activations).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import helper

from calibrators import Stat, TensorStatistics
from ptq.core.bodies import has_bodies
from ptq.core.graph import Graph, ModelError, Node
from ptq.engine.threads import session_errors, session_options
from ptq.engine.transformer_patterns import attention_mask_tensors
from ptq.engine.summed_axes import summed_input_axes

# imports inside functions: onnxruntime, where a session is made: its import starts a thread, and a process
# that has loaded it no longer forks workers (`ptq.parallel.workers.fork_is_safe`)
if TYPE_CHECKING:
    from ptq.engine.body_float import BodyEvaluator


def stats_model(graph: Graph, tensors: Sequence[str]) -> onnx.ModelProto:
    """A copy of the model with every tensor in `tensors` (that is not a graph input) as an extra output."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    present = {o.name for o in model.graph.output} | set(graph.inputs)
    for name in tensors:
        if name in present:
            continue
        info = graph.tensors[name]
        elem = helper.np_dtype_to_tensor_dtype(info.dtype)
        model.graph.output.append(helper.make_tensor_value_info(name, elem, None))
        present.add(name)
    return model


def image_input(graph: Graph) -> str:
    """The one float graph input that images are fed to."""
    float_inputs = [n for n in graph.inputs if graph.tensors[n].is_float]
    if len(graph.inputs) != 1 or len(float_inputs) != 1:
        raise ModelError(f"calibration from images needs a model with one float input, this one has {graph.inputs}")
    return float_inputs[0]


def sample_input(graph: Graph) -> str:
    """The one graph input that arrays of samples are fed to, of any dtype (token ids for an embedding)."""
    if len(graph.inputs) != 1:
        raise ModelError(f"samples feed a model with one input, this one has {graph.inputs}")
    return graph.inputs[0]


@dataclass
class FloatRunner:
    """An onnxruntime session that returns the listed activations for a batch of model inputs: a dict
    {input name: batch}, or for a one-input model the batch array itself."""

    graph: Graph
    tensors: list[str]
    input_names: list[str]
    fixed_batch: Optional[int]  # 1 when an input's batch dimension is fixed at 1 (run sample by sample)
    session: object
    # the listed tensors inside If / Loop bodies, evaluated by ptq from the session's results (`ptq.engine.body_float`)
    bodies: Optional["BodyEvaluator"] = None
    body_tensors: tuple = ()

    @classmethod
    def create(cls, graph: Graph, tensors: Sequence[str], providers: Optional[list[str]] = None,
               intra_op_threads: Optional[int] = None) -> "FloatRunner":
        """`intra_op_threads`: onnxruntime's intra-op pool size (None: the usable cores; no spinning either
        way, `ptq.engine.threads`)."""
        import onnxruntime as ort  # slow to import, and it stops forking: module comment

        # a model whose axis 0 is fixed at 1 runs a batch sample by sample; one with another fixed axis 0 (a
        # state [2, 1, 128]) is never given a batch (`ptq.data.samples.batchable`), its samples run as they are
        first_dims = [(graph.tensors[name].shape or (None,))[0] for name in graph.inputs]
        fixed = 1 if 1 in first_dims and all(d in (None, 0, 1) for d in first_dims) else None
        tensors = list(dict.fromkeys(tensors))
        inner = set(tensors) - set(graph.tensors) if any(has_bodies(n) for n in graph.nodes) else set()
        bodies = None
        if inner:
            from ptq.engine.body_float import BodyEvaluator  # models with control flow only

            bodies = BodyEvaluator(graph)
        session_tensors = [t for t in tensors if t not in inner] + (bodies.needed if bodies is not None else [])
        options = session_options(intra_op_threads)
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(
                stats_model(graph, list(dict.fromkeys(session_tensors))).SerializeToString(),
                options,
                providers=providers or ["CPUExecutionProvider"],
            )
        except session_errors() as exc:
            raise ModelError(f"onnxruntime cannot load the model: {exc}") from exc
        return cls(graph, tensors, list(graph.inputs), fixed, session, bodies,
                   tuple(t for t in tensors if t in inner))

    def feeds(self, batch) -> dict[str, np.ndarray]:
        """The batch as {input name: array in the input's dtype}."""
        if not isinstance(batch, Mapping):
            batch = {sample_input(self.graph): batch}
        return {name: np.asarray(value, dtype=self.graph.tensors[name].dtype) for name, value in batch.items()}

    def _session_run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self.session.run(names, feeds)
        except session_errors() as exc:
            shapes = {name: value.shape for name, value in feeds.items()}
            raise ModelError(f"onnxruntime failed on a batch of shape(s) {shapes}: {exc}") from exc

    def run(self, batch) -> Iterator[tuple[str, np.ndarray]]:
        """(name, activation with the batch on axis 0) for every listed tensor, one tensor at a time.

        For a batch-1 model each tensor's per-sample pieces are concatenated only when it is yielded and
        then released, so the peak is one batch of activations plus one tensor, not two batches.
        """
        feeds = self.feeds(batch)
        if self.bodies is not None:
            yield from self._run_with_bodies(feeds)
            return
        for name in self.input_names:
            if name in self.tensors:
                yield name, feeds[name]
        wanted = [t for t in self.tensors if t not in self.input_names]
        size = batch_size(feeds)
        if self.fixed_batch == 1 and size != 1:
            per_sample = [self._session_run(wanted, {n: v[i : i + 1] for n, v in feeds.items()}) for i in range(size)]
            for k, name in enumerate(wanted):
                pieces = [sample[k] for sample in per_sample]
                for sample in per_sample:
                    sample[k] = None
                yield name, _concat(pieces)
        else:
            yield from zip(wanted, self._session_run(wanted, feeds))

    def _run_with_bodies(self, feeds: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        """`run` for a model whose listed tensors include body tensors: each session run's results, then the
        bodies evaluated from them (sample by sample for a batch-1 model, the pieces joined along axis 0)."""
        session_names = [t for t in dict.fromkeys(list(self.tensors) + self.bodies.needed)
                         if t not in self.input_names and t not in self.body_tensors]
        size = batch_size(feeds)
        parts = [{n: v[i:i + 1] for n, v in feeds.items()} for i in range(size)] \
            if self.fixed_batch == 1 and size != 1 else [feeds]
        pieces: dict[str, list[np.ndarray]] = {}
        for part in parts:
            values = dict(part)
            values.update(zip(session_names, self._session_run(session_names, part)))
            values.update(self.bodies.evaluate(values))
            for name in self.tensors:
                if name in values:
                    pieces.setdefault(name, []).append(values[name])
        for name, arrays in pieces.items():
            yield name, arrays[0] if len(arrays) == 1 else _concat(arrays)

    def run_dict(self, batch) -> dict[str, np.ndarray]:
        """Every listed tensor by name for one batch, held together (the reports keep one image's tensors)."""
        return dict(self.run(batch))


def batch_size(feeds: Mapping[str, np.ndarray]) -> int:
    """The samples in a batch of feeds: axis 0 of its inputs when they all agree on it, else 1 (a sample
    taken at its full shape, whose axis 0 is no batch: `ptq.data.samples`)."""
    sizes = {np.shape(value)[0] if np.ndim(value) else None for value in feeds.values()}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else 1



def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=0) if arrays[0].ndim else np.stack(arrays)


def layer_inputs(graph: Graph, layers: Sequence[Node], batches: Iterable) -> Iterator[tuple[Node, np.ndarray]]:
    """(layer, the batch of its first input's float activations) for every layer and batch: one float run per
    batch, an activation that feeds several layers computed once."""
    by_input: dict[str, list[Node]] = {}
    for node in layers:
        by_input.setdefault(node.inputs[0], []).append(node)
    runner = FloatRunner.create(graph, list(by_input))
    for batch in batches:
        for name, x in runner.run(batch):
            for node in by_input.get(name, []):
                yield node, x


MASK_FLOOR = -1e4  # the grid of a pure mask tensor: [-1e4, 0] (e^-1e4 is 0: a masked position keeps its meaning)


def unmasked_values(value: np.ndarray, threshold: float) -> np.ndarray:
    """What calibration sees of a tensor an attention mask flows into: its values that are no masked position
    (above `threshold`), flattened. A pure mask (nothing else than 0 there: `(1 - mask) * finfo.min`) gets
    [MASK_FLOOR, 0] instead, so its grid keeps zero exact and a masked end (a -1e4 mask, as HF's fp16 models
    use); masked scores take their range from the real scores."""
    kept = value[value > threshold]
    return kept if kept.any() else np.array([MASK_FLOOR, 0.0], dtype=value.dtype)


def collect_statistics(
    graph: Graph,
    batches: Iterable[np.ndarray],
    tensors: Sequence[str],
    needs: frozenset,
    *,
    providers: Optional[list[str]] = None,
    on_batch: Optional[Callable[[int], None]] = None,
    runner: Optional[FloatRunner] = None,
) -> dict[str, TensorStatistics]:
    """Per-tensor statistics of `tensors` over all `batches` (each folded in and dropped). A batch is a dict
    {input name: array, batch on axis 0}, or for a one-input model the array.

    `on_batch(n)` is called after each batch of n samples (progress reporting). `runner`: a session made
    once for `tensors` (a worker process computing many shards), instead of a new one.
    """
    runner = runner or FloatRunner.create(graph, tensors, providers)
    masked = attention_mask_tensors(graph)  # their masked positions never set a range
    summed = summed_input_axes(graph)  # per-channel ranges too, where a layer sums over the channels
    stats = {name: TensorStatistics(needs, axis=None, channel_axis=None if name in masked else summed.get(name))
             for name in tensors}
    # Only per-batch statistics depend on how samples are grouped (min/max, moments and the fixed-grid
    # histograms do not), so without them a batch-1 model folds sample by sample: one sample's activations
    # in memory instead of a batch's.
    sample_by_sample = runner.fixed_batch == 1 and Stat.BATCH_EXTREMA not in needs
    for batch in batches:
        feeds = runner.feeds(batch)
        size = batch_size(feeds)
        for part in ([{n: v[i : i + 1] for n, v in feeds.items()} for i in range(size)] if sample_by_sample
                     else [feeds]):
            for name, value in runner.run(part):
                if name in masked:
                    value = unmasked_values(value, masked[name])
                try:
                    stats[name].update(value)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r}: {exc}") from exc
        if on_batch is not None:
            on_batch(size)
    return stats
