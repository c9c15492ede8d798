"""The options every data-reading command shares (`calibrate`, `run`, `report`, `debug`, `tune`), as flags
(`ptq.commands.data_options`) and as keyword arguments of the Python API (`ptq.api`): where the samples come
from, how images are preprocessed, labels, how many samples, batches, progress, workers.

Preprocessing: the quant table records what calibration used; `config` (a JSON file) replaces that record,
and each preprocessing option given overrides its field. `--data` samples are model inputs already: no
preprocessing option applies to them.
"""
from __future__ import annotations

# imports inside functions: the command line's parser imports this module; the workers' and the samples'
# machinery (numpy, onnx) is imported when the options are used

import contextlib
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

from ptq.data.images import Preprocess
from ptq.data.input_warnings import warn_unit_normalization

if TYPE_CHECKING:  # ptq.data.samples loads onnx: not needed to build the command line
    from ptq.data.samples import SampleSource

PREPROCESSING = ("config", "mean", "std", "resize", "crop_ratio", "bgr", "layout")

Location = Union[str, Path, Sequence[Union[str, Path]]]


@dataclass(frozen=True)
class DataOptions:
    """The shared options, named as the flags (`--crop-ratio` is `crop_ratio`)."""

    images: Optional[Location] = None  # image files: a folder (searched recursively), a file, or a list of files
    data: Optional[Location] = None  # .npy/.npz files of model inputs (ptq.data.samples)
    config: Optional[Union[str, Path]] = None
    mean: Optional[Union[str, float, Sequence[float]]] = None
    std: Optional[Union[str, float, Sequence[float]]] = None
    resize: Optional[int] = None
    crop_ratio: Optional[float] = None
    bgr: Optional[bool] = None
    layout: Optional[str] = None
    labels: Optional[Union[str, Path]] = None
    num_images: Optional[int] = None
    seed: int = 0
    batch_size: int = 8
    quiet: bool = False
    workers: Optional[int] = 1  # None: `ptq.parallel.workers.choose_workers` picks (the CLI's default)
    ray: Optional[str] = None

    def __post_init__(self):
        if (self.images is None) == (self.data is None):
            raise ValueError("give the samples with --images DIR|FILE or --data DIR|FILE (one of them)")
        given = [f"--{name.replace('_', '-')}" for name in PREPROCESSING if getattr(self, name) is not None]
        if self.data is not None and given:
            raise ValueError(f"{', '.join(given)} preprocess images; --data samples are model inputs already")
        if self.num_images is not None and self.num_images <= 0:
            raise ValueError(f"--num-images must be positive, got {self.num_images}")
        if self.batch_size <= 0:
            raise ValueError(f"--batch-size must be positive, got {self.batch_size}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")

    @classmethod
    def of(cls, function: str, options: dict, own: Sequence[str] = ()) -> "DataOptions":
        """From keyword arguments of `ptq.<function>`; an unknown name is a TypeError listing the function's
        `own` keywords and the shared ones, with the closest names."""
        from ptq.core.names import close_names

        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            close = [c for name in unknown for c in close_names(name, [*own, *known])]
            hint = f" (did you mean {', '.join(map(repr, dict.fromkeys(close)))}?)" if close else ""
            raise TypeError(f"ptq.{function}() got unexpected keyword argument(s) {unknown}{hint}; its own keywords "
                            f"are {sorted(own)}, the shared options {sorted(known)}")
        return cls(**options)

    def sharded(self, samples: int) -> bool:
        """Whether `samples` samples go to workers: --ray, or more than one worker (`choose_workers`)."""
        from ptq.parallel.workers import choose_workers

        return choose_workers(self.workers, samples) > 1 or self.ray is not None

    @property
    def progress(self) -> bool:
        return not self.quiet

    def preprocess(self, recorded: Optional[dict] = None) -> Preprocess:
        """The preprocessing of images: `recorded` (the table's) or `config`, then each option given."""
        flags = {"mean": self.mean, "std": self.std, "resize": self.resize, "crop_ratio": self.crop_ratio,
                 "bgr": self.bgr, "layout": self.layout}
        if self.config is not None:
            preprocess = Preprocess.from_config(self.config, **flags)
        else:
            merged = dict(recorded or {})
            merged.update({k: v for k, v in flags.items() if v is not None})
            preprocess = Preprocess(**merged)
        warn_unit_normalization(preprocess.mean, preprocess.std)
        return preprocess

    def source(self, recorded_preprocess: Optional[dict] = None) -> "SampleSource":
        """Where the samples come from and how they are read."""
        from ptq.data.samples import ArrayFormat, ImageFormat, SampleSource

        if self.data is not None:
            return SampleSource(_location(self.data), ArrayFormat())
        return SampleSource(_location(self.images), ImageFormat(self.preprocess(recorded_preprocess)))


def _location(value: Location) -> Union[Path, tuple]:
    return Path(value) if isinstance(value, (str, Path)) else tuple(Path(p) for p in value)


@contextlib.contextmanager
def quiet_logging(quiet: bool) -> Iterator[None]:
    """Warnings of the `ptq` loggers (skipped files, notes) on, or with `quiet` silenced, for the duration
    (where they go is the caller's logging configuration; `ptq.cli` prints them on stderr)."""
    logger = logging.getLogger("ptq")
    previous = logger.level
    logger.setLevel(logging.ERROR if quiet else logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(previous)
