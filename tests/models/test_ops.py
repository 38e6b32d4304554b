"""models/ops.py against independent naive numpy oracles (float64), plus structural properties.

Every oracle here is written from the textbook formula, loop by loop, and never
reuses code or intermediate values from the module under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.layers import SwiGLU
from models.ops import apply_rope, attention, geglu, rms_norm, swiglu
from models.rope import rope_inverse_frequencies

# Per-dtype tolerances (rtol, atol) for comparing torch results with a float64 numpy oracle.
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-6)}


def _close(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(actual.detach().to(torch.float64).numpy(), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# naive numpy oracles


def np_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        mean_square = sum(float(v) * float(v) for v in row) / len(row)
        out[idx] = row / math.sqrt(mean_square + eps) * w
    return out


def np_silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def np_swiglu(x, gate, up, down):
    # torch [out, in] layout: a projection of a row vector r is r @ W^T
    return (np_silu(x @ gate.T) * (x @ up.T)) @ down.T


def np_gelu(z: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":  # 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
        return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))  # z Phi(z)


def np_geglu(x, gate, up, down, approximate):
    return (np_gelu(x @ gate.T, approximate) * (x @ up.T)) @ down.T


def np_rope(x: np.ndarray, positions, base: float, pairing: str) -> np.ndarray:
    """x [..., T, hw]; pair i is rotated by angle positions[t] * base^(-2i/hw)."""
    hw = x.shape[-1]
    out = x.copy()
    for t, pos in enumerate(positions):
        for i in range(hw // 2):
            theta = pos * base ** (-2.0 * i / hw)
            a, b = (2 * i, 2 * i + 1) if pairing == "interleaved" else (i, i + hw // 2)
            xa, xb = x[..., t, a], x[..., t, b]
            out[..., t, a] = xa * math.cos(theta) - xb * math.sin(theta)
            out[..., t, b] = xa * math.sin(theta) + xb * math.cos(theta)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return attention(q, k, v, causal=True)


def np_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """q [B, H, Tq, hw]; k, v [B, KV, Tk, hw]; query j sits at absolute position j + Tk - Tq.
    Query head h reads kv head h // (H // KV)."""
    B, H, Tq, hw = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    group = H // KV
    out = np.zeros((B, H, Tq, v.shape[-1]))
    probs = np.zeros((B, H, Tq, Tk))
    for b in range(B):
        for h in range(H):
            kv = h // group
            for j in range(Tq):
                visible = j + (Tk - Tq) + 1  # keys 0 .. own position
                scores = np.array([q[b, h, j] @ k[b, kv, s] / math.sqrt(hw) for s in range(visible)])
                e = np.exp(scores - scores.max())
                p = e / e.sum()
                probs[b, h, j, :visible] = p
                out[b, h, j] = sum(p[s] * v[b, kv, s] for s in range(visible))
    return out, probs


def _randn(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_rms_norm_matches_naive_formula(dtype, eps):
    x = _randn((2, 3, 6), 0, dtype)
    w = _randn((6,), 1, dtype)
    expected = np_rms_norm(x.double().numpy(), w.double().numpy(), eps)
    _close(rms_norm(x, w, eps), expected, dtype)


def test_rms_norm_hand_values():
    # row (3, 4): mean square = 12.5, rms = sqrt(12.5); with eps = 0 the output is (3, 4) / sqrt(12.5) * w
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    w = torch.tensor([2.0, -1.0], dtype=torch.float64)
    out = rms_norm(x, w, 0.0)
    np.testing.assert_allclose(out.numpy(), [[6 / math.sqrt(12.5), -4 / math.sqrt(12.5)]], rtol=1e-15)
    # eps = 12.5 doubles the denominator's argument: divide by sqrt(25) = 5
    out = rms_norm(x, w, 12.5)
    np.testing.assert_allclose(out.numpy(), [[6 / 5, -4 / 5]], rtol=1e-15)


def test_rms_norm_eps_zero_is_scale_invariant_and_finite():
    x = _randn((4, 8), 2)
    w = torch.ones(8, dtype=torch.float64)
    a, b = rms_norm(x, w, 0.0), rms_norm(1e-3 * x, w, 0.0)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # unit gains: every output row has root-mean-square exactly 1
    torch.testing.assert_close(a.pow(2).mean(-1), torch.ones(4, dtype=torch.float64), rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 3),
    width=st.integers(1, 7),
    eps=st.sampled_from([0.0, 1e-6, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_property(rows, width, eps, seed):
    x = _randn((rows, width), seed) + 0.1  # shift keeps rows away from all-zero when eps = 0
    w = _randn((width,), seed + 1)
    _close(rms_norm(x, w, eps), np_rms_norm(x.numpy(), w.numpy(), eps), torch.float64)


# ---------------------------------------------------------------------------------------------
# swiglu


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swiglu_matches_naive_formula(dtype):
    d, f = 5, 7
    x = _randn((2, 3, d), 10, dtype)
    gate, up, down = _randn((f, d), 11, dtype), _randn((f, d), 12, dtype), _randn((d, f), 13, dtype)
    expected = np_swiglu(*(t.double().numpy() for t in (x, gate, up, down)))
    out = swiglu(x, gate, up, down)
    assert out.shape == (2, 3, d)
    _close(out, expected, dtype)


def test_swiglu_hand_value():
    # identity weights, x = (1, -2): silu(1)*1 = 1/(1+e^-1); silu(-2)*(-2) = -2/(1+e^2) * -2 = 4/(1+e^2)
    x = torch.tensor([1.0, -2.0], dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.float64)
    out = swiglu(x, eye, eye, eye)
    np.testing.assert_allclose(out.numpy(), [1 / (1 + math.exp(-1)), 4 / (1 + math.exp(2))], rtol=1e-14)


def test_swiglu_uses_gate_and_up_asymmetrically():
    # silu(gate x) * (up x) is not symmetric in gate/up: swapping them must change the result
    x = _randn((3, 4), 20)
    gate, up, down = _randn((6, 4), 21), _randn((6, 4), 22), _randn((4, 6), 23)
    assert not torch.allclose(swiglu(x, gate, up, down), swiglu(x, up, gate, down))


# ---------------------------------------------------------------------------------------------
# geglu


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_geglu_matches_naive_formula(dtype, approximate):
    d, f = 5, 7
    x = 2 * _randn((2, 3, d), 14, dtype)  # |gate x| up to about 10: where the two GELUs differ by 1e-3
    gate, up, down = _randn((f, d), 15, dtype), _randn((f, d), 16, dtype), _randn((d, f), 17, dtype)
    expected = np_geglu(*(t.double().numpy() for t in (x, gate, up, down)), approximate)
    out = geglu(x, gate, up, down, approximate)
    assert out.shape == (2, 3, d)
    _close(out, expected, dtype)
    other = np_geglu(*(t.double().numpy() for t in (x, gate, up, down)), {"tanh": "none", "none": "tanh"}[approximate])
    assert np.max(np.abs(other - expected)) > 1e-4  # the formulas differ where this input reaches


@pytest.mark.parametrize("activation,approximate", [("gelu_tanh", "tanh"), ("gelu", "none")])
def test_the_gated_feed_forward_computes_the_gelu_its_activation_names(activation, approximate):
    torch.manual_seed(0)
    ffn = SwiGLU(4, 6, activation).double()
    x = 3 * _randn((2, 4), 18)
    weights = [w.detach().numpy() for w in (ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight)]
    with torch.no_grad():
        np.testing.assert_allclose(ffn(x).numpy(), np_geglu(x.numpy(), *weights, approximate), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_inverse_frequencies_hand_values():
    # head width 8, base 10000: 10000^(0), 10000^(-1/4), 10000^(-1/2), 10000^(-3/4)
    inv = rope_inverse_frequencies(8, 10000.0)
    assert inv.dtype == torch.float64
    np.testing.assert_allclose(inv.numpy(), [1.0, 0.1, 0.01, 0.001], rtol=1e-14)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("hw,base", [(2, 10000.0), (4, 10000.0), (8, 100.0)])
def test_apply_rope_matches_naive_rotation(pairing, dtype, hw, base):
    T = 5
    x = _randn((2, 3, T, hw), 30, dtype)
    positions = torch.arange(T) + 3  # a non-zero offset exercises pos != index
    out = apply_rope(x, positions, rope_inverse_frequencies(hw, base), pairing)
    expected = np_rope(x.double().numpy(), positions.tolist(), base, pairing)
    assert out.dtype == dtype and out.shape == x.shape
    _close(out, expected, dtype)


def test_apply_rope_hand_value_head_width_2():
    # head width 2: one pair, frequency 1, angle = position in radians
    x = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [3.0, -2.0]]]], dtype=torch.float64)
    out = apply_rope(x, torch.tensor([0, 1, 2]), rope_inverse_frequencies(2, 10000.0), "interleaved")
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(2), math.sin(2)
    expected = [[1.0, 0.0], [-s1, c1], [3 * c2 + 2 * s2, 3 * s2 - 2 * c2]]
    np.testing.assert_allclose(out[0, 0].numpy(), expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_apply_rope_preserves_norm_of_every_pair(pairing):
    hw, T = 8, 6
    x = _randn((1, 2, T, hw), 40)
    out = apply_rope(x, torch.arange(T), rope_inverse_frequencies(hw, 10000.0), pairing)

    def pair_norms(t):
        if pairing == "interleaved":
            a, b = t[..., 0::2], t[..., 1::2]
        else:
            a, b = t[..., : hw // 2], t[..., hw // 2 :]
        return (a**2 + b**2).sqrt()

    torch.testing.assert_close(pair_norms(out), pair_norms(x), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_apply_rope_position_zero_is_identity(pairing, dtype):
    x = _randn((2, 2, 1, 8), 50, dtype)
    out = apply_rope(x, torch.tensor([0]), rope_inverse_frequencies(8, 10000.0), pairing)
    assert torch.equal(out, x)  # cos 0 = 1, sin 0 = 0 exactly


@pytest.mark.parametrize("hw", [4, 8])
def test_apply_rope_pairings_differ_for_wide_heads(hw):
    x = _randn((1, 1, 4, hw), 60)
    inv = rope_inverse_frequencies(hw, 10000.0)
    a = apply_rope(x, torch.arange(4), inv, "interleaved")
    b = apply_rope(x, torch.arange(4), inv, "half")
    assert not torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_apply_rope_pairings_coincide_for_head_width_2():
    # with a single pair (0, 1) both layouts rotate the same two coordinates
    x = _randn((1, 1, 4, 2), 61)
    inv = rope_inverse_frequencies(2, 10000.0)
    assert torch.equal(apply_rope(x, torch.arange(4), inv, "interleaved"), apply_rope(x, torch.arange(4), inv, "half"))


def test_apply_rope_relative_property():
    # <R(m) q, R(n) k> depends on m - n only
    hw = 8
    inv = rope_inverse_frequencies(hw, 10000.0)
    q, k = _randn((1, 1, 1, hw), 70), _randn((1, 1, 1, hw), 71)

    def dot(m, n):
        return float(
            (apply_rope(q, torch.tensor([m]), inv, "half") * apply_rope(k, torch.tensor([n]), inv, "half")).sum()
        )

    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-12, abs=1e-12)
    assert dot(5, 2) != pytest.approx(dot(5, 3), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# causal attention


def _future_mask(tq: int, tk: int) -> np.ndarray:
    # query j sits at absolute position j + tk - tq and may not see keys after it
    return np.array([[s > j + tk - tq for s in range(tk)] for j in range(tq)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_attention_matches_naive_softmax_attention(dtype):
    B, H, T, hw = 2, 3, 5, 4
    q, k, v = _randn((B, H, T, hw), 80, dtype), _randn((B, H, T, hw), 81, dtype), _randn((B, H, T, hw), 82, dtype)
    out, probs = causal_attention(q, k, v)
    exp_out, exp_probs = np_causal_attention(*(t.double().numpy() for t in (q, k, v)))
    assert out.shape == (B, H, T, hw) and probs.shape == (B, H, T, T)
    _close(probs, exp_probs, dtype)
    _close(out, exp_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_attention_masked_probabilities_are_exactly_zero(dtype):
    B, H, T, hw = 1, 2, 6, 4
    # large scores make an approximate (finite) mask leak visibly
    q, k, v = (10 * _randn((B, H, T, hw), s, dtype) for s in (90, 91, 92))
    _, probs = causal_attention(q, k, v)
    future = torch.from_numpy(_future_mask(T, T))
    masked = probs[..., future]
    assert masked.numel() == H * T * (T - 1) // 2
    assert (masked == 0.0).all()
    assert (probs[..., ~future] >= 0).all()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T, dtype=dtype), rtol=rtol, atol=atol)


def test_causal_attention_first_query_attends_only_to_itself():
    q, k, v = _randn((1, 1, 4, 2), 93), _randn((1, 1, 4, 2), 94), _randn((1, 1, 4, 2), 95)
    out, probs = causal_attention(q, k, v)
    assert torch.equal(probs[0, 0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], rtol=1e-15, atol=0)


def test_causal_attention_hand_value():
    # head width 2, scale 1/sqrt(2). Query 1 = (1, 0) against keys (1, 0) and (0, 0):
    # scores 1/sqrt(2) and 0 -> p0 = 1 / (1 + exp(-1/sqrt(2)))
    q = torch.tensor([[[[0.0, 0.0], [1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0, 0.0], [0.0, 4.0]]]], dtype=torch.float64)
    out, probs = causal_attention(q, k, v)
    p0 = 1 / (1 + math.exp(-1 / math.sqrt(2)))
    np.testing.assert_allclose(probs[0, 0].numpy(), [[1.0, 0.0], [p0, 1 - p0]], rtol=1e-14)
    np.testing.assert_allclose(out[0, 0, 1].numpy(), [2 * p0, 4 * (1 - p0)], rtol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_attention_with_cached_keys(dtype):
    B, H, Tq, Tk, hw = 2, 2, 2, 5, 4
    q = _randn((B, H, Tq, hw), 100, dtype)
    k, v = _randn((B, H, Tk, hw), 101, dtype), _randn((B, H, Tk, hw), 102, dtype)
    out, probs = causal_attention(q, k, v)
    assert probs.shape == (B, H, Tq, Tk)
    cached = Tk - Tq
    # every query sees all cached keys; query j additionally sees keys cached .. cached + j
    assert (probs[..., :, :cached] > 0).all()
    assert (probs[..., 0, cached] > 0).all() and (probs[..., 0, cached + 1 :] == 0.0).all()
    assert (probs[..., 1, : cached + 2] > 0).all()
    exp_out, exp_probs = np_causal_attention(*(t.double().numpy() for t in (q, k, v)))
    _close(probs, exp_probs, dtype)
    _close(out, exp_out, dtype)


def test_causal_attention_single_query_over_cache_sees_everything():
    q, k, v = _randn((1, 1, 1, 4), 103), _randn((1, 1, 6, 4), 104), _randn((1, 1, 6, 4), 105)
    _, probs = causal_attention(q, k, v)
    assert (probs > 0).all()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (6, 3)])
def test_causal_attention_gqa_equals_explicit_kv_repeat(heads, kv_heads):
    B, T, hw = 2, 4, 4
    q = _randn((B, heads, T, hw), 110)
    k, v = _randn((B, kv_heads, T, hw), 111), _randn((B, kv_heads, T, hw), 112)
    out, probs = causal_attention(q, k, v)
    # explicit repeat: query head h reads kv head h // (heads // kv_heads)
    index = torch.tensor([h // (heads // kv_heads) for h in range(heads)])
    ref_out, ref_probs = causal_attention(q, k[:, index], v[:, index])
    assert torch.equal(out, ref_out) and torch.equal(probs, ref_probs)
    exp_out, exp_probs = np_causal_attention(q.numpy(), k.numpy(), v.numpy())
    _close(out, exp_out, torch.float64)
    _close(probs, exp_probs, torch.float64)


def test_causal_attention_is_causal_in_values():
    # changing the last key/value leaves every earlier query's output bitwise unchanged
    q, k, v = _randn((1, 2, 5, 4), 120), _randn((1, 2, 5, 4), 121), _randn((1, 2, 5, 4), 122)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 3.0
    v2[:, :, -1] -= 5.0
    out, probs = causal_attention(q, k, v)
    out2, probs2 = causal_attention(q, k2, v2)
    assert torch.equal(out[:, :, :-1], out2[:, :, :-1]) and torch.equal(probs[:, :, :-1], probs2[:, :, :-1])
    assert not torch.allclose(out[:, :, -1], out2[:, :, -1])
