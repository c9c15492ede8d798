"""Streaming, mergeable similarity metrics between a float reference tensor x and a test tensor y.

Each image is one *sample*. Per sample the accumulator folds in, with float64 sums (`reports.pair_sums`):

    dot = sum(x*y), xx = sum(x^2), yy = sum(y^2), se = sum((x - y)^2), n = x.size, max|x - y|

and the per-sample cosine `dot / sqrt(xx * yy)`. It keeps only these scalars, so memory does not grow
with the number of images, and two accumulators over disjoint image sets merge into the accumulator of
their union (`merge`).

Definitions (the same everywhere in ptq's reports):

- cosine      = mean over samples of the per-sample cosine of the flattened tensors (the whitepaper's
                per-layer cosine similarity, averaged over images). Two all-zero tensors have cosine 1;
                one all-zero tensor against a non-zero one has cosine 0.
- mse         = sum(se) / sum(n)                                     (over all elements of all samples)
- sqnr_db     = 10 * log10(sum(xx) / sum(se))                        (signal = the float reference;
                +inf when the error is exactly 0, -inf when the reference is all zero and the error is not)
- max_abs_err = max over all samples of max|x - y|
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reports.pair_sums import PairSums, compare


@dataclass(frozen=True)
class Similarity:
    """The metrics of one tensor pair over a set of samples (see the module docstring)."""

    cosine: float
    mse: float
    sqnr_db: float
    max_abs_err: float
    samples: int

    def to_dict(self) -> dict:
        return {"cosine": self.cosine, "mse": self.mse, "sqnr_db": self.sqnr_db, "max_abs_err": self.max_abs_err}


def sample_cosine(dot: float, xx: float, yy: float) -> float:
    """cos = dot / sqrt(xx * yy), with 1 for two zero tensors and 0 for exactly one zero tensor."""
    if xx == 0.0 and yy == 0.0:
        return 1.0
    if xx == 0.0 or yy == 0.0:
        return 0.0
    # clipped with Python's min/max, as np.clip would (NaN kept): 0.3 us against 5 us, and a sharded report's
    # driver re-adds every sample's sums (`reports.evaluate_shards.merge_evaluations`: 125 per image)
    return min(max(dot / math.sqrt(xx * yy), -1.0), 1.0)


@dataclass
class SimilarityAccumulator:
    """Folds (reference, test) tensor pairs into running sums; `result()` gives the `Similarity`."""

    samples: int = 0
    elements: int = 0
    cosine_sum: float = 0.0
    signal: float = 0.0  # sum of x^2 over everything seen
    squared_error: float = 0.0
    max_abs_err: float = 0.0

    def update(self, reference: np.ndarray, test: np.ndarray) -> None:
        """Fold in one sample: the whole arrays, flattened, are one image's tensor (`reports.pair_sums.compare`)."""
        self.add(compare(reference, test)[0])

    def add(self, sums: PairSums) -> None:
        """Fold in one sample's sums."""
        self._add(dot=sums.dot, xx=sums.xx, yy=sums.yy, se=sums.se, max_err=sums.max_err, n=sums.n, samples=1)

    def update_batch(self, reference: np.ndarray, test: np.ndarray) -> None:
        """Fold in a batch: axis 0 indexes samples, the rest of each sample is flattened."""
        x, y = np.asarray(reference), np.asarray(test)
        if x.ndim == 0 or x.shape != y.shape:
            raise ValueError(f"update_batch needs equal shapes with a batch axis, got {x.shape} and {y.shape}")
        for xi, yi in zip(x, y):
            self.update(xi, yi)

    def _add(self, *, dot: float, xx: float, yy: float, se: float, max_err: float, n: int, samples: int) -> None:
        self.cosine_sum += sample_cosine(dot, xx, yy)
        self.samples += samples
        self.elements += n
        self.signal += xx
        self.squared_error += se
        self.max_abs_err = max(self.max_abs_err, max_err)

    def merge(self, other: "SimilarityAccumulator") -> "SimilarityAccumulator":
        """The accumulator of the union of both sample sets (neither input is modified)."""
        return SimilarityAccumulator(
            samples=self.samples + other.samples,
            elements=self.elements + other.elements,
            cosine_sum=self.cosine_sum + other.cosine_sum,
            signal=self.signal + other.signal,
            squared_error=self.squared_error + other.squared_error,
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
        )

    def result(self) -> Similarity:
        if self.samples == 0:
            raise ValueError("similarity: no samples were accumulated")
        return Similarity(
            cosine=self.cosine_sum / self.samples,
            mse=self.squared_error / self.elements,
            sqnr_db=sqnr_db(self.signal, self.squared_error),
            max_abs_err=self.max_abs_err,
            samples=self.samples,
        )


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) with +inf for zero noise and -inf for zero signal with noise."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@dataclass
class TopKAgreement:
    """How often the test model's classification agrees with the reference's, per sample (rows of logits).

    - top1_agreement: argmax(test) == argmax(reference)
    - top5_agreement: argmax(reference) is among the 5 largest test scores; reported only for at least
      2 x 5 = 10 classes (`meaningful_topk`: with 4 classes the top 5 holds every class and agrees always)
    - accuracy: with labels, the fraction of labelled samples whose argmax equals the label (for the
      reference and the test model separately); unlabelled samples are skipped (label None).
    Ties in argmax resolve to the lowest index (numpy's argmax).
    """

    k: int = 5
    classes: int = 0  # the score vectors' length (0: no sample yet)
    samples: int = 0
    top1_agree: int = 0
    topk_agree: int = 0
    labelled: int = 0
    reference_correct: int = 0
    test_correct: int = 0

    def update(self, reference: np.ndarray, test: np.ndarray, label: "int | None" = None) -> None:
        """One sample: `reference` and `test` are score vectors of the same length (any shape, flattened)."""
        x = np.asarray(reference, dtype=np.float64).ravel()
        y = np.asarray(test, dtype=np.float64).ravel()
        if x.shape != y.shape or x.size == 0:
            raise ValueError(f"top-k agreement: score shapes {x.shape} and {y.shape} must match and be non-empty")
        ref_top1 = int(np.argmax(x))
        test_top1 = int(np.argmax(y))
        k = min(self.k, y.size)
        test_topk = np.argpartition(-y, k - 1)[:k]
        self.classes = x.size
        self.samples += 1
        self.top1_agree += int(ref_top1 == test_top1)
        self.topk_agree += int(ref_top1 in test_topk)
        if label is not None:
            if not 0 <= label < x.size:
                raise ValueError(f"label {label} outside the model's {x.size} classes")
            self.labelled += 1
            self.reference_correct += int(ref_top1 == label)
            self.test_correct += int(test_top1 == label)

    @property
    def meaningful_topk(self) -> bool:
        """Whether top-k agreement tells anything: at least 2k classes (top 5 of 10 already holds half)."""
        return self.classes >= 2 * self.k

    def merge(self, other: "TopKAgreement") -> "TopKAgreement":
        if self.k != other.k:
            raise ValueError(f"cannot merge top-{self.k} and top-{other.k} agreement")
        return TopKAgreement(
            k=self.k,
            classes=max(self.classes, other.classes),
            samples=self.samples + other.samples,
            top1_agree=self.top1_agree + other.top1_agree,
            topk_agree=self.topk_agree + other.topk_agree,
            labelled=self.labelled + other.labelled,
            reference_correct=self.reference_correct + other.reference_correct,
            test_correct=self.test_correct + other.test_correct,
        )

    def to_dict(self) -> dict:
        if self.samples == 0:
            raise ValueError("top-k agreement: no samples were accumulated")
        out = {"samples": self.samples, "top1_agreement": self.top1_agree / self.samples}
        if self.meaningful_topk:
            out[f"top{self.k}_agreement"] = self.topk_agree / self.samples
        if self.labelled:
            out["labelled"] = self.labelled
            out["float_accuracy"] = self.reference_correct / self.labelled
            out["int_accuracy"] = self.test_correct / self.labelled
        return out


@dataclass
class ValueAgreement:
    """How many values of an index or boolean output (ArgMax, TopK indices, a mask) equal the reference's:
    exact comparison, element by element. An output whose length depends on the data (NonMaxSuppression's
    selected boxes) is compared row by row along axis 0 over the rows both have; each row only one of them has
    counts as unequal. Merging adds the counts."""

    values: int = 0
    equal: int = 0

    def update(self, reference: np.ndarray, test: np.ndarray) -> None:
        x, y = np.asarray(reference), np.asarray(test)
        if x.shape[1:] != y.shape[1:] or x.ndim == 0:
            raise ValueError(f"agreement: output shapes {x.shape} and {y.shape} must match past axis 0")
        rows = min(len(x), len(y))
        row_size = int(np.prod(x.shape[1:], dtype=np.int64))
        self.values += max(len(x), len(y)) * row_size
        self.equal += int(np.count_nonzero(x[:rows] == y[:rows]))

    def merge(self, other: "ValueAgreement") -> "ValueAgreement":
        return ValueAgreement(self.values + other.values, self.equal + other.equal)

    @property
    def fraction(self) -> float:
        return self.equal / self.values if self.values else float("nan")

    def to_dict(self) -> dict:
        return {"agreement": self.fraction, "values": self.values, "equal": self.equal}


@dataclass
class ClipAccumulator:
    """How many float values fall outside what a tensor's quantization grid can represent:
    below real_min - scale/2 or above real_max + scale/2 (those saturate to qmin/qmax when quantized)."""

    elements: int = 0
    clipped: int = 0

    def update(self, reference: np.ndarray, low, high) -> None:
        """`low`/`high`: scalars, or arrays broadcastable against `reference` (per-channel grids)."""
        x = np.asarray(reference)
        self.elements += x.size
        if np.ndim(low) == 0 and np.ndim(high) == 0 and x.min() >= low and x.max() <= high:
            return  # the common case, two reductions instead of two masks
        self.clipped += int(np.count_nonzero(x < low)) + int(np.count_nonzero(x > high))

    def add(self, elements: int, clipped: int) -> None:
        """Fold in counts made elsewhere (`reports.pair_sums.compare`)."""
        self.elements += elements
        self.clipped += clipped

    def merge(self, other: "ClipAccumulator") -> "ClipAccumulator":
        return ClipAccumulator(self.elements + other.elements, self.clipped + other.clipped)

    @property
    def fraction(self) -> float:
        return self.clipped / self.elements if self.elements else 0.0
