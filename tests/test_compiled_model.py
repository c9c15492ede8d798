"""EfficientNet-Lite0 on the 20 labelled eval photos: the compiled backend (the default) and the numpy
reference backend give identical integer codes for every tensor of the graph, and the same overflow logs; `ptq
run`'s automatic choice between them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ops.backend import NumpyBackend
from ptq.cli import main as cli_main
from ptq.core.graph import load_model
from ptq.engine.backends import AUTO_NUMPY_UP_TO, resolve_backend
from ptq.engine.executor import prepare
from ptq.data.images import ImageLog, Preprocess, load_image, select_files
from ptq.calibration.pipeline import calibrate, input_spec


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def calibrated(model_path, calib_dir, tmp_path_factory):
    return calibrate(model_path, calib_dir, tmp_path_factory.mktemp("compiled"), write_qdq=False)


def test_efficientnet_codes_identical_on_both_backends(model_path, calibrated, eval_dir):
    table = calibrated.table
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


def test_cli_run_backend_choice_prints_the_same_classes(model_path, calibrated, eval_dir, capsys):
    printed = {}
    photo = select_files(eval_dir, ImageLog())[0]
    for backend in ("numpy", "compiled"):
        status = cli_main(["run", str(model_path), "--quant", str(calibrated.table_path), "--images", str(photo),
                           "--top", "3", "--backend", backend])
        assert status == 0
        lines = capsys.readouterr().out.splitlines()
        printed[backend] = [line for line in lines if "ms per image" not in line]
    assert printed["numpy"] == printed["compiled"]
    assert sum(line.startswith("top-1 accuracy") for line in printed["compiled"]) == 1
    with pytest.raises(SystemExit):
        cli_main(["run", str(model_path), "--quant", str(calibrated.table_path), "--images", str(eval_dir),
                  "--backend", "fpga"])
    assert "invalid choice: 'fpga'" in capsys.readouterr().err


def test_resolve_backend_auto_is_numpy_on_a_few_samples_only():
    assert [resolve_backend("auto", n) for n in (1, AUTO_NUMPY_UP_TO, AUTO_NUMPY_UP_TO + 1, 500)] == \
        ["numpy", "numpy", "compiled", "compiled"]
    assert resolve_backend("compiled", 1) == "compiled" and resolve_backend("dsp:int8", 500) == "dsp:int8"


# `ptq run` with its default backend on one photo, in a fresh interpreter: which kernels ran, and whether numba
# was ever imported
RUN_ONE = """
import json, sys
from ptq.cli import main
status = main(sys.argv[1:])
print(json.dumps([status, "numba" in sys.modules]))
"""


def test_cli_run_auto_backend_keeps_numba_off_a_one_image_run(model_path, calibrated, eval_dir, capsys):
    photo = select_files(eval_dir, ImageLog())[0]
    argv = ["run", str(model_path), "--quant", str(calibrated.table_path), "--top", "3"]
    done = subprocess.run([sys.executable, "-c", RUN_ONE, *argv, "--images", str(photo)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    *printed, verdict = done.stdout.splitlines()
    assert json.loads(verdict) == [0, False]  # numpy kernels: numba never imported
    assert sum("ms per image (numpy kernels)" in line for line in printed) == 1
    # the same classes as the compiled kernels print
    assert cli_main([*argv, "--images", str(photo), "--backend", "compiled"]) == 0
    compiled = capsys.readouterr().out.splitlines()
    assert [line for line in printed if "ms per image" not in line] == \
        [line for line in compiled if "ms per image" not in line]
    # on the 20 photos (more than AUTO_NUMPY_UP_TO) the default is the compiled kernels
    assert cli_main([*argv, "--images", str(eval_dir)]) == 0
    assert sum("ms per image (compiled kernels)" in line for line in capsys.readouterr().out.splitlines()) == 1
