"""Output-channel splits of int4-dsp layers, simulated: part of a 4-bit layer's output channels back on 8-bit
lanes, cosine on validation and eval photos against the share of MACs on 4-bit lanes.

    python bench/int4_mix.py --bias-correction --out /tmp/int4_split   # the 8-bit table and the tune record
    python bench/int4_split.py --out /tmp/int4_split [--keep 0 0.1 0.25 --heads 14 17 20]

A Conv's output channels are independent dot products, so a layer can run some of them on 4-bit lanes (its
4-bit weights, GPTQ-rounded and bias-corrected, reading its 4-bit input copy) and the rest on 8-bit lanes (the
8-bit table's weights and bias, reading the 8-bit input), both onto the layer's 8-bit output grid. Simulated
exactly in integers: the mix is built with every layer reading a Requantize copy (`LaneMix.build(every_edge=
True)`) twice, A with the split layers on 4-bit lanes and B with them on 8-bit lanes (same steps, step by step);
A runs, and at each split layer B's Requantize (the identity onto the 8-bit grid) and B's Conv step also run on
A's values, and the layer's output takes B's codes on the kept channels, A's on the others. That is what two
Convs joined by a Concat on the channel axis compute (the 4-bit input copy keeps the grid fitted to the whole
layer). The kept channels of each 4-bit layer: the `--keep` fraction with the largest mean squared difference
between its 4-bit and 8-bit lane outputs (codes, same grid) on the fit photos, all of the set's layers on
4-bit lanes. Layer sets: Lite0's fixed 40 % (`LITE0_FIXED_40`) and the heads of the tuner's order (DSP
operations saved per sensitivity, from the tune record). MACs on 4-bit lanes and throughput count a split
layer by its channel shares: ops = (1 - keep) ops_4 + keep ops_8. `--rank`: the kept channels by that
difference (diff), by it times the next dense layers' weight energy on the channel (next, `downstream_energy`), or
at random; `--global-from N`: the head of N layers with channels returned to 8-bit lanes across layers
(`allocated`) down to each MAC share.

Measured (Lite0, bias-corrected 8-bit base, examples/calib: 16 fit and 7 validation photos, 20 eval photos;
docs/dsp.md has the table): nothing kept reproduces the mix (the 14 layers of 40 %: 0.9796 / 0.9807), every channel
kept all-int8 (--keep 1: 0.9944 / 0.9957). Keeping the 10 % of channels with the largest difference (27-31 % of the
squared difference) gains no more than 10 % chosen at random (36.1 %: 0.9803 / 0.9819, next 0.9816 / 0.9816, random
0.9815 / 0.9813). At equal MACs a split does no better than whole layers (30.0 % split: 0.9831 / 0.9847, 32.7 %
whole: 0.9850 / 0.9853). Channels chosen across the first 20 (17) layers down to 40 %: 0.9797 / 0.9801 (0.9800 /
0.9797). No split reaches 40 % of the MACs at validation 0.984.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import onnxruntime as ort  # noqa: E402

from ops.registry import IntRuntime  # noqa: E402

from int4_mix import LITE0_FIXED_40, cosine  # noqa: E402
from ptq.adjust.adjusted_model import load_model_for_table  # noqa: E402
from ptq.data.image_source import ImageSet  # noqa: E402
from ptq.data_options import DataOptions  # noqa: E402
from ptq.engine.executor import prepare  # noqa: E402
from ptq.table.quant_table import load_quant_table  # noqa: E402
from ptq.tuning.data import split_samples  # noqa: E402
from ptq.tuning.lane_mix import Int4Grid, LaneMix  # noqa: E402
from ptq.tuning.lane_tuner import SENSITIVITY_FLOOR  # noqa: E402
from ptq.tuning.tuner import fit_statistics  # noqa: E402


class SplitRun:
    """The integer run of `four` on 4-bit lanes with `split` of them keeping some output channels on 8-bit lanes."""

    def __init__(self, mix: LaneMix, four: list[str], split: list[str]):
        self.a = prepare(*mix.build(four, every_edge=True))
        self.b = prepare(*mix.build([n for n in four if n not in set(split)], every_edge=True))
        for sa, sb in zip(self.a.steps, self.b.steps, strict=True):
            assert sa.node.name == sb.node.name and sa.node.outputs == sb.node.outputs, sa.node.name
        copies = {mix.copies[n]: n for n in split}
        self.requant = {}  # step index -> the split layer whose input copy it writes
        self.conv = {}  # step index -> the split layer it computes
        for index, step in enumerate(self.a.steps):
            for name in step.node.outputs:
                if name in copies:
                    self.requant[index] = copies[name]
            for name in step.node.inputs:
                if name in copies:
                    self.conv[index] = copies[name]
        assert len(self.requant) == len(self.conv) == len(split), (self.requant, self.conv)
        self.copies = {n: mix.copies[n] for n in split}

    def run(self, x, keep: dict[str, np.ndarray], diffs: dict[str, np.ndarray] = None) -> np.ndarray:
        """Logits with each split layer's channels `keep[layer]` (boolean) from the 8-bit lanes; `diffs`: add
        each split layer's per-channel sum of squared code differences (4-bit lanes minus 8-bit lanes)."""
        values = dict(self.a.quantized_inputs(x))
        eight = {}  # split layer -> its input on the 8-bit grid (B's Requantize)
        runtime_a, runtime_b = IntRuntime(backend=self.a.backend), IntRuntime(backend=self.b.backend)
        for index, (sa, sb) in enumerate(zip(self.a.steps, self.b.steps)):
            node = sa.node
            args = [(values[i] if i in values else self.a.graph.initializers[i]) if i else None
                    for i in node.all_inputs]
            results = self.a.run_step(sa, args, runtime_a)
            layer = self.requant.get(index)
            if layer is not None:
                eight[layer] = self.b.run_step(sb, args, runtime_b)[0]
            layer = self.conv.get(index)
            if layer is not None:
                args_b = [eight[layer] if i == self.copies[layer] else
                          (values[i] if i in values else self.b.graph.initializers[i]) if i else None
                          for i in node.all_inputs]
                wide = self.b.run_step(sb, args_b, runtime_b)[0]
                if diffs is not None:
                    d = (results[0].astype(np.float64) - wide) ** 2
                    diffs[layer] = diffs.get(layer, 0) + d.sum(axis=tuple(i for i in range(d.ndim) if i != 1))
                mask = keep[layer].reshape((1, -1) + (1,) * (results[0].ndim - 2))
                results = [np.where(mask, wide, results[0]).astype(results[0].dtype)] + list(results[1:])
            values.update((name, value) for name, value in zip(node.outputs, results) if name)
        return self.a.qparams[self.a.graph.outputs[0]].dequantize(values[self.a.graph.outputs[0]])


def downstream_energy(mix: LaneMix, node: str) -> np.ndarray:
    """Per output channel c of layer `node`: the factor its error's energy gains at the next dense layers (through
    elementwise nodes: Clip, Add): ||W[:, c]||^2 of each dense layer reached, times ||D_c||^2 of a depthwise one
    passed on the way (its channel c reads only channel c); clipping and spatial correlation ignored."""
    graph, consumers = mix.graph, mix.graph.consumers()
    channels = graph.initializers[mix.by_node[node].weight].shape[0]
    total = np.zeros(channels)
    frontier = [(mix.by_node[node].output, np.ones(channels), 0)]
    while frontier:
        tensor, factor, depth = frontier.pop()
        for user in consumers.get(tensor, []):
            if user.name in mix.by_node and tensor == mix.by_node[user.name].data:
                w = graph.initializers[mix.by_node[user.name].weight].astype(np.float64)
                if user.attr("group", 1) == channels and w.shape[1] == 1:  # depthwise: channel c to channel c
                    frontier.append((user.outputs[0], factor * (w.reshape(channels, -1) ** 2).sum(axis=1), depth))
                else:
                    total += factor * (np.moveaxis(w, 1, 0).reshape(channels, -1) ** 2).sum(axis=1)
            elif depth < 4 and user.name not in mix.by_node:
                frontier += [(name, factor, depth + 1) for name in user.outputs if name]
    return total if total.any() else np.ones(channels)


def ranked(mix: LaneMix, diffs: dict[str, np.ndarray], rank: str) -> dict[str, np.ndarray]:
    """Each split layer's channel scores, highest kept on 8-bit lanes first (--rank)."""
    if rank == "next":
        return {n: d * downstream_energy(mix, n) for n, d in diffs.items()}
    if rank == "random":
        rng = np.random.default_rng(0)
        return {n: rng.random(d.size) for n, d in diffs.items()}
    return diffs


def allocated(mix: LaneMix, split: list[str], score: dict[str, np.ndarray], sensitivity: dict[str, float],
              share: float) -> dict[str, np.ndarray]:
    """Channels kept on 8-bit lanes across the layers, greedily by benefit per DSP operation saved, until at most
    `share` of the MACs are on 4-bit lanes: channel c of layer L is worth s_L score_c / sum score_L (the layer's
    measured sensitivity apportioned by the score) and costs (ops_8 - ops_4) / C_L."""
    total = sum(layer.macs for layer in mix.layers)
    four = sum(mix.by_node[n].macs for n in split)
    candidates = []
    for n in split:
        layer, s = mix.by_node[n], score[n]
        worth = sensitivity[n] * s / s.sum() / ((layer.ops_at(8) - layer.ops_at(4)) / s.size)
        candidates += [(w, n, c) for c, w in enumerate(worth)]
    keep = {n: np.zeros(score[n].size, bool) for n in split}
    for _, n, c in sorted(candidates, reverse=True):
        if four <= share * total:
            break
        keep[n][c] = True
        four -= mix.by_node[n].macs / score[n].size
    return keep


def shares(mix: LaneMix, keep_share: dict[str, float]) -> tuple[float, float]:
    """(share of MACs on 4-bit lanes, MACs per DSP per cycle): layer -> share of its channels on 8-bit lanes."""
    macs = sum(layer.macs for layer in mix.layers)
    four, ops = 0.0, 0.0
    for layer in mix.layers:
        k = keep_share.get(layer.node, 1.0)
        four += layer.macs * (1 - k)
        ops += layer.ops_at(4) * (1 - k) + layer.ops_at(8) * k
    return four / macs, macs / ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="examples/efficientnet_lite0.onnx")
    parser.add_argument("--calib", default="examples/calib")
    parser.add_argument("--eval", default="/work/shared/assets/images/eval")
    parser.add_argument("--out", default="/tmp/int4_split", help="bench/int4_mix.py's --out (table, tune record)")
    parser.add_argument("--validation-fraction", type=float, default=0.34)
    parser.add_argument("--num-eval", type=int, default=20)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.0, 0.1, 0.25],
                        help="share of each 4-bit layer's output channels kept on 8-bit lanes")
    parser.add_argument("--rank", choices=["diff", "next", "random"], default="diff",
                        help="kept channels: largest 4-bit minus 8-bit output difference on the fit photos (diff), "
                             "that times the downstream energy factor (next, `downstream_energy`), or at random")
    parser.add_argument("--global-from", type=int, help="instead: the head of this many layers, its channels "
                        "returned to 8-bit lanes across layers (`allocated`) down to each --global-shares")
    parser.add_argument("--global-shares", type=float, nargs="+", default=[0.40, 0.45])
    parser.add_argument("--heads", type=int, nargs="+", default=[17, 20], help="heads of the tuner's order")
    args = parser.parse_args()
    out, stem = Path(args.out), Path(args.model).stem
    table_path = out / f"{stem}.quant.json"
    table = load_quant_table(table_path)
    graph = load_model_for_table(args.model, table, table_path, note=False)
    record = json.loads((out / f"{stem}.tune.json").read_text())["lanes"]
    source = DataOptions(images=args.calib).source(table.options.preprocess)
    fit, held = split_samples(ImageSet.from_source(source, None, None, 0), args.validation_fraction)
    grid = Int4Grid(**record["int4_grid"])
    start = time.time()
    mix = LaneMix(graph, table, fit_statistics(graph, fit, [grid.activation_calibrator]), grid,
                  (x for _, x, _ in fit.samples(graph)))
    print(f"lane mix fitted in {time.time() - start:.0f} s")
    saving = [r for r in record["layers"] if r["ops_int4"] < r["ops_int8"]]
    order = [r["node"] for r in sorted(saving, key=lambda r: -(r["ops_int8"] - r["ops_int4"])
                                       / max(r["sensitivity"], SENSITIVITY_FLOOR))]
    session = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
    fit_feeds = [x for _, x, _ in fit.samples(graph)]
    held_feeds = [x for _, x, _ in held.samples(graph)]
    eval_source = DataOptions(images=args.eval).source(table.options.preprocess)
    eval_feeds = [x for _, x, _ in ImageSet.from_source(eval_source, None, args.num_eval, 0).samples(graph)]
    held_ref = [session.run(None, x)[0] for x in held_feeds]
    eval_ref = [session.run(None, x)[0] for x in eval_feeds]
    sets = [("fixed 40 %", LITE0_FIXED_40)] + [(f"head {n}", order[:n]) for n in args.heads]
    if args.global_from:
        sets = [(f"global {args.global_from}", order[:args.global_from])]
    sensitivity = {r["node"]: max(r["sensitivity"], SENSITIVITY_FLOOR) for r in record["layers"]}
    print(f"{'set':<12} {'keep 8-bit':>10} {'4-bit MACs':>10} {'MACs/DSP/cyc':>12} {'val cos':>8} {'eval cos':>8} "
          f"{'eval min':>8} {'fit diff2':>9}")
    for label, four in sets:
        split = [n for n in four if mix.by_node[n].ops_at(4) < mix.by_node[n].ops_at(8)]
        runner = SplitRun(mix, four, split)
        none = {n: np.zeros(mix.graph.initializers[mix.by_node[n].weight].shape[0], bool) for n in split}
        diffs: dict[str, np.ndarray] = {}
        for x in fit_feeds:
            runner.run(x, none, diffs)
        score = ranked(mix, diffs, args.rank)
        configs = []
        for k in args.keep:
            keep = {}
            for n in split:
                keep[n] = np.zeros(diffs[n].size, bool)
                keep[n][np.argsort(-score[n])[:int(round(k * diffs[n].size))]] = True
            configs.append((f"{k:.0%}", keep))
        if label.startswith("global"):
            configs = [(f"to {t:.0%}", allocated(mix, split, score, sensitivity, t)) for t in args.global_shares]
        for name, keep in configs:
            held_share = sum(diffs[n][keep[n]].sum() for n in split) / sum(diffs[n].sum() for n in split)
            four_share, throughput = shares(mix, {**{n: 0.0 for n in four},
                                                  **{n: float(keep[n].mean()) for n in split}})
            val = [cosine(r, runner.run(x, keep)) for x, r in zip(held_feeds, held_ref)]
            ev = [cosine(r, runner.run(x, keep)) for x, r in zip(eval_feeds, eval_ref)]
            print(f"{label:<12} {name:>10} {four_share:>10.1%} {throughput:>12.3f} {np.mean(val):>8.5f} "
                  f"{np.mean(ev):>8.5f} {np.min(ev):>8.5f} {held_share:>9.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
