"""Llama-shaped Hugging Face decoders against transformers: Llama 3.x RoPE scaling, explicit head_dim, attention
biases, Mistral's sliding window, Qwen2 and Qwen3.

Each case is a random tiny checkpoint saved with transformers' save_pretrained (odd widths, GQA, tied and
untied, three layers) with a small BPE tokenizer. The oracle is transformers itself: logits within 1e-4 of the
logits' scale in float32 on prefill and on cached decode steps, at positions beyond the window and beyond the
RoPE scaling's original context, and `toolkit generate` token-identical to `model.generate(do_sample=False)`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from artifact.errors import ModelFileError
from models.checkpoints import import_checkpoint
from tests.optional import import_or_skip

transformers = import_or_skip("transformers", reason="transformers (the oracle) is a test extra")

MAX_POS, WINDOW, ORIGINAL = 64, 5, 16
SEQ = 24  # beyond the window and beyond the scaled RoPE's original context
COMMON = dict(
    hidden_size=36,
    intermediate_size=52,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "rope_theta": 500.0,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 500.0}
# name: (config class, keys, what our config must say)
CASES = {
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3, head_dim=8), dict(rope_scaling="llama3", head_width=8)),
    "llama-linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 300.0}, tie_word_embeddings=True),
        dict(rope_scaling="linear", tie_embeddings=True),
    ),
    "llama-yarn": ("LlamaConfig", dict(rope_parameters=YARN), dict(rope_scaling="yarn")),
    "llama-bias-head-dim": (
        "LlamaConfig",
        dict(attention_bias=True, head_dim=10, rope_theta=100.0),
        dict(attention_bias="all", head_width=10),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW, head_dim=6, rope_theta=100.0), dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(rope_theta=100.0, tie_word_embeddings=True), dict(attention_bias="qkv")),
    "qwen2-sliding": (
        "Qwen2Config",
        dict(rope_theta=100.0, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
        dict(attention_bias="qkv", sliding_window=5),
    ),
    "qwen2.5-yarn": ("Qwen2Config", dict(rope_parameters=YARN), dict(rope_scaling="yarn", attention_bias="qkv")),
    "qwen3": ("Qwen3Config", dict(head_dim=8, rope_theta=100.0), dict(qk_norm="head", head_width=8)),
    "qwen2-mixed-windows": (
        "Qwen2Config",
        dict(rope_theta=100.0, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"], sliding_window=5),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=8,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=10.0,
            rope_theta=100.0,
        ),
        dict(norm_placement="sandwich", ffn_activation="gelu_tanh", attention_softcap=2.0, final_softcap=10.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=8,
            sliding_window=WINDOW,
            query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        dict(qk_norm="head", local_rope_base=100.0, rope_scaling="linear", attention_scale=12**-0.5),
    ),
    "olmo2": ("Olmo2Config", dict(rope_theta=100.0), dict(norm_placement="branch_post", qk_norm="full")),
    "granite": (
        "GraniteConfig",
        dict(
            rope_theta=100.0,
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
            residual_multiplier=0.5,
            logits_scaling=4.0,
        ),
        dict(embedding_scale=2.0, attention_scale=0.3, residual_scale=0.5, logits_scale=4.0),
    ),
    "phi3": (
        "Phi3Config",
        dict(hidden_size=48, rope_theta=100.0, partial_rotary_factor=0.5, sliding_window=WINDOW),
        dict(rotary_dim=4, sliding_window=5),
    ),
    "smollm3": ("SmolLM3Config", dict(rope_theta=100.0, no_rope_layers=[1, 0, 1]), dict(no_rope_layers=[1, 0, 1])),
    "pythia": (
        "GPTNeoXConfig",
        dict(
            hidden_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
        ),
        dict(norm="layernorm", norm_placement="parallel", ffn_gated=False, rotary_dim=4, attention_bias="all"),
    ),
    "gpt-neox-sequential": (
        "GPTNeoXConfig",
        dict(hidden_size=48, use_parallel_residual=False, hidden_act="gelu_new", rope_theta=100.0),
        dict(norm_placement="pre", ffn_activation="gelu_tanh", rotary_dim=2),
    ),
    "qwen3-bias": (
        "Qwen3Config",
        dict(head_dim=12, rope_theta=100.0, attention_bias=True, tie_word_embeddings=True),
        dict(qk_norm="head", attention_bias="all", head_width=12),
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    # No full byte alphabet: every token is printable ASCII, so any id sequence decodes cleanly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"] * 10, trainer)
    return tok


@torch.no_grad()
def randomize(model, seed):
    """O(1) weight scales (norm gains near 1, biases near 0.1), so a dropped switch moves logits far beyond noise."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if name.endswith(".bias"):
            p.copy_(0.3 * noise)
        elif p.ndim == 1:
            p.copy_(1 + 0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model.eval()


def build(name, tok, directory, **overrides):
    cls, keys, _ = CASES[name]
    config = getattr(transformers, cls)(vocab_size=tok.get_vocab_size(), **{**COMMON, **keys, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(config), sum(map(ord, name)))
    return save_with_tokenizer(model, tok, directory)


def save_with_tokenizer(model, tok, directory):
    """save_pretrained, with the tokenizer and a tokenizer_config that adds <s> and stops at </s>."""
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tokenizer, tmp_path_factory):
    """(name, checkpoint directory, transformers model)."""
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, directory, build(request.param, tokenizer, directory)


def ids_for(vocab, batch=2, seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int64)


def close(got, want, factor=1e-4):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=factor * scale)


def test_config_switches(case):
    name, directory, _ = case
    config = import_checkpoint(directory).config
    for key, value in CASES[name][2].items():
        got = getattr(config, key)
        assert (got.get("rope_type") if isinstance(got, dict) else got) == value, (key, got)


@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(case):
    name, directory, hf = case
    assert_matches_transformers(directory, hf, seed=len(name))


def assert_matches_transformers(directory, hf, seed, decode_is_prefill=True):
    """Prefill logits, then cached decode one token at a time from 4 tokens to SEQ, within 1e-4 of transformers.
    decode_is_prefill: each decode step also equals the prefill at its position (not for LongRoPE, whose keys
    cached before the switch keep their short-factor rotation, in transformers as here)."""
    ours = import_checkpoint(directory).model.eval()
    config = ours.config
    ids = ids_for(config.vocab_size, seed=seed)
    want = hf(torch.from_numpy(ids)).logits.numpy()
    close(ours(torch.from_numpy(ids))["logits"].numpy(), want)
    # Cached decode: a prefill of 4 tokens, then one token at a time through both caches, past the window and
    # the original context.
    empty = torch.zeros(2, config.kv_heads, 0, config.head_width)
    out = ours(torch.from_numpy(ids[:, :4]), past=[(empty, empty)] * config.layers)
    past = [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(config.layers)]
    theirs = hf(torch.from_numpy(ids[:, :4]), use_cache=True)
    cache = theirs.past_key_values
    for t in range(4, SEQ):
        step = torch.from_numpy(ids[:, t : t + 1])
        out = ours(step, past=past)
        past = [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(config.layers)]
        theirs = hf(step, past_key_values=cache, use_cache=True)
        cache = theirs.past_key_values
        close(out["logits"].numpy(), theirs.logits.numpy())
        if decode_is_prefill:
            close(out["logits"].numpy()[:, 0], want[:, t])


# RoPE types that transformers computes from the call's positions. LongRoPE switches from short to long factors
# once max(position) + 1 passes the original context (16 here; SEQ = 24 crosses it, on prefill and while
# decoding); dynamic NTK changes the base only past max_position_embeddings, which is the context we accept.
LENGTH_ROPE = {
    "phi3-longrope": (
        "Phi3Config",
        dict(
            original_max_position_embeddings=ORIGINAL,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1000.0,
                "short_factor": [1.0, 1.3, 2.5],
                "long_factor": [3.0, 7.0, 40.0],
            },
        ),
    ),
    "llama-dynamic": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0}),
    ),
}


@torch.no_grad()
@pytest.mark.parametrize("name", list(LENGTH_ROPE))
def test_length_dependent_rope_matches_transformers(tokenizer, tmp_path, name):
    cls, keys = LENGTH_ROPE[name]
    config = getattr(transformers, cls)(vocab_size=tokenizer.get_vocab_size(), **{**COMMON, **keys})
    config._attn_implementation = "eager"
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), 11)
    hf.save_pretrained(tmp_path / "hf")
    assert_matches_transformers(tmp_path / "hf", hf, seed=3, decode_is_prefill=name != "phi3-longrope")
    scaling = import_checkpoint(tmp_path / "hf").config.rope_scaling
    assert scaling["rope_type"] == LENGTH_ROPE[name][1]["rope_parameters"]["rope_type"]
    if name == "phi3-longrope":  # no factor given: the context's growth over the original, as transformers takes it
        assert scaling["factor"] == MAX_POS / ORIGINAL


@torch.no_grad()
def test_gemma3_final_soft_cap_when_set_matches_transformers(tokenizer, tmp_path):
    """Gemma 3's configs carry Gemma 2's soft caps, null by default. Set, transformers applies the final one (the
    attention one it ignores, and the import refuses it by name)."""
    hf = build("gemma3", tokenizer, tmp_path / "hf", final_logit_softcapping=30.0)
    ours = import_checkpoint(tmp_path / "hf").model.eval()
    assert (ours.config.attention_softcap, ours.config.final_softcap) == (None, 30.0)
    ids = torch.from_numpy(ids_for(ours.config.vocab_size, seed=7))
    want = hf(ids).logits.numpy()
    assert np.abs(want).max() <= 30.0  # the final cap bounds them (uncapped, this model's logits reach about 80)
    close(ours(ids)["logits"].numpy(), want)
    build("gemma3", tokenizer, tmp_path / "capped", attn_logit_softcapping=2.0)
    with pytest.raises(ModelFileError, match="attn_logit_softcapping") as info:
        import_checkpoint(tmp_path / "capped")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- refusals


def save_config(tokenizer, tmp_path, cls, **keys):
    config = getattr(transformers, cls)(vocab_size=tokenizer.get_vocab_size(), **COMMON, **keys)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_longrope_factors_of_the_wrong_length_are_refused_by_name():
    from artifact.errors import ConfigError
    from models.rope import validate_rope_scaling

    scaling = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [1.0, 2.0, 3.0]}
    scaling.update(original_max_position_embeddings=16, factor=4.0)
    with pytest.raises(ConfigError, match=r"rope_scaling\.short_factor.*a list of 3 numbers") as info:
        validate_rope_scaling("llama config", scaling, 6)
    assert "\n" not in str(info.value)
