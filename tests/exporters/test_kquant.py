"""exporters/kquant.py: the k-quant search against round-to-nearest, with independent oracles.

Round-to-nearest here is ONNX Runtime's own (`quant_tensor` of its weight-only quantizer, integer zero points),
the values are read back through the MatMulNBits spec oracle (tests/toolkit/quantize/test_quantize.py) plus the
offsets, and the end-to-end cases run the graphs in ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor

from exporters.kquant import kquant_blocks, search
from tests.exporters.test_gguf_blocks import with_offsets


def rtn(weight: np.ndarray, bits: int = 4) -> np.ndarray:
    """[K, N]: ONNX Runtime's round-to-nearest (asymmetric, uint8 zero points, block 32) dequantized."""
    k, n = weight.shape
    q, scale, zero = quant_tensor(weight.T.copy(), bits, 32, "asym", "uint")
    return ((q.reshape(-1, 32) - zero.reshape(-1, 1)) * scale.reshape(-1, 1)).reshape(n, k).T


def fixture_weights(seed: int = 0) -> np.ndarray:
    """[192, 160] heavy-tailed weights (Student t, 4 degrees of freedom), like a trained projection's."""
    return (np.random.default_rng(seed).standard_t(4, (192, 160)) * 0.02).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_search_is_at_least_as_good_as_round_to_nearest(bits):
    """On the fixture, the searched blocks' error (RMS, and the search's own weighted objective) is below
    round-to-nearest's, and the values the graph computes are what the search chose."""
    w = fixture_weights()
    weight = kquant_blocks(w, bits)
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
