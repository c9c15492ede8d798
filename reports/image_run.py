"""One image through the integer graph, compared with its float tensors.

- cumulative: the integer graph end to end (`IntegerGraph.run`), each tensor dequantized,
  x_f = (x_q - zp) * scale, and compared with the float tensor of the same name as soon as it is produced;
- isolated: each step alone (`IntegerGraph.run_step`), fed with its float inputs quantized with the qparams
  the integer graph uses for them, x_q = clamp(round(x_f / scale) + zp); its outputs dequantized and compared;
- outputs: the graph outputs, and the classification agreement when the first output is class scores.

The comparisons are handed to a `MetricWorker`; the integer graph runs in the calling thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ptq.engine.executor import IntegerGraph, Step
from reports.detections import DetectionTask
from reports.evaluation import Evaluation
from reports.grid import dequantize32
from reports.layer_specs import LayerSpec
from reports.pair_sums import compare
from reports.worker import MetricWorker


def isolated_args(prepared: IntegerGraph, step: Step, floats: dict, ints: dict, quantized: dict) -> list:
    """The step's inputs with every quantized activation replaced by its quantized float value."""
    constants = prepared.graph.initializers
    args = []
    for name in step.node.all_inputs:
        if not name:
            args.append(None)
        elif name in constants:
            args.append(constants[name])
        elif name in prepared.qparams and name in floats:
            if name not in quantized:
                quantized[name] = prepared.qparams[name].quantize(floats[name])
            args.append(quantized[name])
        else:  # a run-time shape/index tensor: the same in both runs
            args.append(ints[name])
    return args


@dataclass
class ImageRun:
    """One image through the integer graph (calling thread), its metric updates handed to the worker.

    The integer codes handed over are not written to afterwards: integer kernels return new arrays."""

    prepared: IntegerGraph
    ev: Evaluation
    specs: list[LayerSpec]
    steps: list[int]
    bounds: dict[str, tuple[np.ndarray, np.ndarray]]
    outputs: list[str]
    # tensors whose range calibration folded to the clamp of their consumers (Relu, Clip): the float value
    # they stand for is the clamped one, so they are compared with it (their clipping is by design)
    folded: dict[str, tuple[float, float]]
    detection: Optional[DetectionTask] = None  # the detections to compare, decoded from both runs

    def run(self, worker: MetricWorker, sample: dict[str, np.ndarray], label: Optional[int], floats: dict,
            with_isolated: bool) -> None:
        ev = self.ev
        runtime_values: dict[str, np.ndarray] = {}  # run-time shape/index tensors (isolated runs read them)
        watched = set(self.detection.tensors) if self.detection is not None else set()
        captured: dict[str, np.ndarray] = {}  # the codes the detections are decoded from

        def fold(name: str, codes: np.ndarray) -> None:
            # each integer tensor is compared as soon as it exists; the executor may drop it meanwhile
            if name in watched:
                captured[name] = codes
            if name in self.bounds:
                worker.submit(self._fold_cumulative, name, floats[name], codes)
            elif name not in ev.qparams:
                runtime_values[name] = codes

        result = self.prepared.run(sample, keep_all=False, on_tensor=fold if self.specs or watched else None)
        for name, count in result.overflows.items():
            ev.overflows[name] = ev.overflows.get(name, 0) + count
        if with_isolated:  # in the worker too (measured on 20 images, isolated on all: +85% there, +134% here)
            worker.submit(self._isolated, floats, runtime_values)
        worker.submit(self._fold_outputs, floats, {name: result.tensors[name] for name in self.outputs}, label,
                      captured)

    def _fold_cumulative(self, name: str, x: np.ndarray, codes: np.ndarray) -> None:
        """One read of the float tensor and its codes: similarity sums, clipped counts, histogram."""
        ev = self.ev
        histogram = ev.histograms[name]
        sums, grid = compare(x, codes, ev.qparams[name], clamp=self.folded.get(name), histogram=histogram,
                             grid=self.bounds[name])
        ev.cumulative[name].add(sums)
        ev.clipped[name].add(sums.n, grid.below + grid.above)
        histogram.add(grid.counts, grid.min, grid.max)

    def _isolated(self, floats: dict, runtime_values: dict) -> None:
        """Each step alone on its quantized float inputs, its outputs compared with the float tensors."""
        quantized: dict[str, np.ndarray] = {}  # float tensors quantized once per image, shared by their consumers
        produced: dict[str, np.ndarray] = {}
        for index in self.steps:
            step = self.prepared.steps[index]
            args = isolated_args(self.prepared, step, floats, runtime_values, quantized)
            results = self.prepared.run_step(step, args)
            produced.update((name, value) for name, value in zip(step.node.outputs, results) if name)
        for spec in self.specs:
            qp = self.ev.qparams[spec.name]
            if spec.step is None:  # a graph input: its quantization alone
                codes = quantized.get(spec.name)
                codes = qp.quantize(floats[spec.name]) if codes is None else codes
            else:
                codes = produced[spec.name]
            sums, _ = compare(floats[spec.name], codes, qp, clamp=self.folded.get(spec.name))
            self.ev.isolated[spec.name].add(sums)

    def _fold_outputs(self, floats: dict, codes: dict, label: Optional[int], captured: dict) -> None:
        ev = self.ev
        for name in self.outputs:
            if name in ev.index_outputs:
                ev.index_outputs[name].update(floats[name], codes[name])
            else:
                ev.outputs[name].add(compare(floats[name], codes[name], ev.qparams[name])[0])
                for groups in ev.output_groups.get(name, ()):
                    groups.update(floats[name], codes[name], ev.qparams[name])
        if ev.classification is not None:
            first = self.outputs[0]
            ev.classification.update(floats[first], dequantize32(ev.qparams[first], codes[first]), label)
        if ev.detections is not None:
            constants = self.prepared.graph.initializers
            names = self.detection.tensors
            reference = {n: constants[n] if n in constants else floats[n] for n in names}
            test = {n: constants[n] if n in constants else dequantize32(ev.qparams[n], captured[n]) for n in names}
            ev.detections.update(self.detection.decode(reference), self.detection.decode(test))
