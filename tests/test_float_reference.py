"""The report's float reference with adjusted weights: the graph outputs against the user's model."""
from __future__ import annotations

import numpy as np
import onnx

import ptq
from ptq.adjust.adjusted_model import load_model_for_table
from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.data.images import Preprocess
from ptq.table.quant_table import load_quant_table
from ptq.data.image_source import ImageSet
from tests.test_equalize import chain
from tests.tiny_models import write_images

RAW = Preprocess(mean=0, std=1)


def test_with_bias_correction_the_outputs_are_compared_with_the_users_model(tmp_path):
    """Bias correction shifts the adjusted model's biases on purpose: the report's output cosine is the
    integer graph's against the user's model (onnxruntime on it, computed here), on one process and on two
    workers alike, and not the one against the adjusted model."""
    import onnxruntime as ort

    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 6, size=(10, 10))
    cal = ptq.calibrate(model_path, images=tmp_path / "img", out=tmp_path / "out", mean=0, std=1, per_tensor=True,
                        bits=6, bias_correction=True, quiet=True)
    table = load_quant_table(cal.table_path)
    assert table.options.adjusted_model is not None
    adjusted = load_model_for_table(model_path, table, cal.table_path, note=False)
    prepared = prepare(adjusted, table)
    out = adjusted.outputs[0]
    user = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    moved = ort.InferenceSession(adjusted.model.SerializeToString(), providers=["CPUExecutionProvider"])

    def cosine(a, b):
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        return float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))

    against_user, against_adjusted = [], []
    for _, x, _ in ImageSet.from_folder(tmp_path / "img", RAW).samples(load_model(model_path)):
        y = prepared.run(x, keep_all=False).outputs[out]
        against_user.append(cosine(user.run(None, x)[0], y))
        against_adjusted.append(cosine(moved.run(None, x)[0], y))
    assert abs(np.mean(against_user) - np.mean(against_adjusted)) > 1e-4  # the two references differ here
    for workers in (1, 2):
        report = ptq.report(model_path, quant=cal.table_path, images=tmp_path / "img", mean=0, std=1,
                            workers=workers, quiet=True)
        assert abs(report.outputs[0].similarity.cosine - np.mean(against_user)) < 1e-9
