import json
import logging

import numpy as np
import pytest
from PIL import Image

from ptq.data.images import (
    ImageLog,
    InputSpec,
    Preprocess,
    decode_image,
    find_files,
    iter_batches,
    iter_images,
    load_image,
    preprocess_array,
    select_files,
)

RAW = Preprocess(mean=0, std=1, crop_ratio=1.0)


def save(path, arr, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, **kwargs)
    return path


def test_find_files_recursive_sorted_and_hidden_ignored(tmp_path):
    a = save(tmp_path / "b.png", np.zeros((2, 2, 3), np.uint8))
    b = save(tmp_path / "sub" / "deeper" / "a.JPG", np.zeros((2, 2, 3), np.uint8))
    save(tmp_path / ".hidden" / "c.png", np.zeros((2, 2, 3), np.uint8))
    save(tmp_path / ".d.png", np.zeros((2, 2, 3), np.uint8))
    assert find_files(tmp_path) == sorted([a, b])


def test_every_supported_extension_decodes(tmp_path):
    arr = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    log = ImageLog()
    for ext in ("png", "bmp", "webp", "tiff", "tif", "jpg", "jpeg"):
        kwargs = {"lossless": True} if ext == "webp" else {}
        save(tmp_path / f"x.{ext}", arr, **kwargs)
    files = select_files(tmp_path, log)
    assert len(files) == 7 and not log.skipped
    for path in files:
        got = decode_image(path)
        assert got.shape == (6, 5, 3)
        if path.suffix not in (".jpg", ".jpeg"):
            np.testing.assert_array_equal(got, arr)


def test_non_image_and_corrupt_files_are_skipped_counted_and_warned(tmp_path, caplog):
    good = save(tmp_path / "good.png", np.full((4, 4, 3), 9, np.uint8))
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "empty.png").write_bytes(b"")
    log = ImageLog()
    with caplog.at_level(logging.WARNING, logger="ptq.data.images"):
        candidates = select_files(tmp_path, log)
        samples = list(iter_images(candidates, RAW, InputSpec("NCHW", 3, 4, 4), log))
    assert len(samples) == 1 and log.used == [good]
    assert sorted(p.name for p, _ in log.skipped) == ["broken.jpg", "empty.png", "notes.txt"]
    assert sum("skipping" in r.message for r in caplog.records) == 3


def test_empty_folder_and_missing_folder_are_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        select_files(tmp_path, ImageLog())
    with pytest.raises(ValueError, match="not found"):
        select_files(tmp_path / "nope", ImageLog())
    (tmp_path / "file.png").write_bytes(b"")
    with pytest.raises(ValueError, match="expects a folder"):
        select_files(tmp_path / "file.png", ImageLog())


def test_grayscale_rgba_palette_and_16bit_are_converted(tmp_path):
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    np.testing.assert_array_equal(decode_image(save(tmp_path / "g.png", gray)), np.stack([gray] * 3, axis=2))

    rgba = np.random.default_rng(1).integers(0, 256, (3, 4, 4), dtype=np.uint8)
    np.testing.assert_array_equal(decode_image(save(tmp_path / "a.png", rgba)), rgba[:, :, :3])

    pal = Image.new("P", (4, 3))
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    pal.putdata([0, 1] * 6)
    pal.save(tmp_path / "p.png")
    expected = np.array([[255, 0, 0], [0, 0, 255]] * 6, np.uint8).reshape(3, 4, 3)
    np.testing.assert_array_equal(decode_image(tmp_path / "p.png"), expected)

    deep = np.array([[0, 257 * 100, 65535, 257 * 3]], dtype=np.uint16)
    save(tmp_path / "d.png", deep)
    got = decode_image(tmp_path / "d.png")
    np.testing.assert_array_equal(got[0, :, 0], [0, 100, 255, 3])
    assert (got[..., 0] == got[..., 2]).all()


def test_exif_orientation_is_applied(tmp_path):
    arr = np.zeros((2, 3, 3), np.uint8)  # 2 rows, 3 columns; mark the top-left pixel
    arr[0, 0] = 255
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    img.save(tmp_path / "r.png", exif=exif.tobytes())
    got = decode_image(tmp_path / "r.png")
    assert got.shape == (3, 2, 3)
    # rotating 90 degrees clockwise moves the top-left pixel to the top-right
    assert got[0, 1, 0] == 255 and got[..., 0].sum() == 255


def test_center_crop_without_resize_matches_slicing():
    rgb = np.random.default_rng(2).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    pre = Preprocess(mean=(10, 20, 30), std=(2, 4, 8), crop_ratio=0.5)  # short side 200 = 100 / 0.5
    x = preprocess_array(rgb, pre, InputSpec("NCHW", 3, 100, 100))
    crop = rgb[50:150, 100:200].astype(np.float64)
    expected = ((crop - [10, 20, 30]) / [2, 4, 8]).transpose(2, 0, 1)
    assert x.dtype == np.float32 and x.shape == (3, 100, 100)
    np.testing.assert_allclose(x, expected, rtol=1e-6)


def test_resize_short_side_then_center_crop_geometry():
    rgb = np.zeros((200, 400, 3), np.uint8)  # left half red, right half blue
    rgb[:, :200, 0] = 255
    rgb[:, 200:, 2] = 255
    x = preprocess_array(rgb, Preprocess(mean=0, std=1, resize=100), InputSpec("NHWC", 3, 100, 100))
    # resized to 200 x 100; the crop covers x in [50, 150) of it, the color edge sits at crop column 50
    assert x.shape == (100, 100, 3)
    assert (x[:, :48, 0] == 255).all() and (x[:, :48, 2] == 0).all()
    assert (x[:, 52:, 2] == 255).all() and (x[:, 52:, 0] == 0).all()


def test_default_crop_ratio_resizes_short_side_to_crop_over_ratio(tmp_path):
    # 512 x 256 image, 224 crop at ratio 0.875 -> short side 256: no resize, crop the middle
    rgb = np.random.default_rng(3).integers(0, 256, (256, 512, 3), dtype=np.uint8)
    x = preprocess_array(rgb, Preprocess(mean=0, std=1), InputSpec("NHWC", 3, 224, 224))
    np.testing.assert_array_equal(x, rgb[16:240, 144:368].astype(np.float32))


def test_bgr_layout_and_single_mean_value():
    rgb = np.empty((4, 4, 3), np.uint8)
    rgb[:] = (10, 20, 30)
    pre = Preprocess(mean=127, std=128, crop_ratio=1.0, bgr=True)
    nchw = preprocess_array(rgb, pre, InputSpec("NCHW", 3, 4, 4))
    np.testing.assert_allclose(nchw[:, 0, 0], [(30 - 127) / 128, (20 - 127) / 128, (10 - 127) / 128], rtol=1e-6)
    nhwc = preprocess_array(rgb, pre, InputSpec("NHWC", 3, 4, 4))
    np.testing.assert_array_equal(nhwc, nchw.transpose(1, 2, 0))


def test_one_channel_input_uses_luma():
    rgb = np.empty((2, 2, 3), np.uint8)
    rgb[:] = (100, 200, 50)
    x = preprocess_array(rgb, Preprocess(mean=0, std=1, crop_ratio=1.0), InputSpec("NCHW", 1, 2, 2))
    assert x.shape == (1, 2, 2)
    np.testing.assert_allclose(x, 0.299 * 100 + 0.587 * 200 + 0.114 * 50, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"std": 0}, "std must be positive"),
        ({"mean": "1,2"}, "one value or three"),
        ({"mean": "a,b,c"}, "expects numbers"),
        ({"crop_ratio": 1.5}, "crop ratio"),
        ({"resize": -3}, "resize"),
        ({"layout": "CHW"}, "layout"),
    ],
)
def test_bad_preprocess_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Preprocess(**kwargs)


def test_config_file_and_flag_override(tmp_path):
    cfg = tmp_path / "pre.json"
    cfg.write_text(json.dumps({"mean": [1, 2, 3], "std": 4, "crop-ratio": 0.5, "bgr": True}))
    pre = Preprocess.from_config(cfg, std="8", layout=None)
    assert pre.mean == (1.0, 2.0, 3.0) and pre.std == (8.0, 8.0, 8.0)
    assert pre.crop_ratio == 0.5 and pre.bgr and pre.layout is None
    cfg.write_text(json.dumps({"meen": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        Preprocess.from_config(cfg)
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Preprocess.from_config(cfg)


def test_input_spec_from_model_shape():
    assert InputSpec.from_shape((1, 3, 224, 200)) == InputSpec("NCHW", 3, 224, 200)
    assert InputSpec.from_shape((None, 32, 48, 3)) == InputSpec("NHWC", 3, 32, 48)
    with pytest.raises(ValueError, match="rank 4"):
        InputSpec.from_shape((1, 3, 224))
    with pytest.raises(ValueError, match="dynamic spatial"):
        InputSpec.from_shape((1, 3, None, None))
    with pytest.raises(ValueError, match="layout"):
        InputSpec.from_shape((1, 8, 8, 8))


def test_num_images_samples_valid_images_with_seed(tmp_path):
    for k in range(10):
        save(tmp_path / f"{k}.png", np.full((2, 2, 3), k, np.uint8))
    for k in range(5):
        (tmp_path / f"bad{k}.png").write_bytes(b"junk")
    spec = InputSpec("NHWC", 3, 2, 2)

    def sample(seed):
        log = ImageLog()
        values = [int(x[0, 0, 0]) for x in iter_images(select_files(tmp_path, log, num_images=4, seed=seed),
                                                       RAW, spec, log, num_images=4)]
        return values, log

    values, log = sample(0)
    assert len(values) == 4 and len(set(values)) == 4 and len(log.used) == 4
    assert sample(0)[0] == values  # same seed, same sample
    assert any(sample(seed)[0] != values for seed in (1, 2, 3))
    with pytest.raises(ValueError, match="positive"):
        select_files(tmp_path, ImageLog(), num_images=0)


def test_iter_batches_groups_and_keeps_the_remainder():
    batches = list(iter_batches(iter(np.arange(7, dtype=np.float32)[:, None]), 3))
    assert [b.shape for b in batches] == [(3, 1), (3, 1), (1, 1)]
    np.testing.assert_array_equal(np.concatenate(batches)[:, 0], np.arange(7))
    with pytest.raises(ValueError, match="batch-size"):
        list(iter_batches(iter([np.zeros(1)]), 0))


def test_load_image_end_to_end(tmp_path):
    arr = np.random.default_rng(4).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    path = save(tmp_path / "x.png", arr)
    x = load_image(path, RAW, InputSpec("NCHW", 3, 8, 8))
    np.testing.assert_array_equal(x, arr.transpose(2, 0, 1).astype(np.float32))


def test_exif_orientation_is_applied_to_jpeg(tmp_path):
    arr = np.zeros((16, 32, 3), np.uint8)  # landscape, bright block at the top-left
    arr[:8, :8] = 255
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 8  # "rotate 90 CCW to display": the top-left block ends up bottom-left
    img.save(tmp_path / "r.jpg", exif=exif.tobytes(), quality=95)
    got = decode_image(tmp_path / "r.jpg").astype(float)
    assert got.shape == (32, 16, 3)
    assert got[-8:, :8].mean() > 200 and got[:8, :8].mean() < 50 and got[-8:, -8:].mean() < 50
