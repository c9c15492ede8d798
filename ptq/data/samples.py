"""The samples a command reads, one file each: image files preprocessed for the model's one image input
(`--images`), or `.npy`/`.npz` files that already hold the model's inputs (`--data`). A sample is a dict
{input name: array without the batch axis}; shards (`ptq.parallel.workers`) ship file paths and read them here.

`--data` files, one sample per file:
- `.npy`: one array, for a model with one input;
- `.npz`: one array per model input, named as the input (`np.savez(path, input_ids=ids, mask=mask)`): every
  input present, no other array.

Shapes: an array holds the input's full shape, taken as it is: no axis is assumed to be a batch (a recurrent
state `(2, 1, 128)`, a sequence `(64, 576)`); or the shape without its leading batch axis (`(3, 224, 224)`
for an input `[N, 3, 224, 224]`), which then gets a batch axis of 1. The rank tells which. Every fixed
dimension of the input must match; a dynamic one takes the sample's size (`sample_input_shapes` fixes a
model's dynamic dimensions other than axis 0 from the first sample). A sample read here always carries the
input's full rank.

Batches: samples are joined along axis 0 only where every sample agrees: each of their arrays has axis 0 of
1 (a batch of one) and the same shape as the others'. A sample that does not (a state whose axis 0 is 2, a
scalar input) is a batch of its own.

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

from onnx import helper

from ptq.core.graph import Graph, ModelError, read_model
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
        return {self.name: sample.astype(self.dtype, copy=False)[None]}


@dataclass(frozen=True)
class ImageFormat:
    """`--images`: image files and how they are preprocessed."""

    preprocess: Preprocess
    flag: ClassVar[str] = "--images"
    extensions: ClassVar[frozenset] = IMAGE_EXTENSIONS

    def reader(self, graph: Graph) -> ImageReader:
        name = image_input(graph)
        info = graph.tensors[name]
        batch = info.shape[0] if info.shape else None
        if batch not in (None, 0, 1):
            raise ModelError(f"input {name!r} has a fixed batch of {batch}; ptq needs batch 1 or a dynamic batch "
                             "to feed it images")
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
        """`array` as this input's full shape (a batch axis of 1 added to a sample given without it) in the
        input's dtype, or a ValueError."""
        where = f"{path}: input {self.name!r}"
        if self.shape is not None:
            rank = len(self.shape)
            expected = f"the model's input is {_dims(self.shape)}: one sample per file, {_accepted(self.shape)}"
            if array.ndim == rank - 1 and self.shape[0] in (None, 1):
                array = array[None]
            elif array.ndim != rank:
                raise ValueError(f"{where} has shape {array.shape}; {expected}")
            for axis, (got, want) in enumerate(zip(array.shape, self.shape)):
                if want is not None and got != want:
                    raise ValueError(f"{where} has shape {array.shape}; {expected} (dimension {axis} must be {want})")
        return _cast(array, self.dtype, where)


def _accepted(shape: tuple) -> str:
    """The shapes a sample may have: the full shape, or without its batch axis when axis 0 may be one."""
    dims = ["N" if k == 0 and d is None else "?" if d is None else str(d) for k, d in enumerate(shape)]
    full = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
    if not dims or shape[0] not in (None, 1):
        return full
    inner = dims[1:]
    return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + f") or {full}"


def _dims(shape: tuple) -> str:
    return "(" + ", ".join("N" if k == 0 and d is None else "?" if d is None else str(d)
                           for k, d in enumerate(shape)) + ")"


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


def batchable(sample: Feeds) -> bool:
    """Whether a sample may join others in a batch: each of its arrays is a batch of one (axis 0 of 1)."""
    return all(np.ndim(value) >= 1 and np.shape(value)[0] == 1 for value in sample.values())


def _agree(a: Feeds, b: Feeds) -> bool:
    return a.keys() == b.keys() and all(np.shape(a[name]) == np.shape(b[name]) for name in a)


def stack(samples: Sequence[tuple[Path, Feeds]]) -> Feeds:
    """One batch: the samples joined along axis 0. Every sample must be `batchable` and of one shape, or the
    batch be a single sample (taken as it is)."""
    first_path, first = samples[0]
    if len(samples) == 1:
        return dict(first)
    for path, sample in samples[1:]:
        if not (batchable(sample) and batchable(first) and _agree(first, sample)):
            raise ValueError(f"{path}: cannot join {first_path.name} in a batch: samples of a batch are batches of "
                             "one of the same shape")
    return {name: np.concatenate([sample[name] for _, sample in samples]) for name in first}


def iter_sample_batches(samples: Iterator[tuple[Path, Feeds]], batch_size: int) -> Iterator[Feeds]:
    """Group consecutive samples that agree (`batchable`, one shape) into batches of up to `batch_size`; a
    sample that does not agree with the batch before it starts a new one."""
    if batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {batch_size}")
    batch: list = []
    for item in samples:
        if batch and not (batchable(item[1]) and batchable(batch[0][1]) and _agree(batch[0][1], item[1])):
            yield stack(batch)
            batch = []
        batch.append(item)
        if len(batch) == batch_size:
            yield stack(batch)
            batch = []
    if batch:
        yield stack(batch)


def data_input_shapes(model, source: "SampleSource", num_images: Optional[int] = None, seed: int = 0) -> dict:
    """`sample_input_shapes` of `model` (a path or ModelProto) from the first `--data` sample of `source`;
    {} for image sources or a model without dynamic dimensions past axis 0."""
    if not isinstance(source.format, ArrayFormat):
        return {}
    proto = read_model(model)
    initializers = {t.name for t in proto.graph.initializer}
    declared = {}
    for vi in proto.graph.input:
        if vi.name in initializers:
            continue
        tensor_type = vi.type.tensor_type
        shape = (tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                       for d in tensor_type.shape.dim) if tensor_type.HasField("shape") else None)
        declared[vi.name] = (shape, np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)))
    if not any(shape is not None and None in shape[1:] for shape, _ in declared.values()):
        return {}
    files = source.candidates(ImageLog(), num_images, seed)
    if not files:
        return {}
    reader = ArrayReader(tuple(InputSlot(name, shape, dtype) for name, (shape, dtype) in declared.items()))
    return sample_input_shapes({name: shape for name, (shape, _) in declared.items()}, reader.read(files[0]))


def sample_input_shapes(graph_inputs: dict, sample: Feeds) -> dict:
    """{input: shape} fixing the dynamic dimensions other than axis 0 of `graph_inputs` ({name: model shape,
    None for a dynamic dimension}) to the sizes in `sample` (full-rank arrays); axis 0 stays dynamic (None)
    unless the model fixes it. Inputs without such dimensions are left out."""
    shapes = {}
    for name, shape in graph_inputs.items():
        if shape is None or name not in sample or not any(d is None for d in shape[1:]):
            continue
        got = np.shape(sample[name])
        if len(got) != len(shape):
            continue
        shapes[name] = (shape[0],) + tuple(g if want is None else want for g, want in zip(got[1:], shape[1:]))
    return shapes
