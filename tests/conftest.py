"""Shared fixtures: the real assets in ../shared/assets (and the bundled copy in examples/)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SHARED_ASSETS = Path(os.environ.get("PTQ_ASSETS", REPO.parent / "shared" / "assets"))


def _require(path: Path) -> Path:
    if not path.exists():
        if os.environ.get("PTQ_REQUIRE_ASSETS"):
            raise FileNotFoundError(f"test asset missing: {path} (set PTQ_ASSETS to the assets folder)")
        pytest.skip(f"test asset missing: {path}")
    return path


@pytest.fixture(scope="session")
def model_path() -> Path:
    """EfficientNet-Lite0 as bundled in examples/."""
    return _require(EXAMPLES / "efficientnet_lite0.onnx")


@pytest.fixture(scope="session")
def calib_dir() -> Path:
    return _require(EXAMPLES / "calib")


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """20 labelled ImageNet photos (not redistributed in the repo: they come from ../shared/assets)."""
    return _require(SHARED_ASSETS / "images" / "eval")
