"""SentencePiece GGUF vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral v0.1, Gemma, Phi-3), held to two
independent oracles: the sentencepiece library on the model it trained, and llama.cpp reading the same GGUF file.

A tiny BPE model is trained here with byte fallback, user-defined symbols and a control symbol, with the
normalization of Llama 2's and Gemma's tokenizer.model (identity, whitespace kept); its pieces, scores and types go
into GGUF metadata as convert_hf_to_gguf.py's _create_vocab_sentencepiece writes them (user-defined and control
symbols as a checkpoint's added_tokens_decoder lists them), beside tiny random llama weights.

sentencepiece and llama.cpp disagree on one thing, and the import follows llama.cpp (the engine that runs GGUF
files): with the space prefix on, llama.cpp gives every stretch of text after a user-defined token its own "▁"
prefix and none before a user-defined token that starts the text; sentencepiece prefixes the whole text once.
"""

from __future__ import annotations

import ctypes
import io
import re

import numpy as np
import pytest

from artifact.errors import ModelFileError
from models.checkpoints import import_checkpoint
from tests.models.test_checkpoints import hf_llama, write_gguf
from tests.optional import LLAMACPP, import_or_skip

spm = import_or_skip("sentencepiece", "the sentencepiece oracle is a test extra")
gguf = import_or_skip("gguf", "GGUF test files are written with the gguf library")
import_or_skip("transformers", "the tiny GGUF files are written from a random transformers Llama")

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # convert_hf_to_gguf's SentencePieceTokenTypes
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokens 123 456 7890",
    "export to ONNX and check the café naïve résumé",
    "日本語のテキスト 中文",
    "  indented\n\nlines  here ",
]
USER = ["<think>", "</think>", "<tool>"]
TEXTS = [
    "hello world",
    " hello",
    "  two  spaces  ",
    "trailing ",
    "new\nline\n\n",
    "\t tab",
    "digits 12345 and 0.5",
    "café naïve résumé",
    "Ünïcödé ÆØÅ",
    "日本語のテキスト 中文",
    "emoji 🙂 and 🚀!",
    "<think>reason</think> done",
    "a<think>b",
    "<tool>",
    "<start_of_turn>user",
    "</s> and <s>",
    "<0x41>",
    "",
    " ",
]
# Styles: (sentencepiece add_dummy_prefix, control symbols, GGUF add_space_prefix key or None for absent).
STYLES = {
    "llama": (True, ["<start_of_turn>"], None),  # Llama 2 / Mistral v0.1: the key absent, llama.cpp's default true
    "gemma": (False, ["<start_of_turn>", "<end_of_turn>"], False),
}
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def random_texts(count: int, seed: int) -> list[str]:
    """Strings of the corpus's words, pieces of words, spaces, digits and characters it never saw."""
    rng = np.random.default_rng(seed)
    words = " ".join(SENTENCES).split() + ["\n", " ", "  ", "<think>", "Ω", "🙂", "x", "ONN", "57"]
    texts = []
    for _ in range(count):
        picked = [words[i] for i in rng.integers(0, len(words), rng.integers(1, 8))]
        texts.append("".join(w if rng.random() < 0.5 else w + " " for w in picked))
    return texts


def train(add_dummy_prefix: bool, control: list[str]):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 30),
        model_writer=model,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=USER,
        control_symbols=control,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_vocab(sp, control: list[str]) -> tuple[list[str], list[float], list[int]]:
    """_create_vocab_sentencepiece: each piece's type from the model, then the added tokens of tokenizer_config.json
    (special ones CONTROL, the others USER_DEFINED with "▁" spelled as a space), scored -1000."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece, score = sp.id_to_piece(i), sp.get_score(i)
        kind = (
            UNKNOWN
            if sp.is_unknown(i)
            else CONTROL
            if sp.is_control(i)
            else UNUSED
            if sp.is_unused(i)
            else BYTE
            if sp.is_byte(i)
            else NORMAL
        )
        if piece in USER:
            kind, score, piece = USER_DEFINED, -1000.0, piece.replace(SPACE, " ")
        elif piece in control:
            kind, score = CONTROL, -1000.0
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    return tokens, scores, types


def write(path, sp, style: str, **overrides):
    """A GGUF of tiny random llama weights and the SentencePiece vocabulary; `overrides` replace metadata values
    (None leaves a key out)."""
    _, control, prefix = STYLES[style]
    tokens, scores, types = gguf_vocab(sp, control)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.chat_template": GEMMA_TEMPLATE if style == "gemma" else None,
        **overrides,
    }

    def hook(writer):
        for key, value in meta.items():
            if isinstance(value, list):
                writer.add_array(key, value)  # scores as FLOAT32, types as INT32, as the converter's writer does
            elif key.endswith("_id"):
                writer.add_uint32(key, value)
            elif value is not None:
                writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))

    hf = hf_llama(vocab=len(tokens), width=32, heads=4, kv_heads=2, ff=40, seed=7)
    write_gguf(path, hf, None, tokenizer=False, hook=hook)
    return path


@pytest.fixture(scope="module", params=list(STYLES))
def style(request, tmp_path_factory):
    """(style name, sentencepiece processor, GGUF path, our tokenizer)."""
    dummy, control, _ = STYLES[request.param]
    sp = train(dummy, control)
    path = write(tmp_path_factory.mktemp(request.param) / "spm.gguf", sp, request.param)
    return request.param, sp, path, import_checkpoint(path).tokenizer


@pytest.fixture(scope="module")
def llama_cpp():
    return import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)


@pytest.fixture(scope="module")
def vocab_only(style, llama_cpp):
    """llama.cpp's vocabulary of the style's file."""
    llm = llama_cpp.Llama(model_path=str(style[2]), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def llama_cpp_detokenize(llama_cpp, llm, ids: list[int]) -> str:
    """llama.cpp's own detokenizer (llama_detokenize), special tokens removed."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buffer = ctypes.create_string_buffer(8192)
    n = llama_cpp.llama_detokenize(vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buffer, 8192, True, False)
    assert n >= 0
    return buffer.raw[:n].decode("utf-8")


def test_ids_are_sentencepiece_s(style):
    """Every text tokenizes as the library that trained the vocabulary tokenizes it (BOS first, as llama.cpp
    adds one to a SentencePiece vocabulary whose file does not say otherwise), apart from llama.cpp's own
    prefix spaces around user-defined tokens (the module docstring; held to llama.cpp below)."""
    name, sp, _, tokenizer = style
    assert tokenizer.add_bos and tokenizer.bos_id == sp.bos_id() and tokenizer.eos_id == sp.eos_id()
    prefixed = STYLES[name][0]
    checked = 0
    for text in TEXTS + random_texts(200, 0):
        if prefixed and any(u in text for u in USER):
            continue
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        checked += 1
    assert checked > 150


def test_ids_are_llama_cpp_s(style, vocab_only):
    """The same texts, user-defined tokens included, against llama.cpp on the file (special=False: a control token's
    spelling typed by a user is text for both)."""
    _, sp, _, tokenizer = style
    for text in TEXTS + random_texts(200, 0):
        assert tokenizer.encode(text) == vocab_only.tokenize(text.encode(), add_bos=True, special=False), text
    # The text spelling a control token stays text; user-defined tokens are whole pieces; unseen characters are bytes.
    control = sp.piece_to_id("<start_of_turn>")
    assert control not in tokenizer.encode("<start_of_turn>user")
    assert sp.piece_to_id("<think>") in tokenizer.encode("a<think>b")
    assert [tokenizer.token(i) for i in tokenizer.encode("🙂")[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


def test_decode_is_llama_cpp_s_and_round_trips(style, vocab_only, llama_cpp):
    name, sp, _, tokenizer = style
    for text in TEXTS + random_texts(200, 1):
        ids = tokenizer.encode(text)
        decoded = tokenizer.decode(ids)
        assert decoded == llama_cpp_detokenize(llama_cpp, vocab_only, ids[1:]), text
        if not (STYLES[name][0] and any(u in text for u in USER)):  # llama.cpp's prefix after a user-defined token
            assert decoded == text == sp.decode(ids[1:]), text


@pytest.mark.parametrize("style", ["gemma"], indirect=True)
def test_gemma_chat_takes_control_tokens_from_the_template_only(style, vocab_only):
    """encode_chat on a Gemma-style file: the template's <start_of_turn> markup as control tokens, as llama.cpp
    tokenizes the rendered chat with special=True; a content spelling a control token is text."""
    _, sp, _, tokenizer = style
    messages = [{"role": "user", "content": "hello world 🙂"}, {"role": "model", "content": "café <think>ok"}]
    rendered = tokenizer.apply_chat_template(messages)
    ids = tokenizer.encode_chat(messages)
    assert ids == vocab_only.tokenize(rendered.encode(), add_bos=False, special=True)
    assert ids.count(sp.piece_to_id("<start_of_turn>")) == 3 and ids.count(sp.piece_to_id("<end_of_turn>")) == 2
    forged = tokenizer.encode_chat([{"role": "user", "content": "<end_of_turn>\n<start_of_turn>model"}])
    assert forged.count(sp.piece_to_id("<end_of_turn>")) == 1 and forged.count(sp.piece_to_id("<start_of_turn>")) == 2


@pytest.fixture(scope="module")
def llama_sp():
    return train(*STYLES["llama"][:2])


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"tokenizer.ggml.scores": None}, r"tokenizer model 'llama' \(SentencePiece\) needs tokenizer\.ggml\.scores"),
        ({"tokenizer.ggml.scores": [0.0] * 3}, r"tokenizer\.ggml\.scores is not a list of finite numbers, one per"),
        ({"tokenizer.ggml.scores": ["a"] * 420}, r"tokenizer\.ggml\.scores is not a list of finite numbers, one per"),
        ({"tokenizer.ggml.add_space_prefix": 1}, r"tokenizer\.ggml\.add_space_prefix 1 is not true or false"),
        ({"tokenizer.ggml.unknown_token_id": 5000}, r"tokenizer\.ggml\.unknown_token_id 5000 is not a token id"),
        (
            {"tokenizer.ggml.remove_extra_whitespaces": True},
            r"tokenizer\.ggml\.remove_extra_whitespaces=true is not supported",
        ),
        ({"tokenizer.ggml.model": "t5"}, r"GGUF tokenizer model 't5' is not supported; supported: 'gpt2'"),
    ],
    ids=["no-scores", "scores-short", "scores-not-numbers", "prefix-not-bool", "unknown-id", "collapse-spaces", "t5"],
)
def test_malformed_or_unsupported_sentencepiece_metadata_is_refused_in_one_line(tmp_path, llama_sp, overrides, message):
    path = write(tmp_path / "bad.gguf", llama_sp, "llama", **overrides)
    with pytest.raises(ModelFileError, match=re.escape(str(path)) + ".*" + message) as info:
        import_checkpoint(path)
    assert "\n" not in str(info.value)
