"""Whether a QDQ model computes what the integer run of its table computes, on the samples of the onnxruntime check.

`ptq calibrate` and `ptq table export` check the QDQ model against the float model (`ptq.qdq.check`); for a
table with tensors wider than 8 bits (a 16-bit or tuned table, where the two should agree closely) they also
run the integer graph on the same samples and compare its output cosine to float, by the check's definition,
with the QDQ model's two figures. More than `TOLERANCE` (0.002) apart, a warning says why: with optimizations
off too, where the QDQ model first departs from the integer run (`ptq.qdq.departure`); with optimizations on
only, onnxruntime's fused kernels. (`ptq tune` judges its QDQ model on the validation samples instead,
`ptq.tuning.verdict`.)
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx

from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.qdq.check import TOLERANCE, QDQCheck, cosine_of_outputs, qdq_session, run_session
from ptq.qdq.departure import first_departure
from ptq.table.quant_table import QuantTable


def has_wide_tensors(table: QuantTable) -> bool:
    return any(entry.qparams.bits > 8 for entry in table.tensors.values())


def disagreement(graph: Graph, table: QuantTable, qdq_model: onnx.ModelProto, reference: onnx.ModelProto,
                 feeds: Sequence[dict], check: QDQCheck) -> Optional[str]:
    """The warning of the module docstring, or None when both QDQ figures of `check` (over `feeds`) are within
    TOLERANCE of the integer run's."""
    float_run, qdq_run = qdq_session(reference, optimize=True), qdq_session(qdq_model, optimize=False)
    prepared = prepare(graph, table)
    ours, theirs = [], []
    for feed in feeds:
        want = list(run_session(float_run, feed).values())
        got = prepared.run(feed, keep_all=False).outputs
        ours.append(cosine_of_outputs(want, [got[name] for name in graph.outputs]))
        theirs.append(cosine_of_outputs(want, list(run_session(qdq_run, feed).values())))
    integer = float(np.mean(ours))
    off, on = check.cosine_unoptimized, check.cosine_optimized
    if abs(off - integer) > TOLERANCE:
        why = first_departure(graph, table, qdq_model, feeds, f"the {len(feeds)} {check.source} samples".replace(
            "  ", " ")) or "no tensor of the table differs by that much: the difference accumulates over the graph"
        return (f"the QDQ model does not compute what the integer run computes: output cosine to float {off:.4f} in "
                f"onnxruntime with optimizations off against {integer:.4f} for the integer run on {len(feeds)} "
                f"samples (gap {abs(off - integer):.4f} > {TOLERANCE}); {why}")
    if abs(on - integer) > TOLERANCE:
        return (f"the QDQ model, run with onnxruntime's default optimizations, does not compute what the integer run "
                f"computes: output cosine to float {on:.4f} against {integer:.4f} for the integer run on "
                f"{len(feeds)} samples (gap {abs(on - integer):.4f} > {TOLERANCE}); "
                + (check.warning() or "its fused kernels compute otherwise than the QDQ graph on this machine"))
    return None
