"""The calibration samples and the float run over them (the `range statistics` step of `ptq.calibration.steps`):
activation statistics streamed batch by batch into the collectors (`ptq.engine.float_run`), and the samples
read again, in the same order, by the steps that need them after the table (range search, bias correction,
AdaRound)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from calibrators import TensorStatistics
from ptq.core.bodies import calibrated_tensors
from ptq.core.graph import Graph
from ptq.data.images import ImageLog, Preprocess, iter_batches
from ptq.data.samples import ImageFormat, SampleSource, iter_sample_batches, iter_samples
from ptq.engine.float_run import collect_statistics

ImageSource = Union[str, Path, Sequence[Union[str, Path]], np.ndarray]


def sample_source(images: ImageSource, preprocess: Optional[Preprocess]) -> SampleSource:
    """Image files (a folder, one file or a list of files) as a `SampleSource`."""
    location = Path(images) if isinstance(images, (str, Path)) else tuple(Path(p) for p in images)
    return SampleSource(location, ImageFormat(preprocess or Preprocess()))


def collect_image_statistics(
    graph: Graph,
    images: Union[ImageSource, SampleSource],
    needs: frozenset,
    *,
    preprocess: Optional[Preprocess] = None,
    num_images: Optional[int] = None,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> tuple[dict[str, TensorStatistics], ImageLog]:
    """Statistics of every activation of `graph` over the samples: a `SampleSource` (image or `--data`
    files), image files (a folder or a list, preprocessed with `preprocess`), or an array of already
    preprocessed samples with the batch on axis 0."""
    log = ImageLog()
    if isinstance(images, np.ndarray):
        samples = list(images[:num_images] if num_images else images)
        if not samples:
            raise ValueError("no images given (empty array)")
        log.used = [Path(f"<array sample {k}>") for k in range(len(samples))]
        batches: Iterable = iter_batches(iter(samples), batch_size)
        total = len(samples)
    else:
        source = images if isinstance(images, SampleSource) else sample_source(images, preprocess)
        reader = source.format.reader(graph)
        candidates = source.candidates(log, num_images, seed)
        total = len(candidates) if num_images is None else min(num_images, len(candidates))
        batches = iter_sample_batches(iter_samples(candidates, reader, log, num_images=num_images), batch_size)
    bar = tqdm(total=total, unit="img", desc="calibrating", disable=None if progress else True, leave=False)
    with bar, logging_redirect_tqdm():  # skip warnings are printed above the bar, not through it
        stats = collect_statistics(graph, batches, calibrated_tensors(graph), needs, on_batch=bar.update)
    if not log.used:
        where = images.location if isinstance(images, SampleSource) else images
        raise ValueError(f"no valid image in {where} ({len(log.skipped)} files skipped)")
    return stats, log


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
