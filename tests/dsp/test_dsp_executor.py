"""EfficientNet-Lite0 through the packed-DSP backends: every integer tensor identical to the default backend's."""
from pathlib import Path

import numpy as np
import pytest

from ptq.cli import main
from ptq.core.graph import load_model
from ptq.engine.executor import prepare, run_int
from ptq.data.images import Preprocess
from ptq.calibration.pipeline import calibrate
from reports.evaluate import ImageSet

IMAGES = 2
PRE = Preprocess(mean=127, std=128)


@pytest.fixture(scope="module")
def samples(model_path, eval_dir):
    graph = load_model(model_path)
    images = ImageSet.from_folder(eval_dir, PRE, limit=IMAGES)
    return [inputs["input"] for _path, inputs, _label in images.samples(graph)]


@pytest.fixture(scope="module")
def int8(model_path, calib_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib8")
    return calibrate(model_path, calib_dir, out, num_images=8, preprocess=PRE)


@pytest.fixture(scope="module")
def int4(model_path, calib_dir, tmp_path_factory):
    """Lite0 under `calibrate --scheme int4-dsp` (WP521: every Conv/Gemm operand a uint4 or int4 code)."""
    out = tmp_path_factory.mktemp("calib4")
    return calibrate(model_path, calib_dir, out, num_images=8, preprocess=PRE, scheme="int4-dsp", write_qdq=False)


@pytest.fixture(scope="module")
def plain8(model_path, int8):
    return prepare(load_model(model_path), int8.table)


def _macs(graph) -> int:
    """Multiply-accumulates of every Conv and Gemm, from the weight shapes and the output sizes (independent of
    the backends' own counting)."""
    total = 0
    for step in graph.steps:
        node = step.node
        if node.op_type not in ("Conv", "Gemm"):
            continue
        weight = graph.graph.initializers[node.inputs[1]]
        out = graph.graph.tensors[node.outputs[0]].shape
        spatial = int(np.prod(out[2:])) if node.op_type == "Conv" else 1
        total += int(np.prod(weight.shape)) * spatial * out[0]
    return total


@pytest.mark.parametrize("backend", ["dsp:int8", "dsp:int4"])
def test_lite0_integer_tensors_identical_through_the_dsp_backend(backend, model_path, samples, int8, int4, plain8):
    if backend == "dsp:int4":
        graph, table = int4.graph, int4.table
        plain = prepare(graph, table)
    else:
        graph, table, plain = load_model(model_path), int8.table, plain8
    dsp = prepare(graph, table, backend=backend)
    assert dsp.backend.name == backend and dsp.backend.direct_depthwise is False
    name = graph.inputs[0]
    for sample in samples:
        want = plain.run({name: sample}).tensors
        got = dsp.run({name: sample}).tensors
        assert set(got) == set(want)
        for tensor, codes in want.items():
            assert got[tensor].dtype == codes.dtype and np.array_equal(got[tensor], codes), tensor
    assert dsp.backend.stats.macs == IMAGES * _macs(dsp) > 3e8  # every MAC of the model went through the DSPs


def test_naive_extraction_changes_the_lite0_result(model_path, samples, int8, plain8):
    naive = run_int(model_path, int8.table, {"input": samples[0]}, backend="dsp:int8:naive", keep_all=False)
    plain = plain8.run({"input": samples[0]}, keep_all=False)
    logits = next(iter(plain.outputs))
    assert not np.array_equal(naive.outputs[logits], plain.outputs[logits])


@pytest.mark.parametrize("scheme,photos", [("int8", 1), ("int4", 2)])
def test_debug_dump_with_dsp_backend_matches_the_plain_dump(scheme, photos, model_path, eval_dir, int8, int4, tmp_path):
    """The issue's check, `ptq debug --dump DIR --dump-images N --backend dsp:...` against the same without
    --backend, on one or two photos (the API test above covers more; bench/dsp.py all 20). The int4-dsp table brings its model with the
    Requantize nodes (the adjusted model the debug command loads)."""
    table_path = (int8 if scheme == "int8" else int4).table_path
    dumps = {}
    for backend in (None, f"dsp:{scheme}"):
        out = tmp_path / (backend or "plain").replace(":", "_")
        argv = ["debug", str(model_path), "--quant", str(table_path), "--images", str(eval_dir),
                "--num-images", str(photos), "--out", str(out), "--dump", str(out / "dump"), "--dump-images", str(photos)]
        assert main(argv + (["--backend", backend] if backend else [])) == 0
        dumps[backend] = out / "dump"
    files = sorted(p.name for p in Path(dumps[None]).glob("*.int.npy"))
    assert len(files) > photos * 60 and any(name.startswith(f"img{photos - 1:03d}_") for name in files)
    if scheme == "int4":
        assert sum(name.endswith("_uint4.int.npy") for name in files) == photos * 14  # the Requantize outputs
    for name in files:
        assert np.array_equal(np.load(dumps[None] / name), np.load(dumps[f"dsp:{scheme}"] / name)), name


def test_unknown_backend_is_a_one_line_cli_error(model_path, int8, eval_dir, capsys):
    argv = ["run", str(model_path), "--quant", str(int8.table_path), "--images", str(eval_dir), "--backend", "dsp:int2"]
    with pytest.raises(SystemExit):
        main(argv)
    assert "invalid choice: 'dsp:int2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown backend 'dsp:int2'"):
        prepare(load_model(model_path), int8.table, backend="dsp:int2")
