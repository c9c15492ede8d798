"""The Python API's docstring examples (`ptq.api`: calibrate, run, report, debug, tune, export_table) run on the bundled model
with 2 images, as a user would type them in the repository's folder."""
from __future__ import annotations

import doctest

import pytest

import ptq
import ptq.api
from conftest import REPO

FUNCTIONS = ("calibrate", "run", "report", "debug", "tune", "export_table")


@pytest.mark.parametrize("name", FUNCTIONS)
def test_docstring_example_runs(name, model_path, calib_dir, monkeypatch):
    monkeypatch.chdir(REPO)  # the examples name examples/efficientnet_lite0.onnx and examples/calib
    function = getattr(ptq.api, name)
    tests = doctest.DocTestFinder().find(function, f"ptq.{name}", globs={})
    assert len(tests) == 1 and len(tests[0].examples) >= 3  # an example that calls the function and checks it
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(tests[0])
    assert runner.failures == 0


@pytest.mark.parametrize("name", FUNCTIONS)
def test_ptq_exports_the_command_functions(name):
    assert getattr(ptq, name) is getattr(ptq.api, name)
