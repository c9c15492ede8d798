"""`ptq.tuning.data`: the score averages each photo's views and takes its standard error over photos (known
answers), and the validation samples of image files are the views of each photo, scored against the float
model run by onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from ptq.core.graph import load_model
from ptq.engine.executor import prepare
from ptq.data.images import decode_image, preprocess_array
from ptq.calibration.pipeline import calibrate, input_spec
from ptq.table.quant_table import load_quant_table
from ptq.tuning.data import Score, Validation
from ptq.data.views import views
from ptq.data.image_source import ArraySamples, ImageSet
from tests.test_equalize import chain
from tests.test_tune import RAW
from tests.tiny_models import write_images


def test_a_photos_views_count_once_in_the_mean_and_the_standard_error():
    # photo 0: views 0.8 and 1.0 (mean 0.9); photo 1: one view 0.9 -> two photos at 0.9, no spread
    score = Score.of([0.8, 1.0, 0.9], groups=[0, 0, 1])
    assert score.mean == pytest.approx(0.9) and score.sem == pytest.approx(0.0)
    assert Score.of([0.8, 1.0, 0.9]).sem > 0.05  # as three independent samples
    with pytest.raises(ValueError, match="3 values but 2 group labels"):
        Score.of([0.8, 1.0, 0.9], groups=[0, 1])


def test_identical_views_give_the_photos_standard_error_not_a_smaller_one():
    photos = np.array([0.990, 0.995, 0.999, 0.980])
    m = 5
    values, groups = np.repeat(photos, m), np.repeat(np.arange(4), m)
    grouped = Score.of(values, groups)
    assert grouped.mean == pytest.approx(photos.mean())
    assert grouped.sem == pytest.approx(photos.std(ddof=1) / 2)  # sqrt(4 photos)
    naive = Score.of(values)  # 20 "independent" samples: smaller by about sqrt(m), the design effect
    assert naive.sem == pytest.approx(np.sqrt(np.var(values, ddof=1) / 20))
    assert grouped.sem / naive.sem == pytest.approx(np.sqrt((4 * m - 1) / 3), rel=1e-9)


def test_a_hard_view_lowers_the_bound_through_the_spread_over_photos():
    easy = Score.of([0.999] * 6 + [0.998] * 6, [0] * 6 + [1] * 6)
    hard = Score.of([0.999] * 5 + [0.975] + [0.998] * 6, [0] * 6 + [1] * 6)  # one view of photo 0 at 0.975
    assert hard.mean == pytest.approx(easy.mean - 0.024 / 12)
    assert hard.bound(2) < easy.bound(2) - 0.003


def test_image_files_validate_as_their_views_against_onnxruntime(tmp_path):
    import onnxruntime as ort

    model_path = tmp_path / "chain.onnx"
    onnx.save(chain(), model_path)
    write_images(tmp_path / "img", 3, size=(14, 10))
    calibrate(model_path, tmp_path / "img", tmp_path / "out", preprocess=RAW, write_qdq=False)
    table, graph = load_quant_table(tmp_path / "out" / "chain.quant.json"), load_model(model_path)
    images = ImageSet.from_folder(tmp_path / "img", RAW)
    names = ["photo", "mirror", "low-contrast"]
    check = Validation.create(graph, images, views=names)
    assert len(check) == 9 and check.groups == [0, 0, 0, 1, 1, 1, 2, 2, 2] and check.photos == 3

    # independently: each view preprocessed, the float model in onnxruntime, the integer graph, per-photo means
    sess = ort.InferenceSession(model_path.read_bytes(), providers=["CPUExecutionProvider"])
    prepared, spec = prepare(graph, table), input_spec(graph, RAW)
    per_photo = []
    for path in images.files:
        cos = []
        for _, view in views(decode_image(path), (10, 10), names):
            x = preprocess_array(view, RAW, spec)[None]
            ref = sess.run(None, {"input": x})[0].ravel()
            out = prepared.run({"input": x}).outputs[graph.outputs[0]].ravel()
            cos.append(float(np.dot(ref, out) / np.linalg.norm(ref) / np.linalg.norm(out)))
        per_photo.append(np.mean(cos))
    score = check.cosine(graph, table)
    assert score.mean == pytest.approx(np.mean(per_photo), abs=1e-6)
    assert score.sem == pytest.approx(np.std(per_photo, ddof=1) / np.sqrt(3), abs=1e-6)

    plain = Validation.create(graph, images)  # no views: the samples as read, each its own photo
    assert len(plain) == 3 and plain.groups is None and plain.photos == 3
    arrays = Validation.create(graph, ArraySamples(np.stack([x["input"][0] for x in plain.inputs])), views=names)
    assert len(arrays) == 3 and arrays.groups is None  # arrays have no photo to view
