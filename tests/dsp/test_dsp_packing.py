"""Packed products on the slice model: every uint4 x int4 input of WP521's four lanes, a stratified million
int8 triples per WP486 case (the exhaustive 2^24 run is `bench/dsp.py`), and accumulation depth K."""
import itertools

import numpy as np
import pytest

from dsp.packing import CodeRange, Extraction, Int4x4, Int8x2, extract, extract_sum
from dsp.slice import macc, macc_chain, preadd

INT8, UINT8, INT4, UINT4 = CodeRange(8, True), CodeRange(8, False), CodeRange(4, True), CodeRange(4, False)
CASES = {"iii": (INT8, INT8), "uii": (UINT8, INT8), "iuu": (INT8, UINT8), "uuu": (UINT8, UINT8)}  # (shared, packed)


def one_product(ports):
    a, d, b = ports
    return macc(np.zeros(np.broadcast(a, b).shape, dtype=np.int64), preadd(d, a), b)


def int4_exhaustive():
    grid = np.meshgrid(np.arange(16), np.arange(16), np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
    x1, x2, w1, w2 = (g.ravel() for g in grid)
    return x1, x2, w1, w2


def test_int4x4_every_input_exact():
    scheme = Int4x4(x=UINT4, w=INT4)
    x1, x2, w1, w2 = int4_exhaustive()
    assert x1.size == 16 ** 4
    lanes = extract(one_product(scheme.ports(w1, w2, x1, x2)), scheme.lanes, Extraction.EXACT)
    for got, want in zip(lanes, (x1 * w1, x2 * w1, x1 * w2, x2 * w2)):
        assert np.array_equal(got, want)


def test_int4x4_naive_slicing_has_the_published_mean_absolute_error():
    """Sommer et al. 2022: plain bit slicing of the WP521 layout, mean absolute error about 0.37 per product.
    Exact extraction has 0, a wrong layout or extraction far more; each lane is off by -1 exactly when the
    lanes below it sum to a negative value."""
    scheme = Int4x4(x=UINT4, w=INT4)
    x1, x2, w1, w2 = int4_exhaustive()
    p = one_product(scheme.ports(w1, w2, x1, x2))
    lanes = extract(p, scheme.lanes, Extraction.NAIVE)
    truth = (x1 * w1, x2 * w1, x1 * w2, x2 * w2)
    errors = np.stack([got - want for got, want in zip(lanes, truth)])
    mae = np.abs(errors).mean()
    assert 0.36 < mae < 0.38, mae
    below = [np.zeros_like(x1), x1 * w1, x2 * w1 * 2 ** 11 + x1 * w1, x1 * w2 * 2 ** 22 + x2 * w1 * 2 ** 11 + x1 * w1]
    for error, rest in zip(errors, below):
        assert np.array_equal(error, -(rest < 0).astype(np.int64))


def test_int4_preadder_sign_guard():
    """W2 at D[25:22] never overflows the 27-bit pre-adder; at D[26:23], W2 = -8 with W1 < 0 does."""
    w1, w2 = (g.ravel() for g in np.meshgrid(np.arange(-8, 8), np.arange(-8, 8)))
    assert np.array_equal(preadd(w2 * 2 ** 22, w1), w2 * 2 ** 22 + w1)
    shifted = preadd(w2 * 2 ** 23, w1)
    wrong = shifted != w2 * 2 ** 23 + w1
    assert np.array_equal(wrong, (w2 == -8) & (w1 < 0))


def stratified_triples(packed: CodeRange, shared: CodeRange, count: int, seed: int):
    """(low, high, shared) codes: every combination of sign strata (negative / zero / positive) in equal shares,
    plus every triple of the extremes and their neighbours."""
    rng = np.random.default_rng(seed)

    def strata(code):
        return [(code.lo, -1), (0, 0), (1, code.hi)] if code.signed else [(0, 0), (1, code.hi)]

    def edges(code):
        return sorted({code.lo, code.lo + 1, -1 if code.signed else 0, 0, 1, code.hi - 1, code.hi})

    combos = list(itertools.product(strata(packed), strata(packed), strata(shared)))
    per = count // len(combos)
    columns = [[], [], []]
    for combo in combos:
        for column, (lo, hi) in zip(columns, combo):
            column.append(rng.integers(lo, hi + 1, per))
    grid = np.array(list(itertools.product(edges(packed), edges(packed), edges(shared)))).T
    return [np.concatenate(column + [extra]) for column, extra in zip(columns, grid)]


@pytest.mark.parametrize("case", CASES)
def test_int8x2_stratified_million_exact_and_naive_off_by_one_below_negative_lane(case):
    shared, packed = CASES[case]
    scheme = Int8x2(packed=packed, shared=shared)
    assert scheme.case == case
    low, high, s = stratified_triples(packed, shared, 1_000_000, seed=len(case) + ord(case[0]))
    assert low.size >= 1_000_000 and {low.min(), high.min(), s.min()} <= {packed.lo, shared.lo}
    p = one_product(scheme.ports(low, high, s))
    lo, hi = extract(p, scheme.lanes, Extraction.EXACT)
    assert np.array_equal(lo, low * s) and np.array_equal(hi, high * s)
    naive_lo, naive_hi = extract(p, scheme.lanes, Extraction.NAIVE)
    assert np.array_equal(naive_lo, low * s)
    # WP486: without the +bit17 correction every result with low * s < 0 is one too small in the upper lane
    assert np.array_equal(naive_hi - high * s, -(low * s < 0).astype(np.int64))
    if case != "uuu":
        assert np.count_nonzero(low * s < 0) > 100_000


@pytest.mark.parametrize("scheme, depth", [
    (Int8x2(packed=INT8, shared=INT8), 7),
    (Int8x2(packed=INT8, shared=UINT8), 4),
    (Int8x2(packed=UINT8, shared=INT8), 4),
    (Int8x2(packed=UINT8, shared=UINT8), 4),
    (Int4x4(x=UINT4, w=INT4), 8),
    (Int4x4(x=INT4, w=INT4), 15),
])
def test_depth_formula(scheme, depth):
    assert scheme.depth == depth


# (scheme, packed/w code, shared/x code): the product that limits K, repeated in every lane
WORST = [
    (Int8x2(packed=INT8, shared=INT8), -128, -128),  # 16384: 7 * 16384 < 2^17 <= 8 * 16384
    (Int8x2(packed=INT8, shared=UINT8), -128, 255),  # -32640: 4 fit, 5 pass -2^17
    (Int8x2(packed=UINT8, shared=INT8), 255, -128),
    (Int8x2(packed=UINT8, shared=UINT8), 255, 255),  # 65025 in an unsigned 18-bit lane: 4 fit, 5 do not
    (Int4x4(x=UINT4, w=INT4), -8, 15),  # -120 in 11 bits: 8 fit (-960), 9 do not (-1080 < -1024)
    (Int4x4(x=INT4, w=INT4), -8, -8),  # 64: 15 fit (960), 16 do not (1024 > 1023)
]


def chain_lanes(scheme, w: int, x: int, depth: int) -> list[np.ndarray]:
    """Lanes of one MACC chain of `depth` identical products w * x in every lane."""
    if isinstance(scheme, Int8x2):
        a, d, b = scheme.ports(np.full(depth, w), np.full(depth, w), np.full(depth, x))
    else:
        a, d, b = scheme.ports(np.full(depth, w), np.full(depth, w), np.full(depth, x), np.full(depth, x))
    p = macc_chain(preadd(d, a)[None, :], b[:, None])
    return [lane.ravel() for lane in extract(p, scheme.lanes, Extraction.EXACT)]


@pytest.mark.parametrize("scheme, w, x", WORST)
def test_accumulation_exact_at_depth_and_wrong_one_past_it(scheme, w, x):
    k = scheme.depth
    assert all(lane.tolist() == [k * w * x] for lane in chain_lanes(scheme, w, x, k))
    over = chain_lanes(scheme, w, x, k + 1)
    assert over[0].tolist() != [(k + 1) * w * x]  # the bottom lane left its range


def test_extract_sum_equals_summing_extracted_chunks():
    rng = np.random.default_rng(5)
    for scheme in (Int8x2(packed=INT8, shared=UINT8), Int4x4(x=UINT4, w=INT4)):
        p = rng.integers(-(1 << 47), 1 << 47, size=(6, 3, 5))  # arbitrary P values, overflowed lanes included
        for mode in Extraction:
            per_chunk = extract(p, scheme.lanes, mode)
            sums = extract_sum(p, scheme.lanes, mode, axis=0)
            assert all(np.array_equal(s, c.sum(axis=0)) for s, c in zip(sums, per_chunk))
