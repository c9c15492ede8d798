"""What the per-layer report benchmarks (`report_histograms.py`, `report_compare.py`) share: their arguments,
the quant table (calibrated on examples/calib when none is given; not timed), the prepared integer graph, the
reported layers, their float reference (`reports.float_reference`: one onnxruntime thread, every layer tensor
as an output) and the images."""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass
class LayerBench:
    graph: object  # ptq.core.graph.Graph
    table: object  # ptq.table.quant_table.QuantTable
    prepared: object  # ptq.engine.executor.IntegerGraph
    specs: list  # reports.layer_specs.LayerSpec, one per reported layer
    runner: object  # the float reference
    images: object  # ptq.data.image_source.ImageSet


def layer_bench(description: str, argv=None) -> LayerBench:
    """Parse `--model --quant --images --num-images` from `argv` and set the benchmark up."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=str(REPO / "examples" / "efficientnet_lite0.onnx"))
    parser.add_argument("--quant", help="quant table (default: calibrate on examples/calib)")
    parser.add_argument("--images", default=str(REPO.parent / "shared" / "assets" / "images" / "eval"))
    parser.add_argument("--num-images", type=int, default=8)
    args = parser.parse_args(argv)

    from ptq.core.graph import load_model
    from ptq.engine.executor import prepare
    from ptq.data.images import Preprocess
    from ptq.calibration.pipeline import calibrate
    from ptq.table.quant_table import load_quant_table
    from reports.float_reference import float_reference
    from ptq.data.image_source import ImageSet
    from reports.layer_specs import layer_specs

    with tempfile.TemporaryDirectory() as tmp:
        quant = args.quant or calibrate(args.model, REPO / "examples" / "calib", tmp, write_qdq=False,
                                        preprocess=Preprocess(mean=127, std=128)).table_path
        table = load_quant_table(quant)
    graph = load_model(args.model, table.options.input_shapes)
    prepared = prepare(graph, table)
    specs = layer_specs(prepared, graph.activations)
    images = ImageSet.from_folder(args.images, Preprocess(**(table.options.preprocess or {})), None, args.num_images)
    return LayerBench(graph, table, prepared, specs, float_reference(graph, [s.name for s in specs]), images)
