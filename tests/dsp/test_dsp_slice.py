"""The DSP48E2 slice model against Python-integer references of UG579's port widths and wrapping adders."""
import numpy as np
import pytest

from dsp.slice import cascade, macc, macc_chain, multiply, port_a, port_b, port_d, preadd, wrap


def py_wrap(x: int, bits: int) -> int:
    return ((x + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1))


def test_wrap_matches_python_modular_arithmetic():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.integers(-(1 << 60), 1 << 60, 2000), [0, -1, (1 << 47) - 1, 1 << 47, -(1 << 47) - 1]])
    for bits in (11, 18, 27, 48):
        assert wrap(values, bits).tolist() == [py_wrap(int(v), bits) for v in values]


def test_a_port_keeps_only_bits_26_to_0_and_the_preadder_wraps_at_27_bits():
    assert port_a(np.array([(1 << 27) + 5, 1 << 26, -(1 << 29)])).tolist() == [5, -(1 << 26), 0]
    assert preadd(np.array([(1 << 26) - 1]), np.array([1])).tolist() == [-(1 << 26)]
    assert preadd(np.array([-(1 << 26)]), np.array([-1])).tolist() == [(1 << 26) - 1]
    assert preadd(np.array([1000]), np.array([-1001])).tolist() == [-1]


@pytest.mark.parametrize("port, bits", [(port_a, 30), (port_d, 27), (port_b, 18)])
def test_values_beyond_a_port_width_raise(port, bits):
    port(np.array([-(1 << (bits - 1)), (1 << (bits - 1)) - 1]))
    with pytest.raises(ValueError, match=f"{bits}-bit signed"):
        port(np.array([1 << (bits - 1)]))
    with pytest.raises(ValueError, match=f"{bits}-bit signed"):
        port(np.array([-(1 << (bits - 1)) - 1]))


def test_product_is_exact_at_the_port_extremes_and_p_wraps_at_48_bits():
    ad = np.array([-(1 << 26), -(1 << 26), (1 << 26) - 1])
    b = np.array([-(1 << 17), (1 << 17) - 1, -(1 << 17)])
    assert multiply(ad, b).tolist() == [int(x) * int(y) for x, y in zip(ad, b)]
    top = np.array([(1 << 47) - 1])
    assert macc(top, np.array([1]), np.array([1])).tolist() == [-(1 << 47)]
    assert cascade(np.array([-(1 << 47)]), np.array([-1]), np.array([1])).tolist() == [(1 << 47) - 1]


@pytest.mark.parametrize("k, extreme", [(7, False), (40, True), (1100, True)])
def test_macc_chain_equals_step_by_step_maccs(k, extreme):
    """40 (float64 path, wraps) and 1100 (int64 path) products at the port extremes overflow 48 bits."""
    rng = np.random.default_rng(k)
    if extreme:
        ad = rng.choice([-(1 << 26), (1 << 26) - 1], size=(3, k))
        b = rng.choice([-(1 << 17), (1 << 17) - 1], size=(k, 4))
    else:
        ad = rng.integers(-(1 << 26), 1 << 26, size=(3, k))
        b = rng.integers(-(1 << 17), 1 << 17, size=(k, 4))
    p0 = rng.integers(-(1 << 47), 1 << 47, size=(3, 4))
    expected = [[0] * 4 for _ in range(3)]
    for i in range(3):
        for j in range(4):
            p = int(p0[i, j])
            for t in range(k):
                p = py_wrap(p + int(ad[i, t]) * int(b[t, j]), 48)
            expected[i][j] = p
    assert macc_chain(ad, b, p0).tolist() == expected
    steps = p0.copy()
    for t in range(k):
        steps = macc(steps, ad[:, t:t + 1], b[t:t + 1, :])
    assert steps.tolist() == expected


def test_macc_chain_broadcasts_batch_dimensions():
    rng = np.random.default_rng(3)
    ad = rng.integers(-(1 << 20), 1 << 20, size=(2, 1, 3, 5))
    b = rng.integers(-100, 100, size=(4, 5, 6))
    expected = np.matmul(ad, b)  # small enough: no wrap
    assert np.array_equal(macc_chain(ad, b), expected)
