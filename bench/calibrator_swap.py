"""Which tensors' choices make one calibrator's table better or worse than another's: each differing activation
entry of table B set back to table A's, one at a time, and the figure it gives.

    python bench/calibrator_swap.py MODEL [--a extrema] [--b auto] [--eval N] [--top 25]

MODEL: a model of bench/first_try.py (efficientnet_lite0, mobilenet_v3_small, dbnet_detector, char_tagger) or
of bench/detectors.py (yolo, crnn), with the same arrays. The figure: first_try's (mean cosine, or tag agreement)
or, for yolo, the box/score output's cosine and the matched detections, for crnn the greedy CTC decode agreement.
Each swap keeps the rest of table B, re-raises the weight-scale floors, and runs ptq's integer graph on the
held-out arrays (`--eval`: the first N). Prints A's and B's figures, then every swap sorted by what setting that
one tensor back to A's entry gains; a sum of gains far from B - A says the tensors interact.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import detectors  # noqa: E402
import first_try  # noqa: E402
from make_samples import write_samples  # noqa: E402
from ptq.calibration.pipeline import calibrate  # noqa: E402
from ptq.engine.weight_scale_floor import floor_weight_scales  # noqa: E402


def arrays(model: str, tmp: Path, limit: int):
    """(model path, calibration files, held-out feeds)."""
    if model in detectors.MODELS:
        folders = write_samples()[model]
        path = first_try.MODELS / detectors.MODELS[model]
        name = first_try.input_name(path)
        held = [{name: a} for a in detectors.load_arrays(folders["eval"])]
        return path, sorted(folders["calib"].glob("*.npy")), held[: limit or None]
    path = first_try.model_path(model)
    data = first_try.samples(model, limit)
    return path, first_try.write_feeds(data.calib, tmp / "calib"), data.held_out[: limit or None]


def figure(model: str, ref: list, got: list, feeds: list) -> tuple:
    """(the figure swaps are sorted by, a note)."""
    if model == "crnn":
        agree = float(np.mean([detectors.greedy_decode(r) == detectors.greedy_decode(g) for r, g in zip(ref, got)]))
        return agree, ""
    if model == "yolo":
        row = detectors.figures("yolo", ref, got)
        return row["cosine"], f"matched/float/int detections {row['dets']}"
    return first_try.score(got, ref, feeds).key(), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--a", default="extrema")
    parser.add_argument("--b", default="auto")
    parser.add_argument("--eval", type=int, default=0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, calib, held = arrays(args.model, Path(tmp), args.eval)
        ref = first_try.ort_outputs(onnx.load(str(path)), held, optimized=True)
        a = calibrate(str(path), data=calib, out_dir=Path(tmp) / "a", calibrator=args.a)
        b = calibrate(str(path), data=calib, out_dir=Path(tmp) / "b", calibrator=args.b)
    run = lambda result, table: figure(args.model, ref, first_try.integer_outputs(result.graph, table, held), held)
    base_a, base_b = run(a, a.table), run(b, b.table)
    print(f"{args.a}: {base_a[0]:.6f} {base_a[1]}\n{args.b}: {base_b[0]:.6f} {base_b[1]}")
    differing = [n for n, e in b.table.tensors.items() if e.kind == "activation" and n in a.table.tensors
                 and e.qparams != a.table.tensors[n].qparams]
    gains = []
    for name in differing:
        tensors = dict(b.table.tensors)
        tensors[name] = a.table.tensors[name]
        floor_weight_scales(b.graph, tensors, b.table.options)
        value, note = run(b, dataclasses.replace(b.table, tensors=tensors))
        gains.append((value - base_b[0], name, b.table.tensors[name].calibrator, note))
    print(f"{len(differing)} entries differ; sum of one-at-a-time gains {sum(g[0] for g in gains):+.6f}, "
          f"{args.a} - {args.b} {base_a[0] - base_b[0]:+.6f}")
    print(f"| gain setting it to {args.a}'s | tensor | {args.b}'s choice | |\n|---:|---|---|---|")
    for gain, name, label, note in sorted(gains, reverse=True)[: args.top]:
        print(f"| {gain:+.6f} | {name} | {label} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
