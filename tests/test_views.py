"""`ptq.data.views`: each view is the stated deterministic change of the photo, checked on arrays whose result is
known pixel by pixel."""
from __future__ import annotations

import numpy as np
import pytest

from ptq.data.views import VIEWS, views


def photo(h=10, w=20, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def one(rgb, name, size=(224, 224)):
    [(got_name, out)] = views(rgb, size, [name])
    assert got_name == name and out.dtype == np.uint8 and out.shape[2] == 3
    return out


def test_photo_mirror_and_zoom_are_the_photo_flipped_and_its_central_60_percent():
    rgb = photo()
    assert np.array_equal(one(rgb, "photo"), rgb)
    assert np.array_equal(one(rgb, "mirror"), rgb[:, ::-1])
    assert np.array_equal(one(rgb, "zoom"), rgb[2:8, 4:16])  # 6 x 12 of 10 x 20, centred


def test_low_res_scales_the_short_side_to_half_the_model_input():
    rgb = photo(300, 400)
    assert one(rgb, "low-res", (224, 224)).shape == (112, 149, 3)  # 400 * 112 / 300 = 149.3
    assert one(rgb, "low-res", (64, 96)).shape == (32, 43, 3)
    small = photo(50, 60)
    assert np.array_equal(one(small, "low-res", (224, 224)), small)  # already below half: unchanged


def test_contrast_and_brightness_scale_about_the_mean_grey_and_zero_clipped_at_white():
    rgb = np.zeros((4, 4, 3), np.uint8)
    rgb[:, 2:] = 200  # mean grey 100
    assert sorted(np.unique(one(rgb, "low-contrast"))) == [50, 150]
    assert sorted(np.unique(one(rgb, "dark"))) == [0, 120]
    assert sorted(np.unique(one(rgb, "bright"))) == [0, 255]  # 280 clipped


def test_all_views_in_order_and_unknown_names_rejected():
    assert [n for n, _ in views(photo(), (10, 10))] == list(VIEWS)
    with pytest.raises(ValueError, match="unknown view"):
        views(photo(), (10, 10), ["photo", "sepia"])


def test_tune_uses_every_view_by_default():
    from ptq.tuning.defaults import DEFAULT_VIEWS

    assert DEFAULT_VIEWS == tuple(VIEWS)
