"""exporters/gguf_blocks.py: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K blocks as MatMulNBits weights, held to
gguf.quants.

The MatMulNBits side is read by the spec oracle of tests/toolkit/quantize/test_quantize.py (mnb_dequantize, on a
one-node graph), not by the module's own dequantizer; edge blocks are placed by hand: a constant block (Q4_1's
d = 0), an all-positive block and one whose minimum is far from zero in its own steps.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from exporters.gguf_blocks import concat_columns, deviation, target_layout, to_nbits
from tests.toolkit.quantize.test_quantize import mnb_dequantize

gguf = pytest.importorskip("gguf", reason="GGUF blocks are made with the gguf library")
from tests.models.test_checkpoints_gguf import quantized  # noqa: E402

Q = gguf.GGMLQuantizationType
# type: (MatMulNBits bits, block, offsets) it is taken at on its own
LAYOUTS = {
    Q.Q4_0: (4, 32, False),
    Q.Q8_0: (8, 32, False),
    Q.Q5_0: (8, 32, False),
    Q.Q6_K: (8, 16, False),
    Q.Q4_1: (4, 32, True),
    Q.Q4_K: (4, 32, True),
    Q.Q5_1: (8, 32, True),
    Q.Q5_K: (8, 32, True),
}


def matrix() -> np.ndarray:
    """[8, 96] with edge blocks in rows 0-2 (first block of each)."""
    x = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    x[0, :32] = 5.0  # constant: Q4_1 stores d = 0, m = 5
    x[1, :32] = np.abs(x[1, :32]) + 3  # all positive: m > 0
    x[2, :32] += 1000  # the minimum ~ 1000 / d steps from zero: no power-of-two grid reaches it
    return x


def oracle(weight) -> np.ndarray:
    """[K, N] float64 of `weight` read by the spec oracle from a one-node graph."""
    inits = [numpy_helper.from_array(weight.packed, "B"), numpy_helper.from_array(weight.scales, "s")]
    inputs = ["A", "B", "s"]
    if weight.zero_points is not None:
        inits.append(numpy_helper.from_array(weight.zero_points, "z"))
        inputs.append("z")
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=weight.k,
        N=weight.n,
        bits=weight.bits,
        block_size=weight.block_size,
    )
    proto = onnx.ModelProto(graph=helper.make_graph([node], "g", [], [], inits))
    return mnb_dequantize(proto, node)


def with_offsets(weight) -> np.ndarray:
    """[N, K] float32: the spec oracle's values plus the offsets the graph adds to every value of their block."""
    values = oracle(weight).T.astype(np.float32)
    if weight.offsets is None:
        return values
    offsets = np.repeat(weight.offsets.reshape(weight.n, -1), weight.block_size, axis=1)[:, : values.shape[1]]
    return values + offsets


def gguf_rows(kind, rows=8, k=512, seed=0) -> np.ndarray:
    """[rows, row bytes]: gguf.quants' blocks of a random matrix, or random valid K-quant blocks."""
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return quantized(x, kind, np.random.default_rng(seed + 1))


@pytest.mark.parametrize("kind", list(LAYOUTS), ids=[k.name for k in LAYOUTS])
def test_every_type_is_taken_bit_for_bit(kind):
    """Each type at its own layout: the MatMulNBits values (spec oracle) plus the offsets are gguf.quants'
    dequantization of the same bytes, value for value, and the report says so."""
    raw = gguf_rows(kind)
    weight = to_nbits(kind.name, raw)
    assert (weight.bits, weight.block_size, weight.offsets is not None) == LAYOUTS[kind]
    assert weight.exact and weight.zero_points is None
    assert np.array_equal(with_offsets(weight), gguf.quants.dequantize(raw, kind))
    assert deviation(weight, kind.name, raw) == {"identical": True, "max_abs": 0.0, "max_steps": 0.0}


def test_fused_pieces_of_different_types_share_the_widest_layout():
    """A Q4_K attn_q beside a Q6_K attn_v (Q4_K_M's mix, fused by the ort lowering): both at 8 bits, block 16, with
    offsets (zero for Q6_K), still bit for bit."""
    pieces = {Q.Q4_K: gguf_rows(Q.Q4_K, rows=6, seed=3), Q.Q6_K: gguf_rows(Q.Q6_K, rows=4, seed=4)}
    layout = target_layout([kind.name for kind in pieces])
    assert layout == (8, 16, True)
    fused = concat_columns([to_nbits(kind.name, raw, layout=layout) for kind, raw in pieces.items()])
    want = np.concatenate([gguf.quants.dequantize(raw, kind) for kind, raw in pieces.items()])
    assert fused.exact and (fused.bits, fused.block_size) == (8, 16)
    assert np.array_equal(with_offsets(fused), want)


def gguf_values(raw: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray]:
    """([N, K] float32 values as gguf.quants dequantizes them, [N, K] the step |d| of each value's block)."""
    values = gguf.quants.dequantize(raw, kind)
    size = gguf.GGML_QUANT_SIZES[kind][1]
    step = np.abs(raw.reshape(-1, size)[:, :2].copy().view(np.float16)[:, 0].astype(np.float64))
    return values, np.repeat(step, 32).reshape(values.shape)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q8_0])
def test_q4_0_and_q8_0_repack_bit_for_bit(kind):
    raw = gguf.quants.quantize(matrix(), kind)
    weight = to_nbits(kind.name, raw)
    values, _ = gguf_values(raw, kind)
    assert weight.bits == (4 if kind == Q.Q4_0 else 8) and weight.zero_points is None and weight.exact
    assert np.array_equal(oracle(weight).T.astype(np.float32), values)
    assert deviation(weight, kind.name, raw) == {"identical": True, "max_abs": 0.0, "max_steps": 0.0}


def test_q4_1_with_offsets_is_bit_for_bit():
    """The default Q4_1 layout: 4-bit q with the default zero point 8 and scale d, plus m + 8d added per block:
    every value equal to gguf.quants', the constant (d = 0) and far-from-zero blocks included."""
    raw = gguf.quants.quantize(matrix(), Q.Q4_1)
    weight = to_nbits("Q4_1", raw)
    values, _ = gguf_values(raw, Q.Q4_1)
    assert weight.bits == 4 and weight.exact and weight.zero_points is None
    offsets = weight.offsets.reshape(weight.n, -1)  # [N, blocks]: m + 8d of each block
    rebuilt = oracle(weight).T.astype(np.float32) + np.repeat(offsets, 32, axis=1)
    assert np.array_equal(rebuilt, values)
    assert deviation(weight, "Q4_1", raw) == {"identical": True, "max_abs": 0.0, "max_steps": 0.0}


def test_q4_1_on_the_int8_grid_is_within_a_32nd_of_a_step():
    raw = gguf.quants.quantize(matrix(), Q.Q4_1)
    weight = to_nbits("Q4_1", raw, "int8-grid")
    values, step = gguf_values(raw, Q.Q4_1)
    error = np.abs(oracle(weight).T - values)
    assert weight.bits == 8 and weight.zero_points.dtype == np.uint8 and not weight.exact
    ordinary = np.ones_like(error, dtype=bool)
    ordinary[:3, :32] = False
    assert 0 < (error[ordinary] / step[ordinary]).max() <= 1 / 32
    assert error[0, :32].max() <= 1e-6 * 5  # the constant block: its value, on a grid spanning it and zero
    # Positive m (about 21 steps above zero): the grid d/4 is the finest that reaches it, off by at most 1/8.
    assert 1 / 32 < (error[1, :32] / step[1, :32]).max() <= 1 / 8
    # Far from zero: rounded onto 255 steps spanning [0, max], off by at most half of one.
    assert error[2, :32].max() <= 0.5 * values[2, :32].max() / 255 * (1 + 1e-6)
    report = deviation(weight, "Q4_1", raw)
    # The report subtracts in float32: within a float32 rounding of the values (~1000) of the exact figure.
    assert not report["identical"] and report["max_abs"] == pytest.approx(error.max(), abs=1e-4)


def test_q4_1_with_float_zero_points_is_off_by_float32_rounding_only():
    raw = gguf.quants.quantize(matrix(), Q.Q4_1)
    weight = to_nbits("Q4_1", raw, "float-zero-points")
    values, step = gguf_values(raw, Q.Q4_1)
    error = np.abs(oracle(weight).T - values)
    assert weight.bits == 4 and weight.zero_points.dtype == np.float32
    assert error.max() <= 1e-6 * np.abs(values).max()
    assert error[0, :32].max() == 0  # d = 0: scale m, zero point -1


def test_columns_concatenate_and_mixed_layouts_are_refused():
    x = matrix()
    parts = [to_nbits("Q4_0", gguf.quants.quantize(rows, Q.Q4_0)) for rows in (x[:3], x[3:])]
    whole = to_nbits("Q4_0", gguf.quants.quantize(x, Q.Q4_0))
    assert np.array_equal(oracle(concat_columns(parts)), oracle(whole))
    q8 = to_nbits("Q8_0", gguf.quants.quantize(x[3:], Q.Q8_0))
    with pytest.raises(ValueError, match="different MatMulNBits layouts"):
        concat_columns([parts[0], q8])


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q6_K], ids=["Q4_1", "Q6_K"])
def test_a_tensor_converted_a_slab_of_rows_at_a_time_is_the_same(kind, monkeypatch):
    """Rows beyond a slab are converted in slabs and joined: the same weight, bit for bit, as in one piece."""
    from exporters import gguf_blocks

    raw = gguf_rows(kind, rows=7)
    whole = to_nbits(kind.name, raw)
    monkeypatch.setattr(gguf_blocks, "CHECK_SLAB_BYTES", 4 * 512 * 2)  # two rows of K = 512 per slab
    sliced = to_nbits(kind.name, raw)
    for field in ("packed", "scales", "offsets"):
        a, b = getattr(whole, field), getattr(sliced, field)
        assert (a is None and b is None) or np.array_equal(a, b), field
    assert (sliced.bits, sliced.block_size, sliced.exact) == (whole.bits, whole.block_size, whole.exact)
    assert np.array_equal(with_offsets(sliced), gguf.quants.dequantize(raw, kind))
