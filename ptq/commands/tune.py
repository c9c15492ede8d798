"""`ptq tune MODEL --images DIR --quant TABLE --target-cosine 0.995 [--budget-int16 N] [--allow-float N]`:
change the table step by step (`ptq.tune`) until the logits cosine on the images reaches the target; write
`<stem>.tuned.quant.json` (and the adjusted weights the table uses, beside it) and `<stem>.tune.json` with
what each step changed and bought. Tune on calibration images; judge the result on held-out ones."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ptq.parallel import add_parallel_arguments

HELP = "reach a target logits cosine: per-channel weights, better ranges, 16-bit tensors, float as a last resort"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the float ONNX model")
    parser.add_argument("--quant", required=True, help="the quantization table (.quant.json) to start from")
    parser.add_argument("--images", required=True, help="tuning images (the calibration images; not the test set)")
    parser.add_argument("--target-cosine", type=float, required=True, help="stop when the logits cosine reaches this")
    parser.add_argument("--budget-int16", type=int, default=8, help="at most this many 16-bit tensors (default 8)")
    parser.add_argument("--allow-float", type=int, default=0, help="at most this many float layers (default 0)")
    parser.add_argument("--num-images", type=int, help="use only the first N images")
    parser.add_argument("--out", help="output folder (default: the table's folder)")
    add_parallel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import logging

    from ptq.adjusted_model import load_model_for_table, save_adjusted
    from ptq.images import Preprocess
    from ptq.parallel import choose_workers
    from ptq.pipeline import collect_image_statistics
    from ptq.quant_table import load_quant_table, save_quant_table
    from ptq.tune import tune
    from reports.evaluate_shards import choose_evaluator
    from reports.image_source import ImageSet
    from calibrators import required_stats

    if not 0 < args.target_cosine <= 1:
        raise ValueError(f"--target-cosine must be in (0, 1], got {args.target_cosine}")
    if args.budget_int16 < 0 or args.allow_float < 0:
        raise ValueError("--budget-int16 and --allow-float must be >= 0")
    logging.basicConfig(format="ptq: %(message)s")
    logging.getLogger("ptq").setLevel(logging.INFO)
    table_path = Path(args.quant)
    table = load_quant_table(table_path)
    graph = load_model_for_table(args.model, table, table_path)
    pre = Preprocess(**(table.options.preprocess or {}))
    images = ImageSet.from_folder(args.images, pre, None, args.num_images)

    workers = choose_workers(args.workers, images.expected)

    def stats_for(calibrators):
        if workers > 1 or args.ray is not None:
            from ptq.calibration_shards import sharded_statistics

            stats, _ = sharded_statistics(graph.model, graph, args.images, required_stats(calibrators),
                                          preprocess=pre, num_images=args.num_images, batch_size=8, seed=0,
                                          input_shapes=table.options.input_shapes, workers=workers, ray=args.ray)
        else:
            stats, _ = collect_image_statistics(graph, args.images, required_stats(calibrators), preprocess=pre,
                                                num_images=args.num_images)
        return stats

    with choose_evaluator(graph, table, images, workers=workers, ray=args.ray) as evaluator:
        result = tune(graph, table, images, args.target_cosine, budget_int16=args.budget_int16,
                      allow_float=args.allow_float, stats_for=stats_for, evaluator=evaluator)
    out_dir = Path(args.out) if args.out else table_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = table_path.name[: -len(".quant.json")] if table_path.name.endswith(".quant.json") else table_path.stem
    tuned_path = out_dir / f"{stem}.tuned.quant.json"
    tuned = result.table
    if tuned.options.adjusted_model is not None:  # the weights move with the table
        import dataclasses

        _, relative, digest = save_adjusted(graph.model, tuned_path)
        tuned.options = dataclasses.replace(tuned.options, adjusted_model=relative, adjusted_sha256=digest)
    save_quant_table(tuned, tuned_path)
    record = out_dir / f"{stem}.tune.json"
    record.write_text(json.dumps({"model": str(args.model), "quant": str(table_path), "tuned": str(tuned_path),
                                  **result.to_dict()}, indent=1) + "\n", encoding="utf-8")
    print(result.summary())
    if result.float_nodes:
        print("run it with --float-nodes " + " ".join(result.float_nodes))
    print(f"wrote {tuned_path}, {record}")
    return 0 if result.reached else 1
