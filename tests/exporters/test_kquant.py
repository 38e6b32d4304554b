"""exporters/kquant.py: the k-quant search against round-to-nearest, with independent oracles.

Round-to-nearest here is ONNX Runtime's own (`quant_tensor` of its weight-only quantizer, integer zero points),
the values are read back through the MatMulNBits spec oracle (tests/toolkit/quantize/test_quantize.py) plus the
offsets, and the end-to-end cases run the graphs in ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor

from exporters.kquant import kquant_blocks, search, search_zero_point
from tests.exporters.test_gguf_blocks import with_offsets


def rtn(weight: np.ndarray, bits: int = 4) -> np.ndarray:
    """[K, N]: ONNX Runtime's round-to-nearest (asymmetric, uint8 zero points, block 32) dequantized."""
    k, n = weight.shape
    q, scale, zero = quant_tensor(weight.T.copy(), bits, 32, "asym", "uint")
    return ((q.reshape(-1, 32) - zero.reshape(-1, 1)) * scale.reshape(-1, 1)).reshape(n, k).T


def fixture_weights(seed: int = 0) -> np.ndarray:
    """[192, 160] heavy-tailed weights (Student t, 4 degrees of freedom), like a trained projection's."""
    return (np.random.default_rng(seed).standard_t(4, (192, 160)) * 0.02).astype(np.float32)


@pytest.mark.parametrize("zero_points", ["offsets", "integer"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_search_is_at_least_as_good_as_round_to_nearest(bits, zero_points):
    """On the fixture, the searched blocks' error (RMS, and the search's own weighted objective) is below
    round-to-nearest's, and the values the graph computes are what the search chose: float minimums as offsets,
    or integer zero points (MatMulNBits' own uint8 ones, no offsets)."""
    w = fixture_weights()
    weight = kquant_blocks(w, bits, zero_points=zero_points)
    if zero_points == "integer":
        assert weight.offsets is None and weight.zero_points.dtype == np.uint8
    else:
        assert weight.offsets is not None and weight.zero_points is None
    got = with_offsets(weight).T  # [K, N] through the spec oracle
    assert np.allclose(got, weight.dequantize(), rtol=0, atol=1e-6)
    ours, theirs = got - w, rtn(w, bits) - w
    assert np.sqrt((ours**2).mean()) < np.sqrt((theirs**2).mean())
    blocks = w.T.reshape(-1, 32)
    importance = np.sqrt((blocks**2).mean(axis=1, keepdims=True)) + np.abs(blocks)
    assert (importance * ours.T.reshape(-1, 32) ** 2).sum() < (importance * theirs.T.reshape(-1, 32) ** 2).sum()


def test_a_block_on_a_float_grid_is_recovered_and_round_to_nearest_is_not():
    """Values d q + m with a float minimum (a Q4_1 block, dequantized): the search holds them to float32 rounding;
    an integer zero point cannot."""
    rng = np.random.default_rng(1)
    d, m = np.float32(0.0137), np.float32(-0.0911)
    q = rng.permutation(np.resize(np.arange(16), 32)).astype(np.float32)
    w = np.tile((d * q + m)[:, None], (1, 4)).astype(np.float32)  # [32, 4]: K one block
    got = kquant_blocks(w).dequantize()
    assert np.abs(got - w).max() <= 1e-7
    assert np.abs(rtn(w) - w).max() > 1e-3


def test_constant_and_tiny_blocks():
    x = np.zeros((3, 32), dtype=np.float32)
    x[0] = 0.5  # constant: s = 0, m = the value
    x[1, 0] = 1e-30  # one value above zero
    x[2] = np.linspace(-1, 1, 32)
    q, s, m = search(x, 15)
    values = s[:, None] * q + m[:, None]
    assert s[0] == 0 and np.array_equal(values[0], x[0])
    assert np.abs(values - x).max() <= 1 / 15


def test_a_k_that_does_not_fill_its_last_block_is_padded_without_moving_the_fit():
    """K = 40: the second block holds 8 values and 24 of padding. The values are those of searching the 8 alone
    (the padding neither widens the range nor weighs in the fit), and the dequantized matrix is [40, N]."""
    w = fixture_weights()[:40, :16]
    weight = kquant_blocks(w)
    assert weight.k == 40 and weight.packed.shape[:2] == (16, 2)
    got = weight.dequantize()
    assert got.shape == (40, 16) and np.allclose(with_offsets(weight).T, got, rtol=0, atol=1e-6)
    alone = search(np.ascontiguousarray(w[32:].T), 15)  # the 8 values of each column's last block, no padding
    want = alone[1][:, None] * alone[0] + alone[2][:, None]  # [16, 8]
    assert np.allclose(got[32:].T, want, rtol=0, atol=1e-6)


def test_the_search_improves_on_its_starting_point():
    """The min-max float grid (s = range / 15, m = min, computed here) is where the search starts; on the fixture
    the weighted error it ends with is lower in most blocks and never higher."""
    x = fixture_weights(2).T.reshape(-1, 32)
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    s0 = (high - low) / 15
    start = s0 * np.clip(np.rint((x - low) / s0), 0, 15) + low
    q, s, m = search(x, 15)
    importance = np.sqrt((x**2).mean(axis=1, keepdims=True)) + np.abs(x)
    before = (importance * (start - x) ** 2).sum(axis=1)
    after = (importance * (s[:, None] * q + m[:, None] - x) ** 2).sum(axis=1)
    assert np.all(after <= before * (1 + 1e-5)) and (after < before * 0.99).mean() > 0.5


def test_a_block_on_an_integer_zero_point_grid_is_recovered_and_round_to_nearest_is_not():
    """Values s (q - z) with q in 0..14 (one level short of the grid, so min-max rounding picks another scale):
    the search finds the grid to float32 rounding, with the zero point z."""
    rng = np.random.default_rng(3)
    s, z = np.float32(0.0137), 6
    q = rng.permutation(np.resize(np.arange(0, 15), 32)).astype(np.float32)
    w = np.tile((s * (q - z))[:, None], (1, 4)).astype(np.float32)  # [32, 4]: K one block
    weight = kquant_blocks(w, zero_points="integer")
    assert np.abs(weight.dequantize() - w).max() <= 1e-7
    assert np.abs(rtn(w) - w).max() > 1e-3
    found = search_zero_point(np.ascontiguousarray(w.T), 15)
    assert set(found[2].tolist()) == {z}


@pytest.mark.parametrize("weighted", [False, True])
def test_integer_zero_point_codes_are_those_of_the_scale_and_zero_point_returned(weighted):
    """Each block's codes are round(x / s) + z clamped to the grid, for the s and z the search returns (numpy's
    float32 division and half-to-even rounding, as MatMulNBits' round-to-nearest would take them): no block
    keeps one candidate's codes with another's scale. Heavy-tailed blocks, a constant block, one all positive."""
    rng = np.random.default_rng(5)
    x = (rng.standard_t(4, (4000, 32)) * 0.02).astype(np.float32)
    x[7], x[11] = 0.0, np.abs(x[11])
    importance = np.broadcast_to(rng.random(32).astype(np.float32) + 0.1, x.shape) if weighted else None
    q, s, z = search_zero_point(x, 15, None, importance)
    live = s > 0
    assert live.sum() == len(x) - 1 and s[7] == 0 and not q[7].any()
    expected = np.clip(np.round(x[live] / s[live, None]) + z[live, None], 0, 15)
    np.testing.assert_array_equal(q[live], expected.astype(np.uint8))


def test_integer_zero_points_are_no_worse_than_the_min_max_grid_refitted():
    """One of search_zero_point's candidates is the min-max grid's scale (range with 0 / 15) refitted: z the
    nearest integer to where 0 falls, then s by weighted least squares twice with z fixed, each after rounding again
    (computed here in float64). On heavy-tailed blocks no block's weighted error is above that candidate's; a
    search without it ends above it in some blocks, since that candidate is the best of all in some."""
    x = (np.random.default_rng(7).standard_t(4, (4000, 32)) * 0.02).astype(np.float32)
    xd = x.astype(np.float64)
    w = np.sqrt((xd**2).mean(axis=1, keepdims=True)) + np.abs(xd)
    low, high = np.minimum(xd.min(axis=1), 0), np.maximum(xd.max(axis=1), 0)
    s = (high - low) / 15
    z = np.clip(np.rint(-low / s), 0, 15)[:, None]
    for _ in range(2):
        d = np.clip(np.rint(xd / s[:, None]), -z, 15 - z)
        s = (w * d * xd).sum(axis=1) / (w * d * d).sum(axis=1)
    d = np.clip(np.rint(xd / s[:, None]), -z, 15 - z)
    candidate = (w * (s[:, None] * d - xd) ** 2).sum(axis=1)
    q, s, z = search_zero_point(x, 15)
    found = (w * (s[:, None].astype(np.float64) * (q - z[:, None].astype(np.float64)) - xd) ** 2).sum(axis=1)
    assert np.all(found <= candidate * (1 + 1e-4))


def test_integer_zero_points_of_edge_blocks():
    """All zero (scale 0), all positive (zero point 0), all negative (zero point 15): each within half a step."""
    x = np.zeros((3, 32), dtype=np.float32)
    x[1] = np.linspace(0.5, 2.0, 32)
    x[2] = -np.linspace(0.5, 2.0, 32)
    q, s, z = search_zero_point(x, 15)
    values = s[:, None] * (q.astype(np.float32) - z[:, None])
    assert s[0] == 0 and z[0] == 0 and not values[0].any()
    assert z[1] == 0 and z[2] == 15
    assert np.all(np.abs(values - x) <= s[:, None] / 2 + 1e-6)


def test_integer_zero_points_pack_two_per_byte_and_run_in_onnx_runtime():
    """K = 96 (three blocks: the zero points' last byte has one nibble) and K = 40 (a padded last block): ONNX
    Runtime's MatMulNBits with the packed weight computes x @ the dequantized matrix (numpy, float64)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    for k in (96, 40):
        w = fixture_weights()[:k, :48]
        weight = kquant_blocks(w, 4, zero_points="integer")
        blocks = (k + 31) // 32
        assert weight.zero_points.shape == (48 * ((blocks + 1) // 2),)  # two per byte, per column
        inits = [
            numpy_helper.from_array(weight.packed, "B"),
            numpy_helper.from_array(weight.scales, "s"),
            numpy_helper.from_array(weight.zero_points, "z"),
        ]
        node = helper.make_node(
            "MatMulNBits", ["A", "B", "s", "z"], ["Y"], domain="com.microsoft", K=k, N=48, bits=4, block_size=32
        )
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [2, k])],
            [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 48])],
            inits,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        )
        x = np.random.default_rng(k).standard_normal((2, k)).astype(np.float32)
        y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]
        assert np.allclose(y, x.astype(np.float64) @ with_offsets(weight).T.astype(np.float64), rtol=1e-5, atol=1e-5)
        if k == 96:  # whole blocks: the values the search itself returns, unpacked by nobody
            q, scale, zero = search_zero_point(np.ascontiguousarray(w.T).reshape(-1, 32), 15)
            values = (scale[:, None] * (q.astype(np.float64) - zero[:, None])).reshape(48, k)  # [N, K]
            assert np.allclose(y, x.astype(np.float64) @ values.T, rtol=1e-5, atol=1e-5)


def planted(seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """([K, N] weights, [K] importance): in each block of 32 input channels one carries 10^4 the mean square of
    the others, and its weights are 100x smaller (the same function, as a model with a loud channel has)."""
    w = fixture_weights(seed)
    importance = np.ones(w.shape[0], dtype=np.float32)
    loud = np.arange(0, w.shape[0], 32)
    w[loud] /= 100
    importance[loud] = 1e4
    return w, importance


def test_auto_keeps_integer_zero_points_unless_their_weighted_error_is_far_above():
    """zero_points="auto": on the heavy-tailed fixture the integer search's weighted error is within
    AUTO_TOLERANCE of the float minimums' and the integer layout is kept; where loud channels read small weights
    it is far above (the only level near those weights is 0), and the float minimums are kept. On a grid that
    only one of them holds, that one is kept."""
    from exporters.kquant import AUTO_TOLERANCE

    def error(w, importance, mode):  # the search's objective, written out here in float64
        x = np.ascontiguousarray(w.T).reshape(-1, 32).astype(np.float64)
        square = (x**2).mean(axis=1, keepdims=True)
        if importance is None:
            weight = np.sqrt(square) + np.abs(x)
        else:
            held = np.broadcast_to(importance, (w.shape[1], w.shape[0])).reshape(-1, 32)
            weight = held * np.sqrt(2 * square + x**2)
        if mode == "integer":
            q, scale, zero = search_zero_point(x.astype(np.float32), 15, None, None if importance is None else held)
            values = scale[:, None] * (q.astype(np.float64) - zero[:, None])
        else:
            q, scale, low = search(x.astype(np.float32), 15, None, None if importance is None else held)
            values = scale[:, None] * q.astype(np.float64) + low[:, None]
        return float((weight * (values - x) ** 2).sum())

    w = fixture_weights()
    ratio = error(w, None, "integer") / error(w, None, "offsets")
    assert 1 < ratio < AUTO_TOLERANCE
    chosen = kquant_blocks(w, zero_points="auto")
    assert chosen.offsets is None and np.array_equal(
        chosen.dequantize(), kquant_blocks(w, zero_points="integer").dequantize()
    )
    w, importance = planted()
    assert error(w, importance, "integer") > 2 * AUTO_TOLERANCE * error(w, importance, "offsets")
    chosen = kquant_blocks(w, importance=importance, zero_points="auto")
    assert chosen.zero_points is None and chosen.offsets is not None
    assert np.array_equal(chosen.dequantize(), kquant_blocks(w, importance=importance).dequantize())
    # On a grid: Q4_0's (d (q - 8), which both hold to float32 rounding) keeps integer zero points; Q4_1's
    # (d q + m, a float minimum) keeps offsets.
    rng = np.random.default_rng(5)
    q = np.stack([rng.permutation(np.resize(np.arange(16), 32)) for _ in range(8)], axis=1).astype(np.float32)
    d, m = rng.uniform(0.01, 0.02, 8).astype(np.float32), -rng.uniform(0.05, 0.1, 8).astype(np.float32)
    q4_0, q4_1 = (d * (q - 8)).astype(np.float32), (d * q + m).astype(np.float32)  # [32, 8]: K one block
    on_q4_0 = kquant_blocks(q4_0, zero_points="auto")
    assert on_q4_0.offsets is None and np.abs(on_q4_0.dequantize() - q4_0).max() <= 1e-7
    on_q4_1 = kquant_blocks(q4_1, zero_points="auto")
    assert on_q4_1.offsets is not None and np.abs(on_q4_1.dequantize() - q4_1).max() <= 1e-7
    with pytest.raises(ValueError, match="zero_points: expected one of auto, integer, offsets, got 'float'"):
        kquant_blocks(w, zero_points="float")
