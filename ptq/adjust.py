"""The weight adjustments of calibration, in order: cross-layer equalization before the statistics (data-free,
`ptq.equalize`), then, with the table's weight qparams, bias correction (`ptq.bias_correction`) and AdaRound
(`ptq.adaround`) on the calibration images. Each returns a new Graph; the table's activation entries stay
those calibrated on the equalized model (bias correction moves a channel's mean by a fraction of an LSB)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import onnx
from onnx import numpy_helper

from ptq.core.graph import Graph, load_model
from ptq.images import ImageLog, iter_batches
from ptq.quant_table import QuantTable
from ptq.samples import SampleSource, iter_sample_batches, iter_samples

logger = logging.getLogger("ptq.adjust")


def sample_batches(graph: Graph, source: Union[SampleSource, np.ndarray], num_images: Optional[int], batch_size: int,
                   seed: int) -> Iterator:
    """The calibration samples again, as `collect_image_statistics` reads them (same files, same order)."""
    if isinstance(source, np.ndarray):
        samples = list(source[:num_images] if num_images else source)
        return iter_batches(iter(samples), batch_size)
    log = ImageLog()
    files = source.candidates(log, num_images, seed)
    return iter_sample_batches(iter_samples(files, source.format.reader(graph), log, num_images=num_images),
                               batch_size)


def equalized(graph: Graph, input_shapes: Optional[dict]) -> Graph:
    from ptq.equalize import equalize

    model, log = equalize(graph)
    logger.info("%s", log.summary())
    return load_model(model, input_shapes)


def after_table(graph: Graph, table: QuantTable, batches, *, bias_correction: bool, adaround: bool,
                input_shapes: Optional[dict]) -> Graph:
    """AdaRound (weights onto the table's grid, rounding learned), then the bias correction of the mean shift
    that remains against the float weights."""
    from ptq.bias_correction import correct_biases

    learned = None
    if adaround:
        from ptq.adaround import adaround as learn

        learned, log = learn(graph, table, batches())
        logger.info("%s", log.summary())
    if bias_correction:
        model, log = correct_biases(graph, table, batches(), quantized=learned)
        logger.info("%s", log.summary())
    else:
        model = with_initializers(graph.model, learned or {})
    return load_model(model, input_shapes)


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` with the named initializers replaced."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return out


def write_adjusted(graph: Graph, table_path: Path) -> tuple[str, str]:
    from ptq.adjusted_model import save_adjusted

    _, relative, digest = save_adjusted(graph.model, table_path)
    return relative, digest
