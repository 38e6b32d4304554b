"""The language-model CLI path: export --from, generate, run, check --decode-steps, and their errors.

A tiny random transformers LlamaForCausalLM with a small BPE tokenizer is saved as a
Hugging Face directory and exported once through `toolkit export --from`. Generated text
is checked against greedy decoding of the transformers model itself (the oracle).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.optional import import_or_skip
from tests.toolkit.test_cli import assert_user_error, invoke

transformers = import_or_skip("transformers", reason="transformers (the oracle) is a test extra")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "the quick brown fox"


@torch.no_grad()
def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if p.ndim == 1:
            p.copy_(1 + 0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model, tokenizers.Tokenizer): a tiny Llama with a tokenizer (one layer keeps
    the export cheap; multi-layer caches are covered in tests/models/test_kv_cache.py)."""
    # No full byte alphabet: every token is printable ASCII, so any id sequence decodes cleanly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"], show_progress=False
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"] * 10, trainer)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        rope_theta=500.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = randomize(transformers.LlamaForCausalLM(config), 0)
    directory = tmp_path_factory.mktemp("cli-lm") / "hf"
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
                # transformers' "no limit" (int(1e30)), as most tokenizer_config.json files hold it
                "model_max_length": int(1e30),
            }
        )
    )
    return directory, model, tok


@pytest.fixture(scope="module")
def artifact_dir(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-lm-artifact") / "artifact"
    result = invoke("export", "--from", checkpoint[0], "--out", out)
    assert result.exit_code == 0, (result.output, result.exception)
    assert f"exported {checkpoint[0]} (huggingface llama) (llama, serving) to {out}" in result.stdout
    return out


def hf_greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """Greedy decoding with full transformers forwards (no cache); stops after eos."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > 1e-4, "near-tie: greedy would be precision-dependent"
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


def generated(result):
    """(streamed text, summary line) of a `toolkit generate` run."""
    assert result.exit_code == 0, (result.output, result.exception)
    summary = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(summary) == 1, result.stderr
    return result.stdout.removesuffix("\n"), summary[0]


def test_export_writes_tokenizer_and_source(artifact_dir, checkpoint):
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    assert manifest["variant"] == "serving" and manifest["family"] == "llama"
    source = {k: manifest["source"].get(k) for k in ("format", "path", "architecture")}  # and the files' sha256
    assert source == {"format": "huggingface", "path": str(checkpoint[0].resolve()), "architecture": "llama"}
    assert set(manifest["extra_files"]) == {"tokenizer.json", "tokenizer_config.json"}
    for name, digest in manifest["extra_files"].items():
        assert hashlib.sha256((artifact_dir / name).read_bytes()).hexdigest() == digest
    config = json.loads((artifact_dir / "tokenizer_config.json").read_text())
    tok = checkpoint[2]
    assert (config["bos_id"], config["eos_id"], config["add_bos"]) == (
        tok.token_to_id("<s>"),
        tok.token_to_id("</s>"),
        True,
    )


@pytest.mark.parametrize("backend", ["ort-cpu", "eager", "onnx-reference"])
def test_generate_prints_the_transformers_greedy_continuation(artifact_dir, checkpoint, backend):
    _, model, tok = checkpoint
    ids = [tok.token_to_id("<s>")] + tok.encode(PROMPT).ids
    tokens = hf_greedy(model, ids, 5, tok.token_to_id("</s>"))
    text, summary = generated(
        invoke("generate", artifact_dir, "--prompt", PROMPT, "--max-new-tokens", 5, "--backend", backend)
    )
    assert text == tok.decode(tokens, skip_special_tokens=True)
    finish = "stop" if tokens[-1] == tok.token_to_id("</s>") else "length"
    assert summary.startswith(f"[{len(tokens)} tokens, finish: {finish}, prompt {len(ids)} tokens")
    assert summary.endswith(f"on {backend}]")


def test_generate_with_the_chat_template(artifact_dir, checkpoint):
    _, model, tok = checkpoint
    ids = [tok.token_to_id("<s>")] + tok.encode(f"<|user|>{PROMPT}</s><|assistant|>").ids
    assert tok.token_to_id("<|assistant|>") in ids  # the markers are single special tokens
    tokens = hf_greedy(model, ids, 6, tok.token_to_id("</s>"))
    text, summary = generated(invoke("generate", artifact_dir, "--chat", "--prompt", PROMPT, "--max-new-tokens", 6))
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert f"prompt {len(ids)} tokens" in summary


def test_generate_sampling_is_seeded(artifact_dir):
    args = ("generate", artifact_dir, "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 1.5)
    a, _ = generated(invoke(*args, "--seed", 1))
    b, _ = generated(invoke(*args, "--seed", 1))
    c, _ = generated(invoke(*args, "--seed", 2))
    assert a == b and a != c


def test_run_with_only_input_ids_fills_an_empty_cache(artifact_dir, checkpoint, tmp_path):
    _, model, tok = checkpoint
    ids = np.random.default_rng(0).integers(0, tok.get_vocab_size(), (2, 7)).astype(np.int64)
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    result = invoke(
        "run", artifact_dir, "--backend", "ort-cpu", "--inputs", tmp_path / "ids.npz", "--save", tmp_path / "out.npz"
    )
    assert result.exit_code == 0, (result.output, result.exception)
    with np.load(tmp_path / "out.npz") as data:
        out = dict(data)
    assert set(out) == {"logits", "present.0.key", "present.0.value"}
    assert out["present.0.value"].shape == (2, 2, 7, 8)  # (batch, kv_heads, prompt, head_width)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(out["logits"], want, rtol=0, atol=5e-5 * max(1.0, np.abs(want).max()))


def test_check_decode_steps(artifact_dir, tmp_path):
    result = invoke("check", artifact_dir, "--decode-steps", 3, "--json", tmp_path / "report.json")
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    for k in range(3):
        (row,) = [line for line in lines if line.startswith(f"decode.{k}.logits ")]
        assert row.count(" ok") == 3 and "FAIL" not in row, row
    assert not any(line.startswith("decode.3.") for line in lines)
    assert "RESULT: PASS" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    names = [r["stage"] for r in report["results"] if r["backend"] == "ort-cpu"]
    assert names[0] == "logits" and names[-3:] == ["decode.0.logits", "decode.1.logits", "decode.2.logits"]


def test_decode_steps_on_a_stages_artifact_is_a_user_error(exported):
    result = invoke("check", exported("block-small").directory, "--decode-steps", 2)
    assert_user_error(result, "--decode-steps needs a KV-cache artifact", "--variant serving")


def test_generate_without_a_tokenizer_is_a_user_error(exported):
    directory = exported("decoder-small", "serving").directory
    assert_user_error(
        invoke("generate", directory, "--prompt", "hi"),
        "no tokenizer in the artifact",
        "export a checkpoint with --from",
    )


def test_export_from_a_bad_path_is_a_user_error(tmp_path, checkpoint):
    assert_user_error(invoke("export", "--from", tmp_path / "nope", "--out", tmp_path / "a"), "no such checkpoint")
    (tmp_path / "empty").mkdir()
    assert_user_error(invoke("export", "--from", tmp_path / "empty", "--out", tmp_path / "b"), "missing config.json")
    assert_user_error(
        invoke("export", "--from", checkpoint[0], "--preset", "decoder-small", "--out", tmp_path / "c"),
        "give --from on its own",
    )
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.parametrize(
    "option,value,fragment",
    [
        ("--temperature", -1, "Invalid value for '--temperature'"),
        ("--top-p", 0, "Invalid value for '--top-p'"),
        ("--max-new-tokens", 0, "Invalid value for '--max-new-tokens'"),
    ],
)
def test_generate_option_ranges_are_usage_errors(artifact_dir, option, value, fragment):
    result = invoke("generate", artifact_dir, "--prompt", "hi", option, value)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and "Traceback" not in result.output


def test_quantize_measures_perplexity_on_a_users_text_window_by_window(artifact_dir, checkpoint, tmp_path):
    """--perplexity-text: the file tokenized whole (BOS first), cut into windows of the model's context (48 here),
    each fed alone. The float perplexity equals transformers' over the same windows (tokenized by the tokenizers
    library, not the toolkit), and the quantized one numpy's over the quantized artifact's logits."""
    from models.artifacts import open_artifact
    from runners.decoding.generate import CachedLM
    from runners.registry import create_runner

    directory, model, tok = checkpoint
    text = " ".join(["the quick brown fox jumps over the lazy dog", "hello world", "the lazy fox"] * 12)
    path = tmp_path / "text.txt"
    path.write_text(text)
    out, report = tmp_path / "q", tmp_path / "q.json"
    result = invoke(
        "quantize", artifact_dir, "--bits", 8, "--recipe", "rtn", "--perplexity-text", path, "--out", out,
        "--json", report, "--greedy-tokens", 2,
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    quality = json.loads(report.read_text())["quality"]
    ids = [tok.token_to_id("<s>"), *tok.encode(text).ids]
    width = model.config.max_position_embeddings
    windows = [ids[i : i + width] for i in range(0, len(ids), width)]
    windows = [w for w in windows if len(w) > 1]
    assert len(windows) >= 3  # several windows, so a report of the first alone differs
    used = sum(len(w) for w in windows)
    assert quality["perplexity_text"] == {
        "file": "text.txt",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "tokens_used": used,
        "whole_file": used == len(ids),
        "windows": len(windows),
    }
    assert quality["perplexity_tokens"] == sum(len(w) - 1 for w in windows)
    which = "all" if used == len(ids) else "the first"
    assert f"of text.txt: {len(windows)} windows, {which} {used} tokens of the file" in result.output

    def log_probs(logits):  # numpy: log softmax of the rows that predict a token
        logits = np.asarray(logits, dtype=np.float64)[:-1]
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    def loss(rows, window):  # -log p of the next token
        return -rows[np.arange(len(window) - 1), window[1:]]

    with torch.no_grad():
        hf = [log_probs(model(torch.tensor([w])).logits[0].double().numpy()) for w in windows]
    assert quality["perplexity_float"] == pytest.approx(
        math.exp(np.concatenate([loss(r, w) for r, w in zip(hf, windows, strict=True)]).mean()), rel=1e-5
    )
    runner = create_runner("ort-cpu", open_artifact(out))
    ours = [log_probs(CachedLM(runner, width).step(np.asarray([w], dtype=np.int64))[0]) for w in windows]
    quantized = np.concatenate([loss(r, w) for r, w in zip(ours, windows, strict=True)])
    assert quality["perplexity_quantized"] == pytest.approx(math.exp(quantized.mean()), rel=1e-9)
    # KL(transformers' float model || the int8 artifact) at the same tokens: the report's float side is ONNX
    # Runtime's and stored as float16, so the two agree to about a percent, not to the last bit.
    kl = np.concatenate([(np.exp(f) * (f - q)).sum(-1) for f, q in zip(hf, ours, strict=True)])
    assert kl.mean() > 0
    assert quality["kl_from_float"] == pytest.approx(kl.mean(), rel=1e-2)
    assert f"KL from float:     {quality['kl_from_float']:.4g} nats per token" in result.output


def test_a_long_perplexity_text_is_tokenized_only_as_far_as_the_measured_tokens(artifact_dir, checkpoint, tmp_path):
    """A file far past PERPLEXITY_TEXT_TOKENS: hashed whole, its first tokens exactly those of tokenizing the whole
    file (the tokenizers library, not the toolkit), without tokenizing all of it; a bad byte past the measured
    part is still refused with its offset."""
    from artifact.errors import ConfigError
    from models.artifacts import open_artifact
    from models.tokenizer import TextTokenizer
    from toolkit.quantize import pipeline

    _, _, tok = checkpoint
    words = ["the quick brown fox", "jumps over", "the lazy dog", "hello world", "ünïcode text"]
    text = " ".join(words[i * 7 % 5] for i in range(60_000))  # about 5 x 8192 tokens, 0.9 MB
    path = tmp_path / "long.txt"
    path.write_text(text)
    artifact = open_artifact(artifact_dir)
    encoded = []
    real = TextTokenizer.encode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TextTokenizer, "encode", lambda self, t: encoded.append(len(t)) or real(self, t))
        read = pipeline.read_perplexity_text(artifact, path)
    ids = [tok.token_to_id("<s>"), *tok.encode(text).ids]
    assert len(ids) > 4 * pipeline.PERPLEXITY_TEXT_TOKENS
    assert [t for w in read.windows for t in w] == ids[: pipeline.PERPLEXITY_TEXT_TOKENS]
    assert read.report()["whole_file"] is False and read.report()["tokens_used"] == pipeline.PERPLEXITY_TEXT_TOKENS
    assert read.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert max(encoded) < len(text) / 4  # a prefix, not the file

    data = path.read_bytes()
    path.write_bytes(data[:-10] + b"\xff" + data[-9:])
    with pytest.raises(ConfigError, match=rf"is not UTF-8 text \(byte {len(data) - 10}: b'\\xff'\)"):
        pipeline.read_perplexity_text(artifact, path)


def test_quantize_perplexity_text_errors_are_user_errors(artifact_dir, exported, tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"the quick \xff\xfe fox")
    args = ("--bits", 8, "--recipe", "rtn", "--out", tmp_path / "q", "--perplexity-text")
    assert_user_error(invoke("quantize", artifact_dir, *args, binary), "binary.txt is not UTF-8 text (byte 10")
    short = tmp_path / "short.txt"
    short.write_text("")
    assert_user_error(invoke("quantize", artifact_dir, *args, short), "short.txt is 1 token(s)")
    assert_user_error(invoke("quantize", artifact_dir, *args, tmp_path / "missing.txt"), "cannot read", "missing")
    assert_user_error(invoke("quantize", artifact_dir, *args, "/dev/zero"), "/dev/zero is not a regular file")
    lone = exported("decoder-small", "serving").directory
    assert_user_error(invoke("quantize", lone, *args, binary), "has no tokenizer.json to tokenize")
    assert not (tmp_path / "q").exists()


def test_a_failing_export_exits_at_once_while_the_checkpoint_is_still_being_hashed(checkpoint, tmp_path):
    """`export --from` hashes the checkpoint on a thread beside the export. When the export fails (here: --out is a
    directory of the user's that is not an artifact) the command prints its one line and exits 2 at once, not after
    a hash that would take a minute more (the hash is slowed to a minute; its thread must not hold the exit)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not an artifact")
    code = (
        "import sys, time\n"
        "import toolkit.check.oracle as oracle\n"
        "hashes = oracle.checkpoint_hashes\n"
        "oracle.checkpoint_hashes = lambda directory: (time.sleep(60), hashes(directory))[1]\n"
        "from toolkit.cli import main\n"
        "sys.argv[0] = 'toolkit'\n"
        "main()\n"
    )
    command = [sys.executable, "-c", code, "export", "--from", str(checkpoint[0]), "--out", str(out), "--no-verify"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=180)
    elapsed = time.perf_counter() - start
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < 40, f"exited {elapsed:.0f} s after starting: it waited for the hash"
    assert (out / "notes.txt").read_text() == "not an artifact"


def test_a_perplexity_text_prefix_is_taken_only_once_a_longer_one_agrees(tmp_path, monkeypatch):
    """A BPE whose merges cascade from the right: a chain of 1201 characters cut by the first 64 KiB chunk
    tokenizes differently cut and whole, and that changes measured tokens far before the cut (about 225 of them
    here). The prefix is taken only once one a chunk longer gives the same measured tokens, so the measured
    tokens are the whole file's (the tokenizers library on the whole text)."""
    import types

    from toolkit.quantize import pipeline

    chain = [chr(0x4E00 + i) for i in range(1201)]
    vocab = {c: i for i, c in enumerate(chain)}
    merges = [(chain[i], chain[i + 1]) for i in reversed(range(len(chain) - 1))]  # the rightmost pair first
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for run in ("x", "xx", "xxxx", "xxxxxxxx"):
        vocab[run] = len(vocab)
    merges += [("x", "x"), ("xx", "xx"), ("xxxx", "xxxx")]
    directory = tmp_path / "artifact"
    directory.mkdir()
    Tokenizer(models.BPE(vocab=vocab, merges=merges)).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos": False, "chat_template": None}))
    monkeypatch.setattr(pipeline, "artifact_config", lambda artifact: types.SimpleNamespace(max_positions=512))
    filler = "x" * 63736  # 7967 tokens of 8 characters, then the chain, cut by the first chunk after 600 of it
    text = filler + "".join(chain) + "x" * 200_000
    assert len((filler + "".join(chain[:600])).encode()) == pipeline.PERPLEXITY_TEXT_CHUNK
    path = tmp_path / "text.txt"
    path.write_text(text)
    read = pipeline.read_perplexity_text(types.SimpleNamespace(directory=directory, location=str(directory)), path)
    whole = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    cut = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text[: len(filler) + 600]).ids
    assert cut[: pipeline.PERPLEXITY_TEXT_TOKENS] != whole[: pipeline.PERPLEXITY_TEXT_TOKENS]  # the cascade
    assert [t for w in read.windows for t in w] == whole[: pipeline.PERPLEXITY_TEXT_TOKENS]
    assert read.report()["whole_file"] is False


def test_the_checkpoint_hashing_lines_of_an_export_carry_its_label_and_quiet_silences_them(checkpoint, tmp_path):
    """`export --from` hashes the checkpoint's files; every file reports (the size threshold lowered to 0), under
    [export ...] when progress shows, and nothing shows with --quiet."""
    import re

    import artifact.hashing
    from toolkit.progress import PROGRESS_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(artifact.hashing, "PROGRESS_BYTES", 0)
        patch.setenv(PROGRESS_ENV, "1")
        args = ("export", "--from", checkpoint[0], "--no-verify")
        shown = invoke(*args, "--out", tmp_path / "a")
        assert shown.exit_code == 0, shown.output
        hashing = [line for line in shown.stderr.splitlines() if "hashed" in line]
        assert any("model.safetensors" in line for line in hashing), shown.stderr
        assert all(re.match(r"\[export +[\d.]+ s\] verifying ", line) for line in hashing), shown.stderr
        quiet = invoke(*args, "--out", tmp_path / "b", "--quiet")
        assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr
