"""The reference MatMulNBits: held to ONNX Runtime's own kernel, and to a hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from runners.contrib_ops import CONTRIB_OPS, Evaluator


def nbits_model(k, n, bits, block, b, scales, zero_points=None, bias=None, batch_shape=("m",), level=0):
    """A one-node graph Y = MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias]) at accuracy `level`."""
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["A", "B", "scales", "", "", ""]  # optional inputs 3-5: zero_points, g_idx, bias
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "zp"))
        inputs[3] = "zp"
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs[5] = "bias"
    while not inputs[-1]:
        inputs.pop()
    levels = {"accuracy_level": level} if level else {}
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, **levels
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*batch_shape, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*batch_shape, n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def random_weights(rng, k, n, bits, block, zero_points):
    blocks = -(-k // block)
    per_block = block * bits // 8
    b = rng.integers(0, 256, size=(n, blocks, per_block), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(n * blocks,)).astype(np.float32)
    if zero_points == "packed":
        zp = rng.integers(0, 256, size=(n * (-(-blocks * bits // 8)),), dtype=np.uint8)
    elif zero_points == "float":
        zp = rng.uniform(0, 2**bits - 1, size=(n * blocks,)).astype(np.float32)
    else:
        zp = None
    return b, scales, zp


# ONNX Runtime's CPU kernel takes float zero points (HQQ) at 4 bits only.
@pytest.mark.parametrize(("bits", "zero_points"), [(4, None), (4, "packed"), (4, "float"), (8, None), (8, "packed")])
@pytest.mark.parametrize(("k", "n", "block"), [(64, 48, 32), (96, 40, 32), (128, 24, 64), (40, 8, 32)])
def test_reference_matches_onnxruntime(bits, zero_points, k, n, block):
    import onnxruntime

    rng = np.random.default_rng(k * n + bits)
    b, scales, zp = random_weights(rng, k, n, bits, block, zero_points)
    model = nbits_model(k, n, bits, block, b, scales, zp)
    a = rng.standard_normal((3, k)).astype(np.float32)
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"A": a}
    )[0]
    got = ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run(None, {"A": a})[0]
    assert got.dtype == np.float32 and got.shape == (3, n)
    # Both compute the same dequantized weights; they differ by float32 summation order over K terms.
    bound = (k + 1) * np.finfo(np.float32).eps * float(np.max(np.abs(a) @ np.abs(got_weight(model))))
    assert np.abs(got - want).max() <= bound


@pytest.mark.parametrize(("bits", "zero_points"), [(4, None), (4, "packed"), (4, "float"), (8, None), (8, "packed")])
@pytest.mark.parametrize(("k", "n", "block"), [(64, 48, 32), (96, 40, 32), (128, 24, 64), (40, 8, 32), (256, 16, 128)])
def test_reference_rounds_activations_at_level_4_where_onnxruntime_does(bits, zero_points, k, n, block):
    """At accuracy level 4 ONNX Runtime's CPU kernel multiplies int8-rounded activations, except with float zero
    points; the reference follows it to float32 summation order, and the float product is measurably off."""
    import onnxruntime

    rng = np.random.default_rng(k * n + bits + 1)
    b, scales, zp = random_weights(rng, k, n, bits, block, zero_points)
    model = nbits_model(k, n, bits, block, b, scales, zp, level=4)
    a = rng.standard_normal((4, k)).astype(np.float32)
    a[1, :block] = 0.0  # a block of zeros: scale 0, no division
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"A": a}
    )[0]
    got = ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run(None, {"A": a})[0]
    weight = got_weight(model)
    bound = (k + 1) * np.finfo(np.float32).eps * float(np.max(np.abs(a) @ np.abs(weight)))
    assert np.abs(got - want).max() <= bound
    float_product = np.abs(a.astype(np.float64) @ weight - want).max()
    if zero_points == "float":
        assert float_product <= bound
    else:
        assert float_product > 20 * bound


def got_weight(model):
    from exporters.quantize import dequantize_weight

    node = model.graph.node[0]
    spec = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    spec.update(weight=node.input[1], scales=node.input[2])
    if len(node.input) > 3 and node.input[3]:
        spec["zero_points"] = node.input[3]
    return dequantize_weight({i.name: i for i in model.graph.initializer}, spec)


def test_hand_computed_block():
    # K = 32, one block, N = 2. Column 0: every code 9, zero point 8 (default), scale 0.5 -> weights 0.5.
    # Column 1: codes 0..15 twice (low nibble first), scale 2 -> weights 2 * (q - 8).
    codes0 = np.full(32, 9, dtype=np.uint8)
    codes1 = np.tile(np.arange(16, dtype=np.uint8), 2)
    pack = lambda c: (c[0::2] | (c[1::2] << 4)).astype(np.uint8)  # noqa: E731
    b = np.stack([pack(codes0), pack(codes1)]).reshape(2, 1, 16)
    scales = np.array([0.5, 2.0], dtype=np.float32)
    model = nbits_model(32, 2, 4, 32, b, scales, bias=np.array([1.0, -1.0], dtype=np.float32))
    a = np.ones((1, 32), dtype=np.float32)
    a[0, 1] = 3.0  # position 1 holds code 1 in column 1: weight 2 * (1 - 8) = -14
    got = ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run(None, {"A": a})[0]
    # column 0: 0.5 * (31 + 3) + 1 = 18; column 1: sum 2 * (q - 8) over two runs of 0..15 is 2 * 2 * (-8) = -32,
    # plus 2 more of position 1's weight (-14 x 2 extra), minus the bias 1: -32 - 28 - 1 = -61
    np.testing.assert_array_equal(got, np.array([[18.0, -61.0]], dtype=np.float32))


def test_g_idx_refused():
    model = nbits_model(32, 2, 4, 32, np.zeros((2, 1, 16), np.uint8), np.ones(2, np.float32))
    node = model.graph.node[0]
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(32, np.int32), "g"))
    node.input[:] = ["A", "B", "scales", "", "g"]
    with pytest.raises(Exception, match="g_idx"):
        ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run(None, {"A": np.ones((1, 32), np.float32)})


def gelu_model(approximate: str):
    node = helper.make_node("Gelu", ["X"], ["Y"], approximate=approximate)
    graph = helper.make_graph(
        [node],
        "gelu",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [3])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, [3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize(
    "approximate,expected",
    [
        # x Phi(x), the normal CDF from tables: Phi(1) = 0.841344746068543, Phi(-2) = 0.0227501319481792
        ("none", [0.0, 0.841344746068543, -2 * 0.0227501319481792]),
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with Python's math.tanh at x = 1 and -2
        ("tanh", [0.0, 0.8411919906082768, -0.04540230591222494]),
    ],
)
def test_gelu_matches_hand_computed_values(approximate, expected):
    x = np.array([0.0, 1.0, -2.0])
    got = Evaluator(gelu_model(approximate)).run(None, {"X": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_gelu_refuses_an_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        Evaluator(gelu_model("sigmoid")).run(None, {"X": np.zeros(3)})
