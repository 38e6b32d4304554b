"""int8 activations as ONNX Runtime's level-4 MatMulNBits rounds them, on hand-computed blocks.

The product with ONNX Runtime's own kernel is held in tests/runners/test_contrib_ops.py and, through whole
artifacts, in tests/toolkit/quantize/test_quantize.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runners.activations import AMBIGUITY, Int8Activations, RoundedWeight, int8_activations, rounds_activations


def test_a_block_whose_maximum_is_127_keeps_unit_steps_and_rounds_half_to_even():
    # amax 127: scale 1 and inverse 1, so each value is its own step count.
    x = torch.tensor([[127.0, 63.5, -0.5, 1.5, 2.5, -3.25, 0.0, 100.7]], dtype=torch.float64)
    got = int8_activations(x, block_size=8)
    assert got.tolist() == [[127.0, 64.0, -0.0, 2.0, 2.0, -3.0, 0.0, 101.0]]


def test_away_rounds_only_the_values_on_a_half_step_the_other_way():
    x = torch.tensor([[127.0, 63.5, -0.5, 1.5, 2.5, -3.25, 0.0, 100.7]], dtype=torch.float64)
    got = int8_activations(x, block_size=8, away=True)
    assert got.tolist() == [[127.0, 63.0, -1.0, 1.0, 3.0, -3.0, 0.0, 101.0]]
    # just outside the window the value is no longer ambiguous
    off = 1.5 * (1 + 4 * AMBIGUITY)
    x = torch.tensor([[127.0, off]], dtype=torch.float64)
    assert int8_activations(x, block_size=2, away=True).tolist() == [[127.0, 2.0]]


def test_the_inverse_scale_is_one_float32_division_as_the_kernel_computes_it():
    # A block from SmolLM2's first layer: a * (127 / amax) is exactly -49.5 in float32 (rounds to -50), while
    # a * (127 * (1 / amax)) is -49.499996 (rounds to -49), one step apart.
    amax, a = np.float32(0.16518016), np.float32(-0.06438124)
    assert a * (np.float32(127) / amax) == np.float32(-49.5)
    assert a * (np.float32(127) * (np.float32(1) / amax)) != np.float32(-49.5)
    x = torch.tensor([[amax, a]], dtype=torch.float64)
    step = float(amax / np.float32(127))
    assert int8_activations(x, block_size=2)[0, 1].item() == -50 * step


def test_blocks_scale_apart_and_a_zero_block_and_the_padding_stay_zero():
    # K = 5, block 2: blocks [2, -1], [0, 0], [0.5] (padded). Steps: 2/127, none, 0.5/127.
    x = torch.tensor([[2.0, -1.0, 0.0, 0.0, 0.5]], dtype=torch.float64)
    got = int8_activations(x, block_size=2)
    step = np.float32(2.0) / np.float32(127.0)
    q = round(-1.0 * float(np.float32(127.0) / np.float32(2.0)))  # -63.5 -> -64 (half to even)
    assert got[0, 0] == pytest.approx(127 * float(step), rel=0, abs=0)
    assert got[0, 1].item() == q * float(step)
    assert got[0, 2:4].tolist() == [0.0, 0.0]
    assert got[0, 4].item() == float(np.float32(0.5) / np.float32(127.0)) * 127


def test_which_weights_round():
    # Asked of this machine's ONNX Runtime (kernel_rounds); the int8 path of the layouts `toolkit quantize`
    # writes at level 4 is held to the kernel's output in tests/runners/test_contrib_ops.py.
    assert rounds_activations(4, None, 4, 32) and rounds_activations(4, np.uint8, 8, 64)
    assert not rounds_activations(4, np.float32, 4, 32)  # HQQ: no int8 kernel
    assert not rounds_activations(4, np.float32, 8, 32)  # a layout the CPU kernel refuses
    assert not rounds_activations(0, None) and not rounds_activations(None, None)


def test_the_mode_rounds_only_the_registered_weights_and_applies_offsets_to_the_float_activations():
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    nbits = torch.randn(5, 8, dtype=torch.float64)  # [N, K]
    other = torch.randn(5, 8, dtype=torch.float64)
    offsets = torch.randn(2, 5, dtype=torch.float64)  # [blocks, N], block 4
    weight = nbits + offsets.repeat_interleave(4, dim=0).T  # what the eager model holds: the dequantized sum
    with Int8Activations({id(weight): RoundedWeight(4, offsets)}):
        got = torch.nn.functional.linear(x, weight)
        untouched = torch.nn.functional.linear(x, other)
    rounded = int8_activations(x, 4)
    sums = x.unflatten(-1, (2, 4)).sum(-1)  # the graph's offsets MatMul on the float activations
    torch.testing.assert_close(got, rounded @ nbits.T + sums @ offsets, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(untouched, x @ other.T, rtol=0, atol=0)
