"""`dump_tensors`: the float and integer tensors of chosen layers as .npy files, with an `index.json`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from ptq.core.graph import Graph
from ptq.engine.executor import prepare
from ptq.core.names import did_you_mean
from ptq.table.quant_table import QuantTable
from reports.float_reference import float_reference
from reports.layer_specs import layer_specs
from reports.layers import qparams_summary


def _safe(name: str) -> str:
    """A file-name-safe form of a tensor name (`a/b:0` -> `a_b_0`); two names can share it, so file stems
    also carry the tensor's position (index.json maps each tensor to its files)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def dump_tensors(graph: Graph, table: QuantTable, images, out_dir: Union[str, Path], *, layers: Sequence[str] = (),
                 float_nodes: Sequence[str] = (), max_images: int = 1, backend=None) -> Path:
    """Save the float and integer tensors of `layers` (all reported tensors when empty) for the first
    `max_images` images as .npy files, with `index.json` describing them (tensor, op, shape, qparams, files).

    Integer tensors are saved as their codes; dequantize with x_f = (x_q - zero_point) * scale from the index.
    """
    if max_images <= 0:
        raise ValueError(f"--dump-images must be positive, got {max_images}")
    prepared = prepare(graph, table, float_nodes=float_nodes, backend=backend)
    specs = layer_specs(prepared, graph.activations)
    if layers:
        known = {s.name for s in specs}
        by_node = {s.node: s.name for s in specs}
        wanted = []
        for layer in layers:
            if layer not in known and layer not in by_node:
                raise ValueError(f"--dump: {layer!r} is not a reported tensor or node of the integer graph"
                                 f"{did_you_mean(layer, list(known) + list(by_node))}")
            wanted.append(layer if layer in known else by_node[layer])
        specs = [s for s in specs if s.name in set(wanted)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runner = float_reference(graph, [s.name for s in specs])
    index = {"float_nodes": [f.name for f in prepared.float_nodes], "images": [], "tensors": []}
    for spec in specs:
        qp = prepared.qparams[spec.name]
        index["tensors"].append({"name": spec.name, "node": spec.node, "op_type": spec.op_type, "bits": qp.bits,
                                 "qparams": qparams_summary(qp), "scale": [float(v) for v in qp.scale],
                                 "zero_point": [int(v) for v in qp.zero_point], "axis": qp.axis})
    for k, (path, sample, _label) in enumerate(images.samples(graph)):
        if k >= max_images:
            break
        floats = runner.run_dict(sample)
        ints = prepared.run(sample).tensors
        files = {}
        for position, spec in enumerate(specs):
            stem = f"img{k:03d}_t{position:04d}_{_safe(spec.name)}"
            np.save(out / f"{stem}.float.npy", np.asarray(floats[spec.name]))
            np.save(out / f"{stem}.int.npy", ints[spec.name])
            files[spec.name] = {"float": f"{stem}.float.npy", "int": f"{stem}.int.npy"}
        index["images"].append({"image": str(path), "files": files})
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    return out / "index.json"
