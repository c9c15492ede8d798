"""lut.FUNCTIONS: float semantics against onnx's reference evaluator, symmetry claims checked numerically."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from lut import FUNCTIONS, LutFunction, get_function, power

ONNX_OPS = {
    "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "elu": "Elu",
    "selu": "Selu", "softplus": "Softplus", "softsign": "Softsign", "hardswish": "HardSwish", "cos": "Cos",
    "sin": "Sin", "reciprocal": "Reciprocal",
}
X = np.concatenate([np.linspace(-9, 9, 1001), [0.0, 1e-3, -1e-3, 3.0, -3.0, 6.0, -6.0]])


def onnx_reference(op_type: str, x: np.ndarray) -> np.ndarray:
    node = helper.make_node(op_type, ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [x.size])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [x.size])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


@pytest.mark.parametrize("name", sorted(ONNX_OPS))
def test_float_semantics_match_onnx_defaults(name):
    x = np.abs(X) + 1e-3 if name in ("log", "sqrt") else X
    with np.errstate(all="ignore"):
        want = onnx_reference(ONNX_OPS[name], x)
    # onnx expands HardSwish into HardSigmoid with alpha = 1/6 stored as a float32 attribute: off by
    # x^2 * |float32(1/6) - 1/6| <= 9 * 5e-9 where the clamp is inactive (|x| <= 3)
    atol = 1e-7 if name == "hardswish" else 1e-15
    np.testing.assert_allclose(FUNCTIONS[name](x), want, rtol=1e-12, atol=atol)


def test_whitepaper_only_functions():
    x = np.array([0.25, 1.0, 4.0])
    np.testing.assert_allclose(FUNCTIONS["rsqrt"](x), [2.0, 1.0, 0.5])
    np.testing.assert_allclose(FUNCTIONS["square"](np.array([-3.0, 2.0])), [9.0, 4.0])
    np.testing.assert_allclose(FUNCTIONS["bnll"](np.array([0.0])), [np.log(2.0)])
    np.testing.assert_allclose(FUNCTIONS["log_abs"](np.array([-np.e, np.e])), [1.0, 1.0])
    np.testing.assert_allclose(power(3)(np.array([-2.0, 2.0])), [-8.0, 8.0])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_declared_symmetry_holds(name):
    f = FUNCTIONS[name]
    x = np.linspace(0.01, 5, 200)
    if f.symmetry == "odd":
        np.testing.assert_allclose(f(-x), 2 * f.center - f(x), rtol=1e-12, atol=1e-12)
    elif f.symmetry == "even":
        np.testing.assert_allclose(f(-x), f(x), rtol=1e-12)


def test_registry_is_typed_and_frozen():
    f = FUNCTIONS["sigmoid"]
    assert isinstance(f, LutFunction) and (f.symmetry, f.center) == ("odd", 0.5)
    assert FUNCTIONS["cos"].symmetry == "even" and FUNCTIONS["exp"].symmetry is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.center = 0.0
    assert get_function("tanh") is FUNCTIONS["tanh"]
    assert (power(2).symmetry, power(3).symmetry, power(0.5).symmetry) == ("even", "odd", None)
    with pytest.raises(ValueError, match="symmetry"):
        LutFunction("bad", np.tanh, "mirror")
    with pytest.raises(TypeError):
        get_function(3)
