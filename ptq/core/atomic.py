"""Atomic file writes: write a temporary file in the target's directory, then `os.replace` it into place.

A reader never sees a half-written file, and an interrupted write leaves the previous file untouched.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Union[str, Path], data: bytes) -> Path:
    """Write `data` to `path` atomically (same-directory temp file, fsync, os.replace). Returns the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        # cleanup of the temp file, then the original error propagates unchanged
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: Union[str, Path], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def refuse_to_overwrite(inputs: dict, outputs) -> None:
    """A one-line ValueError when an output path is one of the input files. `inputs`: what each is (e.g.
    "model") -> its path; anything not a path (a model given in memory, None) is skipped."""
    for what, source in inputs.items():
        if not isinstance(source, (str, Path)) or not Path(source).exists():
            continue
        for path in map(Path, outputs):
            if path.exists() and os.path.samefile(path, source):
                raise ValueError(f"refusing to overwrite the input {what} {source} with {path}")
