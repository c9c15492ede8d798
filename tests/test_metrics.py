import math

import numpy as np
import pytest

from ptq.data.labels import LabelResolver, label_from_filename, load_labels
from reports.metrics import SimilarityAccumulator, TopKAgreement, sample_cosine, sqnr_db


def test_single_sample_against_hand_computation():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    y = np.array([1.0, 2.5, 2.0, 4.0])
    acc = SimilarityAccumulator()
    acc.update(x, y)
    s = acc.result()
    # dot = 1 + 5 + 6 + 16 = 28; |x|^2 = 30; |y|^2 = 1 + 6.25 + 4 + 16 = 27.25
    assert s.cosine == pytest.approx(28 / math.sqrt(30 * 27.25), abs=1e-12)
    # errors 0, -0.5, 1, 0 -> squared 0.25 + 1 = 1.25 over 4 elements
    assert s.mse == pytest.approx(1.25 / 4)
    assert s.sqnr_db == pytest.approx(10 * math.log10(30 / 1.25))
    assert s.max_abs_err == pytest.approx(1.0)
    assert s.samples == 1


def test_sample_cosine_clips_as_np_clip_bit_for_bit():
    rng = np.random.default_rng(0)
    sums = [(float(d), float(a), float(b)) for d, a, b in rng.normal(size=(2000, 3)) ** 2]
    # parallel vectors, whose quotient rounds to just above 1, and a dot product whose quotient is NaN
    sums += [(3.0 * v * v, v * v, 9.0 * v * v) for v in rng.uniform(0.1, 10.0, 500)] + [(math.inf, math.inf, 1.0)]
    for dot, xx, yy in sums:
        expected = float(np.clip(dot / math.sqrt(xx * yy), -1.0, 1.0))
        got = sample_cosine(dot, xx, yy)
        assert (math.isnan(got) and math.isnan(expected)) or got.hex() == expected.hex()
    assert any(dot / math.sqrt(xx * yy) > 1.0 for dot, xx, yy in sums[2000:-1])  # the clip was exercised


def test_cosine_is_mean_of_per_image_cosines_and_mse_over_all_elements():
    a1, b1 = np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])  # cosine 0
    a2, b2 = np.array([[3.0, 4.0]]), np.array([[6.0, 8.0]])  # cosine 1
    acc = SimilarityAccumulator()
    acc.update(a1, b1)
    acc.update(a2, b2)
    s = acc.result()
    assert s.cosine == pytest.approx(0.5)
    # squared errors: 1 + 1, 9 + 16 -> 27 over 4 elements; signal 1 + 25 = 26
    assert s.mse == pytest.approx(27 / 4)
    assert s.sqnr_db == pytest.approx(10 * math.log10(26 / 27))
    assert s.max_abs_err == pytest.approx(4.0)


def test_batch_update_equals_sample_updates_and_merge_equals_union():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3, 5)).astype(np.float32)
    y = x + rng.normal(scale=0.2, size=x.shape).astype(np.float32)
    one = SimilarityAccumulator()
    for i in range(6):
        one.update(x[i], y[i])
    batched = SimilarityAccumulator()
    batched.update_batch(x, y)
    left, right = SimilarityAccumulator(), SimilarityAccumulator()
    left.update_batch(x[:2], y[:2])
    right.update_batch(x[2:], y[2:])
    merged = left.merge(right).result()
    # independent float64 reference
    xf, yf = x.reshape(6, -1).astype(np.float64), y.reshape(6, -1).astype(np.float64)
    cos = np.mean([(a @ b) / np.linalg.norm(a) / np.linalg.norm(b) for a, b in zip(xf, yf)])
    for s in (one.result(), batched.result(), merged):
        # float32 inputs: the differences are float32 (rounded once), every sum is float64
        assert s.cosine == pytest.approx(cos, abs=1e-12)
        assert s.mse == pytest.approx(np.mean((xf - yf) ** 2), rel=1e-6)
        assert s.sqnr_db == pytest.approx(10 * np.log10(np.sum(xf**2) / np.sum((xf - yf) ** 2)), rel=1e-6)
        assert s.max_abs_err == pytest.approx(np.abs(xf - yf).max())
        assert s.samples == 6


def test_zero_tensors_and_exact_match():
    acc = SimilarityAccumulator()
    acc.update(np.zeros(3), np.zeros(3))
    assert acc.result().cosine == 1.0
    assert acc.result().sqnr_db == math.inf
    acc2 = SimilarityAccumulator()
    acc2.update(np.zeros(3), np.ones(3))
    assert acc2.result().cosine == 0.0
    assert acc2.result().sqnr_db == -math.inf
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)


def test_bad_inputs_raise():
    acc = SimilarityAccumulator()
    with pytest.raises(ValueError, match="shape"):
        acc.update(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        acc.update(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="no samples"):
        acc.result()


def test_topk_agreement_and_accuracy():
    t = TopKAgreement(k=2)  # 4 classes: top-2 agreement is reported (2k classes or more)
    t.update([0.1, 0.9, 0.0, 0.0], [0.2, 0.8, 0.0, 0.0], label=1)  # agree, both right
    t.update([0.9, 0.5, 0.0, 0.0], [0.4, 0.6, 0.0, 0.0], label=0)  # disagree; float top-1 (0) in int top-2; int wrong
    t.update([0.0, 0.1, 0.9, 0.0], [0.9, 0.5, 0.0, 0.0], label=None)  # disagree; float top-1 (2) not in int top-2
    d = t.to_dict()
    assert d["samples"] == 3
    assert d["top1_agreement"] == pytest.approx(1 / 3)
    assert d["top2_agreement"] == pytest.approx(2 / 3)
    assert d["labelled"] == 2
    assert d["float_accuracy"] == pytest.approx(1.0)
    assert d["int_accuracy"] == pytest.approx(0.5)
    other = TopKAgreement(k=2)
    other.update([1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], label=0)
    assert t.merge(other).to_dict()["top1_agreement"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="label 7"):
        t.update([1.0, 0.0], [1.0, 0.0], label=7)


@pytest.mark.parametrize(
    "name, label",
    [("imagenet_00_243.jpg", 243), ("a/b/imagenet_19_7.JPEG", 7), ("cat-12.png", 12), ("cat.jpg", None),
     ("img42.jpg", None), ("photo_12_x.jpg", None)],
)
def test_label_from_filename(name, label):
    assert label_from_filename(name) == label


def test_labels_file_text_csv_and_json(tmp_path):
    txt = tmp_path / "labels.txt"
    txt.write_text("# comment\nfile,label\na.jpg,3\nb 5\n\nc.png: 7\n")
    assert load_labels(txt) == {"a.jpg": 3, "b": 5, "c.png": 7}
    js = tmp_path / "labels.json"
    js.write_text('{"a.jpg": 1, "b": 2}')
    resolver = LabelResolver.from_option(js)
    assert resolver(tmp_path / "a.jpg") == 1
    assert resolver("dir/b.png") == 2  # matched by stem
    assert resolver("imagenet_00_243.jpg") is None  # with a labels file, file names are not parsed
    assert LabelResolver.from_option(None)("imagenet_00_243.jpg") == 243


def test_labels_file_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("a.jpg 1\nb.jpg x\n")
    with pytest.raises(ValueError, match="not an integer"):
        load_labels(bad)
    dup = tmp_path / "dup.txt"
    dup.write_text("a 1\na 2\n")
    with pytest.raises(ValueError, match="labelled twice"):
        load_labels(dup)
    js = tmp_path / "bad.json"
    js.write_text('{"a": "x"}')
    with pytest.raises(ValueError, match="not an integer"):
        load_labels(js)
    with pytest.raises(FileNotFoundError):
        load_labels(tmp_path / "missing.txt")


def test_clip_accumulator_counts_values_beyond_half_an_lsb():
    from reports.metrics import ClipAccumulator

    c = ClipAccumulator()
    c.update(np.array([-1.2, -1.0, 0.0, 1.04, 1.06]), -1.05, 1.05)  # -1.2 and 1.06 saturate
    c.update(np.array([[0.0, 2.0]]), np.array([[-1.0, -1.0]]), np.array([[1.0, 3.0]]))  # per-channel: none
    assert (c.clipped, c.elements) == (2, 7)
    assert c.merge(ClipAccumulator(3, 1)).fraction == pytest.approx(3 / 10)


def test_file_name_labels_only_when_every_image_has_one(tmp_path):
    """A folder of unlabelled photos where one file happens to end in `_512` has no labels at all."""
    from ptq.data.labels import LabelResolver

    mixed = [tmp_path / "holiday.jpg", tmp_path / "scan_512.jpg"]
    resolver = LabelResolver.from_option(None, mixed)
    assert [resolver(f) for f in mixed] == [None, None]
    labelled = [tmp_path / "a_3.jpg", tmp_path / "b-17.png"]
    resolver = LabelResolver.from_option(None, labelled)
    assert [resolver(f) for f in labelled] == [3, 17]
    (tmp_path / "labels.txt").write_text("holiday.jpg 5\n")
    assert LabelResolver.from_option(tmp_path / "labels.txt", mixed)(mixed[0]) == 5
