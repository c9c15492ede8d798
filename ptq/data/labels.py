"""Class labels of evaluation images: from a labels file, or from a number at the end of the file name.

File-name rule: the label is the integer after the last `_` or `-` of the stem, e.g.
`imagenet_00_243.jpg` -> 243, `cat-7.png` -> 7. A stem without such a suffix (`cat.jpg`, `img42.jpg`) has no
label: a bare trailing number is too often a sequence number to be trusted. The rule applies only when every
image of the set is named that way: in a folder of unlabelled photos one that happens to end in `_512` is
not a labelled image.

Labels file (`--labels FILE`), one of:
- JSON: an object mapping file names (or stems) to integer labels;
- text: one `NAME LABEL` pair per line, separated by whitespace, a comma or a colon; blank lines and lines
  starting with `#` are ignored; a first line whose label is not an integer is taken as a CSV header.
Names in the file match an image by its file name or by its stem.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Union

_SUFFIX = re.compile(r"[_-](\d+)$")
_LINE = re.compile(r"^\s*(.+?)\s*[\s,:]\s*(\S+)\s*$")


def label_from_filename(path: Union[str, Path]) -> Optional[int]:
    """The integer after the last `_` or `-` of the file's stem, or None."""
    match = _SUFFIX.search(Path(path).stem)
    return int(match.group(1)) if match else None


def load_labels(path: Union[str, Path]) -> dict[str, int]:
    """Read a labels file (JSON object or NAME LABEL lines) into {name: label}."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labels file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        return _labels_from_json(path, text)
    labels: dict[str, int] = {}
    first = True
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise ValueError(f"{path}:{lineno}: expected 'NAME LABEL', got {line!r}")
        name, value = match.group(1), match.group(2)
        try:
            label = int(value)
        except ValueError:
            if first:  # a CSV header such as "file,label"
                first = False
                continue
            raise ValueError(f"{path}:{lineno}: label {value!r} is not an integer") from None
        first = False
        _put(labels, name, label, f"{path}:{lineno}")
    if not labels:
        raise ValueError(f"labels file {path} holds no labels")
    return labels


def _labels_from_json(path: Path, text: str) -> dict[str, int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"labels file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not data:
        raise ValueError(f"labels file {path}: expected a non-empty JSON object mapping file names to labels")
    labels: dict[str, int] = {}
    for name, label in data.items():
        if isinstance(label, bool) or not isinstance(label, int):
            raise ValueError(f"labels file {path}: label of {name!r} is {label!r}, not an integer")
        _put(labels, name, label, str(path))
    return labels


def _put(labels: dict[str, int], name: str, label: int, where: str) -> None:
    if label < 0:
        raise ValueError(f"{where}: negative label {label} for {name!r}")
    if name in labels and labels[name] != label:
        raise ValueError(f"{where}: {name!r} labelled twice ({labels[name]} and {label})")
    labels[name] = label


SEQUENCE_MIN = 3  # file-name numbers that count this many files or more (0, 1, 2, ...) are a sequence, not labels


def usable_labels(resolver: "LabelResolver", files, classes: Optional[int]) -> tuple["LabelResolver", Optional[str]]:
    """`resolver` when its labels of `files` can be trusted as class labels of a model with `classes` classes
    (None: not a classifier, not checked); else no labels and why (a command says it once and goes on):
    file-name numbers that count the files (`line_00.png`, `line_01.png`, ...), a label outside the classes,
    a labels file that labels only some of the files, or file names of which only some end in a label."""
    files = list(files)
    values = [resolver(f) for f in files]
    given = [v for v in values if v is not None]
    source = "the file names" if resolver.labels is None else "the labels file"
    why = None
    if resolver.labels == {}:  # no labels file, and not every file name ends in a number
        named = sum(label_from_filename(f) is not None for f in files)
        if 0 < named < len(files):
            why = f"only {named} of the {len(files)} file names end in _LABEL"
    elif resolver.labels is None and len(given) >= SEQUENCE_MIN and sorted(given) == list(
            range(min(given), min(given) + len(given))):
        why = f"the numbers ending the file names count the files ({min(given)}..{max(given)}): not labels"
    elif classes is not None and given and max(given) >= classes:
        outside = sorted({v for v in given if v >= classes})
        shown = ", ".join(map(str, outside[:3])) + (", ..." if len(outside) > 3 else "")
        why = f"{source} give labels outside the model's {classes} classes ({shown})"
    elif resolver.labels and len(given) < len(files):
        why = f"the labels file labels {len(given)} of the {len(files)} files"
    if why is None:
        return resolver, None
    return LabelResolver({}), why


class LabelResolver:
    """Looks up the label of an image path: in the labels file when given, else from the file name."""

    def __init__(self, labels: Optional[dict[str, int]] = None):
        self.labels = labels

    @classmethod
    def from_option(cls, labels_file: Optional[Union[str, Path]], files=()) -> "LabelResolver":
        """The labels file's labels; without one, the file-name labels when every one of `files` has one (or
        when no file list is given), else no labels at all."""
        if labels_file:
            return cls(load_labels(labels_file))
        if all(label_from_filename(f) is not None for f in files):
            return cls(None)
        return cls({})

    def __call__(self, image: Union[str, Path]) -> Optional[int]:
        path = Path(image)
        if self.labels is None:
            return label_from_filename(path)
        for key in (path.name, path.stem, str(image)):
            if key in self.labels:
                return self.labels[key]
        return None
