"""Where a report's samples come from: image files preprocessed as at calibration or `--data` sample files
(`ImageSet`, see `ptq.data.samples`), or arrays already preprocessed (`ArraySamples`). Both yield (path, inputs
{name: value with a batch axis of 1}, label) per sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from ptq.core.graph import Graph
from ptq.engine.float_run import sample_input
from ptq.data.images import ImageLog, Preprocess
from ptq.data.samples import ArrayFormat, ImageFormat, SampleFormat, SampleSource, iter_samples
from ptq.data.labels import LabelResolver


@dataclass
class ImageSet:
    """The evaluation samples: files (images or `--data` sample files), their format, their labels, and how
    many of them to use (the first `limit` readable ones)."""

    files: list[Path]
    format: SampleFormat
    labels: LabelResolver = field(default_factory=LabelResolver)
    limit: Optional[int] = None

    @classmethod
    def from_folder(
        cls,
        images: Union[str, Path],
        preprocess: Preprocess,
        labels_file: Optional[Union[str, Path]] = None,
        limit: Optional[int] = None,
    ) -> "ImageSet":
        """Images of a folder (or one image file) in sorted order, the first `limit` used."""
        return cls.from_source(SampleSource(Path(images), ImageFormat(preprocess)), labels_file, limit, sample=False)

    @classmethod
    def from_source(
        cls,
        source: SampleSource,
        labels_file: Optional[Union[str, Path]] = None,
        num_images: Optional[int] = None,
        seed: int = 0,
        *,
        sample: bool = True,
    ) -> "ImageSet":
        """The files of `source`; with `num_images`, a sample of them drawn with `seed` (as calibration draws
        it) unless `sample=False` (the first ones). Labels: the labels file; without one, image file names
        when every image has a label suffix, and none for `--data` samples."""
        if num_images is not None and num_images <= 0:
            raise ValueError(f"--num-images must be positive, got {num_images}")
        files = source.candidates(ImageLog(), num_images if sample else None, seed)
        if not files:
            raise ValueError(f"no {source.format.flag[2:]} files in {source.location}")
        if labels_file is None and isinstance(source.format, ArrayFormat):
            labels = LabelResolver({})
        else:
            labels = LabelResolver.from_option(labels_file, files)
        return cls(files, source.format, labels, num_images)

    @property
    def expected(self) -> int:
        return len(self.files) if self.limit is None else min(self.limit, len(self.files))

    def samples(self, graph: Graph, log: Optional[ImageLog] = None) -> Iterator[tuple[Path, dict, Optional[int]]]:
        """(path, inputs at the model's full rank (`ptq.data.samples`: a batch axis of 1 unless the sample gives the
        full shape), label) per readable file; undecodable images are skipped (into `log`)."""
        reader = self.format.reader(graph)
        for path, sample in iter_samples(self.files, reader, log or ImageLog(), num_images=self.limit):
            yield path, sample, self.labels(path)


@dataclass
class ArraySamples:
    """Already preprocessed samples (batch on axis 0) with optional labels: the in-memory `ImageSet`."""

    arrays: np.ndarray
    labels: Optional[Sequence[Optional[int]]] = None

    def __post_init__(self):
        if len(self.arrays) == 0:
            raise ValueError("no samples given")
        if self.labels is not None and len(self.labels) != len(self.arrays):
            raise ValueError(f"{len(self.labels)} labels for {len(self.arrays)} samples")

    @property
    def expected(self) -> int:
        return len(self.arrays)

    def samples(self, graph: Graph) -> Iterator[tuple[Path, dict, Optional[int]]]:
        name = sample_input(graph)
        dtype = graph.tensors[name].dtype
        for k, sample in enumerate(self.arrays):
            label = None if self.labels is None else self.labels[k]
            yield Path(f"<sample {k}>"), {name: np.asarray(sample)[None].astype(dtype, copy=False)}, label
