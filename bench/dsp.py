"""Benchmark: the packed-DSP48E2 emulation (`dsp`), exhaustively and on EfficientNet-Lite0.

    python3 bench/dsp.py [--model M] [--calib DIR] [--images DIR] [--time-images N] [--skip-exhaustive]

1. Every single-product input: all 2^24 int8 triples (low, high, shared) of each WP486 case (iii, uii, iuu,
   uuu) and all 2^16 uint4 x int4 inputs of WP521's four lanes: exact extraction must show 0 errors; naive bit
   slicing's error rate and mean absolute error per product are printed (Sommer et al. 2022: about 0.37 for INT4).
2. Lite0 (calibrated here on --calib, not timed; int8, and `--scheme int4-dsp` for dsp:int4): every integer
   tensor of every eval photo through the DSP backend against the default backend's, then the time per image
   of the DSP backends beside the int64 numpy reference of the same dot products and the default backend (as
   ratios, images interleaved so that machine load hits all alike).
3. Naive extraction's effect: logits cosine, top-1 agreement with float and top-1 accuracy over the eval photos,
   exact beside naive.
4. Resources: MACs per DSP per cycle for int8 and int4 against the seeds' 2 and 4, and the lanes lost to odd
   channel counts (padding) and to dot products shorter than whole chains of K.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ptq.cli import one_blas_thread  # noqa: E402  (imports no numpy)

one_blas_thread()  # as the `ptq` command runs; before numpy is imported

import numpy as np  # noqa: E402

from dsp.backend import DspBackend  # noqa: E402
from dsp.packing import CodeRange, Extraction, Int4x4, Int8x2, extract  # noqa: E402
from dsp.slice import macc, preadd  # noqa: E402
from ptq.engine.backends import get_backend  # noqa: E402
from ptq.core.graph import load_model  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.data.images import Preprocess  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from reports.output_metrics import OutputMetrics  # noqa: E402
from reports.evaluate import evaluate  # noqa: E402
from ptq.data.image_source import ImageSet  # noqa: E402

INT8, UINT8, INT4, UINT4 = CodeRange(8, True), CodeRange(8, False), CodeRange(4, True), CodeRange(4, False)
SEED_MACS_PER_DSP = {"int8": 2, "int4": 4}  # WP486, WP521


class Int64Reference:
    """The numpy reference of the very dot products the DSP backends see: int64 np.matmul, depthwise included."""

    name = "int64 numpy"
    direct_depthwise = False

    def matmul(self, a, b):
        return np.matmul(a.astype(np.int64), b.astype(np.int64))


def _product(ports):
    a, d, b = ports
    return macc(np.zeros(np.broadcast(a, b).shape, dtype=np.int64), preadd(d, a), b)


def exhaustive_int8() -> None:
    print("WP486 INT8 x 2, every (low, high, shared) triple: 2^24 per case")
    print(f"{'case':<5} {'K':>3} {'exact errors':>12} {'naive wrong':>12} {'naive MAE/product':>18} {'seconds':>8}")
    pairs = np.stack(np.meshgrid(np.arange(256), np.arange(256), indexing="ij"), -1).reshape(-1, 2)
    for shared, packed in ((INT8, INT8), (UINT8, INT8), (INT8, UINT8), (UINT8, UINT8)):
        scheme = Int8x2(packed=packed, shared=shared)
        low, high = (pairs[:, 0] + packed.lo)[None, :], (pairs[:, 1] + packed.lo)[None, :]
        exact_errors = naive_wrong = 0
        naive_abs = 0
        start = time.perf_counter()
        for block in range(0, 256, 16):
            s = (np.arange(block, block + 16) + shared.lo)[:, None]
            p = _product(scheme.ports(low, high, s))
            truth = (low * s, high * s)
            for lane, want in zip(extract(p, scheme.lanes, Extraction.EXACT), truth):
                exact_errors += int(np.count_nonzero(lane != want))
            for lane, want in zip(extract(p, scheme.lanes, Extraction.NAIVE), truth):
                naive_wrong += int(np.count_nonzero(lane != want))
                naive_abs += int(np.abs(lane - want).sum())
        seconds = time.perf_counter() - start
        products = 2 * (1 << 24)
        print(f"{scheme.case:<5} {scheme.depth:>3} {exact_errors:>12} {naive_wrong / products:>11.1%} "
              f"{naive_abs / products:>18.4f} {seconds:>8.1f}")


def exhaustive_int4() -> None:
    scheme = Int4x4(x=UINT4, w=INT4)
    grid = np.meshgrid(np.arange(16), np.arange(16), np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
    x1, x2, w1, w2 = (g.ravel() for g in grid)
    p = _product(scheme.ports(w1, w2, x1, x2))
    truth = (x1 * w1, x2 * w1, x1 * w2, x2 * w2)
    exact = sum(int(np.count_nonzero(g != t)) for g, t in zip(extract(p, scheme.lanes, Extraction.EXACT), truth))
    naive = np.stack([g - t for g, t in zip(extract(p, scheme.lanes, Extraction.NAIVE), truth)])
    print(f"\nWP521 INT4 x 4 (uint4 x int4), every (A1, A2, W1, W2): {x1.size} inputs, {4 * x1.size} products, "
          f"K = {scheme.depth}")
    print(f"  exact errors {exact}; naive: {np.count_nonzero(naive) / naive.size:.1%} wrong, mean absolute error "
          f"{np.abs(naive).mean():.4f} per product (published: about 0.37), per lane "
          + ", ".join(f"{np.abs(lane).mean():.3f}" for lane in naive))


def _interleaved(fns: dict, samples: list, name: str) -> dict[str, float]:
    for fn in fns.values():
        fn({name: samples[0]})
    totals = dict.fromkeys(fns, 0.0)
    for x in samples:
        for key, fn in fns.items():
            start = time.perf_counter()
            fn({name: x})
            totals[key] += time.perf_counter() - start
    return {key: total / len(samples) for key, total in totals.items()}


def identical(label: str, graph, table, samples: list, scheme: str) -> None:
    """Every integer tensor of every sample through dsp:<scheme> against the default backend's."""
    name = graph.inputs[0]
    default, dsp = prepare(graph, table), prepare(graph, table, backend=DspBackend(scheme))
    photos = tensors = 0
    for x in samples:
        want, got = default.run({name: x}).tensors, dsp.run({name: x}).tensors
        same = sum(np.array_equal(codes, got[k]) for k, codes in want.items())
        photos += same == len(want)
        tensors = len(want)
    print(f"\n{label}: dsp:{scheme} integer tensors identical to the default backend's ({tensors} tensors per "
          f"photo) on {photos}/{len(samples)} eval photos")


def timing(label: str, graph, table, samples: list, scheme: str) -> None:
    name = graph.inputs[0]
    default_backend = get_backend(None)
    prepared = {b.name: prepare(graph, table, backend=b) for b in
                (Int64Reference(), default_backend, DspBackend(scheme), DspBackend(scheme, "naive"))}
    times = _interleaved({k: (lambda x, p=p: p.run(x, keep_all=False)) for k, p in prepared.items()}, samples, name)
    base, default = times["int64 numpy"], times[default_backend.name]
    print(f"  time per image over {len(samples)} image(s), one BLAS thread:")
    for key, seconds in times.items():
        print(f"  {key:<16} {1000 * seconds:8.1f} ms   {seconds / base:5.2f}x int64 numpy   "
              f"{seconds / default:5.2f}x default ({default_backend.name})")


def accuracy(label: str, graph, table, images: ImageSet, scheme: str) -> None:
    print(f"\n{label}: output against the float model over {images.expected} eval photo(s)")
    print(f"{'backend':<16} {'logits cosine':>13} {'top-1 agree':>11} {'top-1 acc':>9}")
    for backend in ("numpy", f"dsp:{scheme}", f"dsp:{scheme}:naive"):
        ev = evaluate(graph, table, images, layers=False, isolated=False, backend=backend)
        metrics, c = OutputMetrics.of(ev), ev.classification
        acc = f"{c.test_correct}/{c.labelled}" if c.labelled else "-"
        print(f"{backend:<16} {metrics.cosine:13.6f} {metrics.top1_agreement:11.3f} {acc:>9}")


def resources(runs: dict) -> None:
    print("\nresources per Lite0 image (all Conv, Gemm dot products; depthwise packs pixels)")
    print(f"{'scheme':<7} {'MACs':>12} {'DSP ops':>12} {'MACs/DSP/cycle':>14} {'with chains':>11} {'seed':>5} "
          f"{'padding lost':>12} {'chain lost':>10}")
    for scheme, stats in runs.items():
        print(f"{scheme:<7} {stats.macs:>12,} {stats.ops:>12,} {stats.macs / stats.ops:>14.3f} "
              f"{stats.macs / stats.chain_ops:>11.3f} {SEED_MACS_PER_DSP[scheme]:>5} {stats.padding_loss:>12.1%} "
              f"{stats.chain_loss:>10.1%}")
    print("(MACs/DSP/cycle: useful products per slice cycle; 'with chains': every dot product rounded up to whole "
          "MACC chains of K slices, K from the operand ranges)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--calib", default=str(REPO / "examples" / "calib"))
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--time-images", type=int, default=4, help="images for the timing (default 4)")
    parser.add_argument("--skip-exhaustive", action="store_true")
    args = parser.parse_args(argv)

    if not args.skip_exhaustive:
        exhaustive_int8()
        exhaustive_int4()

    pre = Preprocess(mean=127, std=128)
    graph = load_model(args.model)
    print(f"\ncalibrating {Path(args.model).name} on {args.calib} (int8, and --scheme int4-dsp for dsp:int4) ...",
          flush=True)
    int8 = calibrate(args.model, args.calib, preprocess=pre, write_qdq=False, progress=False)
    int4 = calibrate(args.model, args.calib, preprocess=pre, scheme="int4-dsp", write_qdq=False, progress=False)
    models = {  # the int4-dsp graph carries its Requantize nodes
        "int8": ("Lite0 int8", int8.graph, int8.table),
        "int4": ("Lite0 int4 (calibrate --scheme int4-dsp)", int4.graph, int4.table),
    }
    images = ImageSet.from_folder(args.images, pre)
    samples = [inputs[graph.inputs[0]] for _p, inputs, _l in images.samples(graph)]
    runs = {}
    for scheme, (label, graph, table) in models.items():
        identical(label, graph, table, samples, scheme)
        timing(label, graph, table, samples[: args.time_images], scheme)
        backend = DspBackend(scheme)
        prepare(graph, table, backend=backend).run({graph.inputs[0]: samples[0]}, keep_all=False)
        runs[scheme] = backend.stats
        accuracy(label, graph, table, images, scheme)
    resources(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
