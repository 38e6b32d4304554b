"""models/llama.py (with registry.build_model and the worked example) against independent oracles.

The numpy block below is written from the formulas
    pre-norm:  x' = x + MHA(RMSNorm_a(x));   y = x' + SwiGLU(RMSNorm_f(x'))
    post-norm: h  = RMSNorm_a(x + MHA(x));   y = RMSNorm_f(h + SwiGLU(h))
using only the module's weights; RoPE is done with complex multiplication so it shares
nothing with models/ops.py. The worked-example values are derived by hand in comments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from artifact.errors import ConfigError, InputError
from models.llama import BlockConfig, LlamaBlock, LlamaConfig, ProbedBlockConfig
from models.registry import build_model
from models.worked_example import build_worked_example, worked_example_config, worked_example_inputs

PRE_STAGES = (
    "attention_norm",
    "attention_weights",
    "attention_branch",
    "after_attention",
    "feed_forward_norm",
    "feed_forward_branch",
    "output",
)
POST_STAGES = (
    "attention_weights",
    "attention_branch",
    "attention_norm",
    "after_attention",
    "feed_forward_branch",
    "feed_forward_norm",
    "output",
)
PARAMETER_NAMES = (
    "attention_norm.weight",
    "attention.q_proj.weight",
    "attention.k_proj.weight",
    "attention.v_proj.weight",
    "attention.o_proj.weight",
    "feed_forward_norm.weight",
    "feed_forward.gate_proj.weight",
    "feed_forward.up_proj.weight",
    "feed_forward.down_proj.weight",
)


def _randn(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------
# independent numpy oracle


def _np_rms(x, w, eps):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) / x.shape[-1] + eps) * w


def _np_rope(x, positions, base, pairing):
    """x [T, hw] for one head; complex rotation of each pair by pos * base^(-2i/hw)."""
    hw = x.shape[-1]
    idx = np.arange(hw // 2)
    a, b = (2 * idx, 2 * idx + 1) if pairing == "interleaved" else (idx, idx + hw // 2)
    theta = np.asarray(positions, dtype=np.float64)[:, None] * base ** (-2.0 * idx / hw)[None, :]
    z = (x[:, a] + 1j * x[:, b]) * np.exp(1j * theta)
    out = np.empty_like(x)
    out[:, a], out[:, b] = z.real, z.imag
    return out


def _np_mha(z, W, c, prefix, offset):
    """z [T, d] for one batch row; returns (o_proj output [T, d], probabilities [heads, T, T])."""
    T = z.shape[0]
    hw, group = c.width // c.heads, c.heads // (c.kv_heads or c.heads)
    q, k, v = (z @ W[prefix + f"attention.{n}_proj.weight"].T for n in "qkv")
    positions = np.arange(T) + offset
    heads_out, probs = [], np.zeros((c.heads, T, T))
    for h in range(c.heads):
        g = h // group
        qh = _np_rope(q[:, h * hw : (h + 1) * hw], positions, c.rope_base, c.rope_pairing)
        kh = _np_rope(k[:, g * hw : (g + 1) * hw], positions, c.rope_base, c.rope_pairing)
        vh = v[:, g * hw : (g + 1) * hw]
        scores = qh @ kh.T / math.sqrt(hw)
        scores[np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
        e = np.exp(scores - scores.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
        probs[h] = p
        heads_out.append(p @ vh)
    return np.concatenate(heads_out, -1) @ W[prefix + "attention.o_proj.weight"].T, probs


def _np_ffn(z, W, prefix):
    gate = z @ W[prefix + "feed_forward.gate_proj.weight"].T
    up = z @ W[prefix + "feed_forward.up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ W[prefix + "feed_forward.down_proj.weight"].T


def np_block(x, W, c, prefix="", offset=0):
    """x [B, T, d] float64 -> dict of stages computed from the formulas."""
    na = lambda z: _np_rms(z, W[prefix + "attention_norm.weight"], c.eps)  # noqa: E731
    nf = lambda z: _np_rms(z, W[prefix + "feed_forward_norm.weight"], c.eps)  # noqa: E731
    out = {k: [] for k in ("attention_weights", "after_attention", "output")}
    for row in x:
        if c.norm_placement == "pre":
            attn, p = _np_mha(na(row), W, c, prefix, offset)
            h = row + attn
            y = h + _np_ffn(nf(h), W, prefix)
        else:
            attn, p = _np_mha(row, W, c, prefix, offset)
            h = na(row + attn)
            y = nf(h + _np_ffn(h, W, prefix))
        out["attention_weights"].append(p)
        out["after_attention"].append(h)
        out["output"].append(y)
    return {k: np.stack(v) for k, v in out.items()}


def _weights(module):
    return {n: t.detach().double().numpy() for n, t in module.state_dict().items()}


def _block_model(seed=0, **overrides):
    fields = dict(width=8, heads=2, ff_width=12, max_positions=8)
    fields.update(overrides)
    return build_model("block", ProbedBlockConfig(**fields), seed=seed)


def _decoder_model(seed=0, **overrides):
    fields = dict(vocab_size=11, layers=2, width=8, heads=2, ff_width=12, max_positions=8)
    fields.update(overrides)
    return build_model("llama", LlamaConfig(**fields), seed=seed)


# ---------------------------------------------------------------------------------------------
# stages: names, order, shapes


@pytest.mark.parametrize("placement,expected", [("pre", PRE_STAGES), ("post", POST_STAGES)])
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_block_stage_names_order_and_shapes(placement, expected, kv_heads):
    c = BlockConfig(width=8, heads=2, ff_width=12, max_positions=8, norm_placement=placement, kv_heads=kv_heads)
    block = LlamaBlock(c).double()
    B, T = 2, 5
    stages = block(_randn((B, T, 8), 0))
    assert tuple(stages) == expected
    assert c.stage_names == expected
    for name, value in stages.items():
        want = (B, 2, T, T) if name == "attention_weights" else (B, T, 8)
        assert tuple(value.shape) == want, name


def test_probed_block_stage_names_and_logits():
    model = _block_model(probe_width=3).double()
    x = _randn((2, 4, 8), 1)
    stages = model(x)
    assert tuple(stages) == tuple(f"block.0.{s}" for s in PRE_STAGES) + ("logits",)
    assert stages["logits"].shape == (2, 4, 3)
    np.testing.assert_allclose(
        stages["logits"].detach().numpy(),
        stages["block.0.output"].detach().numpy() @ model.probe.numpy(),
        rtol=1e-13,
        atol=1e-13,
    )


# ---------------------------------------------------------------------------------------------
# whole block against the numpy formulas


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(norm_placement="post"),
        dict(rope_pairing="half", heads=2),
        dict(heads=4, kv_heads=2),
        dict(heads=4, kv_heads=1, norm_placement="post", rope_pairing="half"),
        dict(eps=0.0, rope_base=100.0),
    ],
    ids=["pre", "post", "half", "gqa", "mqa-post-half", "eps0"],
)
@pytest.mark.parametrize("offset", [0, 2])
def test_block_matches_numpy_formulas(overrides, offset):
    model = _block_model(seed=3, **overrides).double()
    x = _randn((2, 5, 8), 4)
    stages = model(x, position_offset=offset)
    expected = np_block(x.numpy(), _weights(model), model.config, prefix="block.0.", offset=offset)
    for name, value in expected.items():
        np.testing.assert_allclose(
            stages[f"block.0.{name}"].detach().numpy(), value, rtol=1e-11, atol=1e-12, err_msg=name
        )


def test_block_float32_matches_numpy_formulas_within_float32_tolerance():
    model = _block_model(seed=5)
    x = _randn((1, 6, 8), 6, torch.float32)
    stages = model(x)
    expected = np_block(x.double().numpy(), _weights(model), model.config, prefix="block.0.")
    np.testing.assert_allclose(stages["block.0.output"].detach().numpy(), expected["output"], rtol=1e-4, atol=1e-5)


def test_pre_and_post_norm_outputs_differ():
    pre, post = _block_model(seed=7).double(), _block_model(seed=7, norm_placement="post").double()
    assert all(torch.equal(a, b) for a, b in zip(pre.state_dict().values(), post.state_dict().values(), strict=False))
    x = _randn((1, 4, 8), 8)
    diff = (pre(x)["block.0.output"] - post(x)["block.0.output"]).abs().max()
    assert diff > 1e-3


def test_post_norm_stage_values_are_the_norm_outputs():
    model = _block_model(seed=9, norm_placement="post").double()
    s = model(_randn((1, 4, 8), 10))
    # In post-norm the residual stream is the normalised value: same tensors by design.
    assert torch.equal(s["block.0.attention_norm"], s["block.0.after_attention"])
    assert torch.equal(s["block.0.feed_forward_norm"], s["block.0.output"])


# ---------------------------------------------------------------------------------------------
# the worked example, by hand
#
# d=4, heads=2 -> head width 2, one RoPE pair with frequency base^0 = 1: angle = position (radians).
# x rows 2e0, 2e1, 2e2: rms(2 e_i) over d=4 is sqrt(4/4) = 1, so attention_norm = x.
# Q=K=V=identity: head 0 holds dims (0,1), head 1 dims (2,3).
#   head 0: t0 (2,0) -> rope 0 -> (2,0); t1 (0,2) -> rope 1 -> (-2 sin1, 2 cos1); t2 (0,0)
#   head 1: t0 (0,0); t1 (0,0); t2 (2,0) -> rope 2 -> (2 cos2, 2 sin2)
# scale 1/sqrt(2):
#   head 0, q1: s(k0) = -4 sin1/sqrt2, s(k1) = 4/sqrt2 -> p(k0) = 1/(1+exp((4 + 4 sin1)/sqrt2))
#   head 0, q2: q = 0 -> uniform 1/3 over three keys
#   head 1, q1: q = 0 -> 1/2, 1/2;  head 1, q2: scores (0, 0, 4/sqrt2) -> p = (1, 1, e^{2 sqrt2})/(2 + e^{2 sqrt2})
# attention outputs (V = identity, values unrotated):
#   t0: (2, 0, 0, 0); t1: (2 p0, 2 p1, 0, 0); t2: (2/3, 2/3, 2 p(k2), 0)
# FFN with identity matrices: ffn(n)_i = silu(n_i) * n_i = n_i^2 sigmoid(n_i).

SIG = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
P0 = 1 / (1 + math.exp((4 + 4 * math.sin(1)) / math.sqrt(2)))
E = math.exp(2 * math.sqrt(2))
PROBE = np.array([[1.0, 0.0, -1.0], [0.0, 1.0, -1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def _hand_rms(v):
    return [a / math.sqrt(sum(b * b for b in v) / len(v)) for a in v]


def _hand_worked_example(placement):
    x = [[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]]
    attn = [[2.0, 0, 0, 0], [2 * P0, 2 * (1 - P0), 0, 0], [2 / 3, 2 / 3, 2 * E / (2 + E), 0]]
    rows = []
    for xt, at in zip(x, attn, strict=False):
        if placement == "pre":
            h = [a + b for a, b in zip(xt, at, strict=False)]
            y = [hi + ni * ni * SIG(ni) for hi, ni in zip(h, _hand_rms(h), strict=False)]
        else:
            h = _hand_rms([a + b for a, b in zip(xt, at, strict=False)])
            y = _hand_rms([hi * (1 + hi * SIG(hi)) for hi in h])
        rows.append((h, y))
    return rows


@pytest.fixture(scope="module")
def worked():
    model = build_worked_example().double()
    x = torch.from_numpy(worked_example_inputs()["hidden_states"]).double()
    with torch.no_grad():
        return x, model(x)


def test_worked_example_inputs_and_config():
    x = worked_example_inputs()["hidden_states"]
    np.testing.assert_array_equal(x, [[[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]]])
    c = worked_example_config()
    assert (c.width, c.heads, c.head_width, c.ff_width, c.eps) == (4, 2, 2, 4, 0.0)


def test_worked_example_attention_norm_equals_input(worked):
    x, s = worked
    np.testing.assert_allclose(s["block.0.attention_norm"].numpy(), x.numpy(), rtol=1e-15, atol=0)


def test_worked_example_attention_probabilities_by_hand(worked):
    _, s = worked
    p = s["block.0.attention_weights"][0].numpy()
    expected = np.array(
        [
            [[1, 0, 0], [P0, 1 - P0, 0], [1 / 3, 1 / 3, 1 / 3]],
            [[1, 0, 0], [0.5, 0.5, 0], [1 / (2 + E), 1 / (2 + E), E / (2 + E)]],
        ]
    )
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=1e-15)
    assert p[0, 1, 0] == pytest.approx(0.005440, abs=2e-6)  # 1/(1 + e^5.2085) = 1/183.8
    future = np.triu(np.ones((3, 3), dtype=bool), k=1)
    assert (p[:, future] == 0.0).all()


def test_worked_example_token0_output_and_all_rows_by_hand(worked):
    _, s = worked
    y = s["block.0.output"][0].numpy()
    # token 0: h = (4,0,0,0), rms 2 -> n = (2,0,0,0), ffn = 2*2*sigmoid(2) -> y = (4 + 4 sigmoid(2), 0, 0, 0)
    np.testing.assert_allclose(y[0], [4 + 4 * SIG(2), 0, 0, 0], rtol=1e-14, atol=0)
    hand = _hand_worked_example("pre")
    np.testing.assert_allclose(s["block.0.after_attention"][0].numpy(), [h for h, _ in hand], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(y, [r for _, r in hand], rtol=1e-12, atol=1e-14)


def test_worked_example_probe_logits(worked):
    _, s = worked
    logits = s["logits"].numpy()
    assert logits.shape == (1, 3, 3)
    y = np.array([r for _, r in _hand_worked_example("pre")])
    np.testing.assert_allclose(logits[0], y @ PROBE, rtol=1e-12, atol=1e-14)
    t0 = 4 + 4 * SIG(2)
    np.testing.assert_allclose(logits[0, 0], [t0, 0, -t0], rtol=1e-14, atol=0)


def test_worked_example_post_norm_by_hand(worked):
    x, pre = worked
    with torch.no_grad():
        post = build_worked_example("post").double()(x)
    hand = _hand_worked_example("post")
    np.testing.assert_allclose(post["block.0.after_attention"][0].numpy(), [h for h, _ in hand], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(post["block.0.output"][0].numpy(), [y for _, y in hand], rtol=1e-12, atol=1e-14)
    assert not np.allclose(post["block.0.after_attention"][0, 1], pre["block.0.after_attention"][0, 1], atol=1e-3)


def test_worked_example_norms_own_distinct_equal_tensors():
    block = build_worked_example().block[0]
    a, f = block.attention_norm.weight, block.feed_forward_norm.weight
    assert torch.equal(a, f)
    assert a.data_ptr() != f.data_ptr()
    with torch.no_grad():
        a[0] = 5.0
    assert f[0] == 1.0


def test_worked_example_leaves_rng_untouched():
    before = torch.get_rng_state()
    build_worked_example()
    assert torch.equal(before, torch.get_rng_state())


# ---------------------------------------------------------------------------------------------
# causality


def _prefix(t, name, T):
    axis = 2 if name.endswith("attention_weights") else 1
    index = [slice(None)] * t.ndim
    index[axis] = slice(0, T - 1)
    return t[tuple(index)]


@pytest.mark.parametrize(
    "overrides", [dict(), dict(norm_placement="post"), dict(heads=4, kv_heads=2, rope_pairing="half")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_causality_bitwise(overrides, dtype):
    model = _block_model(seed=11, **overrides).to(dtype)
    T = 6
    x = _randn((2, T, 8), 12, dtype)
    changed = x.clone()
    changed[:, -1] = _randn((2, 8), 13, dtype) * 10
    with torch.no_grad():
        a, b = model(x), model(changed)
    for name in a:
        assert torch.equal(_prefix(a[name], name, T), _prefix(b[name], name, T)), name
    assert not torch.equal(a["block.0.output"][:, -1], b["block.0.output"][:, -1])


@pytest.mark.parametrize("overrides", [dict(), dict(norm_placement="post", heads=4, kv_heads=1)])
def test_decoder_causality_bitwise(overrides):
    model = _decoder_model(seed=14, **overrides)
    ids = torch.tensor([[1, 5, 2, 7, 3], [0, 10, 4, 4, 9]])
    changed = ids.clone()
    changed[:, -1] = torch.tensor([8, 6])
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert len(a) == 1 + 2 * 7 + 2
    for name in a:
        assert torch.equal(_prefix(a[name], name, 5), _prefix(b[name], name, 5)), name
    assert not torch.equal(a["logits"][:, -1], b["logits"][:, -1])


# ---------------------------------------------------------------------------------------------
# parameters


@pytest.mark.parametrize("width,heads,ff,expected", [(4, 2, 4, 120), (12, 3, 32, 1752), (12, 2, 32, 1752)])
def test_block_parameter_count(width, heads, ff, expected):
    # 2d + 4d^2 + 3*d*d_ff, evaluated by hand: 8+64+48 = 120; 24+576+1152 = 1752
    model = build_model("block", ProbedBlockConfig(width=width, heads=heads, ff_width=ff))
    assert sum(p.numel() for p in model.parameters()) == expected
    assert 2 * width + 4 * width**2 + 3 * width * ff == expected


def test_block_parameter_names_and_order():
    block = LlamaBlock(BlockConfig(width=8, heads=2, ff_width=12))
    assert tuple(n for n, _ in block.named_parameters()) == PARAMETER_NAMES
    probed = _block_model()
    assert tuple(n for n, _ in probed.named_parameters()) == tuple(f"block.0.{n}" for n in PARAMETER_NAMES)
    assert "probe" in dict(probed.named_buffers()) and "probe" not in dict(probed.named_parameters())
    assert not any("bias" in n for n, _ in probed.named_parameters())
    for module in probed.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.bias is None


def test_block_parameter_shapes():
    c = ProbedBlockConfig(width=8, heads=4, kv_heads=2, ff_width=12)
    shapes = {n: tuple(p.shape) for n, p in LlamaBlock(c).named_parameters()}
    assert shapes == {
        "attention_norm.weight": (8,),
        "attention.q_proj.weight": (8, 8),
        "attention.k_proj.weight": (4, 8),
        "attention.v_proj.weight": (4, 8),
        "attention.o_proj.weight": (8, 8),
        "feed_forward_norm.weight": (8,),
        "feed_forward.gate_proj.weight": (12, 8),
        "feed_forward.up_proj.weight": (12, 8),
        "feed_forward.down_proj.weight": (8, 12),
    }


def test_gqa_parameter_count():
    # d=8, heads=4 -> hw=2, kv_heads=2 -> kv_width=4, d_ff=8: 2*8 + 2*64 + 2*8*4 + 3*8*8 = 16+128+64+192 = 400
    model = build_model("block", ProbedBlockConfig(width=8, heads=4, kv_heads=2, ff_width=8))
    assert sum(p.numel() for p in model.parameters()) == 400


def test_norms_own_distinct_tensors_after_build():
    block = _block_model().block[0]
    assert block.attention_norm.weight.data_ptr() != block.feed_forward_norm.weight.data_ptr()
    # gains are perturbed away from 1 and from each other by the seeded init
    assert not torch.equal(block.attention_norm.weight, block.feed_forward_norm.weight)


# ---------------------------------------------------------------------------------------------
# determinism and RNG hygiene


@pytest.mark.parametrize("family", ["block", "llama"])
def test_same_seed_same_state_dict_bitwise(family):
    make = _block_model if family == "block" else _decoder_model
    torch.manual_seed(1)
    a = make(seed=5).state_dict()
    torch.manual_seed(2)  # the caller's global RNG must not leak into the weights
    b = make(seed=5).state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["block", "llama"])
def test_different_seeds_differ(family):
    make = _block_model if family == "block" else _decoder_model
    a, b = make(seed=0).state_dict(), make(seed=1).state_dict()
    for k in a:
        if k.endswith(("proj.weight", "norm.weight", "embed_tokens.weight")) or k == "probe":
            assert not torch.equal(a[k], b[k]), k


def test_build_model_leaves_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    _block_model(seed=3)
    _decoder_model(seed=4)
    assert torch.equal(before, torch.get_rng_state())


def test_build_model_wrong_config_class_raises_and_leaves_rng_untouched():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(ConfigError, match=r"family 'block' expects a ProbedBlockConfig, got LlamaConfig"):
        build_model("block", LlamaConfig())
    with pytest.raises(ConfigError, match=r"family 'llama' expects a LlamaConfig, got ProbedBlockConfig"):
        build_model("llama", ProbedBlockConfig())
    with pytest.raises(ConfigError, match=r"unknown model family 'no-such-family'"):
        build_model("no-such-family", ProbedBlockConfig())
    assert torch.equal(before, torch.get_rng_state())


def test_build_model_failing_inside_construction_leaves_rng_untouched(monkeypatch):
    import models.registry as registry

    def exploding_initialize(model, generator):
        torch.randn(100)  # consume the global stream, then fail
        raise RuntimeError("boom during init")

    monkeypatch.setattr(registry, "initialize", exploding_initialize)
    torch.manual_seed(9)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom during init"):
        build_model("block", ProbedBlockConfig(width=8, heads=2))
    assert torch.equal(before, torch.get_rng_state())


def test_build_model_returns_eval_mode():
    assert not _block_model().training
    assert not _decoder_model().training


# ---------------------------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize(
    "fields,pattern",
    [
        (dict(width=16, heads=3), r"BlockConfig\.heads: expected a divisor of width=16, got 3"),
        (dict(width=12, heads=4), r"BlockConfig\.heads: expected .*even head width \(width=12\), got 4"),
        (dict(width=6, heads=6), r"BlockConfig\.heads: expected .*even head width \(width=6\), got 6"),
        (dict(heads=4, kv_heads=3), r"BlockConfig\.kv_heads: expected a divisor of heads=4, got 3"),
        (dict(heads=4, kv_heads=8), r"BlockConfig\.kv_heads: expected a divisor of heads=4, got 8"),
        (dict(width=True), r"BlockConfig\.width: expected a positive integer, got True"),
        (dict(heads=False), r"BlockConfig\.heads: expected a positive integer, got False"),
        (dict(ff_width=32.0), r"BlockConfig\.ff_width: expected a positive integer, got 32\.0"),
        (dict(max_positions="64"), r"BlockConfig\.max_positions: expected a positive integer, got '64'"),
        (dict(eps=-1e-6), r"BlockConfig\.eps: expected a number >= 0(\.0)?, got -1e-06"),
        (dict(eps=float("nan")), r"BlockConfig\.eps: expected a finite number, got nan"),
        (dict(eps=float("inf")), r"BlockConfig\.eps: expected a finite number, got inf"),
        (dict(eps=True), r"BlockConfig\.eps: expected a finite number, got True"),
        (dict(eps="1e-5"), r"BlockConfig\.eps: expected a finite number, got '1e-5'"),
        (dict(rope_base=0.0), r"BlockConfig\.rope_base: expected a number > 0(\.0)?, got 0\.0"),
        (dict(rope_base=-10.0), r"BlockConfig\.rope_base: expected a number > 0(\.0)?, got -10\.0"),
        (dict(rope_base=float("inf")), r"BlockConfig\.rope_base: expected a finite number, got inf"),
        (dict(rope_base=float("nan")), r"BlockConfig\.rope_base: expected a finite number, got nan"),
        (
            dict(norm_placement="middle"),
            r"BlockConfig\.norm_placement: expected one of 'pre', 'post', 'sandwich', 'branch_post', 'parallel', got 'middle'",
        ),
        (dict(norm_placement="Pre"), r"BlockConfig\.norm_placement: .*got 'Pre'"),
        (dict(rope_pairing="neox"), r"BlockConfig\.rope_pairing: expected one of 'interleaved', 'half', got 'neox'"),
    ],
)
def test_block_config_rejects(fields, pattern):
    with pytest.raises(ConfigError, match=pattern):
        BlockConfig(**fields)


@pytest.mark.parametrize("field", ["width", "heads", "ff_width", "max_positions", "kv_heads"])
@pytest.mark.parametrize("value", [0, -1])
def test_block_config_rejects_non_positive_sizes(field, value):
    with pytest.raises(ConfigError, match=rf"BlockConfig\.{field}: expected a positive integer, got {value}\b"):
        BlockConfig(**{field: value})


@pytest.mark.parametrize(
    "fields,pattern",
    [
        (dict(vocab_size=0), r"LlamaConfig\.vocab_size: expected a positive integer, got 0"),
        (dict(vocab_size=-1), r"LlamaConfig\.vocab_size: expected a positive integer, got -1"),
        (dict(layers=0), r"LlamaConfig\.layers: expected a positive integer, got 0"),
        (dict(layers=-1), r"LlamaConfig\.layers: expected a positive integer, got -1"),
        (dict(layers=True), r"LlamaConfig\.layers: expected a positive integer, got True"),
        (dict(tie_embeddings=1), r"LlamaConfig\.tie_embeddings: expected true or false, got 1"),
        (dict(width=16, heads=3), r"LlamaConfig\.heads: expected a divisor of width=16, got 3"),
    ],
)
def test_decoder_config_rejects(fields, pattern):
    with pytest.raises(ConfigError, match=pattern):
        LlamaConfig(**fields)


@pytest.mark.parametrize("value", [0, -1])
def test_probed_block_config_rejects_probe_width(value):
    with pytest.raises(ConfigError, match=rf"ProbedBlockConfig\.probe_width: expected a positive integer, got {value}"):
        ProbedBlockConfig(probe_width=value)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        BlockConfig(width=0)


@pytest.mark.parametrize("cls", [BlockConfig, LlamaConfig, ProbedBlockConfig])
def test_from_dict_unknown_key(cls):
    with pytest.raises(ConfigError, match=rf"{cls.__name__}: unknown field 'widht'; valid fields are .*width"):
        cls.from_dict({"widht": 8})


def test_from_dict_rejects_derived_field_and_non_dict():
    with pytest.raises(ConfigError, match=r"BlockConfig: unknown field 'head_width'"):
        BlockConfig.from_dict({"width": 8, "heads": 2, "head_width": 4})
    with pytest.raises(ConfigError, match=r"BlockConfig: expected a JSON object of config fields, got list"):
        BlockConfig.from_dict([("width", 8)])


def test_from_dict_round_trip_and_validation():
    c = LlamaConfig(vocab_size=11, layers=1, width=8, heads=4, kv_heads=2, ff_width=6, rope_pairing="half")
    d = c.to_dict()
    assert "head_width" not in d and d["kv_heads"] == 2 and d["vocab_size"] == 11
    assert LlamaConfig.from_dict(d) == c
    with pytest.raises(ConfigError, match=r"LlamaConfig\.layers: expected a positive integer, got 0"):
        LlamaConfig.from_dict({**d, "layers": 0})


def test_kv_heads_default_and_head_width():
    c = BlockConfig(width=12, heads=3)
    assert c.kv_heads == 3 and c.head_width == 4


def test_eps_zero_is_accepted_and_finite():
    model = _block_model(seed=2, eps=0.0)
    assert model.config.eps == 0.0
    out = model(_randn((1, 4, 8), 3, torch.float32))
    assert all(torch.isfinite(v).all() for v in out.values())
    dec = _decoder_model(seed=2, eps=0.0)
    assert torch.isfinite(dec(torch.tensor([[1, 2, 3]]))["logits"]).all()


# ---------------------------------------------------------------------------------------------
# LlamaDecoder


def test_decoder_tied_head_shares_embedding():
    model = _decoder_model()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    # counted once: V*d + layers*block + d (final norm); block = 2*8 + 4*64 + 3*8*12 = 560
    assert sum(p.numel() for p in model.parameters()) == 11 * 8 + 2 * 560 + 8


def test_decoder_untied_head_is_separate():
    model = _decoder_model(tie_embeddings=False)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.shape == (11, 8)
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    assert sum(p.numel() for p in model.parameters()) == 2 * 11 * 8 + 2 * 560 + 8


@pytest.mark.parametrize("tie", [True, False])
def test_decoder_matches_numpy_formulas(tie):
    model = _decoder_model(seed=21, tie_embeddings=tie, heads=4, kv_heads=2).double()
    ids = torch.tensor([[3, 0, 10, 7], [1, 1, 2, 9]])
    stages = model(ids)
    W = _weights(model)
    c = model.config
    x = W["embed_tokens.weight"][ids.numpy()]
    for i in range(c.layers):
        x = np_block(x, W, c, prefix=f"block.{i}.")["output"]
    final = _np_rms(x, W["final_norm.weight"], c.eps)
    head = W["embed_tokens.weight"] if tie else W["lm_head.weight"]
    logits = final @ head.T
    assert stages["logits"].shape == (2, 4, 11)
    np.testing.assert_allclose(stages["final_norm"].detach().numpy(), final, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(stages["logits"].detach().numpy(), logits, rtol=1e-11, atol=1e-12)


def test_decoder_stage_names():
    stages = _decoder_model(layers=2)(torch.tensor([[1, 2]]))
    expected = ("embed_tokens",) + tuple(f"block.{i}.{s}" for i in range(2) for s in PRE_STAGES)
    assert tuple(stages) == expected + ("final_norm", "logits")
    assert stages["logits"].shape == (1, 2, 11)


@pytest.mark.parametrize("bad", [-1, 11, 1000])
def test_decoder_token_id_out_of_range_raises_input_error(bad):
    model = _decoder_model()
    with pytest.raises(InputError, match=rf"token id {bad} outside \[0, 11\)"):
        model(torch.tensor([[1, bad, 2]]))


def test_decoder_too_long_raises_input_error():
    model = _decoder_model()  # max_positions = 8
    model(torch.zeros((1, 8), dtype=torch.int64))  # exactly max_positions is fine
    with pytest.raises(InputError, match=r"sequence length 9 .*exceeds max_positions=8"):
        model(torch.zeros((1, 9), dtype=torch.int64))
    with pytest.raises(InputError, match=r"sequence length 6 \(\+ offset 3\) exceeds max_positions=8"):
        model(torch.zeros((1, 6), dtype=torch.int64), position_offset=3)


def test_decoder_wrong_dtype_raises_input_error():
    with pytest.raises(InputError, match=r"expected dtype int64, got torch.int32"):
        _decoder_model()(torch.tensor([[1, 2]], dtype=torch.int32))


def test_probed_block_too_long_raises_input_error():
    model = _block_model()  # max_positions = 8
    with pytest.raises(InputError, match=r"sequence length 9 .*exceeds max_positions=8"):
        model(torch.zeros((1, 9, 8)))


def test_probed_block_offset_past_max_positions_raises_input_error():
    model = _block_model()  # max_positions = 8
    with pytest.raises(InputError, match=r"max_positions=8"):
        model(torch.zeros((1, 6, 8)), position_offset=3)
