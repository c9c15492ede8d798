"""The QDQ model of a table with tensors wider than 8 bits is compared with the integer run on the check's samples
(`ptq.qdq.integer_agreement`, from `export_checked`, as `ptq calibrate` and `ptq table export` call it): a warning
that says why when they are more than 0.002 apart, none when they agree."""
from __future__ import annotations

import logging

import numpy as np

from ptq.calibration.pipeline import calibrate
from ptq.core.graph import load_model
from ptq.qdq.output import export_checked
from reports.tables import with_bits
from tests.test_tune_metric import classifier


def test_a_16_bit_edit_the_integer_run_reads_otherwise_warns_with_why(caplog):
    """The classifier at 4 bits with the Relu's output 'a' edited to 16 bits: the integer Gemm+Relu writes it at
    16 bits from its accumulator, the QDQ model rounds the Gemm's output 'h' at 4 bits first; with 'h' at 16 bits
    too they agree and nothing is said."""
    model = classifier()
    graph = load_model(model)
    x = np.random.default_rng(3).normal(0, 1, (28, 3, 4, 4)).astype(np.float32)
    table = calibrate(model, x[:20], write_qdq=False, bits=4, weight_bits=4, per_channel=False,
                      calibrator="extrema").table
    feeds = [{"input": x[k:k + 1]} for k in range(20, 28)]
    edited = with_bits(table, ["a", "logits"], 16)
    with caplog.at_level(logging.WARNING, logger="ptq.qdq"):
        export_checked(graph, edited, "ort-cpu", reference=model, feeds=feeds)
    (warning,) = [r.getMessage() for r in caplog.records if "integer run" in r.getMessage()]
    assert warning.startswith("the QDQ model does not compute what the integer run computes: output cosine to float ")
    assert "at tensor 'a' (written by Gemm 'fc1')" in warning and "rounds 'h' (4 bits)" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ptq.qdq"):
        export_checked(graph, with_bits(edited, ["h"], 16), "ort-cpu", reference=model, feeds=feeds)
    assert not [r for r in caplog.records if "integer run" in r.getMessage()]
