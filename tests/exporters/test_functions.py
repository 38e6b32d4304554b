"""The RMSNorm / SwiGLU / GeGLU FunctionProtos evaluated on their own, against numpy formulas.

Each function is called from a one-node model built with onnx.helper, so these
tests need no torch export; the oracle is float64 numpy written from the math.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from exporters.functions import OPSET, function_protos
from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from runners.contrib_ops import Evaluator

ELEM = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}
# float32: a handful of ulps of O(1) values; float64: the function must not drop to float32 anywhere.
TOL = {np.float32: dict(rtol=2e-6, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-12)}


def single_node_model(op_type: str, inputs: dict[str, np.ndarray], **attributes) -> onnx.ModelProto:
    """A model whose only node calls the custom function; the output's dims are left symbolic."""
    x = next(iter(inputs.values()))
    dtype = x.dtype.type
    node = helper.make_node(op_type, list(inputs), ["y"], domain=CUSTOM_DOMAIN, **attributes)
    graph = helper.make_graph(
        [node],
        f"call_{op_type}",
        [helper.make_tensor_value_info(name, ELEM[dtype], list(value.shape)) for name, value in inputs.items()],
        [helper.make_tensor_value_info("y", ELEM[dtype], [f"y{i}" for i in range(x.ndim)])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)],
        functions=function_protos({op_type}),
    )
    model.ir_version = 10  # what onnxruntime of this era reads
    onnx.checker.check_model(model, full_check=True)
    return model


def run_ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], inputs)[0]


def run_reference(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    # As runners/reference.py builds it: with Gelu, which the evaluator cannot expand inside a function body.
    return Evaluator(model).run(["y"], inputs)[0]


BACKENDS = {"onnxruntime": run_ort, "onnx-reference": run_reference}


def rms_norm_oracle(x, weight, eps):
    x, weight = x.astype(np.float64), weight.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def swiglu_oracle(x, gate, up, down):
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    g = x @ gate.T
    silu = g / (1.0 + np.exp(-g))
    return (silu * (x @ up.T)) @ down.T


def geglu_oracle(x, gate, up, down, approximate):
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    g = x @ gate.T
    if approximate == "tanh":
        gelu = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))
    else:
        gelu = 0.5 * g * (1.0 + np.vectorize(math.erf)(g / np.sqrt(2.0)))
    return (gelu * (x @ up.T)) @ down.T


def test_function_protos_are_sorted_deduplicated_and_skip_unknown_ops():
    protos = function_protos({"SwiGLU", "RMSNorm", "GeGLU", "NotACustomOp"})
    assert [p.name for p in protos] == ["GeGLU", "RMSNorm", "SwiGLU"]
    assert all(p.domain == CUSTOM_DOMAIN for p in protos)
    assert function_protos(set()) == []


def test_function_bodies_import_the_default_opset_and_declare_their_signature():
    protos = {p.name: p for p in function_protos({"RMSNorm", "SwiGLU", "GeGLU"})}
    for proto in protos.values():
        assert {o.domain: o.version for o in proto.opset_import}.get("") == OPSET
        assert list(proto.output) and len(proto.output) == 1
    assert list(protos["RMSNorm"].input) == ["x", "weight"]
    assert list(protos["RMSNorm"].attribute) == ["epsilon"]
    assert list(protos["SwiGLU"].input) == ["x", "gate_proj", "up_proj", "down_proj"]
    assert list(protos["GeGLU"].input) == ["x", "gate_proj", "up_proj", "down_proj"]
    assert list(protos["GeGLU"].attribute) == ["approximate"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eps", [0.0, 0.25])  # both exact in float32: ONNX float attributes are 32-bit
def test_rms_norm_function_matches_formula(backend, dtype, eps):
    rng = np.random.default_rng(1)
    # Small inputs so that eps = 0.25 visibly changes the result.
    inputs = {
        "x": (0.3 * rng.standard_normal((2, 3, 5))).astype(dtype),
        "weight": (1 + 0.5 * rng.standard_normal(5)).astype(dtype),
    }
    model = single_node_model("RMSNorm", inputs, epsilon=eps)
    got = BACKENDS[backend](model, inputs)
    assert got.dtype == dtype and got.shape == (2, 3, 5)
    expected = rms_norm_oracle(inputs["x"], inputs["weight"], eps)
    np.testing.assert_allclose(got, expected, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_epsilon_attribute_is_used(backend):
    # If the body ignored or hard-coded epsilon, the two evaluations would coincide.
    rng = np.random.default_rng(2)
    inputs = {"x": (0.2 * rng.standard_normal((1, 4, 6))).astype(np.float64), "weight": np.ones(6)}
    without = BACKENDS[backend](single_node_model("RMSNorm", inputs, epsilon=0.0), inputs)
    with_eps = BACKENDS[backend](single_node_model("RMSNorm", inputs, epsilon=0.5), inputs)
    assert np.max(np.abs(without - with_eps)) > 0.1
    np.testing.assert_allclose(with_eps, rms_norm_oracle(inputs["x"], inputs["weight"], 0.5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_eps_zero_is_exact_for_hand_computed_row(backend):
    # Row (3, 4): mean square = 12.5, rms = sqrt(12.5); with weight (2, 1): (6, 4) / sqrt(12.5).
    inputs = {"x": np.array([[3.0, 4.0]]), "weight": np.array([2.0, 1.0])}
    got = BACKENDS[backend](single_node_model("RMSNorm", inputs, epsilon=0.0), inputs)
    np.testing.assert_allclose(got, [[6 / np.sqrt(12.5), 4 / np.sqrt(12.5)]], rtol=1e-15, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swiglu_function_matches_formula(backend, dtype):
    rng = np.random.default_rng(3)
    width, ff, out = 4, 6, 3  # all different, so any transposition mistake changes shapes or values
    inputs = {
        "x": rng.standard_normal((2, 3, width)).astype(dtype),
        "gate_proj": rng.standard_normal((ff, width)).astype(dtype),
        "up_proj": rng.standard_normal((ff, width)).astype(dtype),
        "down_proj": rng.standard_normal((out, ff)).astype(dtype),
    }
    got = BACKENDS[backend](single_node_model("SwiGLU", inputs), inputs)
    assert got.dtype == dtype and got.shape == (2, 3, out)
    expected = swiglu_oracle(*inputs.values())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is np.float32 else TOL[np.float64]
    np.testing.assert_allclose(got, expected, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_hand_computed_value(backend):
    # x = (1, 0); gate row (2, 0) -> g = 2; up row (0, 0) + (3 from x0) -> u = 3; down = [[1]]
    # y = silu(2) * 3 = 2 * sigmoid(2) * 3
    inputs = {
        "x": np.array([[1.0, 0.0]]),
        "gate_proj": np.array([[2.0, 5.0]]),
        "up_proj": np.array([[3.0, -7.0]]),
        "down_proj": np.array([[1.0]]),
    }
    got = BACKENDS[backend](single_node_model("SwiGLU", inputs), inputs)
    np.testing.assert_allclose(got, [[6.0 / (1.0 + np.exp(-2.0))]], rtol=1e-14, atol=0)


# onnxruntime has no float64 Erf kernel, so its erf GELU runs in float32 only (exports are never float64).
GELU_CASES = [
    (backend, dtype, approximate)
    for backend in BACKENDS
    for dtype in (np.float32, np.float64)
    for approximate in ("tanh", "none")
    if (backend, dtype, approximate) != ("onnxruntime", np.float64, "none")
]


@pytest.mark.parametrize("backend,dtype,approximate", GELU_CASES)
def test_geglu_function_matches_formula(backend, dtype, approximate):
    rng = np.random.default_rng(4)
    width, ff, out = 4, 6, 3
    inputs = {
        "x": (2 * rng.standard_normal((2, 3, width))).astype(dtype),  # gate values past 3, where the GELUs differ
        "gate_proj": rng.standard_normal((ff, width)).astype(dtype),
        "up_proj": rng.standard_normal((ff, width)).astype(dtype),
        "down_proj": rng.standard_normal((out, ff)).astype(dtype),
    }
    got = BACKENDS[backend](single_node_model("GeGLU", inputs, approximate=approximate), inputs)
    assert got.dtype == dtype and got.shape == (2, 3, out)
    expected = geglu_oracle(*inputs.values(), approximate)
    # onnxruntime's float64 Gelu evaluates erf/tanh by its own approximations, to about 1e-7 relative
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is np.float32 else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, expected, **tol)
    other = geglu_oracle(*inputs.values(), {"tanh": "none", "none": "tanh"}[approximate])
    assert np.max(np.abs(other - expected)) > 1e-3  # the approximate attribute reaches the body's Gelu
