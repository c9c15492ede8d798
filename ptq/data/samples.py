"""The samples a command reads, one file each: image files preprocessed for the model's one image input
(`--images`), or `.npy`/`.npz` files that already hold the model's inputs (`--data`). A sample is a dict
{input name: array without the batch axis}; shards (`ptq.parallel.workers`) ship file paths and read them here.

`--data` files, one sample per file:
- `.npy`: one array, for a model with one input;
- `.npz`: one array per model input, named as the input (`np.savez(path, input_ids=ids, mask=mask)`): every
  input present, no other array.

Batch axis: an array holds the input's shape without its batch axis (`(3, 224, 224)` for an input
`[N, 3, 224, 224]`), or with a leading batch axis of 1 (`(1, 3, 224, 224)`); the rank tells which. Every fixed
dimension of the input must match; a dynamic one takes any size (the samples of one batch must agree).

Dtypes: an array must be of the input's kind (float for a float input, integer for an integer input, bool for
bool). A float array is cast to the input's float type (float64 -> float32 rounds to nearest, as the model
would see it anyway); an integer array is cast when every value fits the input's integer type (int64 token ids
into an int32 input). Anything else is an error naming the file, the input and what was expected.

A sample file that does not fit the model is an error; an image that cannot be decoded is skipped with a warning.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator, Optional, Sequence, Union

import numpy as np

from ptq.core.graph import Graph
from ptq.engine.float_run import image_input
from ptq.data.images import IMAGE_EXTENSIONS, ImageLog, InputSpec, Preprocess, load_image, select_files

DATA_EXTENSIONS = frozenset({".npy", ".npz"})

Feeds = dict  # input name -> array (one sample: no batch axis; a batch: the batch on axis 0)


class UnreadableSample(ValueError):
    """A file that is skipped with a warning (an image that cannot be decoded), not an error."""


@dataclass(frozen=True)
class ImageReader:
    """Image file -> the model's one float input, preprocessed."""

    name: str
    spec: InputSpec
    dtype: np.dtype
    preprocess: Preprocess

    def read(self, path: Path) -> Feeds:
        try:
            sample = load_image(path, self.preprocess, self.spec)
        except ValueError as exc:
            raise UnreadableSample(str(exc)) from exc
        return {self.name: sample.astype(self.dtype, copy=False)}


@dataclass(frozen=True)
class ImageFormat:
    """`--images`: image files and how they are preprocessed."""

    preprocess: Preprocess
    flag: ClassVar[str] = "--images"
    extensions: ClassVar[frozenset] = IMAGE_EXTENSIONS

    def reader(self, graph: Graph) -> ImageReader:
        name = image_input(graph)
        info = graph.tensors[name]
        return ImageReader(name, InputSpec.from_shape(info.shape, self.preprocess.layout), info.dtype, self.preprocess)

    def to_dict(self) -> dict:
        return {"preprocess": self.preprocess.to_dict()}


@dataclass(frozen=True)
class InputSlot:
    """A model input as a sample file must fill it: name, shape with the batch axis (None: dynamic), dtype."""

    name: str
    shape: Optional[tuple]
    dtype: np.dtype

    def fit(self, array: np.ndarray, path: Path) -> np.ndarray:
        """`array` as one sample of this input (no batch axis, the input's dtype), or a ValueError."""
        where = f"{path}: input {self.name!r}"
        if self.shape is not None:
            rank = len(self.shape)
            expected = f"the model's input is {_dims(self.shape)}: one sample per file, {_accepted(self.shape)}"
            if array.ndim == rank and rank > 0 and array.shape[0] == 1:
                array = array[0]
            elif array.ndim != rank - 1:
                raise ValueError(f"{where} has shape {array.shape}; {expected}")
            for axis, (got, want) in enumerate(zip(array.shape, self.shape[1:]), 1):
                if want is not None and got != want:
                    raise ValueError(f"{where} has shape {array.shape}; {expected} (dimension {axis} must be {want})")
        return _cast(array, self.dtype, where)


def _accepted(shape: tuple) -> str:
    """The two shapes a sample may have: without the batch axis, or with a batch axis of 1."""
    inner = ["?" if d is None else str(d) for d in shape[1:]]
    without = "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
    return f"{without} or (1, {', '.join(inner)})" if inner else f"{without} or (1,)"


def _dims(shape: tuple) -> str:
    return "(" + ", ".join("N" if k == 0 else "?" if d is None else str(d) for k, d in enumerate(shape)) + ")"


def _cast(array: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    kind = {"f": "float", "i": "integer", "u": "integer", "b": "bool"}
    want, got = kind.get(dtype.kind), kind.get(array.dtype.kind)
    if want is None or got != want:
        wanted = want or str(dtype)
        raise ValueError(f"{where} is {array.dtype}, the model input is {dtype}: give "
                         f"{'an' if wanted[0] in 'aeiou' else 'a'} {wanted} array")
    if want == "integer" and array.size and not np.can_cast(array.dtype, dtype, casting="safe"):
        info = np.iinfo(dtype)
        lo, hi = int(array.min()), int(array.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{where} holds values in [{lo}, {hi}], outside the model's {dtype}")
    return array.astype(dtype, copy=False)


def _load_arrays(path: Path) -> dict[Optional[str], np.ndarray]:
    """{name: array} of an .npz, {None: array} of an .npy; a ValueError naming the file if it cannot be read."""
    try:
        if path.suffix.lower() == ".npy":
            return {None: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: cannot read the sample file: {exc}") from exc


@dataclass(frozen=True)
class ArrayReader:
    """.npy/.npz file -> the model's inputs, checked against them (see the module docstring)."""

    inputs: tuple

    def read(self, path: Path) -> Feeds:
        arrays = _load_arrays(path)
        names = [slot.name for slot in self.inputs]
        if None in arrays:
            if len(names) != 1:
                raise ValueError(f"{path}: an .npy file holds one array, the model has inputs {names}: write an "
                                 ".npz with one array per input name")
            arrays = {names[0]: arrays[None]}
        missing = [n for n in names if n not in arrays]
        extra = sorted(set(arrays) - set(names))
        if missing or extra:
            problems = ([f"missing input(s) {missing}"] if missing else []) + \
                       ([f"unknown array(s) {extra}"] if extra else [])
            raise ValueError(f"{path}: {' and '.join(problems)}; the model's inputs are {names}")
        return {slot.name: slot.fit(arrays[slot.name], path) for slot in self.inputs}


@dataclass(frozen=True)
class ArrayFormat:
    """`--data`: .npy/.npz files of model inputs, used as they are."""

    flag: ClassVar[str] = "--data"
    extensions: ClassVar[frozenset] = DATA_EXTENSIONS

    def reader(self, graph: Graph) -> ArrayReader:
        slots = []
        for name in graph.inputs:
            info = graph.tensors[name]
            shape = None if info.shape is None else tuple(d if isinstance(d, int) and d > 0 else None
                                                          for d in info.shape)
            slots.append(InputSlot(name, shape, np.dtype(info.dtype)))
        return ArrayReader(tuple(slots))

    def to_dict(self) -> dict:
        return {}


SampleFormat = Union[ImageFormat, ArrayFormat]


@dataclass(frozen=True)
class SampleSource:
    """Where a command's samples come from: a folder or a file (or, from Python, a list of files), and their
    format."""

    location: Union[Path, tuple]
    format: SampleFormat

    def candidates(self, log: ImageLog, num_images: Optional[int] = None, seed: int = 0) -> list[Path]:
        """The files to read, in order (shuffled with `seed` when `num_images` samples a subset)."""
        location = self.location
        if isinstance(location, Path) and location.is_file():
            location = (location,)
        return select_files(location if isinstance(location, Path) else list(location), log,
                            num_images=num_images, seed=seed, extensions=self.format.extensions,
                            flag=self.format.flag)

    def to_dict(self) -> dict:
        """What report.json records: the flag and its value, and the preprocessing of images."""
        where = str(self.location) if isinstance(self.location, Path) else [str(p) for p in self.location]
        return {self.format.flag[2:]: where, **self.format.to_dict()}


def iter_samples(candidates: Sequence[Path], reader, log: ImageLog, *,
                 num_images: Optional[int] = None) -> Iterator[tuple[Path, Feeds]]:
    """(path, sample) of the candidates in order, unreadable images skipped, until `num_images` are used."""
    for path in candidates:
        if num_images is not None and len(log.used) >= num_images:
            return
        try:
            sample = reader.read(path)
        except UnreadableSample as exc:
            log.skip(path, str(exc))
            continue
        log.used.append(path)
        yield path, sample


def stack(samples: Sequence[tuple[Path, Feeds]]) -> Feeds:
    """One batch: each input's samples stacked on a new axis 0. Samples of a batch must share their shapes."""
    first_path, first = samples[0]
    for path, sample in samples[1:]:
        for name, value in sample.items():
            if value.shape != first[name].shape:
                raise ValueError(f"{path}: input {name!r} has shape {value.shape}, {first_path.name} in the same "
                                 f"batch {first[name].shape}; give --batch-size 1 for samples of different shapes")
    return {name: np.stack([sample[name] for _, sample in samples]) for name in first}


def iter_sample_batches(samples: Iterator[tuple[Path, Feeds]], batch_size: int) -> Iterator[Feeds]:
    """Group samples into batches of up to `batch_size`."""
    if batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {batch_size}")
    batch = []
    for item in samples:
        batch.append(item)
        if len(batch) == batch_size:
            yield stack(batch)
            batch = []
    if batch:
        yield stack(batch)
