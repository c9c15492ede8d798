"""Where a report's samples come from: image files preprocessed as at calibration (`ImageSet`), or arrays
already preprocessed (`ArraySamples`). Both yield (path, sample with a batch axis of 1, label) per sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from ptq.core.graph import Graph
from ptq.float_run import image_input
from ptq.images import ImageLog, Preprocess, iter_images, select_files
from ptq.pipeline import input_spec
from reports.labels import LabelResolver


@dataclass
class ImageSet:
    """The evaluation images: files, how they are preprocessed, and their labels."""

    files: list[Path]
    preprocess: Preprocess
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
        path = Path(images)
        files = [path] if path.is_file() else select_files(path, ImageLog())
        if not files:
            raise ValueError(f"no image files in {images}")
        if limit is not None and limit <= 0:
            raise ValueError(f"--num-images must be positive, got {limit}")
        return cls(files, preprocess, LabelResolver.from_option(labels_file, files), limit)

    @property
    def expected(self) -> int:
        return len(self.files) if self.limit is None else min(self.limit, len(self.files))

    def samples(self, graph: Graph) -> Iterator[tuple[Path, np.ndarray, Optional[int]]]:
        """(path, sample with a batch axis of 1, label) per decodable image; unreadable files are skipped."""
        log = ImageLog()
        spec = input_spec(graph, self.preprocess)
        dtype = graph.tensors[image_input(graph)].dtype
        for sample in iter_images(self.files, self.preprocess, spec, log, num_images=self.limit):
            path = log.used[-1]
            yield path, sample[None].astype(dtype, copy=False), self.labels(path)


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

    def samples(self, graph: Graph) -> Iterator[tuple[Path, np.ndarray, Optional[int]]]:
        dtype = graph.tensors[image_input(graph)].dtype
        for k, sample in enumerate(self.arrays):
            label = None if self.labels is None else self.labels[k]
            yield Path(f"<sample {k}>"), np.asarray(sample)[None].astype(dtype, copy=False), label
