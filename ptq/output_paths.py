"""Output paths checked before any work starts: a command that writes (calibrate, report, debug, tune,
table set/export, dsp-report) fails at once, with one line naming the flag, when its outputs cannot be
written, instead of after minutes of calibration or tuning; and it says (a `ptq.core.notes.Note`) which existing
files it will replace.

An output folder cannot be written when it is an existing file, when a folder on its path is a file, when
it (or, not yet created, its nearest existing parent) is not writable, or when one of the files to write
there is a folder.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterable, Union

from ptq.core.notes import Note

PathLike = Union[str, Path]


def _nearest_existing(path: Path) -> Path:
    """`path` or the nearest of its parents that exists (a file or a folder)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def check_folder(folder: PathLike, flag: str) -> Path:
    """`folder` as a Path; a one-line ValueError when it cannot be created or written to."""
    folder = Path(folder)
    existing = _nearest_existing(folder)
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == folder else f"cannot be created: {existing} is a file"
        raise ValueError(f"{flag} {folder} {where}, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == folder else f" (cannot be created in {existing})"
        raise ValueError(f"{flag} {folder} is not writable{where}")
    return folder


def check_file(path: PathLike, flag: str) -> bool:
    """A one-line ValueError when the file `path` cannot be written (its folder checked as `check_folder`);
    returns whether it exists (it will be replaced)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    check_folder(path.parent, flag)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")
    return path.exists()


def check_outputs(folder: PathLike, names: Iterable[str], flag: str = "--out", *, note: bool = True) -> list[Path]:
    """Check that `folder` can hold the files `names`; with `note`, say which of them exist and will be
    replaced. Returns those existing files."""
    folder = check_folder(folder, flag)
    existing = [folder / name for name in names if check_file(folder / name, flag)]
    if note:
        note_replaced(existing)
    return existing


def note_replaced(existing: Iterable[PathLike]) -> None:
    """A note naming the existing outputs a command will replace (nothing when there are none)."""
    existing = [Path(p) for p in existing]
    if not existing:
        return
    folders = {p.parent for p in existing}
    if len(folders) == 1:
        where = f" in {next(iter(folders))}" if len(existing) > 1 else ""
        names = ", ".join(p.name if len(existing) > 1 else str(p) for p in existing)
    else:
        where, names = "", ", ".join(map(str, existing))
    warnings.warn(f"replacing the existing {names}{where}", Note, stacklevel=2)
