"""GGUF files of Qwen2, Qwen3, scaled-RoPE Llamas, Gemma 2, Gemma 3 and Phi-3, held to two independent oracles.

Each file is written with gguf.GGUFWriter from a random transformers model the way llama.cpp's
convert_hf_to_gguf.py writes it: the metadata its converter class writes, tensor names from gguf-py's own
name map (Qwen2/3, Gemma, Phi-3: Hugging Face rows, NEOX rotation; Llama: Q/K rows permuted; Llama 3.1-style
scaling: a rope_freqs tensor of per-frequency divisors; linear: rope.scaling metadata; Gemma: every RMSNorm
gain stored as 1 + w; Phi-3: fused attn_qkv and [gate; up] ffn_up as the checkpoint has them). The import must
match transformers on the original model at positions past the sliding windows, and `toolkit check --oracle
llama.cpp` must pass against llama.cpp reading the same file (float32 weights: within 1e-5 relative RMS).
Two llama.cpp facts shape that check: its CPU GELU is a float16 table, so Gemma files are held to llama.cpp's
logits with that table modelled (test_llama_cpp_reads_gemma_files_as_the_import_does); and it computes Phi-3
without the file's sliding window, so Phi-3's check stays within the window.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from artifact.errors import ModelFileError
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
WINDOW = 8  # Gemma's sliding window, well inside SEQ
# Phi-3's window: llama.cpp reads it but computes without one, so its check runs on PHI3_WINDOW positions.
PHI3_WINDOW, PHI3_CHECK_PROMPT = 24, 16
# Architectures whose FFN is a GELU, which llama.cpp's CPU computes from a float16 table (about 1e-4 of the
# logits: measured 1.1e-4 to 2.2e-4 relative RMS on these float32 files). Held to llama.cpp with that table in our
# model within GELU_TABLE_BOUND (measured 1.8e-6 to 5.5e-5: near a float16 rounding boundary our float64 input and
# llama.cpp's float32 one still pick neighbouring entries, more often the more layers), and with the exact GELU
# within GELU_EXACT_BOUND.
GELU_TABLE_ARCHS, GELU_TABLE_BOUND, GELU_EXACT_BOUND = ("gemma2", "gemma3"), 1e-4, 1e-3
LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
COMMON = dict(
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
)
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's default period of 6
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
    # Gemma 2's converter writes no RoPE base (llama.cpp's default 10000 is Gemma 2's) and no query scalar
    # (llama.cpp uses 1/sqrt(head_dim) below the 27B size): the checkpoint has both at those values.
    "gemma2": (
        "gemma2",
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            # Its logits reach 140 before the cap: 30 (Gemma 2's own) compresses them without float32 ties at the
            # cap, which would make llama.cpp's greedy token a matter of index order.
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma3": (
        "gemma3",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=GEMMA3_LAYERS,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    # Layers given one by one (sliding_window_pattern as an array, which llama.cpp also reads), and no
    # freq_base_swa (older converters wrote none): the sliding layers take llama.cpp's default base 10000, as
    # the checkpoint does.
    "gemma3-layer-flags": (
        "gemma3",
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi3": (
        "phi3",
        "Phi3Config",
        dict(rope_theta=100.0, partial_rotary_factor=0.5, sliding_window=PHI3_WINDOW),
    ),
}
# What the import must make of each new architecture's metadata, read off the checkpoints' configs above.
SWITCHES = {
    "gemma2": dict(
        norm_placement="sandwich",
        ffn_activation="gelu_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        attention_softcap=2.0,
        final_softcap=30.0,
        attention_scale=16**-0.5,
        embedding_scale=8.0,
        rope_base=10000.0,
        tie_embeddings=True,
    ),
    "gemma3": dict(
        layer_types=GEMMA3_LAYERS,
        sliding_window=WINDOW,
        qk_norm="head",
        attention_softcap=None,
        final_softcap=10.0,
        rope_base=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        local_rope_base=100.0,
        tie_embeddings=False,
    ),
    "gemma3-layer-flags": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_softcap=None,
        local_rope_base=10000.0,
    ),
    "phi3": dict(rotary_dim=8, sliding_window=PHI3_WINDOW, rope_pairing="half", tie_embeddings=False),
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


def write_metadata(writer, arch, c, swa_base=True) -> None:
    """The model metadata each converter class's set_gguf_parameters writes (convert_hf_to_gguf.py); swa_base=False
    leaves out Gemma 3's rope.freq_base_swa, as converters before that key did."""
    if arch == "phi3":  # Phi3MiniModel
        writer.add_context_length(c.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_block_count(c.num_hidden_layers)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        partial = c.rope_parameters.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(partial * c.hidden_size) // c.num_attention_heads)
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_sliding_window(c.sliding_window or 0)
        return
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "head_dim", None):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch == "gemma2":  # Gemma2Model: no RoPE keys at all
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
        return
    # TextModel's RoPE keys: the full layers' parameters, and the sliding layers' base where there is one.
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma3":  # Gemma3Model
        if swa_base:
            writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)


def write(path, name, bpe, extra_metadata=(), extra_tensors=()):
    """A random transformers model of case `name` and its GGUF as llama.cpp's converter writes it."""
    arch, cls, keys = CASES[name]
    tok, tokens, merges = bpe
    config = getattr(transformers, cls)(vocab_size=len(tokens), **{**COMMON, **keys})
    config._attn_implementation = "eager"
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config), sum(map(ord, name)))
    c, sd = hf.config, {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, c, swa_base=name != "gemma3-layer-flags")
    if name == "gemma3-layer-flags":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    for key, value in extra_metadata:
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # llama.cpp knows pre-tokenizers by name; "default" is plain byte-level BPE
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    writer.add_bos_token_id(tok.token_to_id("<s>"))
    writer.add_eos_token_id(tok.token_to_id("</s>"))
    # The converter's own name map (gguf-py's tensor_mapping.py), as ModelBase.map_tensor_name uses it.
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c.num_hidden_layers
    )
    tensors = {}
    for key, array in sd.items():
        if key == "lm_head.weight" and (c.tie_word_embeddings or arch == "gemma2"):
            continue  # tied checkpoints save no lm_head; Gemma2Model drops it
        if arch in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            array = array + np.float32(1)  # Gemma(2|3)Model.modify_tensors: the RMSNorm's (1 + w), stored summed
        if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):  # only llama files are permuted
            heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, key
        tensors[gguf_name] = array
    if c.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(c)
    tensors.update(extra_tensors)
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


def test_config_switches(case):
    name, path, _ = case
    config = import_checkpoint(path).config
    for key, value in SWITCHES.get(name, {}).items():
        want = pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
        assert getattr(config, key) == want, (key, getattr(config, key))


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_llama_cpp_reads_the_file_as_the_import_does(case, tmp_path):
    import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    name, path, _ = case
    out = tmp_path / "artifact"
    result = invoke("export", "--from", path, "--out", out)
    assert result.exit_code == 0, result.output
    report = tmp_path / "report.json"
    prompt = PHI3_CHECK_PROMPT if CASES[name][0] == "phi3" else SEQ - 8  # 8 decode steps follow
    check = invoke("check", out, "--oracle", "llama.cpp", "--seq-len", prompt, "--json", report)
    assert check.exit_code == 0, check.output
    oracle = json.loads(report.read_text())["oracle"]
    # Gemma's GeGLU: llama.cpp reads GELU from a float16 table (the test below models it), so the check allows 1e-3.
    precision, bound = ("float32-gelu", 1e-3) if CASES[name][0] in GELU_TABLE_ARCHS else ("float32", 1e-5)
    assert oracle["precision"] == precision and oracle["greedy_agreement"] == 1.0
    assert all(row["value"] < bound for row in oracle["results"])


def ggml_gelu_table(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """ggml's CPU GELU on float32 (GGML_GELU_FP16, ggml-cpu/vec.h): the tanh approximation read from a table of
    float16 values indexed by the float16-rounded input; 0 at or below -10, the input at or above 10."""
    x32 = x.to(torch.float32)
    h = x32.to(torch.float16).to(torch.float32)
    table = (0.5 * h * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * h * (1.0 + 0.044715 * h * h)))).to(torch.float16)
    y = torch.where(x32 <= -10, 0.0, torch.where(x32 >= 10, x32, table.to(torch.float32)))
    return y.to(x.dtype)


@torch.no_grad()
@pytest.mark.parametrize("case", [n for n in CASES if CASES[n][0] in GELU_TABLE_ARCHS], indirect=True)
def test_llama_cpp_reads_gemma_files_as_the_import_does(case, monkeypatch):
    """Gemma's GeGLU: llama.cpp's CPU GELU is a float16 table, about 1e-4 of the logits on a float32 file (the
    reason `toolkit check --oracle llama.cpp` allows 1e-3 for GELU models where float32 files get 1e-5).
    Our float64 model with that table, and with the exact GELU, against llama.cpp's logits on the prompt and
    on its 8 greedy decode steps; greedy agreement 100% either way."""
    import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    from toolkit.check.llamacpp import judge_llama_cpp, run_llama_cpp

    name, path, _ = case
    model = import_checkpoint(path).model.to(torch.float64)
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, SEQ - 8))
    run = run_llama_cpp(path, prompt, 8)
    ids = torch.from_numpy(np.concatenate([run.prompt, run.tokens], axis=1))
    exact = model(ids)["logits"].numpy()
    monkeypatch.setattr(torch.nn.functional, "gelu", ggml_gelu_table)
    tabled = model(ids)["logits"].numpy()
    for logits, bound in ((tabled, GELU_TABLE_BOUND), (exact, GELU_EXACT_BOUND)):
        comparison, extra = judge_llama_cpp(run, logits, "float32")
        assert extra["greedy_agreement"] == 1.0
        assert all(row.value < bound for row in comparison.outputs), [
            (row.name, row.value) for row in comparison.outputs
        ]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "name,metadata,tensors,message",
    [
        # Phi-3 128k: LongRoPE's factor tensors, which llama.cpp switches between by the context it is run at.
        (
            "phi3",
            (),
            {"rope_factors_long.weight": np.ones(4, np.float32), "rope_factors_short.weight": np.ones(4, np.float32)},
            "'rope_factors_long.weight' is LongRoPE scaling",
        ),
        # llama.cpp's Gemma 3 graph has no attention soft cap; transformers would apply one.
        ("gemma3", (("gemma3.attn_logit_softcapping", 50.0),), {}, "gemma3.attn_logit_softcapping=50.0"),
        # A sliding-layer RoPE base in a Gemma 2 file: llama.cpp scales those layers too, our local base does not.
        ("gemma2", (("gemma2.rope.freq_base_swa", 500.0),), {}, "gemma2.rope.freq_base_swa=500.0"),
        # llama.cpp's Gemma 2 reads no attention.scale: the key is unknown here, not ignored.
        ("gemma2", (("gemma2.attention.scale", 0.5),), {}, "gemma2.attention.scale=0.5"),
        # llama.cpp's Phi-3 reads no sliding-layer pattern.
        ("phi3", (("phi3.attention.sliding_window_pattern", 2),), {}, "phi3.attention.sliding_window_pattern=2"),
    ],
    ids=["longrope", "gemma3-attention-softcap", "gemma2-local-rope-base", "unknown-key", "phi3-pattern"],
)
def test_what_the_import_does_not_implement_is_refused_by_name(bpe, tmp_path, name, metadata, tensors, message):
    path = tmp_path / f"{name}.gguf"
    write(path, name, bpe, metadata, tensors)
    with pytest.raises(ModelFileError, match=re.escape(message)) as info:
        import_checkpoint(path)
    assert "\n" not in str(info.value)
