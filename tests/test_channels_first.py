"""`reports.channels_first`: codes of channels-last views copied to C order, checked against numpy's copy."""
import numpy as np
import pytest

from reports.channels_first import channels_first


def _channels_last(a: np.ndarray) -> np.ndarray:
    """`a` as the compiled convolutions hand it over: the same values, the channel axis innermost in memory."""
    view = np.ascontiguousarray(np.moveaxis(a, 1, -1))
    return np.moveaxis(view, -1, 1)


@pytest.mark.parametrize("shape", [(1, 8, 8, 8), (2, 16, 7, 7), (1, 13, 5, 9), (3, 24, 14, 14), (1, 5, 3, 3),
                                   (1, 96, 1, 1), (2, 3, 17), (1, 40, 2, 3, 5), (2, 48, 9, 7), (1, 64, 16, 16)])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_channels_last_bytes_are_copied_to_c_order(shape, dtype):
    """Blocks of 16 x 16 and 8 x 8 and every kind of leftover (channels or positions not a multiple of 16 or 8),
    several rows, ranks 3-5."""
    rng = np.random.default_rng(sum(shape))
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    last = _channels_last(a)
    assert last.flags.c_contiguous == (np.prod(shape[2:]) == 1)  # one position: channels-last is C order too
    out = channels_first(last)
    assert out.flags.c_contiguous and out.dtype == a.dtype
    np.testing.assert_array_equal(out, a)


def test_every_byte_lands_in_its_place():
    """Distinct values (the flat C-order index mod 251) so that any swapped byte shows."""
    shape = (2, 24, 9, 10)
    a = (np.arange(np.prod(shape)) % 251).astype(np.uint8).reshape(shape)
    np.testing.assert_array_equal(channels_first(_channels_last(a)), a)


def test_read_only_codes_are_copied():
    a = np.random.default_rng(1).integers(-128, 127, size=(1, 32, 5, 5)).astype(np.int8)
    last = _channels_last(a)
    last.flags.writeable = False
    np.testing.assert_array_equal(channels_first(last), a)


def test_other_layouts_and_dtypes_are_copied_by_numpy():
    rng = np.random.default_rng(0)
    a = rng.integers(-300, 300, size=(1, 16, 6, 6)).astype(np.int16)
    np.testing.assert_array_equal(channels_first(_channels_last(a)), a)  # 2-byte codes
    b = rng.integers(0, 255, size=(1, 16, 6, 6)).astype(np.uint8)
    strided = b[:, :, ::2, :]  # neither C order nor channels-last
    np.testing.assert_array_equal(channels_first(strided), np.ascontiguousarray(strided))
    contiguous = np.ascontiguousarray(b)
    assert channels_first(contiguous) is contiguous
