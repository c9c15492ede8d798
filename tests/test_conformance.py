"""The conformance harness (ptq/opdocs/conformance.py): every registered op declares its case (`OpDef.conformance`,
in its own class); each case's integer run is
within its op's `lsb_bound` of the float reference (onnxruntime on the dequantized inputs for ONNX ops,
forward_float -- itself checked against a numpy formula -- for ai.ptq ops), index and bool outputs equal;
docs/operators.md is what the generator writes from these results."""
from __future__ import annotations

from pathlib import Path

import pytest

from ops import REGISTRY, OpDef, get_op
from ops.conformance_case import Case
from ops.registry import conformance_case
from ptq.opdocs.conformance import CASES, KNOWN_OUT_OF_BOUND, Result, collect_cases, run_case, uncovered_ops
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
    assert uncovered_ops() == [], "declare `conformance = Case(...)` in the op's class (ops/conformance_case.py)"
    keys = [(c.domain, c.op_type) for c in CASES]
    assert len(keys) == len(set(keys)) == len(REGISTRY)


class _Uncovered(OpDef):
    op_type = "Uncovered"
    domain = "ai.ptq"


class _MatMulKin(type(get_op("MatMul"))):
    """A subclass of a covered op: MatMul's case checks MatMul, not this op."""

    op_type = "MatMulKin"


class _Declared(OpDef):
    op_type = "Declared"
    conformance = Case(attrs={"axis": 1})


def test_an_op_without_its_own_case_is_reported():
    ops = [get_op("Abs"), _Uncovered(), _MatMulKin(), _Declared()]
    assert uncovered_ops(ops) == ["ai.onnx::MatMulKin", "ai.ptq::Uncovered"]
    assert [(c.domain, c.op_type) for c in collect_cases(ops)] == [("", "Abs"), ("", "Declared")]
    declared = conformance_case(_Declared())
    assert (declared.op_type, declared.domain, declared.attrs) == ("Declared", "", {"axis": 1})
    assert _Declared.conformance.op_type == ""  # the declaration itself is not changed by binding it


def test_cases_come_from_the_ops_that_declare_them():
    assert [(c.domain, c.op_type) for c in CASES] == sorted(REGISTRY)
    assert conformance_case(get_op("Einsum")).inputs == ("x", "x")  # its own, not MatMul's inherited case


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
    want = render([_result(c) for c in CASES], KNOWN_OUT_OF_BOUND)
    assert DOC.read_text(encoding="utf-8") == want, (
        "docs/operators.md is stale: run `python -m ptq.opdocs.conformance --write docs/operators.md`")
    assert "79 of 79 whitepaper chapter-4 operators implemented." in want
