"""The conformance harness (ptq/opdocs/conformance.py): every registered op has a case; each case's integer run is
within its op's `lsb_bound` of the float reference (onnxruntime on the dequantized inputs for ONNX ops,
forward_float -- itself checked against a numpy formula -- for ai.ptq ops), index and bool outputs equal;
docs/operators.md is what the generator writes from these results."""
from __future__ import annotations

from pathlib import Path

import pytest

from ops import REGISTRY
from ptq.opdocs.conformance import CASES, KNOWN_OUT_OF_BOUND, Result, case_for, run_case, uncovered_ops
from ptq.opdocs.operators_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "operators.md"
_RESULTS: dict[tuple[str, str], Result] = {}


def _result(case) -> Result:
    """Each case runs once per session (the per-op tests and the document test share it)."""
    key = (case.domain, case.op_type)
    if key not in _RESULTS:
        _RESULTS[key] = run_case(case)
    return _RESULTS[key]


def test_every_registered_op_has_a_conformance_case():
    assert uncovered_ops() == []
    keys = [(c.domain, c.op_type) for c in CASES]
    assert len(keys) == len(set(keys)) == len(REGISTRY)


def test_custom_domain_ops_run_directly_and_carry_a_numpy_formula():
    for case in CASES:
        if case.domain:
            assert case.path == "direct" and case.reference is not None, case.op_type


@pytest.mark.parametrize("case", CASES, ids=[f"{c.domain + '::' if c.domain else ''}{c.op_type}" for c in CASES])
def test_integer_run_is_within_the_ops_lsb_bound(case):
    result = _result(case)
    assert result.bound is not None, f"{case.op_type}: no lsb_bound on the op"
    assert result.exact_ok, f"{case.op_type}: an index/bool output differs from the reference"
    if (case.domain, case.op_type) in KNOWN_OUT_OF_BOUND:
        # a known defect, reported; when it is fixed this fails and the entry must go
        assert not result.passed, f"{case.op_type} now meets its bound: remove it from KNOWN_OUT_OF_BOUND"
    else:
        assert result.passed, f"{case.op_type}: worst {result.worst_lsb} LSB > bound {result.bound}"


def test_operators_doc_is_up_to_date():
    want = render([_result(c) for c in CASES], case_for, KNOWN_OUT_OF_BOUND)
    assert DOC.read_text(encoding="utf-8") == want, (
        "docs/operators.md is stale: run `python -m ptq.opdocs.conformance --write docs/operators.md`")
    assert "79 of 79 whitepaper chapter-4 operators implemented." in want
