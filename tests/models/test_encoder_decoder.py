"""models/encoder_decoder.py (family "encoder-decoder") against independent implementations.

Oracles:
* the 2017 recipe (and its pre-norm / GELU / bias-free variants) is torch.nn.TransformerEncoderLayer /
  TransformerDecoderLayer stacked with final LayerNorms, in float64, with the weights copied over;
* the sinusoidal table is written from PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...);
* the 2026 recipe (RMSNorm, SwiGLU, RoPE, no biases) is a numpy float64 block written from the formulas,
  with RoPE as complex multiplication;
* parameter counts are hand formulas.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
from onnx import numpy_helper

import models.registry as registry
from artifact.errors import ConfigError, InputError
from exporters.onnx_export import export_model
from models.encoder_decoder import EncoderDecoder, EncoderDecoderBlock, EncoderDecoderConfig
from models.layers import sinusoidal_table
from models.presets import get_preset
from models.registry import build_model, encoder_decoder_formula, get_family, initialize
from toolkit.check.crosscheck import cross_check

BACKENDS = ["eager", "ort-cpu", "onnx-reference"]
PRE = ("attention_norm", "attention_weights", "attention_branch", "after_attention")
POST = ("attention_weights", "attention_branch", "attention_norm", "after_attention")


def _cfg(**fields):
    base = dict(vocab_size=20, width=8, heads=2, ff_width=16, encoder_layers=2, decoder_layers=2, max_positions=10)
    base.update(fields)
    return EncoderDecoderConfig(**base)


def _model(config, seed=0, dtype=torch.float64):
    return build_model("encoder-decoder", config, seed=seed).to(dtype)


def _preset_model(name, seed=0):
    spec = get_preset(name)
    return build_model(spec.family, spec.config, seed=seed).double()


def _ids(B, T, V, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, V, size=(B, T), dtype=np.int64))


def _sinusoid_by_formula(positions, d):
    table = np.zeros((positions, d))
    for pos in range(positions):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


# ---------------------------------------------------------------------------------------------
# shapes, stages and the sinusoidal table


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
def test_six_token_source_five_token_target_gives_five_rows_of_logits(preset):
    model = _preset_model(preset)
    with torch.no_grad():
        stages = model(_ids(1, 6, 64, 0), _ids(1, 5, 64, 1))
    assert stages["logits"][0].shape == (5, 64)
    assert stages["encoder_output"].shape == (1, 6, 16)
    assert stages["decoder.block.1.cross_attention_weights"].shape == (1, 4, 5, 6)
    assert stages["encoder.block.0.attention_weights"].shape == (1, 4, 6, 6)
    assert stages["decoder.block.0.attention_weights"].shape == (1, 4, 5, 5)


@pytest.mark.parametrize("placement,sub", [("post", POST), ("pre", PRE)])
def test_stage_names_in_computation_order(placement, sub):
    config = _cfg(norm_placement=placement, encoder_layers=1, decoder_layers=1)
    with torch.no_grad():
        stages = _model(config)(_ids(1, 4, 20, 0), _ids(1, 3, 20, 1))
    ff = (
        ("feed_forward_norm", "feed_forward_branch", "output")
        if placement == "pre"
        else ("feed_forward_branch", "feed_forward_norm", "output")
    )
    cross = tuple(s.replace("attention", "cross_attention") for s in sub)
    assert tuple(stages) == (
        "encoder.embed_tokens",
        *(f"encoder.block.0.{s}" for s in sub + ff),
        "encoder_output",
        "decoder.embed_tokens",
        *(f"decoder.block.0.{s}" for s in sub + cross + ff),
        "decoder.final_norm",
        "logits",
    )
    family = get_family("encoder-decoder")
    assert family.stage_names(config) == tuple(stages)
    assert [g.name for g in family.graphs(config)] == ["encoder", "decoder"]


@pytest.mark.parametrize("positions,d", [(32, 16), (7, 6), (50, 512)])
def test_sinusoidal_table_matches_the_formula(positions, d):
    np.testing.assert_allclose(
        sinusoidal_table(positions, d).numpy(), _sinusoid_by_formula(positions, d), rtol=0, atol=1e-12
    )


def test_sinusoidal_positions_are_added_to_the_embedding():
    model = _preset_model("vaswani-2017", seed=3)
    ids = torch.tensor([[3, 9, 3, 60]])
    with torch.no_grad():
        embedded = model.encode(ids)["encoder.embed_tokens"][0].numpy()
    E = model.encoder.embed_tokens.weight.detach().numpy()
    np.testing.assert_allclose(embedded, E[[3, 9, 3, 60]] + _sinusoid_by_formula(4, 16), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the 2017 recipe against torch.nn.Transformer*Layer


def _mha_from(ours, theirs: nn.MultiheadAttention):
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.out_proj.weight.copy_(ours.o_proj.weight)
    if ours.q_proj.bias is not None:
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.bias.copy_(ours.o_proj.bias)
    else:
        assert theirs.in_proj_bias is None


def _norm_from(ours, theirs: nn.LayerNorm):
    theirs.weight.copy_(ours.weight)
    if ours.bias is not None:
        theirs.bias.copy_(ours.bias)
    else:
        assert theirs.bias is None


def _linear_from(ours, theirs: nn.Linear):
    theirs.weight.copy_(ours.weight)
    if ours.bias is not None:
        theirs.bias.copy_(ours.bias)


@torch.no_grad()
def _torch_reference(model: EncoderDecoder):
    c = model.config
    kw = dict(
        d_model=c.width,
        nhead=c.heads,
        dim_feedforward=c.ff_width,
        dropout=0.0,
        activation=c.ffn,
        layer_norm_eps=c.eps,
        batch_first=True,
        norm_first=c.norm_placement == "pre",
        bias=c.biases,
        dtype=torch.float64,
    )
    encoder = nn.ModuleList([nn.TransformerEncoderLayer(**kw) for _ in range(c.encoder_layers)])
    decoder = nn.ModuleList([nn.TransformerDecoderLayer(**kw) for _ in range(c.decoder_layers)])
    for ours, theirs in zip(model.encoder.block, encoder, strict=False):
        _mha_from(ours.attention, theirs.self_attn)
        _norm_from(ours.attention_norm, theirs.norm1)
        _norm_from(ours.feed_forward_norm, theirs.norm2)
        _linear_from(ours.feed_forward.up_proj, theirs.linear1)
        _linear_from(ours.feed_forward.down_proj, theirs.linear2)
    for ours, theirs in zip(model.decoder.block, decoder, strict=False):
        _mha_from(ours.attention, theirs.self_attn)
        _mha_from(ours.cross_attention, theirs.multihead_attn)
        _norm_from(ours.attention_norm, theirs.norm1)
        _norm_from(ours.cross_attention_norm, theirs.norm2)
        _norm_from(ours.feed_forward_norm, theirs.norm3)
        _linear_from(ours.feed_forward.up_proj, theirs.linear1)
        _linear_from(ours.feed_forward.down_proj, theirs.linear2)
    finals = []
    for stack in (model.encoder, model.decoder):
        norm = nn.LayerNorm(c.width, eps=c.eps, bias=c.biases, dtype=torch.float64)
        _norm_from(stack.final_norm, norm)
        finals.append(norm)
    return encoder.eval(), decoder.eval(), finals


@torch.no_grad()
def _torch_forward(model, source, target):
    c = model.config
    encoder, decoder, (enc_norm, dec_norm) = _torch_reference(model)
    S, T = source.shape[1], target.shape[1]
    x = model.encoder.embed_tokens.weight[source] + torch.from_numpy(_sinusoid_by_formula(S, c.width))
    for layer in encoder:
        x = layer(x)
    memory = enc_norm(x)
    causal = torch.triu(torch.full((T, T), float("-inf"), dtype=torch.float64), diagonal=1)
    y = model.decoder.embed_tokens.weight[target] + torch.from_numpy(_sinusoid_by_formula(T, c.width))
    for layer in decoder:
        y = layer(y, memory, tgt_mask=causal)
    final = dec_norm(y)
    return {"encoder_output": memory, "decoder.final_norm": final, "logits": final @ model.decoder.lm_head.weight.T}


VARIANTS_2017 = {
    "vaswani-2017": dict(),
    "pre-gelu-bias-free": dict(norm_placement="pre", ffn="gelu", biases=False),
    "post-gelu": dict(ffn="gelu"),
    "pre-relu-biases": dict(norm_placement="pre"),
}


@pytest.mark.parametrize("variant", list(VARIANTS_2017))
def test_layernorm_recipes_match_torch_nn_transformer_layers(variant):
    spec = get_preset("vaswani-2017")
    config = dataclasses.replace(spec.config, **VARIANTS_2017[variant])
    model = _model(config, seed=5)
    source, target = _ids(2, 6, 64, 2), _ids(2, 5, 64, 3)
    with torch.no_grad():
        ours = model(source, target)
    theirs = _torch_forward(model, source, target)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-10, atol=1e-11, msg=name)


def test_torch_reference_is_sensitive_to_a_wrong_weight():
    # guard against a vacuous comparison: perturb one decoder cross-attention weight after the copy
    model = _preset_model("vaswani-2017", seed=6)
    source, target = _ids(1, 6, 64, 4), _ids(1, 5, 64, 5)
    before = _torch_forward(model, source, target)["logits"]
    with torch.no_grad():
        ours = model(source, target)["logits"]
        model.decoder.block[1].cross_attention.v_proj.weight[0, 0] += 0.5
    after = _torch_forward(model, source, target)["logits"]
    torch.testing.assert_close(ours, before, rtol=1e-10, atol=1e-11)
    assert (after - ours).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------
# the 2026 recipe: one encoder block from the formulas


def _np_rms(x, g, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g


def _np_rope_interleaved(x, base):
    """x [T, hw]: rotate pairs (2i, 2i+1) by pos * base^(-2i/hw) via complex multiplication."""
    T, hw = x.shape
    theta = np.arange(T)[:, None] * base ** (-np.arange(0, hw, 2) / hw)[None, :]
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * np.exp(1j * theta)
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = z.real, z.imag
    return out


def _np_modern_encoder_block(x, W, c):
    """Pre-norm, bidirectional RoPE attention, SwiGLU, no biases; x [B, T, d]."""
    hw = c.width // c.heads
    outputs, weights = [], []
    for row in x:
        n = _np_rms(row, W["attention_norm.weight"], c.eps)
        q, k, v = (n @ W[f"attention.{m}_proj.weight"].T for m in "qkv")
        heads, probs = [], []
        for h in range(c.heads):
            sl = slice(h * hw, (h + 1) * hw)
            s = _np_rope_interleaved(q[:, sl], c.rope_base) @ _np_rope_interleaved(k[:, sl], c.rope_base).T
            s = s / math.sqrt(hw)  # no mask: the encoder attends both ways
            e = np.exp(s - s.max(-1, keepdims=True))
            p = e / e.sum(-1, keepdims=True)
            probs.append(p)
            heads.append(p @ v[:, sl])
        h_ = row + np.concatenate(heads, -1) @ W["attention.o_proj.weight"].T
        m = _np_rms(h_, W["feed_forward_norm.weight"], c.eps)
        gate, up = m @ W["feed_forward.gate_proj.weight"].T, m @ W["feed_forward.up_proj.weight"].T
        outputs.append(h_ + (gate / (1 + np.exp(-gate)) * up) @ W["feed_forward.down_proj.weight"].T)
        weights.append(np.stack(probs))
    return np.stack(outputs), np.stack(weights)


def _seeded_block(config, decoder=False, seed=0):
    block = EncoderDecoderBlock(config, decoder=decoder).double()
    initialize(block, torch.Generator().manual_seed(seed))
    return block


def test_modern_2026_encoder_block_matches_numpy_formulas():
    config = get_preset("modern-2026").config
    block = _seeded_block(config, seed=7)
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((2, 6, 16)))
    with torch.no_grad():
        stages = block(x)
    W = {n: t.detach().numpy() for n, t in block.state_dict().items()}
    output, weights = _np_modern_encoder_block(x.numpy(), W, config)
    np.testing.assert_allclose(stages["attention_weights"].numpy(), weights, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(stages["output"].numpy(), output, rtol=1e-11, atol=1e-12)


def test_modern_2026_encoder_stack_matches_numpy_formulas():
    model = _preset_model("modern-2026", seed=9)
    c = model.config
    source = _ids(2, 7, 64, 10)
    with torch.no_grad():
        encoder_output = model.encode(source)["encoder_output"].numpy()
    x = model.encoder.embed_tokens.weight.detach().numpy()[source.numpy()]  # RoPE: no additive positions
    for i in range(c.encoder_layers):
        prefix = f"encoder.block.{i}."
        W = {n[len(prefix) :]: t.detach().numpy() for n, t in model.state_dict().items() if n.startswith(prefix)}
        x, _ = _np_modern_encoder_block(x, W, c)
    expected = _np_rms(x, model.encoder.final_norm.weight.detach().numpy(), c.eps)
    np.testing.assert_allclose(encoder_output, expected, rtol=1e-11, atol=1e-12)


def test_modern_2026_cross_attention_has_no_rotation():
    block = _seeded_block(get_preset("modern-2026").config, decoder=True, seed=11)
    assert block.attention.rope and not block.cross_attention.rope


# ---------------------------------------------------------------------------------------------
# masks: bidirectional encoder, causal decoder, cross-attention over the whole source


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
def test_encoder_self_attention_is_bidirectional(preset):
    model = _preset_model(preset, seed=12)
    source = _ids(1, 6, 64, 13)
    changed = source.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    with torch.no_grad():
        a, b = model.encode(source), model.encode(changed)
    weights = a["encoder.block.0.attention_weights"]
    assert torch.all(weights > 0)  # no position is masked
    for name in ("encoder.block.0.attention_branch", "encoder.block.0.output", "encoder_output"):
        assert not torch.allclose(a[name][:, 0], b[name][:, 0], rtol=0, atol=1e-9), name  # row 0 sees the last token


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
def test_decoder_self_attention_is_causal_bitwise(preset):
    model = _preset_model(preset, seed=14)
    memory = model.encode(_ids(2, 6, 64, 15))["encoder_output"].detach()
    target = _ids(2, 5, 64, 16)
    changed = target.clone()
    changed[:, -1] = (changed[:, -1] + 7) % 64
    with torch.no_grad():
        a, b = model.decode(target, memory), model.decode(changed, memory)
    for name in a:
        if name.endswith("_weights"):  # (B, heads, T, keys): query rows are dim 2
            assert torch.equal(a[name][:, :, :-1], b[name][:, :, :-1]), name
        else:
            assert torch.equal(a[name][:, :-1], b[name][:, :-1]), name
    assert not torch.equal(a["logits"][:, -1], b["logits"][:, -1])
    future = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    assert torch.all(a["decoder.block.0.attention_weights"][..., future] == 0)


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
def test_cross_attention_sees_every_source_position(preset):
    model = _preset_model(preset, seed=17)
    source, target = _ids(1, 6, 64, 18), _ids(1, 5, 64, 19)
    changed = source.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    with torch.no_grad():
        a, b = model(source, target), model(changed, target)
    cross = a["decoder.block.0.cross_attention_weights"]
    assert cross.shape == (1, 4, 5, 6)
    assert torch.all(cross > 0)  # the first target position attends to the last source position too
    torch.testing.assert_close(cross.sum(-1), torch.ones(1, 4, 5, dtype=torch.float64), rtol=0, atol=1e-14)
    assert not torch.allclose(a["logits"][0, 0], b["logits"][0, 0], rtol=0, atol=1e-9)


def test_decode_rejects_a_memory_of_the_wrong_width():
    model = _preset_model("vaswani-2017")
    with pytest.raises(InputError, match=r"encoder_output.*expected shape \(1, S, 16\)"):
        model.decode(_ids(1, 3, 64, 0), torch.zeros(1, 4, 8, dtype=torch.float64))


def test_source_longer_than_max_positions_raises_input_error():
    model = _model(_cfg(max_positions=6))
    with pytest.raises(InputError, match="exceeds max_positions=6"):
        model.encode(_ids(1, 7, 20, 0))


# ---------------------------------------------------------------------------------------------
# parameter counts


def test_modern_encoder_block_of_width_512_has_3146240_parameters():
    config = EncoderDecoderConfig(
        vocab_size=8,
        width=512,
        heads=8,
        ff_width=4 * 512,
        norm="rmsnorm",
        ffn="swiglu",
        positions="rope",
        norm_placement="pre",
        biases=False,
    )
    hidden = round(2 / 3 * 2048)
    assert hidden == 1365
    d = 512
    hand = 2 * d + 4 * d * d + 3 * d * hidden  # two RMSNorm gains, Q/K/V/O, gate/up/down
    assert hand == 1_024 + 1_048_576 + 2_096_640 == 3_146_240
    block = EncoderDecoderBlock(config, decoder=False)
    assert sum(p.numel() for p in block.parameters()) == 3_146_240
    assert tuple(block.feed_forward.gate_proj.weight.shape) == (1365, 512)
    assert encoder_decoder_formula(config)[0] == 3_146_240


def test_preset_totals_by_hand():
    # vaswani-2017, d=16, d_ff=64, V=64: LayerNorm 2d=32; attention 4d^2+4d=1,088; FFN 2*d*f+f+d=2,128
    #   encoder block 64+1,088+2,128=3,280; decoder block 96+2,176+2,128=4,400
    #   total 3*V*d=3,072 + 2*3,280 + 2*4,400 + 2*32 = 18,496
    # modern-2026: RMSNorm d=16; attention 4d^2=1,024; SwiGLU 3*d*round(2*64/3)=3*16*43=2,064
    #   encoder block 32+1,024+2,064=3,120; decoder block 48+2,048+2,064=4,160
    #   total 3,072 + 6,240 + 8,320 + 32 = 17,664
    for preset, enc, dec, total in [("vaswani-2017", 3_280, 4_400, 18_496), ("modern-2026", 3_120, 4_160, 17_664)]:
        model = _preset_model(preset)
        assert sum(p.numel() for p in model.encoder.block[0].parameters()) == enc
        assert sum(p.numel() for p in model.decoder.block[0].parameters()) == dec
        assert sum(p.numel() for p in model.parameters()) == total
        assert encoder_decoder_formula(model.config) == (enc, dec, total)


SWITCH_GRID = [
    dict(norm=n, ffn=f, biases=b, norm_placement=p, positions=pos)
    for n in ("layernorm", "rmsnorm")
    for f in ("relu", "gelu", "swiglu")
    for b in (True, False)
    for p, pos in (("post", "sinusoidal"), ("pre", "rope"))
    if not (f == "swiglu" and b)
]


@pytest.mark.parametrize("switches", SWITCH_GRID, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_formula_agrees_with_real_tensors_for_every_switch_combination(switches):
    config = _cfg(encoder_layers=2, decoder_layers=3, ff_width=20, **switches)
    model = EncoderDecoder(config)
    encoder_block, decoder_block, total = encoder_decoder_formula(config)
    assert sum(p.numel() for p in model.encoder.block[0].parameters()) == encoder_block
    assert sum(p.numel() for p in model.decoder.block[0].parameters()) == decoder_block
    assert sum(p.numel() for p in model.parameters()) == total
    assert get_family("encoder-decoder").parameter_formula(config) == total


# ---------------------------------------------------------------------------------------------
# config validation


def test_swiglu_with_biases_is_rejected_naming_biases():
    with pytest.raises(ConfigError, match=r"EncoderDecoderConfig\.biases: expected false with ffn='swiglu'"):
        _cfg(ffn="swiglu", biases=True)


@pytest.mark.parametrize(
    "fields,pattern",
    [
        (dict(norm="batchnorm"), r"\.norm: expected one of"),
        (dict(ffn="geglu"), r"\.ffn: expected one of"),
        (dict(positions="alibi"), r"\.positions: expected one of"),
        (dict(norm_placement="sandwich"), r"\.norm_placement: expected one of"),
        (dict(biases=1), r"\.biases: expected true or false"),
        (dict(width=8, heads=3), r"\.heads: expected a divisor of width"),
        (dict(width=6, heads=2, positions="rope"), r"\.heads: expected a head count giving an even head width"),
        (dict(width=9, heads=3), r"\.width: expected an even width"),
        (dict(encoder_layers=0), r"\.encoder_layers: expected a positive integer"),
    ],
)
def test_invalid_configs_are_rejected(fields, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _cfg(**fields)


# ---------------------------------------------------------------------------------------------
# each switch changes the numbers


SAME_WEIGHT_SWITCHES = [("norm", "rmsnorm"), ("ffn", "gelu"), ("positions", "rope"), ("norm_placement", "pre")]


@pytest.mark.parametrize("switch,value", SAME_WEIGHT_SWITCHES)
def test_switch_with_identical_weights_changes_the_outputs(switch, value):
    base = _cfg(biases=False)  # layernorm, relu, sinusoidal, post; no biases so both models own the same tensors
    a, b = _model(base, seed=20), _model(dataclasses.replace(base, **{switch: value}), seed=20)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)  # same seed, same weights
    source, target = _ids(2, 6, 20, 21), _ids(2, 5, 20, 22)
    with torch.no_grad():
        ya, yb = a(source, target), b(source, target)
    assert (ya["encoder_output"] - yb["encoder_output"]).abs().max() > 1e-3
    assert (ya["logits"] - yb["logits"]).abs().max() > 1e-3


def test_swiglu_switch_changes_the_outputs_and_the_tensors():
    base = _cfg(biases=False)
    a, b = _model(base, seed=23), _model(dataclasses.replace(base, ffn="swiglu"), seed=23)
    assert "encoder.block.0.feed_forward.gate_proj.weight" in b.state_dict()
    assert "encoder.block.0.feed_forward.gate_proj.weight" not in a.state_dict()
    source, target = _ids(1, 6, 20, 24), _ids(1, 5, 20, 25)
    with torch.no_grad():
        assert (a(source, target)["logits"] - b(source, target)["logits"]).abs().max() > 1e-3


def test_biases_switch_adds_biases_that_are_used():
    free = _model(_cfg(biases=False), seed=26)
    biased = _model(_cfg(biases=True), seed=26)
    extra = set(biased.state_dict()) - set(free.state_dict())
    assert extra and all(name.endswith(".bias") for name in extra)
    assert not set(free.state_dict()) - set(biased.state_dict())
    source, target = _ids(2, 6, 20, 27), _ids(2, 5, 20, 28)
    with torch.no_grad():
        y_biased = biased(source, target)["logits"]
        # the bias-free weights plus zero biases must reproduce the bias-free model exactly
        state = {
            name: torch.zeros_like(t) if name in extra else free.state_dict()[name]
            for name, t in biased.state_dict().items()
        }
        biased.load_state_dict(state)
        y_zeroed = biased(source, target)["logits"]
        y_free = free(source, target)["logits"]
    torch.testing.assert_close(y_zeroed, y_free, rtol=1e-12, atol=1e-12)
    assert (y_biased - y_free).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# each switch changes the exported graph
#
# Only the encoder graph is exported per switch (every switch shows there; the decoder graph would double
# the export cost): export_model runs with the family's graph list cut to the encoder, on a model whose
# decoder is removed, so every exported weight is still covered.

GRAPH_BASE = dict(
    vocab_size=16,
    width=8,
    heads=2,
    ff_width=16,
    encoder_layers=1,
    decoder_layers=1,
    max_positions=8,
    norm="layernorm",
    ffn="relu",
    positions="sinusoidal",
    norm_placement="post",
    biases=False,
)


@pytest.fixture(scope="module")
def encoder_graph(tmp_path_factory):
    family = registry.FAMILIES["encoder-decoder"]
    encoder_only = dataclasses.replace(family, graphs=lambda c: family.graphs(c)[:1])
    cache = {}

    def get(**switches):
        key = tuple(sorted(switches.items()))
        if key not in cache:
            config = EncoderDecoderConfig(**{**GRAPH_BASE, **switches})
            model = build_model("encoder-decoder", config, seed=0)
            del model.decoder
            out = tmp_path_factory.mktemp("encoder-graph") / "artifact"
            with pytest.MonkeyPatch.context() as mp:
                mp.setitem(registry.FAMILIES, "encoder-decoder", encoder_only)
                artifact = export_model(model, "encoder-decoder", config, out, variant="serving")
            assert [g.name for g in artifact.graphs] == ["encoder"]
            cache[key] = (onnx.load(str(artifact.graphs[0].model_path)), model)
        return cache[key]

    return get


def _histogram(proto):
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in proto.graph.node)


def test_norm_switch_swaps_layernormalization_for_the_custom_rmsnorm(encoder_graph):
    base, rms = _histogram(encoder_graph()[0]), _histogram(encoder_graph(norm="rmsnorm")[0])
    assert base["LayerNormalization"] == 3 and base["onnx_toolkit::RMSNorm"] == 0  # 2 in the block + final
    assert rms["onnx_toolkit::RMSNorm"] == 3 and rms["LayerNormalization"] == 0


@pytest.mark.parametrize("ffn,op", [("gelu", "Gelu"), ("swiglu", "onnx_toolkit::SwiGLU")])
def test_ffn_switch_swaps_the_activation_op(encoder_graph, ffn, op):
    base, other = _histogram(encoder_graph()[0]), _histogram(encoder_graph(ffn=ffn)[0])
    assert base["Relu"] == 1 and base[op] == 0
    assert other[op] == 1 and other["Relu"] == 0


def test_positions_switch_adds_rotary_sin_and_cos(encoder_graph):
    base, rope = _histogram(encoder_graph()[0]), _histogram(encoder_graph(positions="rope")[0])
    assert base["Sin"] == 0 and base["Cos"] == 0  # the sinusoidal table is a constant
    assert rope["Sin"] >= 1 and rope["Cos"] >= 1


def test_biases_switch_adds_bias_initializers_and_adds(encoder_graph):
    (free, _), (biased, model) = encoder_graph(), encoder_graph(biases=True)
    assert _histogram(biased)["Add"] > _histogram(free)["Add"]
    stored = [numpy_helper.to_array(i) for i in biased.graph.initializer]
    biases = [name for name in model.state_dict() if name.endswith(".bias")]
    assert len(biases) == 4 + 2 + 2 + 1  # attention q/k/v/o, FFN up/down, the block's two norms, final norm
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias"):
            value = tensor.numpy()
            assert any(s.shape == value.shape and np.array_equal(s, value) for s in stored), name
    assert len(biased.graph.initializer) > len(free.graph.initializer)


def _first(proto, op_type):
    return next(i for i, n in enumerate(proto.graph.node) if n.op_type == op_type)


def test_norm_placement_switch_moves_the_norm_before_the_projections(encoder_graph):
    (post, _), (pre, _) = encoder_graph(), encoder_graph(norm_placement="pre")
    # nodes are topologically sorted: in post-norm the first norm consumes the attention output (after the
    # projections), in pre-norm every projection consumes the first norm's output
    assert _first(post, "MatMul") < _first(post, "LayerNormalization")
    assert _first(pre, "LayerNormalization") < _first(pre, "MatMul")


# ---------------------------------------------------------------------------------------------
# the exported artifact: two graphs, checked together


def test_export_writes_an_encoder_graph_and_a_decoder_graph(exported):
    artifact = exported("vaswani-2017")
    files = sorted(p.name for p in artifact.directory.iterdir())
    assert files == ["decoder.onnx", "encoder.onnx", "manifest.json"]
    encoder, decoder = artifact.graphs
    assert (encoder.name, decoder.name) == ("encoder", "decoder")
    assert [s.name for s in encoder.input_specs] == ["source_ids"]
    assert [s.name for s in decoder.input_specs] == ["input_ids", "encoder_output"]
    assert list(decoder.input_specs[1].shape) == ["batch", "source_sequence", 16]
    assert encoder.output_names[-1] == "encoder_output" and decoder.output_names[-1] == "logits"
    # each graph holds only its own side's weights
    assert all(name.startswith("encoder.") for name in encoder.weights)
    assert all(name.startswith("decoder.") for name in decoder.weights)


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
def test_cross_check_covers_the_stages_of_both_graphs(exported, preset):
    c = get_preset(preset).config
    report = cross_check(exported(preset), BACKENDS, batch=2, sequence=4)
    sub = POST if c.norm_placement == "post" else PRE
    ff = (
        ("feed_forward_branch", "feed_forward_norm", "output")
        if c.norm_placement == "post"
        else ("feed_forward_norm", "feed_forward_branch", "output")
    )
    cross = tuple(s.replace("attention", "cross_attention") for s in sub)
    expected = [
        "encoder.embed_tokens",
        *(f"encoder.block.{i}.{s}" for i in range(2) for s in sub + ff),
        "encoder_output",
        "decoder.embed_tokens",
        *(f"decoder.block.{i}.{s}" for i in range(2) for s in sub + cross + ff),
        "decoder.final_norm",
        "logits",
    ]
    assert report.stages == expected
    assert report.passed, report.first_divergence
    for backend in report.backends:
        assert {o.name for o in backend.comparison.outputs} == set(expected), backend.name
    assert report.inputs == {"source_ids": [2, 5], "input_ids": [2, 4]}
