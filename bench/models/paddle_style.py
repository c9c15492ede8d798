"""Rewrite a torch export into the Paddle exporter's style: every Conv without a bias input, its bias added by
an `Add` of a per-channel constant [1, C, 1, 1] (what Paddle2ONNX writes: 75 of 83 Convs of a PP-OCR text
detector). Used by the DBNet-style and CRNN-style build scripts (onnx only)."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper, numpy_helper


def move_conv_biases_to_adds(model: onnx.ModelProto) -> int:
    """Move each Conv's bias into an Add after it, in place; returns how many Convs changed."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    nodes, moved = [], 0
    for node in graph.node:
        if node.op_type != "Conv" or len(node.input) < 3 or node.input[2] not in inits:
            nodes.append(node)
            continue
        bias = numpy_helper.to_array(inits[node.input[2]])
        name = node.input[2] + "_add"
        graph.initializer.append(numpy_helper.from_array(bias.reshape(1, -1, 1, 1), name))
        out = node.output[0]
        bare = out + "_nobias"
        del node.input[2]
        node.output[0] = bare
        nodes.append(node)
        nodes.append(helper.make_node("Add", [bare, name], [out], name=(node.name or out) + "_bias"))
        moved += 1
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return moved


def rewrite_export(path: Path) -> int:
    """Rewrite the torch export at `path` in place into the Paddle style (checked by onnx); returns how many Conv
    biases moved into Adds."""
    model = onnx.load(path)
    moved = move_conv_biases_to_adds(model)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return moved
