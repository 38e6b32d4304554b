"""GGUF files of Qwen2, Qwen3 and scaled-RoPE Llamas, held to two independent oracles.

Each file is written with gguf.GGUFWriter from a random transformers model the way llama.cpp's
convert_hf_to_gguf.py writes it (Qwen2/3: Hugging Face rows, NEOX rotation; Llama: Q/K rows permuted;
Llama 3.1-style scaling: a rope_freqs tensor of per-frequency divisors; linear: rope.scaling metadata).
The import must match transformers on the original model, and `toolkit check --oracle llama.cpp` must pass
against llama.cpp reading the same file (float32 weights: within 1e-5 relative RMS).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from models.checkpoints import import_checkpoint
from tests.models import test_checkpoints as checkpoints
from tests.models.test_checkpoints import llama_cpp_permute
from tests.models.test_hf_decoders import randomize
from tests.optional import LLAMACPP, import_or_skip
from tests.toolkit.test_cli import invoke

gguf = import_or_skip("gguf", "GGUF test files are written with the gguf library")
transformers = import_or_skip("transformers", "transformers (the oracle) is a test extra")

bpe = checkpoints.bpe  # the fixture: a small byte-level BPE vocabulary
MAX_POS, ORIGINAL, SEQ = 64, 16, 40
LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
LAYER = (
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
)
CASES = {
    # name: (GGUF arch, transformers config class, keys)
    "qwen2": ("qwen2", "Qwen2Config", dict(rope_theta=100.0)),
    "qwen2-tied": ("qwen2", "Qwen2Config", dict(rope_theta=100.0, tie_word_embeddings=True)),
    "qwen3": ("qwen3", "Qwen3Config", dict(rope_theta=100.0, head_dim=16)),
    "llama3-rope-freqs": (
        "llama",
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, **LLAMA3}),
    ),
    "llama-linear": (
        "llama",
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 300.0}),
    ),
}


def llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: per-frequency divisors of Llama 3.1 scaling."""
    rope = config.rope_parameters
    head = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head, 2, dtype=np.float64) / head))
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], ORIGINAL
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write(path, name, bpe):
    """A random transformers model of case `name` and its GGUF as llama.cpp's converter writes it."""
    arch, cls, keys = CASES[name]
    tok, tokens, merges = bpe
    config = getattr(transformers, cls)(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **keys,
    )
    config._attn_implementation = "eager"
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), sum(map(ord, name)))
    c, sd = hf.config, {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "head_dim", None):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if c.rope_parameters["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # llama.cpp knows pre-tokenizers by name; "default" is plain byte-level BPE
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    writer.add_bos_token_id(tok.token_to_id("<s>"))
    writer.add_eos_token_id(tok.token_to_id("</s>"))
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    if c.rope_parameters["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(c)
    for i in range(c.num_hidden_layers):
        for ours, theirs in LAYER:
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{theirs}.{kind}"
                if key not in sd:
                    continue
                array = sd[key]
                if arch == "llama" and ours in ("attn_q", "attn_k"):  # only llama files are permuted
                    heads = c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads
                    array = llama_cpp_permute(array, heads)
                tensors[f"blk.{i}.{ours}.{kind}"] = array
    for key, array in tensors.items():
        writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def case(request, bpe, tmp_path_factory):
    """(name, GGUF path, transformers model)."""
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    return request.param, path, write(path, request.param, bpe)


@torch.no_grad()
def test_import_matches_transformers(case):
    name, path, hf = case
    imported = import_checkpoint(path)
    assert imported.source["architecture"] == CASES[name][0]
    ids = np.random.default_rng(3).integers(0, imported.config.vocab_size, (2, SEQ))  # beyond the original context
    want = hf(torch.from_numpy(ids)).logits.numpy()
    got = imported.model(torch.from_numpy(ids))["logits"].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_llama_cpp_reads_the_file_as_the_import_does(case, tmp_path):
    import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    name, path, _ = case
    out = tmp_path / "artifact"
    result = invoke("export", "--from", path, "--out", out)
    assert result.exit_code == 0, result.output
    report = tmp_path / "report.json"
    check = invoke("check", out, "--oracle", "llama.cpp", "--seq-len", SEQ - 8, "--json", report)
    assert check.exit_code == 0, check.output
    oracle = json.loads(report.read_text())["oracle"]
    assert oracle["precision"] == "float32" and oracle["greedy_agreement"] == 1.0
    assert all(row["value"] < 1e-5 for row in oracle["results"])
