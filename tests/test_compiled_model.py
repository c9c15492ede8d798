"""EfficientNet-Lite0 on the 20 labelled eval photos: the compiled backend (the default) and the numpy
reference backend give identical integer codes for every tensor of the graph, and the same overflow logs."""
from __future__ import annotations

import numpy as np

from ops.backend import CompiledBackend, NumpyBackend
from ptq.core.graph import load_model
from ptq.executor import prepare
from ptq.images import ImageLog, Preprocess, load_image, select_files
from ptq.pipeline import calibrate, input_spec


def test_efficientnet_codes_identical_on_both_backends(model_path, calib_dir, eval_dir):
    table = calibrate(model_path, calib_dir, write_qdq=False).table
    graph = load_model(model_path)
    pre = Preprocess(**table.options.preprocess)
    spec = input_spec(graph, pre)
    files = select_files(eval_dir, ImageLog())
    assert len(files) == 20
    reference = prepare(graph, table, backend=NumpyBackend())
    compiled = prepare(graph, table)
    assert compiled.backend.name == "compiled"
    for path in files:
        x = load_image(path, pre, spec)[None]
        want = reference.run({"input": x})
        got = compiled.run({"input": x})
        assert set(got.tensors) == set(want.tensors)
        for name, codes in want.tensors.items():
            assert got.tensors[name].dtype == codes.dtype, name
            np.testing.assert_array_equal(got.tensors[name], codes, err_msg=f"{path.name}: {name}")
        assert got.overflows == want.overflows
        np.testing.assert_array_equal(got.outputs["logits"], want.outputs["logits"])
