"""models/gpt.py (family "gpt") against hand counts and an independent numpy float64 oracle.

The oracle below is written from the GPT-2 style formulas, using only the module's weights:
    x      = tok[ids] + pos[0..T)                       (every window starts at position 0)
    h      = x + MHA(LN_a(x))                           (causal, bias-free projections)
    y      = h + W2 gelu_erf(W1 LN_f(h) + b1) + b2
    logits = LN_final(y) @ head^T                       (untied head)
LN(z) = (z - mean) / sqrt(biased var + eps) * g + b.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from artifact.errors import ConfigError, InputError
from models.gpt import GPT, GPTConfig
from models.presets import get_preset
from models.registry import build_model, get_family

BLOCK_STAGES = (
    "attention_norm",
    "attention_weights",
    "attention_branch",
    "after_attention",
    "feed_forward_norm",
    "feed_forward_branch",
    "output",
)


def _gpt(seed=0, **fields):
    return build_model("gpt", GPTConfig(**fields), seed=seed)


def _tiny(seed=0):
    spec = get_preset("gpt-tiny")
    return build_model(spec.family, spec.config, seed=seed)


def _ids(B, T, V, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, V, size=(B, T), dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# numpy oracle

_erf = np.vectorize(math.erf)


def _np_layernorm(z, g, b, eps):
    mean = z.mean(-1, keepdims=True)
    var = ((z - mean) ** 2).mean(-1, keepdims=True)  # biased variance (divide by d, not d - 1)
    return (z - mean) / np.sqrt(var + eps) * g + b


def _np_gelu(z):
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def _np_gpt(ids, W, c):
    """ids [B, T] -> dict of float64 stages, written from the formulas in the module docstring."""
    ids = np.asarray(ids)
    B, T = ids.shape
    d, H = c.width, c.heads
    hw = d // H
    x = W["embed_tokens.weight"][ids] + W["embed_positions.weight"][np.arange(T)][None]
    out = {"embed_tokens": x}
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    for layer in range(c.layers):
        p = f"block.{layer}."
        n_a = _np_layernorm(x, W[p + "attention_norm.weight"], W[p + "attention_norm.bias"], c.eps)
        q, k, v = (n_a @ W[p + f"attention.{m}_proj.weight"].T for m in "qkv")
        probs = np.zeros((B, H, T, T))
        heads = np.zeros((B, T, d))
        for b in range(B):
            for h in range(H):
                sl = slice(h * hw, (h + 1) * hw)
                s = q[b, :, sl] @ k[b, :, sl].T / math.sqrt(hw)
                s[mask] = -np.inf
                e = np.exp(s - s.max(-1, keepdims=True))
                probs[b, h] = e / e.sum(-1, keepdims=True)
                heads[b, :, sl] = probs[b, h] @ v[b, :, sl]
        branch = heads @ W[p + "attention.o_proj.weight"].T
        h_ = x + branch
        n_f = _np_layernorm(h_, W[p + "feed_forward_norm.weight"], W[p + "feed_forward_norm.bias"], c.eps)
        hidden = _np_gelu(n_f @ W[p + "feed_forward.up_proj.weight"].T + W[p + "feed_forward.up_proj.bias"])
        ffn = hidden @ W[p + "feed_forward.down_proj.weight"].T + W[p + "feed_forward.down_proj.bias"]
        y = h_ + ffn
        out.update(
            {
                p + "attention_norm": n_a,
                p + "attention_weights": probs,
                p + "attention_branch": branch,
                p + "after_attention": h_,
                p + "feed_forward_norm": n_f,
                p + "feed_forward_branch": ffn,
                p + "output": y,
            }
        )
        x = y
    out["final_norm"] = _np_layernorm(x, W["final_norm.weight"], W["final_norm.bias"], c.eps)
    out["logits"] = out["final_norm"] @ W["lm_head.weight"].T
    return out


def _weights(model):
    return {n: t.detach().double().numpy() for n, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# parameters


def test_gpt_tiny_has_exactly_19320_parameters_by_hand():
    V, d, C, L, f = 290, 24, 24, 1, 48
    # 2Vd = 13,920 (embedding + untied head); Cd = 576; per layer 4d^2 = 2,304, 2*d*d_ff = 2,304,
    # d_ff = 48 (first FFN bias), 5d = 120 (two LayerNorms' gain+shift, second FFN bias); 2d = 48 final LN.
    by_hand = 2 * V * d + C * d + L * (4 * d * d + 2 * d * f + f + 5 * d) + 2 * d
    assert by_hand == 13_920 + 576 + (2_304 + 2_304 + 48 + 120) + 48 == 19_320
    model = _tiny()
    assert sum(p.numel() for p in model.parameters()) == 19_320
    assert get_family("gpt").parameter_formula(get_preset("gpt-tiny").config) == 19_320


def test_gpt_tiny_has_exactly_17_named_tensors_with_expected_shapes():
    shapes = {n: tuple(p.shape) for n, p in _tiny().named_parameters()}
    assert shapes == {
        "embed_tokens.weight": (290, 24),
        "embed_positions.weight": (24, 24),
        "block.0.attention_norm.weight": (24,),
        "block.0.attention_norm.bias": (24,),
        "block.0.attention.q_proj.weight": (24, 24),
        "block.0.attention.k_proj.weight": (24, 24),
        "block.0.attention.v_proj.weight": (24, 24),
        "block.0.attention.o_proj.weight": (24, 24),
        "block.0.feed_forward_norm.weight": (24,),
        "block.0.feed_forward_norm.bias": (24,),
        "block.0.feed_forward.up_proj.weight": (48, 24),
        "block.0.feed_forward.up_proj.bias": (48,),
        "block.0.feed_forward.down_proj.weight": (24, 48),
        "block.0.feed_forward.down_proj.bias": (24,),
        "final_norm.weight": (24,),
        "final_norm.bias": (24,),
        "lm_head.weight": (290, 24),
    }
    assert len(shapes) == 17


@pytest.mark.parametrize("V,d,heads,f,C,L", [(11, 8, 2, 12, 6, 1), (11, 8, 4, 20, 9, 3), (5, 6, 1, 6, 3, 2)])
def test_parameter_formula_matches_real_tensors(V, d, heads, f, C, L):
    hand = 2 * V * d + C * d + L * (4 * d * d + 2 * d * f + f + 5 * d) + 2 * d
    config = GPTConfig(vocab_size=V, width=d, heads=heads, ff_width=f, context=C, layers=L)
    assert sum(p.numel() for p in GPT(config).parameters()) == hand
    assert get_family("gpt").parameter_formula(config) == hand


def test_head_is_untied_and_attention_has_no_biases():
    model = _tiny()
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    for name in "qkvo":
        assert getattr(model.block[0].attention, f"{name}_proj").bias is None
    assert model.lm_head.bias is None


# ---------------------------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize("width,heads", [(24, 5), (24, 7), (10, 4)])
def test_heads_not_dividing_width_is_rejected_naming_heads(width, heads):
    with pytest.raises(ConfigError, match=r"GPTConfig\.heads.*divisor of width"):
        GPTConfig(width=width, heads=heads)


@pytest.mark.parametrize("field,value", [("context", 0), ("vocab_size", -1), ("layers", 1.5), ("ff_width", True)])
def test_non_positive_or_non_integer_sizes_are_rejected(field, value):
    with pytest.raises(ConfigError, match=rf"GPTConfig\.{field}"):
        GPTConfig(**{field: value})


def test_from_dict_round_trip_and_unknown_key():
    config = GPTConfig(vocab_size=13, width=8, heads=2, ff_width=12, context=5, layers=2)
    assert GPTConfig.from_dict(config.to_dict()) == config
    assert "head_width" not in config.to_dict()
    with pytest.raises(ConfigError, match="unknown field 'n_embd'"):
        GPTConfig.from_dict({"n_embd": 8})


# ---------------------------------------------------------------------------------------------
# forward against the numpy oracle


def test_stage_names_order_and_shapes():
    model = _tiny()
    stages = model(_ids(2, 5, 290, 0))
    assert tuple(stages) == ("embed_tokens", *(f"block.0.{s}" for s in BLOCK_STAGES), "final_norm", "logits")
    assert stages["block.0.attention_weights"].shape == (2, 4, 5, 5)
    assert stages["logits"].shape == (2, 5, 290)
    for name in ("embed_tokens", "block.0.output", "final_norm"):
        assert stages[name].shape == (2, 5, 24), name


@pytest.mark.parametrize("which", ["gpt-tiny", "two-layer"])
def test_forward_matches_numpy_float64_oracle_at_every_stage(which):
    if which == "gpt-tiny":
        model, ids = _tiny(seed=3).double(), _ids(2, 7, 290, 1)
    else:
        model, ids = (
            _gpt(seed=4, vocab_size=13, width=8, heads=2, ff_width=20, context=6, layers=2).double(),
            _ids(3, 6, 13, 2),
        )
    with torch.no_grad():
        stages = model(ids)
    expected = _np_gpt(ids.numpy(), _weights(model), model.config)
    assert set(expected) == set(stages)
    for name, value in expected.items():
        np.testing.assert_allclose(stages[name].numpy(), value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_float32_forward_matches_oracle_within_float32_tolerance():
    model = _tiny(seed=5)
    ids = _ids(1, 24, 290, 3)  # a full context window
    with torch.no_grad():
        logits = model(ids)["logits"].numpy()
    expected = _np_gpt(ids.numpy(), _weights(model), model.config)["logits"]
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_every_window_starts_at_position_zero():
    model = _tiny(seed=6).double()
    W = _weights(model)
    ids = torch.tensor([[7, 100, 3, 289, 0]])
    with torch.no_grad():
        full = model(ids)["embed_tokens"][0].numpy()
        # the last three tokens as their own window: they are embedded at positions 0, 1, 2, not 2, 3, 4
        tail = model(ids[:, 2:])["embed_tokens"][0].numpy()
    np.testing.assert_array_equal(full, W["embed_tokens.weight"][[7, 100, 3, 289, 0]] + W["embed_positions.weight"][:5])
    np.testing.assert_array_equal(tail, W["embed_tokens.weight"][[3, 289, 0]] + W["embed_positions.weight"][:3])
    assert not np.array_equal(tail, full[2:])


def test_learned_positions_matter():
    model = _tiny(seed=7).double()
    ids = torch.tensor([[5, 5, 5, 5]])
    with torch.no_grad():
        logits = model(ids)["logits"][0]
        model.embed_positions.weight.zero_()
        flat = model(ids)["logits"][0]
    # the same token at four positions: distinct rows with positions, but a position-free causal model
    # sees one repeated token, so every row is the same
    assert not torch.allclose(logits[0], logits[3])
    torch.testing.assert_close(flat[0], flat[3], rtol=1e-12, atol=1e-12)


def test_gelu_is_the_exact_erf_form_not_tanh():
    model = _tiny(seed=8).double()
    ids = _ids(1, 4, 290, 4)
    with torch.no_grad():
        branch = model(ids)["block.0.feed_forward_branch"].numpy()
    W = _weights(model)
    norm = _np_gpt(ids.numpy(), W, model.config)["block.0.feed_forward_norm"]
    pre = norm @ W["block.0.feed_forward.up_proj.weight"].T + W["block.0.feed_forward.up_proj.bias"]
    tanh_gelu = 0.5 * pre * (1 + np.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre**3)))
    with_tanh = tanh_gelu @ W["block.0.feed_forward.down_proj.weight"].T + W["block.0.feed_forward.down_proj.bias"]
    with_erf = _np_gelu(pre) @ W["block.0.feed_forward.down_proj.weight"].T + W["block.0.feed_forward.down_proj.bias"]
    np.testing.assert_allclose(branch, with_erf, rtol=1e-11, atol=1e-12)
    assert np.abs(branch - with_tanh).max() > 1e-7  # the two forms are distinguishable at these values


def test_causal_attention_probabilities_are_exactly_zero_in_the_future():
    model = _tiny(seed=9).double()
    with torch.no_grad():
        probs = model(_ids(2, 6, 290, 5))["block.0.attention_weights"]
    future = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    assert torch.all(probs[..., future] == 0)
    assert torch.all(probs[..., ~future] > 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64), rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# inputs


def test_sequence_longer_than_context_raises_input_error():
    model = _tiny()
    with pytest.raises(InputError, match=r"sequence length 25 .*max_positions=24"):
        model(_ids(1, 25, 290, 0))
    assert model(_ids(1, 24, 290, 0))["logits"].shape == (1, 24, 290)  # exactly the context is fine


@pytest.mark.parametrize("bad", [-1, 290])
def test_token_ids_outside_vocabulary_raise_input_error(bad):
    with pytest.raises(InputError, match=rf"token id {bad} outside \[0, 290\)"):
        _tiny()(torch.tensor([[1, bad, 2]]))


def test_non_int64_ids_raise_input_error():
    with pytest.raises(InputError, match="expected dtype int64"):
        _tiny()(torch.tensor([[1, 2]], dtype=torch.int32))
