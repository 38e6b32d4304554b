"""exporters/quantize.py's `_within_steps`: whether a MatMulNBits weight dequantizes to within `bound` steps of the
float weight it was made from, on hand-built 8-bit blocks whose dequantized values are written out here:
w = (q - 128) * scale (no zero points: 2^(bits-1)), one step = the block's scale."""

from __future__ import annotations

import numpy as np
import pytest

from exporters import quantize
from exporters.quantize import _within_steps

K, N, BLOCK = 16, 4, 16
SCALES = np.array([[0.5], [0.25], [1.0], [0.125]], dtype=np.float32)  # [N, blocks]: one step per output column
SPEC = {"weight": "w_Q8", "scales": "w_scales", "bits": 8, "block_size": BLOCK, "K": K, "N": N}


def parts():
    """(B [N, 1, K] uint8, its scales) and the float weight [N, K] (torch layout) they stand for exactly."""
    q = (np.arange(N * K).reshape(N, K) * 7 % 256).astype(np.uint8)
    weight = ((q.astype(np.float32) - 128) * SCALES).astype(np.float32)
    return {"weight": q.reshape(N, 1, K), "scales": SCALES.copy()}, weight


def off(weight: np.ndarray, column: int, row: int, steps: float) -> np.ndarray:
    """`weight` with output column `column`, input row `row` moved by `steps` of that column's scale."""
    moved = weight.copy()
    moved[column, row] += steps * SCALES[column, 0]
    return moved


def test_exact_blocks_pass_every_bound():
    stored, weight = parts()
    for bound in (0, 0.51, 16.0):
        assert _within_steps(SPEC, stored, {"transpose": True}, weight, bound)


@pytest.mark.parametrize("column", range(N))
def test_an_element_off_by_0_6_steps_fails_at_0_51_and_0_4_passes(column):
    stored, weight = parts()
    chosen = {"transpose": True}
    assert not _within_steps(SPEC, stored, chosen, off(weight, column, 5, 0.6), 0.51)
    assert not _within_steps(SPEC, stored, chosen, off(weight, column, 5, -0.6), 0.51)
    assert _within_steps(SPEC, stored, chosen, off(weight, column, 5, 0.4), 0.51)
    assert _within_steps(SPEC, stored, chosen, off(weight, column, 5, -0.4), 0.51)
    assert _within_steps(SPEC, stored, chosen, off(weight, column, 5, 0.6), 1.0)


def test_bit_for_bit_refuses_any_difference():
    stored, weight = parts()
    chosen = {"transpose": True}
    assert not _within_steps(SPEC, stored, chosen, off(weight, 2, 0, 0.4), 0)
    nudged = weight.copy()
    nudged[3, 15] = np.nextafter(nudged[3, 15], np.float32(np.inf))  # one float32 ulp
    assert not _within_steps(SPEC, stored, chosen, nudged, 0)


def test_one_column_per_slab_still_sees_the_last_column(monkeypatch):
    monkeypatch.setattr(quantize, "CHECK_SLAB_BYTES", 4 * K)  # a slab of one output column
    stored, weight = parts()
    assert _within_steps(SPEC, stored, {"transpose": True}, weight, 0)
    assert not _within_steps(SPEC, stored, {"transpose": True}, off(weight, N - 1, K - 1, 0.6), 0.51)


def test_untransposed_and_sliced_locations():
    stored, weight = parts()
    # Stored layout [K, N] (no transpose): the float weight is weight.T.
    assert _within_steps(SPEC, stored, {"transpose": False}, weight.T.copy(), 0)
    assert not _within_steps(SPEC, stored, {"transpose": False}, off(weight, 1, 3, 0.6).T.copy(), 0.51)
    # A fused initializer's columns 2 and 3 (stored axis 1), transposed back to torch layout.
    chosen = {"transpose": True, "slice": [1, 2, 4]}
    assert _within_steps(SPEC, stored, chosen, weight[2:4].copy(), 0)
    assert not _within_steps(SPEC, stored, chosen, off(weight, 3, 7, 0.6)[2:4].copy(), 0.51)
    assert _within_steps(SPEC, stored, chosen, off(weight, 3, 7, 0.4)[2:4].copy(), 0.51)


def test_a_weight_of_another_shape_fails():
    stored, weight = parts()
    assert not _within_steps(SPEC, stored, {"transpose": True}, weight[:, :8].copy(), 16.0)
    assert not _within_steps(SPEC, stored, {"transpose": True, "slice": [1, 0, 2]}, weight.copy(), 16.0)
