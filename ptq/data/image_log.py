"""`ImageLog`: the files of a folder that were used and those skipped (a warning on the "ptq.data.images" logger
each). Apart from `ptq.data.images` so that `ptq.parallel.workers`, which the command line imports, does not load numpy
and PIL."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("ptq.data.images")


@dataclass
class ImageLog:
    """What happened to the files of a folder: images used, files skipped and why."""

    used: list[Path] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def skip(self, path: Path, reason: str) -> None:
        log.warning("skipping %s: %s", path, reason)
        self.skipped.append((path, reason))
