"""BatchNormalization folded into the ONNX model itself, keeping what its parameters say about the data.

The executor folds each BatchNormalization into the Conv before it (`ptq.engine.rewrites.fold_batchnorm`); the
weight adjustments (equalization, bias correction, AdaRound) must see the same folded Conv, or they adjust
a weight the integer graph never uses. `fold_batchnorms` does that fold on a copy of the model, with the
same formula (seed 003):

    k_c = gamma_c / sqrt(var_c + eps),   W'_c = W_c k_c,   b'_c = (b_c - mean_c) k_c + beta_c

and the folded Conv writes the BatchNormalization's output tensor. A BatchNormalization normalizes its input
over the training data, so its output channel c has mean beta_c and standard deviation |gamma_c| there (Nagel
et al. 2019, section 4.2: the data-free statistics behind analytic bias correction and high-bias absorption).
Those per-channel statistics are returned by the output tensor's name, which the fold keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from ops.registry import get_op, layer_kind
from ptq.core.graph import Graph
from ptq.core.roles import LayerKind


@dataclass
class ChannelStats:
    """Per-channel mean and standard deviation of a tensor over the training data (from a BatchNormalization)."""

    mean: np.ndarray
    std: np.ndarray


def batchnorm_statistics(graph: Graph) -> dict[str, ChannelStats]:
    """Output tensor -> (beta, |gamma|) of every inference-mode BatchNormalization with constant parameters."""
    out = {}
    for node in graph.nodes:
        if layer_kind(node) is not LayerKind.BATCH_NORMALIZATION or node.attr("training_mode", 0):
            continue
        params = node.inputs[1:5]
        if len(params) < 4 or not all(p in graph.initializers for p in params):
            continue
        gamma, beta = (graph.initializers[p].astype(np.float64) for p in params[:2])
        out[node.outputs[0]] = ChannelStats(beta, np.abs(gamma))
    return out


def fold_batchnorms(graph: Graph) -> tuple[onnx.ModelProto, int]:
    """A copy of `graph.model` with each BatchNormalization whose input is a Conv's only use folded into that
    Conv (module docstring); returns the copy and how many were folded."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    producer = {o: n for n in model.graph.node for o in n.output}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    inits = {i.name: i for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    removed = []
    for bn in model.graph.node:
        bn_op = get_op(bn.op_type, bn.domain)
        if bn_op is None or bn_op.layer_kind is not LayerKind.BATCH_NORMALIZATION:
            continue
        if any(a.name == "training_mode" and a.i for a in bn.attribute) or len([o for o in bn.output if o]) != 1:
            continue
        conv = producer.get(bn.input[0])
        conv_op = get_op(conv.op_type, conv.domain) if conv is not None else None
        if conv_op is None or not conv_op.absorbs_batchnorm or uses.get(bn.input[0], 0) != 1:
            continue
        if bn.input[0] in outputs or not all(p in inits for p in list(bn.input[1:5]) + [i for i in conv.input[1:] if i]):
            continue
        if len(conv.input) < 2 or uses.get(conv.input[1], 0) != 1 or (len(conv.input) > 2 and conv.input[2]
                                                                       and uses.get(conv.input[2], 0) != 1):
            continue
        gamma, beta, mean, var = (numpy_helper.to_array(inits[p]).astype(np.float64) for p in bn.input[1:5])
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        w = numpy_helper.to_array(inits[conv.input[1]])
        b = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] \
            else np.zeros(w.shape[0])
        k = gamma / np.sqrt(var + eps)
        new_w = (w.astype(np.float64) * k.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        new_b = ((b - mean) * k + beta).astype(w.dtype)
        inits[conv.input[1]].CopyFrom(numpy_helper.from_array(new_w, conv.input[1]))
        if len(conv.input) > 2 and conv.input[2]:
            inits[conv.input[2]].CopyFrom(numpy_helper.from_array(new_b, conv.input[2]))
        else:
            name = f"{conv.input[1]}.bn_bias"
            model.graph.initializer.append(numpy_helper.from_array(new_b, name))
            conv.input.append(name)
        conv.output[0] = bn.output[0]
        removed.append(bn)
    for bn in removed:
        model.graph.node.remove(bn)
    if removed:  # the BN parameters and the Conv's old output are gone; drop the stale value_info
        used = {i for n in model.graph.node for i in n.input}
        kept = [i for i in model.graph.initializer if i.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        gone = {bn.input[0] for bn in removed}
        kept_info = [v for v in model.graph.value_info if v.name not in gone]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept_info)
    return model, len(removed)
