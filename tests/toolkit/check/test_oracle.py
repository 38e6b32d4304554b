"""`toolkit check --oracle transformers`: the artifact's float64 rebuild held to the original checkpoint.

Tiny random checkpoints are written with transformers' save_pretrained (O(1) weight scales, as in
tests/models/test_checkpoints.py, so a wrong weight or a dropped mechanism moves outputs far beyond float32
noise) and exported with `toolkit export --from`, the way a user would.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper

from artifact import MANIFEST_FILE, MODEL_FILE, sha256_file
from tests.optional import import_or_skip
from toolkit.cli import main

LAYERS, WINDOW, SEQ = 3, 4, 8


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@torch.no_grad()
def randomize(model, seed):
    """Re-draw every parameter with O(1) scales (norm gains near 1, biases near 0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif p.ndim == 1:
            p.copy_(1 + 0.1 * noise)
        elif "embed_tokens" in name or "wte" in name:
            p.copy_(noise)
        elif "wpe" in name:
            p.copy_(0.5 * noise)
        elif any(k in name for k in ("c_attn", "c_proj", "c_fc")):  # GPT-2 Conv1D: [in, out]
            p.copy_(noise / math.sqrt(p.shape[0]))
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model.eval()


LLAMA_KEYS = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rope_theta=100.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def export_from(checkpoint: Path, out: Path) -> Path:
    result = invoke("export", "--from", checkpoint, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: (checkpoint dir, artifact dir)}: a llama and a gpt2 import, and the hand-edited Mistral case."""
    transformers = import_or_skip("transformers", "the transformers oracle is the [oracle] extra")
    root = tmp_path_factory.mktemp("oracle")
    randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_KEYS)), 0).save_pretrained(root / "llama")
    gpt2 = transformers.GPT2Config(
        vocab_size=50, n_embd=32, n_head=4, n_layer=2, n_positions=16, bos_token_id=None, eos_token_id=None
    )
    randomize(transformers.GPT2LMHeadModel(gpt2), 2).save_pretrained(root / "gpt2")
    mistral = transformers.MistralConfig(sliding_window=WINDOW, **LLAMA_KEYS)
    randomize(transformers.MistralForCausalLM(mistral), 1).save_pretrained(root / "mistral")
    out = {name: (root / name, export_from(root / name, root / f"art-{name}")) for name in ("llama", "gpt2")}

    # The case: config.json hand-edited to say llama. The import reads it as a llama without the window
    # (built here from a copy without the key, which the import may refuse); the manifest points at the original.
    edited = root / "mistral-as-llama"
    shutil.copytree(root / "mistral", edited)

    def as_llama(config):
        config.update(model_type="llama", architectures=["LlamaForCausalLM"])
        config.pop("sliding_window")

    edit_json(edited / "config.json", as_llama)
    artifact = export_from(edited, root / "art-mistral")
    edit_json(artifact / MANIFEST_FILE, lambda m: repoint(m, root / "mistral"))
    out["mistral"] = (root / "mistral", artifact)
    return out


def repoint(manifest: dict, checkpoint: Path) -> None:
    """Make the manifest's source name `checkpoint` with its current hashes, as an import of it would."""
    hashes = {p.name: sha256_file(p) for p in [checkpoint / "config.json", *checkpoint.glob("*.safetensors")]}
    manifest["source"].update(path=str(checkpoint), sha256=hashes)


def edited_copy(artifact: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(artifact, out)
    edit_json(out / MANIFEST_FILE, edit)
    return out


def check(artifact, tmp_path, *extra):
    report = tmp_path / "report.json"
    result = invoke("check", artifact, "--oracle", "transformers", "--seq-len", SEQ, "--json", report, *extra)
    data = json.loads(report.read_text()) if report.exists() else None
    return result, data


# --------------------------------------------------------------------------- passing imports


def test_export_records_the_checkpoint_hashes(exports):
    checkpoint, artifact = exports["llama"]
    source = json.loads((artifact / MANIFEST_FILE).read_text())["source"]
    assert source["path"] == str(checkpoint.resolve())
    expected = {
        name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
        for name in ("config.json", "model.safetensors")
    }
    assert source["sha256"] == expected


@pytest.mark.parametrize("name,layers", [("llama", LAYERS), ("gpt2", 2)])
def test_oracle_passes_on_hugging_face_imports(exports, tmp_path, name, layers):
    _, artifact = exports[name]
    result, data = check(artifact, tmp_path, "--decode-steps", 2)
    assert result.exit_code == 0, result.output
    stages = ["embed_tokens", *(f"block.{i}.output" for i in range(layers)), "final_norm", "logits"]
    stages += ["decode.0.logits", "decode.1.logits"]
    oracle = data["oracle"]
    assert oracle["passed"] and oracle["first_divergence"] is None
    assert [r["stage"] for r in oracle["results"]] == stages  # every layer, the final norm and the decode steps
    for row in oracle["results"]:
        # float32 against float64: far inside the allowance, and not trivially zero past the embedding
        assert row["max_abs"] <= row["allowed"] / 5, row
        if row["stage"] != "embed_tokens":
            assert row["max_abs"] > 0, row
    assert "oracle transformers: PASS, every stage matches the original" in result.output
    assert "RESULT: PASS, every backend matches the reference and the reference matches the original" in result.output


# --------------------------------------------------------------------------- the original disagrees


def test_hand_edited_mistral_fails_naming_the_first_layer(exports, tmp_path):
    _, artifact = exports["mistral"]
    plain = invoke("check", artifact, "--seq-len", SEQ)
    assert plain.exit_code == 0 and "RESULT: PASS" in plain.output  # the backends agree with the misread rebuild
    result, data = check(artifact, tmp_path)
    assert result.exit_code == 1, result.output
    assert "oracle transformers: FAIL, first stage out of tolerance: block.0.output (layer 0)" in result.output
    assert "MistralForCausalLM" in result.output
    rows = {r["stage"]: r for r in data["oracle"]["results"]}
    assert rows["embed_tokens"]["passed"] and not rows["block.0.output"]["passed"]
    # The window was dropped: positions inside it agree, the first one past it does not.
    assert data["oracle"]["first_position"]["block.0.output"] == WINDOW
    assert "from position 4" in result.output
    assert data["oracle"]["first_divergence"] == "block.0.output" and not data["passed"]


def changed_weight_copy(artifact: Path, tmp_path: Path) -> Path:
    """A copy of `artifact` whose one element of layer 1's down projection moved by 1e-3 (about 0.6% of the
    weights' spread), re-hashed so it loads, as if the export had misread that weight."""
    out = tmp_path / "changed"
    shutil.copytree(artifact, out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    name = manifest["graphs"][0]["weights"]["block.1.feed_forward.down_proj.weight"]["initializer"]
    model = onnx.load(out / MODEL_FILE)
    weight = next(i for i in model.graph.initializer if i.name == name)
    array = numpy_helper.to_array(weight).copy()
    array[3, 5] += np.float32(1e-3)
    weight.CopyFrom(numpy_helper.from_array(array, name))
    onnx.save(model, out / MODEL_FILE)
    manifest["graphs"][0]["sha256"] = sha256_file(out / MODEL_FILE)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


def test_one_changed_weight_fails_naming_its_layer(exports, tmp_path):
    out = changed_weight_copy(exports["llama"][1], tmp_path)
    result, data = check(out, tmp_path)
    assert result.exit_code == 1, result.output
    assert "first stage out of tolerance: block.1.output (layer 1)" in result.output
    rows = {r["stage"]: r for r in data["oracle"]["results"]}
    assert rows["embed_tokens"]["passed"] and rows["block.0.output"]["passed"]
    assert not rows["block.1.output"]["passed"]
    assert all(b["passed"] for b in data["backends"])  # the backends agree with the changed artifact


# --------------------------------------------------------------------------- one-line errors


def test_moved_checkpoint_is_a_one_line_error(exports, tmp_path):
    _, artifact = exports["llama"]
    out = edited_copy(artifact, tmp_path, lambda m: m["source"].update(path=str(tmp_path / "gone")))
    assert_user_error(invoke("check", out, "--oracle", "transformers"), "gone", "moved or deleted")


def test_changed_checkpoint_is_a_one_line_error(exports, tmp_path):
    checkpoint, artifact = exports["llama"]
    copy = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, copy)
    out = edited_copy(artifact, tmp_path, lambda m: m["source"].update(path=str(copy)))
    (copy / "config.json").write_text(
        (copy / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    )
    assert_user_error(invoke("check", out, "--oracle", "transformers"), "config.json: sha256", "changed since")


def test_unrecorded_hashes_are_a_one_line_error(exports, tmp_path):
    _, artifact = exports["llama"]
    out = edited_copy(artifact, tmp_path, lambda m: m["source"].pop("sha256"))
    assert_user_error(invoke("check", out, "--oracle", "transformers"), "records no sha256", "re-export")


def test_preset_artifact_is_refused():
    assert_user_error(
        invoke("check", "--preset", "worked-example", "--oracle", "transformers"),
        "imported from a Hugging Face directory",
        "preset 'worked-example'",
    )


def test_without_transformers_the_option_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert_user_error(invoke("check", "--oracle", "transformers"), "pip install '.[oracle]'")


def test_unknown_oracle_is_a_usage_error():
    result = invoke("check", "--oracle", "onnxruntime")
    assert result.exit_code == 2 and "'onnxruntime' is not one of 'transformers', 'llama.cpp'" in result.output


# --------------------------------------------------------------------------- `toolkit export --from` verification


def test_export_from_verifies_against_the_original(exports, tmp_path):
    checkpoint, _ = exports["llama"]
    result = invoke("export", "--from", checkpoint, "--out", tmp_path / "art")
    assert result.exit_code == 0, result.output
    assert "verified against the original: LlamaForCausalLM with transformers" in result.output
    assert "logits max abs" in result.output


def misreading_import(monkeypatch, delta=1e-2):
    """Make the import misread one element of layer 1's down projection by `delta`, as a wrong mapping would
    (in the weights `toolkit export` reads from the opened checkpoint)."""
    import dataclasses

    import models.checkpoints as checkpoints

    real = checkpoints.open_checkpoint

    def misread(path, **options):
        opened = real(path, **options)

        def read_model():
            model = opened.read_model()
            with torch.no_grad():
                model.block[1].feed_forward.down_proj.weight[3, 5] += delta
            return model

        return dataclasses.replace(opened, read_model=read_model)

    monkeypatch.setattr(checkpoints, "open_checkpoint", misread)


def test_export_that_disagrees_with_the_original_fails_and_writes_nothing(exports, tmp_path, monkeypatch):
    checkpoint, artifact = exports["llama"]
    out = tmp_path / "art"
    shutil.copytree(artifact, out)  # a previous good export stays as it was
    before = (out / MANIFEST_FILE).read_bytes(), (out / MODEL_FILE).read_bytes()
    misreading_import(monkeypatch)
    assert_user_error(
        invoke("export", "--from", checkpoint, "--out", out),
        "disagrees with the original LlamaForCausalLM",
        "nothing was written",
    )
    assert ((out / MANIFEST_FILE).read_bytes(), (out / MODEL_FILE).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no staging directory left behind

    written = invoke("export", "--from", checkpoint, "--out", tmp_path / "written", "--no-verify")
    assert written.exit_code == 0 and "verified against" not in written.output, written.output


def test_export_skips_verification_it_cannot_do_and_says_why(exports, tmp_path, monkeypatch):
    import toolkit.memory
    from artifact.format import DEFAULT_LOWERING
    from models.checkpoints import checkpoint_weights
    from toolkit.commands.export import export_memory

    checkpoint, _ = exports["llama"]
    room = export_memory(*checkpoint_weights(checkpoint), "float32", DEFAULT_LOWERING)

    def export(*args):
        # Room for the export when it starts; once the import holds its share, none is left for the original.
        readings = iter([room])
        monkeypatch.setattr(toolkit.memory, "available_memory", lambda: next(readings, 1024))
        return invoke("export", "--from", checkpoint, *args)

    misreading_import(monkeypatch)
    result = export("--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    assert "not verified against the original: the original needs about" in result.output
    assert "--verify forces it" in result.output
    assert_user_error(export("--out", tmp_path / "b", "--verify"), "disagrees")

    monkeypatch.setitem(sys.modules, "transformers", None)
    result = export("--out", tmp_path / "c")
    assert result.exit_code == 0 and "not verified against the original: transformers is not installed" in result.output
    assert_user_error(export("--out", tmp_path / "d", "--verify"), "pip install '.[oracle]'")


def test_verify_needs_a_checkpoint():
    assert_user_error(invoke("export", "--preset", "worked-example", "--out", "x", "--verify"), "--from")


# --------------------------------------------------------------------------- golden files record the original


def test_golden_holds_the_artifact_to_the_original_without_transformers(exports, tmp_path, monkeypatch):
    _, artifact = exports["llama"]
    golden = tmp_path / "golden"
    saved = invoke("check", artifact, "--oracle", "transformers", "--seq-len", SEQ, "--save-golden", golden)
    assert saved.exit_code == 0, saved.output
    index = json.loads((golden / "golden.json").read_text())
    assert index["oracle"]["stages"] == [
        "embed_tokens",
        *(f"block.{i}.output" for i in range(LAYERS)),
        "final_norm",
        "logits",
    ]
    assert (
        index["oracle"]["checkpoint_sha256"] == json.loads((artifact / MANIFEST_FILE).read_text())["source"]["sha256"]
    )
    assert "oracle.transformers" in index["groups"]

    monkeypatch.setitem(sys.modules, "transformers", None)  # CI without transformers
    same = invoke("check", artifact, "--golden", golden)
    assert same.exit_code == 0, same.output
    assert "golden original         matches the stored original" in same.output
    changed = invoke("check", changed_weight_copy(artifact, tmp_path), "--golden", golden)
    assert changed.exit_code == 1, changed.output
    assert "golden original         LEAVES the stored original at stage block.1.output (layer 1)" in changed.output


def test_a_check_the_original_fails_saves_no_golden(exports, tmp_path):
    _, artifact = exports["mistral"]
    result = invoke("check", artifact, "--oracle", "transformers", "--seq-len", SEQ, "--save-golden", tmp_path / "g")
    assert_user_error(result, "the check failed")
    assert not (tmp_path / "g").exists()


def test_inputs_the_original_cannot_take_are_refused(exports, tmp_path):
    _, artifact = exports["llama"]
    ids = np.random.default_rng(0).integers(0, 50, (1, 6))
    np.savez(tmp_path / "shifted.npz", input_ids=ids, position_ids=np.arange(2, 8)[None])
    result = invoke("check", artifact, "--oracle", "transformers", "--inputs", tmp_path / "shifted.npz")
    assert_user_error(result, "positions 0..T-1")
