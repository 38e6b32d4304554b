"""Fuzzing the JSON files of a checkpoint and an artifact that are not weights: a Hugging Face config.json (through
the config half of the import: typed read, key policy, our config, size checks), a Hugging Face
tokenizer_config.json and an artifact's tokenizer_config.json. Drawn from valid files with values replaced by
drawn JSON (wrong types, huge and negative numbers, nesting), keys dropped or added, and text damage. Only
the toolkit's own errors escape, in one line. 2,000 cases per file, counts printed."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from artifact.errors import ModelFileError, ToolkitError
from models.checkpoints.huggingface import hf_model_config
from models.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

CASES = 2000
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 4, 16, 64, 1024, 10**10]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["llama", "gpt2", "qwen2", "default", "linear", "silu", "<s>", "{{ 1/0 }}", "{{ x.y.z }}"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "tie_word_embeddings": True,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_head": 4, "n_positions": 32, "n_layer": 2}
QWEN2 = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
HF_TOKENIZER = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": "x"}
ARTIFACT_TOKENIZER = {"bos_id": 0, "eos_id": 1, "add_bos": True, "chat_template": "{{ bos_token }}", "eos_ids": [1]}


@st.composite
def json_texts(draw, bases: list[dict]) -> str:
    """A base file with up to four keys replaced, dropped or added (nested objects included), then sometimes
    damaged as text: cut, a 5,000-digit integer, deep nesting, bytes that are not UTF-8."""
    data = json.loads(json.dumps(draw(st.sampled_from(bases))))
    for _ in range(draw(st.integers(0, 4))):
        where = data
        nested = [k for k, v in data.items() if isinstance(v, dict)]
        if nested and draw(st.booleans()):
            where = data[draw(st.sampled_from(nested))]
        key = draw(st.sampled_from(sorted(where) + ["unknown_key", "head_dim", "layer_types", "n_inner"]))
        if draw(st.integers(0, 4)) == 0:
            where.pop(key, None)
        else:
            where[key] = draw(JSON_VALUES)
    if draw(st.integers(0, 9)) == 0:
        data = draw(JSON_VALUES)  # not an object at all
    text = json.dumps(data, allow_nan=True)
    damage = draw(st.integers(0, 14))
    if damage == 0:
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == 1:
        text = text.replace("2", "9" * 5000, 1)
    elif damage == 2:
        text = "[" * 3000 + text + "]" * 3000
    return text


def run_fuzz(name, strategy, check, fuzz_summary, errors=(ToolkitError,)):
    counts = {"cases": 0, "accepted": 0, "refused": 0}

    @settings(
        max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def run(text):
        counts["cases"] += 1
        try:
            check(text)
        except errors as exc:
            assert str(exc) and "\n" not in str(exc), repr(exc)
            counts["refused"] += 1
            return
        counts["accepted"] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of {name} ({counts['accepted']} accepted, {counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES and counts["accepted"] > 0 and counts["refused"] > 0


def test_fuzz_hugging_face_config(tmp_path, fuzz_summary):
    directory = tmp_path / "hf"
    directory.mkdir()

    def check(text):
        (directory / "config.json").write_text(text)
        family, config, _, _ = hf_model_config(directory)
        # Independent invariants of an accepted config: positive sizes within reason, heads dividing.
        assert family in ("llama", "gpt")
        assert 0 < config.vocab_size <= 1 << 22 and 0 < config.layers <= 1024 and 0 < config.width <= 1 << 16
        assert config.heads > 0 and config.heads % getattr(config, "kv_heads", config.heads) == 0

    run_fuzz("models.checkpoints hf_model_config (config.json)", json_texts([LLAMA, GPT2, QWEN2]), check, fuzz_summary)


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world"] * 5, trainer)
    return tok.to_str()


def test_fuzz_hugging_face_tokenizer_config(tmp_path, tokenizer_json, fuzz_summary):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tokenizer_json)

    def check(text):
        (directory / "tokenizer_config.json").write_text(text)
        tokenizer = TextTokenizer.from_hf_dir(directory)
        assert tokenizer.chat_template is None or isinstance(tokenizer.chat_template, str)
        assert isinstance(tokenizer.add_bos, bool)
        if tokenizer.chat_template:  # rendering a drawn template: only the toolkit's errors
            tokenizer.encode_chat([{"role": "user", "content": "hi </s>"}])

    run_fuzz("TextTokenizer.from_hf_dir (tokenizer_config.json)", json_texts([HF_TOKENIZER]), check, fuzz_summary)


def test_fuzz_artifact_tokenizer_config(tmp_path, tokenizer_json, fuzz_summary):
    directory = tmp_path / "artifact"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tokenizer_json)

    def check(text):
        (directory / "tokenizer_config.json").write_text(text)
        tokenizer = TextTokenizer.from_artifact(directory)
        vocabulary = tokenizer.vocab_size
        for token in (tokenizer.bos_id, tokenizer.eos_id, *tokenizer.eos_ids):
            assert token is None or (isinstance(token, int) and 0 <= token < vocabulary)
        assert tokenizer.encode("hi <s>")  # usable
        if tokenizer.chat_template:
            tokenizer.encode_chat([{"role": "user", "content": "hi"}])

    run_fuzz(
        "TextTokenizer.from_artifact (tokenizer_config.json)",
        json_texts([ARTIFACT_TOKENIZER]),
        check,
        fuzz_summary,
        errors=(ModelFileError,),
    )
