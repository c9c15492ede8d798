"""The QDQ model a command writes beside its quant table (`ptq calibrate`, `ptq tune`, `ptq table export`):
exported for a target (`ptq.qdq.export`), checked in onnxruntime against the float model on a few samples
(`ptq.qdq.check`, a warning when its two figures disagree), then written atomically, never over an input."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import onnx

from ptq.core.atomic import atomic_write_bytes
from ptq.core.graph import Graph
from ptq.qdq.check import CHECK_SAMPLES, QDQCheck, QDQCheckError, check_qdq
from ptq.qdq.export import export_qdq
from ptq.qdq.integer_agreement import disagreement, has_wide_tensors
from ptq.qdq.targets import QDQTarget, get_target
from ptq.table.quant_table import QuantTable

if TYPE_CHECKING:
    from ptq.data.image_source import ImageSet

logger = logging.getLogger("ptq.qdq")


@dataclass
class ExportedQDQ:
    """A QDQ model in memory, the target it is stored for, and the onnxruntime check (None: not run)."""

    model: onnx.ModelProto
    target: str
    check: Optional[QDQCheck] = None


def export_checked(graph: Graph, table: QuantTable, target: Union[str, QDQTarget], *,
                   reference: Optional[onnx.ModelProto] = None, feeds: Sequence[dict] = (),
                   source: str = "calibration") -> ExportedQDQ:
    """The QDQ model of `graph` with `table` for `target`; with `reference` (the user's float model) and
    `feeds` (from `source`: "calibration", "tuning", ""), checked in onnxruntime (`ptq.qdq.check`): a warning
    when the optimized and unoptimized runs disagree, or when onnxruntime cannot run the check; for a table with
    tensors wider than 8 bits, also when the QDQ model departs from the integer run (`ptq.qdq.integer_agreement`)."""
    target = get_target(target)
    exported = ExportedQDQ(export_qdq(graph, table, target), target.name)
    if reference is None or not feeds:
        return exported
    try:
        exported.check = check_qdq(reference, exported.model, feeds, target.name, source)
    except QDQCheckError as exc:
        logger.warning("could not check the QDQ model in onnxruntime: %s", exc)
        return exported
    if exported.check.warning() is not None:
        logger.warning("%s", exported.check.warning())
    if has_wide_tensors(table):  # a 16-bit or tuned table: the QDQ model should compute what the integer run does
        try:
            warning = disagreement(graph, table, exported.model, reference, feeds, exported.check)
        except QDQCheckError as exc:
            warning = f"could not compare the QDQ model with the integer run: {exc}"
        if warning is not None:
            logger.warning("%s", warning)
    return exported


def sample_feeds(samples: "ImageSet", graph: Graph) -> list[dict]:
    """The first CHECK_SAMPLES readable samples, as onnxruntime feeds (batch axis of 1)."""
    return [feed for _, feed, _ in islice(samples.samples(graph), CHECK_SAMPLES)]


def write_model(model: onnx.ModelProto, path: Union[str, Path]) -> Path:
    """Write `model` to `path` atomically; returns the path."""
    return atomic_write_bytes(path, model.SerializeToString())


def summary_lines(path: Optional[Path], target: str, check: Optional[QDQCheck]) -> list[str]:
    """What a command prints about the QDQ model it wrote: where, for which target, and the check's figures."""
    lines = [f"QDQ model: {path} (target {target})"] if path is not None else []
    return lines + ([check.summary()] if check is not None else [])
