"""Mixed 4-bit/8-bit DSP lanes (`ptq tune --scheme int4-dsp`) on a model: the trade-off points the tuner
measured, each assignment's cosine on held-out photos against onnxruntime's float logits, and the tuned mix
bit-exact through `dsp:lanes`.

    python bench/int4_mix.py [--model examples/efficientnet_lite0.onnx --calib examples/calib
                              --eval /work/shared/assets/images/eval --target 0.98 --out /tmp/int4_mix]

Steps: `ptq calibrate` (8-bit, default scheme) on --calib; `ptq.tune(scheme="int4-dsp")` on --calib only (a
third of it validates, no views); then on --eval: onnxruntime's float logits beside ptq's integer logits of
all-int8, all-int4, the tuned mix and every assignment the tuner measured (cosine mean and min, top-1
agreement with the float model); last, every integer tensor of the tuned mix on --exact-photos photos through
the plain backend and through `dsp:lanes` (each 4-bit layer on int4 lanes, each 8-bit one on int8 lanes).
The tune result is cached in --out (delete it to tune again). With --grids, the 4-bit grid variants are
compared first (all-int4 and a fixed 40 %-of-MACs assignment on the validation photos). --fixed adds Lite0's
fixed 40 % assignment (LITE0_FIXED_40) to the table, also with its 4-bit weights reading the 8-bit inputs (what
the weights' 4 bits alone cost). --equalize calibrates the 8-bit base with cross-layer equalization
(`ptq calibrate --equalize`); the tune, the table and the written tuned model all use its equalized weights.

Measured (2-core shared machine, Lite0 with examples/calib: 16 fit photos, 7 validation photos without views;
20 eval photos). 4-bit grids, mean cosine on the 7 validation photos, all-int4 / the 40 % of the MACs whose
4-bit lanes save most, 8-bit base without bias correction:

    pow2, max|w|, extrema, no bias corr.   0.109 / 0.555      free, mse, mse, no bias corr.   0.275 / 0.838
    pow2, mse, mse, no bias corr.          0.196 / 0.774      free, mse, mse, bias corr.      0.642 / 0.866
    pow2, mse, mse, bias corr.             0.337 / 0.827      + AdaRound                      0.606 / 0.883
    bias correction of the input's rounding as well as the weight's: 0.866 -> 0.868 at 40 %

The rows above predate the two fixes below (their 4-bit layers with a dead channel ran on max|w| / 7.5).
On the bias-corrected 8-bit base (0.9944 / 0.9957 on the eval photos), the 14 layers of 40 % of the MACs (the
sensitivity order of the earlier nearest-rounding tune), validation / eval cosine:

    tensor fits, nearest                  0.9755 / 0.9757     output fits, nearest                  0.9776 / 0.9769
    tensor fits, GPTQ                     0.9768 / 0.9798     output fits, AdaRound                 0.9785 / 0.9808
    output fits, GPTQ damping 0.01        0.9798 / 0.9787     output fits, GPTQ damping >= K/n (default) 0.9796 / 0.9807
    dropped: per-channel scales x0.9-1.2 chosen by GPTQ's output error 0.9764 / 0.9794; GPTQ towards the rounded
    input (W Hxq Hqq^-1) 0.904 / 0.894; sequential bias correction in the mixed graph (each layer's bias from its
    real quantized input, topological order) -0.003 / +0.000 on the 4-bit layers, -0.005 / -0.002 on all layers.

Fixes: a 4-bit weight entry's range was its extrema, so `floor_weight_scales`, raising a dead channel's scale,
recomputed every channel from it (5 of the 14 layers off their fitted grid, GPTQ's codes re-rounded); GPTQ's
dampening is at least K / n (n / K ~ 4 on the 7x7 layers overfit the 16 fit photos at 0.01) and an input dead on
the fit photos keeps its weights (GPTQ's reference code zeroed them). GPTQ is the default (`--rounding`). The
tuner's sensitivities are cross-fitted (each half of the fit photos scored by the 4-bit layers fitted to the other
half; measured where GPTQ was fitted, the 7x7 layers looked up to 4x cheaper than on the eval photos).
Tuned (`--bias-correction --fixed`, target 0.98, z = 2; default calibrator auto, 16-bit exchanges): 13 of 50
layers, 35.5 % of the MACs on 4-bit lanes, 2.429 MACs/DSP/cycle, validation 0.9829 (bound 0.9802), eval cosine
0.9833 (min 0.969, top-1 agreement with float 90 %, top-1 70 % against float's 80 %); all-int8 1.999 / 0.9958
(100 %), all-int4 3.637 / 0.756 (85 %); 38.3 % (2.470) scores 0.9830 (validation 0.9804), the fixed 40 % above
(2.495) 0.9816 (validation 0.9794) on the eval photos. The exchanges: the stem on 16-bit lanes with 38.3 % on
4-bit lanes 2.387, validation 0.9853 (reached), eval 0.9842; with 41.1 % 2.427, validation 0.9843 (bound 0.97998,
missed), eval 0.9811; neither faster than 35.5 %. Target 0.997 (above all-int8's bound 0.9925): the stem and
the first depthwise layer on 16-bit lanes and 5.8 % of the MACs on 4-bit lanes, 1.982, validation 0.9977, eval
0.9973; all-int16 1.000 / 0.9995. Before these changes (extrema default, no exchanges): 32.7 % (2.389) at eval
0.9853; before GPTQ and the cross-fitted sensitivities (nearest, in-sample sensitivities): 33.5 % (2.400) at
0.9785; GPTQ with in-sample sensitivities: 28.8 % (2.334) at 0.9875.
Cross-layer equalization of the 8-bit base (`--equalize --bias-correction --fixed`) hurts Lite0, dropped: all-int8
0.9944 / 0.9957 -> 0.9895 / 0.9924 (validation / eval); the fixed 40 % 0.9796 / 0.9807 -> 0.9643 / 0.9691; its
4-bit weights reading 8-bit inputs 0.9823 / 0.9848 -> 0.9772 / 0.9789, so the 4 bits of the weights cost 0.0121 /
0.0109 without and 0.0124 / 0.0135 with it: balanced weight columns do not help the per-channel GPTQ-rounded 4-bit
weights, and the depthwise outputs' channels, spread by 1/s_c, lose resolution on their per-tensor 8- and 4-bit
grids. Tuned: 3 layers, 5.9 % of the MACs (2.060) at eval 0.9898 against 32.7 % without. Mini ResNet (target
0.998): 98.3 % either way, eval 0.99894 -> 0.99916, validation 0.99921 -> 0.99914, all-int4 0.99703 -> 0.99621.
Mini ResNet (`--model bench/models/mini_resnet.onnx --calib bench/models/mini_resnet_data/calib --eval
bench/models/mini_resnet_data/eval --data`): target 0.998 -> 98.3 % (3.935) at 0.99884 (nearest, earlier: 71.3 %,
3.108), target 0.98 -> 100 % (4.000) at 0.99787; all-int8 0.99995, all-int4 0.99708.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402

import ptq  # noqa: E402
from dsp.backend import DspLanesBackend  # noqa: E402
from ptq.adjust.adjusted_model import load_model_for_table  # noqa: E402
from ptq.data.image_source import ImageSet  # noqa: E402
from ptq.data_options import DataOptions  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.table.quant_table import load_quant_table  # noqa: E402
from ptq.tuning.data import split_samples  # noqa: E402
from ptq.tuning.lane_mix import Int4Grid, LaneMix, four_bit_macs, lane_throughput  # noqa: E402
from ptq.tuning.tuner import fit_statistics  # noqa: E402
from reports.lane_pareto import pareto_svg  # noqa: E402


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# Lite0's 14 layers holding 40.0 % of its MACs: the head of the order of the nearest-rounding tune (DSP operations
# saved per unit of sensitivity); the fixed assignment the 4-bit grid levers are compared on (docs/dsp.md)
LITE0_FIXED_40 = ["node_Conv_829", "node_Conv_849", "node_Conv_844", "node_Conv_834", "node_Conv_841", "node_Conv_859",
                  "node_Conv_846", "node_Conv_819", "node_Conv_864", "node_Conv_816", "node_Conv_869", "node_Conv_856",
                  "node_Conv_809", "node_Conv_861"]


def most_saving(layers, fraction: float) -> list[str]:
    """The layers saving most DSP operations on 4-bit lanes, in that order, until they hold `fraction` of the
    MACs (the fixed assignment the grids are compared on; the same layers on an equalized model)."""
    ranked = sorted(layers, key=lambda layer: layer.ops_at(4) - layer.ops_at(8))
    total, order, acc = sum(layer.macs for layer in ranked), [], 0
    for layer in ranked:
        if acc >= fraction * total:
            break
        order.append(layer.node)
        acc += layer.macs
    return order


def built(mix: LaneMix, four: list[str], sixteen: list[str] = (), inputs8: bool = False):
    """The mix's graph and table with `four` on 4-bit lanes and `sixteen` on 16-bit ones; `inputs8`: the 4-bit
    weights read the 8-bit inputs (what the weights' 4 bits alone cost; not a lane assignment: an 8-bit input does
    not fit int4 lanes)."""
    if not inputs8:
        return mix.build(four, sixteen)
    graph, table = mix.build(four, sixteen, every_edge=True)
    return graph, dataclasses.replace(table, tensors={
        **table.tensors, **{mix.copies[n]: mix.table.tensors[mix.by_node[n].data] for n in four}})


def compare_grids(graph, table, samples, fraction: float) -> None:
    fit, held = split_samples(samples, fraction)
    stats = fit_statistics(graph, fit, ["mse", "extrema"])
    feeds = [x for _, x, _ in held.samples(graph)]
    session = ort.InferenceSession(str(graph_path), providers=["CPUExecutionProvider"])  # the user's model
    ref = [session.run(None, x)[0] for x in feeds]
    grids = {"pow2, max|w|, extrema, no bias corr.": Int4Grid(pow2=True, weight_fit="max",
                                                             activation_calibrator="extrema", bias_correction=False),
             "pow2, mse, mse, no bias corr.": Int4Grid(pow2=True, bias_correction=False),
             "pow2, mse, mse, bias corr.": Int4Grid(pow2=True),
             "free, mse, mse, no bias corr.": Int4Grid(bias_correction=False),
             "free, mse, mse, bias corr. (default)": Int4Grid(),
             "free, mse, mse, AdaRound, bias corr.": Int4Grid(rounding="adaround"),
             "free, mse, mse, GPTQ, bias corr.": Int4Grid(rounding="gptq")}
    print(f"4-bit grids (scales, weight fit, activation calibrator, rounding, bias correction) on {len(feeds)} "
          "validation photos: mean cosine vs onnxruntime float")
    order = None
    for name, grid in grids.items():
        mix = LaneMix(graph, table, stats, grid, (x for _, x, _ in fit.samples(graph)))
        if order is None:
            order = most_saving(mix.layers, 0.4)
        row = []
        for four in ([layer.node for layer in mix.layers], order):
            prepared = prepare(*mix.build(four))
            row.append(np.mean([cosine(r, prepared.run(x).outputs[graph.outputs[0]]) for x, r in zip(feeds, ref)]))
        print(f"  {name:<40} all int4 {row[0]:.4f}   40 % of MACs int4 {row[1]:.4f}")


def main() -> int:
    global graph_path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="examples/efficientnet_lite0.onnx")
    parser.add_argument("--calib", default="examples/calib")
    parser.add_argument("--eval", default="/work/shared/assets/images/eval")
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--z", type=float, default=2.0)
    parser.add_argument("--validation-fraction", type=float, default=0.34)
    parser.add_argument("--num-eval", type=int, default=20)
    parser.add_argument("--exact-photos", type=int, default=1)
    parser.add_argument("--pow2", action="store_true", help="power-of-two 4-bit scales (WP521)")
    parser.add_argument("--rounding", choices=["nearest", "adaround", "gptq"], default="gptq",
                        help="how the 4-bit weights are rounded (Int4Grid.rounding)")
    parser.add_argument("--bias-correction", action="store_true", help="calibrate the 8-bit table with bias correction")
    parser.add_argument("--equalize", action="store_true",
                        help="calibrate the 8-bit table with cross-layer equalization (the tune starts from it)")
    parser.add_argument("--fixed", action="store_true",
                        help="also score Lite0's fixed 40 %% assignment (LITE0_FIXED_40) on validation and eval photos")
    parser.add_argument("--grids", action="store_true", help="compare the 4-bit grid variants first")
    parser.add_argument("--data", action="store_true", help="--calib and --eval are .npy sample files")
    parser.add_argument("--out", default="/tmp/int4_mix")
    parser.add_argument("--svg", help="draw every point's held-out cosine against its throughput here")
    args = parser.parse_args()
    graph_path = Path(args.model)
    out = Path(args.out)
    stem = graph_path.stem
    source = {"data": args.calib} if args.data else {"images": args.calib}
    table_path = out / f"{stem}.quant.json"
    if not table_path.exists():
        ptq.calibrate(args.model, out=out, quiet=True, bias_correction=args.bias_correction,
                      equalize=args.equalize, **source)
    table = load_quant_table(table_path)
    graph = load_model_for_table(args.model, table, table_path, note=False)  # bias-corrected weights, if any
    if args.grids:
        opts = DataOptions(**source)
        compare_grids(graph, table, ImageSet.from_source(opts.source(table.options.preprocess), None, None, 0),
                      args.validation_fraction)
    record_path = out / f"{stem}.tune.json"
    start = time.time()
    if not record_path.exists():
        ptq.tune(args.model, quant=table_path, target_cosine=args.target, scheme="int4-dsp", views=[], z=args.z,
                 validation_fraction=args.validation_fraction, quiet=True, no_check=True,
                 int4_grid=Int4Grid(pow2=args.pow2, rounding=args.rounding), **source)
        print(f"tuned in {time.time() - start:.0f} s")
    record = json.loads(record_path.read_text())
    lanes = record["lanes"]
    tuned_table = load_quant_table(out / f"{stem}.tuned.quant.json")
    tuned_graph = load_model_for_table(args.model, tuned_table, out / f"{stem}.tuned.quant.json", note=False)

    print(f"\nlayers ({len(lanes['layers'])}): lanes, MACs, sensitivity (fit-photo cosine drop alone at 4 bits, "
          "cross-fitted; - on 16-bit lanes)")
    for row in sorted(lanes["layers"], key=lambda r: -r["macs"])[:12]:
        sensitivity = "-" if row["sensitivity"] is None else format(row["sensitivity"], "+.5f")
        print(f"  {row['node']:<28} {row['lanes']:>2}-bit {row['macs']:>11,} {sensitivity:>8}")
    print(f"  ... ({len(lanes['layers']) - 12} more in {record_path})")

    eval_opts = DataOptions(**({"data": args.eval} if args.data else {"images": args.eval}))
    photos = ImageSet.from_source(eval_opts.source(table.options.preprocess), None, args.num_eval, 0)
    read = list(photos.samples(graph))
    feeds = [x for _, x, _ in read]
    labels = [label for _, _, label in read]
    labelled = all(label is not None for label in labels)
    session = ort.InferenceSession(str(graph_path), providers=["CPUExecutionProvider"])
    ref = [session.run(None, x)[0] for x in feeds]
    fit, held = split_samples(ImageSet.from_source(DataOptions(**source).source(table.options.preprocess), None, None,
                                                   0), args.validation_fraction)
    grid = Int4Grid(**lanes["int4_grid"])
    mix = LaneMix(graph, table, fit_statistics(graph, fit, [grid.activation_calibrator]), grid,
                  (x for _, x, _ in fit.samples(graph)))
    print(f"\ntrade-off points ({len(lanes['points'])} measured by the tuner on {record['validation_samples']} "
          f"validation photos) and on {len(feeds)} held-out photos, ptq integer logits vs onnxruntime float:")
    if labelled:
        print(f"top-1 of onnxruntime float against the labels: "
              f"{np.mean([int(np.argmax(r)) == int(label) for r, label in zip(ref, labels)]):.0%}")
    print(f"{'point':<34} {'4-bit MACs':>10} {'16-bit layers':>13} {'MACs/DSP/cyc':>12} {'val cos':>8} {'eval cos':>8} "
          f"{'eval min':>8} {'top-1 agree':>11}" + (f" {'top-1':>6}" if labelled else ""))
    chosen = lanes["chosen"]
    drawn = []
    fixed = []
    if args.fixed:  # scored on the tuner's validation photos as the tuner scores its points
        four = LITE0_FIXED_40
        if not set(four) <= set(mix.by_node):
            missing = sorted(set(four) - set(mix.by_node))
            raise SystemExit(f"--fixed: {args.model} lacks Lite0's layers {', '.join(missing[:3])}, ...")
        held_feeds = [x for _, x, _ in held.samples(graph)]
        for inputs8 in (False, True):
            prepared = prepare(*built(mix, four, inputs8=inputs8))
            val = np.mean([cosine(session.run(None, x)[0], prepared.run(x).outputs[graph.outputs[0]])
                           for x in held_feeds])
            fixed.append(dict(label=f"FIXED 40 %{', 8-bit inputs' if inputs8 else ''}", four=four, inputs8=inputs8,
                              cosine=float(val), four_bit_macs=four_bit_macs(mix.layers, four),
                              throughput=lane_throughput(mix.layers, four)))
    for point in lanes["points"] + fixed + [dict(chosen, label="TUNED: " + chosen["label"])]:
        prepared = prepare(*built(mix, point["four"], point.get("sixteen", []), point.get("inputs8", False)))
        ys = [prepared.run(x).outputs[graph.outputs[0]] for x in feeds]
        cos = [cosine(r, y) for r, y in zip(ref, ys)]
        agree = np.mean([int(np.argmax(r)) == int(np.argmax(y)) for r, y in zip(ref, ys)])
        top1 = np.mean([int(np.argmax(y)) == int(label) for y, label in zip(ys, labels)]) if labelled else None
        print(f"{point['label'][:34]:<34} {point['four_bit_macs']:>10.1%} {len(point.get('sixteen', [])):>13} "
              f"{point['throughput']:>12.3f} "
              f"{point['cosine']:>8.5f} {np.mean(cos):>8.5f} {np.min(cos):>8.5f} {agree:>11.0%}"
              + (f" {top1:>6.0%}" if labelled else ""))
        drawn.append(dict(point, cosine=float(np.mean(cos))))
    if args.svg:
        svg = pareto_svg(drawn[:-1 - len(fixed)], drawn[-1], args.target,
                         f"{graph_path.name}: cosine on {len(feeds)} held-out samples against DSP throughput")
        Path(args.svg).write_text(svg + "\n", encoding="utf-8")
        print(f"wrote {args.svg}")
    same = prepare(tuned_graph, tuned_table).run(feeds[0]).outputs[graph.outputs[0]]
    rebuilt = prepare(*mix.build(chosen["four"], chosen["sixteen"])).run(feeds[0]).outputs[graph.outputs[0]]
    print("\nthe written tuned model and table give the same logits as the rebuilt mix:", np.array_equal(same, rebuilt))
    eight = [layer.weight for layer in mix.layers if layer.node not in set(chosen["four"]) | set(chosen["sixteen"])]
    print(f"the written tuned model has the calibrated model's weights ({len(eight)} 8-bit layers"
          f"{', equalized' if table.options.equalize else ''}):",
          all(np.array_equal(tuned_graph.initializers[w], graph.initializers[w]) for w in eight))

    for k, x in enumerate(feeds[:args.exact_photos]):
        start = time.time()
        backend = DspLanesBackend()
        plain = prepare(tuned_graph, tuned_table, backend="numpy").run(x, keep_all=True).tensors
        dsp = prepare(tuned_graph, tuned_table, backend=backend).run(x, keep_all=True).tensors
        differ = [name for name in plain if not np.array_equal(plain[name], dsp[name])]
        print(f"photo {k}: {len(plain)} integer tensors, {len(differ)} differ between numpy and dsp:lanes; dot "
              f"products on int4 lanes {backend.lanes['int4']}, int8 {backend.lanes['int8']}, wider "
              f"{backend.lanes['wide']} ({time.time() - start:.0f} s)")
    return 0


graph_path = Path()

if __name__ == "__main__":
    sys.exit(main())
