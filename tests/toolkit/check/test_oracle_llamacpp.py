"""`toolkit check --oracle llama.cpp`: a GGUF import's float64 rebuild held to llama.cpp on the same file.

Tiny GGUF files are written with gguf.GGUFWriter the way llama.cpp's converter writes them (the helpers of
tests/models/test_checkpoints.py: a random transformers Llama, Q/K rows permuted to llama.cpp's pairing) and
exported with `toolkit export --from`, the way a user would. llama-cpp-python runs for real.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from artifact import MANIFEST_FILE, sha256_file
from models.artifacts import open_artifact
from runners.eager import model_from_artifact
from tests.optional import LLAMACPP, import_or_skip
from tests.toolkit.check.test_oracle import assert_user_error, edited_copy, invoke
from toolkit.check.golden import _array_entry
from toolkit.check.llamacpp import TOLERANCES, LlamaCppRun, judge_llama_cpp, rebuild_logits, run_llama_cpp

SEQ, STEPS = 10, 6
HEADROOM = {"float32": 300, "float16": 60, "quantized": 15}

gguf = import_or_skip("gguf", "GGUF test files are written with the gguf library")
import_or_skip("transformers", "the tiny GGUF files are written from a random transformers Llama")
from tests.models import test_checkpoints as checkpoints  # noqa: E402
from tests.models.test_checkpoints import gguf_llama, write_gguf  # noqa: E402

bpe = checkpoints.bpe  # the fixture: a small byte-level BPE vocabulary

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def llama_cpp():
    return import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)


def write(path: Path, bpe, *, seed=4, **kwargs) -> Path:
    # llama.cpp knows pre-tokenizers by name; "default" is its plain byte-level BPE.
    write_gguf(path, gguf_llama(bpe, seed=seed), bpe, pre="default", **kwargs)
    return path


def export(gguf_file: Path, out: Path) -> Path:
    result = invoke("export", "--from", gguf_file, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, bpe, llama_cpp):
    """{name: (gguf file, artifact)} for float32, float16 and Q8_0 files of one model."""
    root = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for name, qtype in (("f32", Q.F32), ("f16", Q.F16), ("q8_0", Q.Q8_0)):
        path = write(root / f"{name}.gguf", bpe, qtype=qtype)
        out[name] = (path, export(path, root / f"art-{name}"))
    return out


def check(artifact, tmp_path, *extra):
    report = tmp_path / "report.json"
    result = invoke("check", artifact, "--oracle", "llama.cpp", "--seq-len", SEQ, "--json", report, *extra)
    return result, json.loads(report.read_text()) if report.exists() else None


def repoint(artifact: Path, gguf_file: Path, tmp_path: Path) -> Path:
    """A copy of `artifact` whose manifest says it was imported from `gguf_file` (with that file's hash)."""
    path = gguf_file.resolve()
    return edited_copy(
        artifact, tmp_path, lambda m: m["source"].update(path=str(path), sha256={path.name: sha256_file(path)})
    )


# --------------------------------------------------------------------------- passing imports


def test_export_records_the_gguf_hash(files):
    path, artifact = files["f32"]
    source = json.loads((artifact / MANIFEST_FILE).read_text())["source"]
    assert source == {
        "format": "gguf",
        "path": str(path.resolve()),
        "architecture": "llama",
        "sha256": {path.name: sha256_file(path)},
    }


@pytest.mark.parametrize("name,precision", [("f32", "float32"), ("f16", "float16"), ("q8_0", "quantized")])
def test_oracle_passes_on_gguf_imports(files, tmp_path, name, precision):
    _, artifact = files[name]
    result, data = check(artifact, tmp_path, "--decode-steps", STEPS)
    assert result.exit_code == 0, result.output
    oracle = data["oracle"]
    assert oracle["name"] == "llama.cpp" and oracle["passed"] and oracle["precision"] == precision
    rows = {r["stage"]: r for r in oracle["results"]}
    assert list(rows) == ["logits", "decode.logits"]
    assert rows["logits"]["shape"][1] == SEQ and rows["decode.logits"]["shape"][1] == STEPS
    for row in rows.values():
        assert row["metric"] == "rel_rms" and row["allowed"] == TOLERANCES[precision]
        # Well inside the bound (it is not chosen to scrape past), and never exactly zero: llama.cpp is another
        # implementation. The quantized bound is the one SmolLM2's 30 layers need (test_smollm2.py).
        assert 0 < row["value"] < row["allowed"] / 3, row
        # ...and not loose either: within a set factor of what is measured here (float32 about 2e-7, float16 4e-4,
        # Q8_0 1e-2), so a bound made 10x looser fails this test.
        assert row["allowed"] < HEADROOM[precision] * row["value"], row
    assert oracle["decode_steps"] == STEPS and oracle["greedy_agreement"] >= 0.5
    assert "oracle llama.cpp: PASS, the logits match llama.cpp's" in result.output
    assert "greedy agreement over llama.cpp's 6 decode steps" in result.output


def test_float32_gguf_matches_to_float32_noise(files, tmp_path):
    """On float32 weights llama.cpp computes in float32: every greedy token is ours, every arg-max agrees."""
    result, data = check(files["f32"][1], tmp_path, "--decode-steps", STEPS)
    assert result.exit_code == 0, result.output
    assert data["oracle"]["greedy_agreement"] == 1.0
    assert all(r["argmax_agreement"] == 1.0 for r in data["oracle"]["results"])


# --------------------------------------------------------------------------- llama.cpp disagrees


def test_misread_rope_pairing_fails(files, tmp_path, bpe):
    """An artifact imported from a GGUF without llama.cpp's Q/K permutation (the import's pairing misread),
    recorded against the real file: the backends agree with the misread rebuild, llama.cpp does not."""
    plain = export(write(tmp_path / "plain.gguf", bpe, permute=False), tmp_path / "art-plain")
    artifact = repoint(plain, files["f32"][0], tmp_path)
    result, data = check(artifact, tmp_path)
    assert result.exit_code == 1, result.output
    assert all(b["passed"] for b in data["backends"])
    assert "oracle llama.cpp: FAIL, logits: relative RMS error" in result.output
    assert data["oracle"]["results"][0]["value"] > 100 * TOLERANCES["float32"]


def test_misread_rope_base_fails(files, tmp_path, bpe):
    """The same weights with RoPE base 10000 where the file says 100 (a freq_base the import ignored)."""
    with_base = write(
        tmp_path / "base-10000.gguf",
        bpe,
        skip_meta=("rope.freq_base",),
        hook=lambda writer: writer.add_rope_freq_base(10000.0),
    )
    artifact = repoint(export(with_base, tmp_path / "art-base"), files["f32"][0], tmp_path)
    result, data = check(artifact, tmp_path)
    assert result.exit_code == 1, result.output
    assert all(b["passed"] for b in data["backends"])
    assert "oracle llama.cpp: FAIL, logits: relative RMS error" in result.output


def test_tightness_3x_fails_and_a_third_passes(files, tmp_path, llama_cpp):
    """The verdict's bound itself: noise of 3x the allowed relative RMS error on our side fails, 0.3x passes."""
    path, artifact = files["f32"]
    prompt = np.random.default_rng(0).integers(0, 300, (1, SEQ))
    run = run_llama_cpp(path, prompt, 3)
    model = model_from_artifact(open_artifact(artifact)).to(torch.float64)
    ours = rebuild_logits(model, np.concatenate([run.prompt, run.tokens], axis=1))
    noise = np.random.default_rng(1).standard_normal(ours.shape)
    scale = np.sqrt(np.mean(np.square(run.logits.astype(np.float64))))
    for factor, passes in ((3.0, False), (0.3, True)):
        for precision in ("float32", "quantized"):
            delta = noise * (factor * TOLERANCES[precision] * scale / np.sqrt(np.mean(noise**2)))
            comparison, _ = judge_llama_cpp(run, ours + delta, precision)
            assert bool(comparison) is passes, (factor, precision, [o.value for o in comparison.outputs])


def test_judge_against_hand_computed_values():
    """Relative RMS error and greedy agreement on a fixture small enough to work out by hand."""
    # B=1, T=2 prompt positions, N=2 decode steps, V=3.
    theirs = np.array([[[1, 0, 0], [0, 2, 0], [0, 0, 2], [1, 1, 0]]], dtype=np.float32)
    tokens = np.array([[1, 2]])  # llama.cpp's greedy picks after positions 1 and 2: arg-max of rows 1 and 2
    ours = theirs.astype(np.float64).copy()
    ours[0, 1] = [0, 1, 3]  # row 1 now picks token 2, not llama.cpp's 1: greedy agreement 1/2
    run = LlamaCppRun(np.array([[0, 1]]), tokens, theirs)
    comparison, extra = judge_llama_cpp(run, ours, "quantized")
    # prompt rows: diff [0,0,0],[0,-1,3] -> RMS sqrt(10/6); reference RMS sqrt(5/6) -> rel sqrt(2)
    assert comparison["logits"].value == pytest.approx(np.sqrt(2))
    assert comparison["logits"].argmax_agreement == 0.5
    assert comparison["decode.logits"].value == 0.0 and comparison["decode.logits"].passed
    assert extra["greedy_agreement"] == 0.5
    assert not comparison and comparison["logits"].reason.startswith("relative RMS error 1.41 > allowed")


# --------------------------------------------------------------------------- golden outputs


def test_save_golden_holds_the_artifact_to_llama_cpp_without_it(files, tmp_path, monkeypatch):
    _, artifact = files["q8_0"]
    golden = tmp_path / "golden"
    result, _ = check(artifact, tmp_path, "--save-golden", golden)
    assert result.exit_code == 0, result.output
    assert (golden / "oracle.llama_cpp.npz").is_file()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # CI without llama.cpp still holds it to the original
    result = invoke("check", artifact, "--golden", golden)
    assert result.exit_code == 0, result.output
    assert "golden original         matches the stored original" in result.output


def test_golden_llama_cpp_outputs_catch_a_changed_rebuild(files, tmp_path, bpe):
    _, artifact = files["f32"]
    golden = tmp_path / "golden"
    assert check(artifact, tmp_path, "--save-golden", golden)[0].exit_code == 0
    # The stored logits, scaled by 1.01: today's rebuild now leaves llama.cpp's stored outputs by 1 %.
    data = dict(np.load(golden / "oracle.llama_cpp.npz"))
    data["logits"] = data["logits"] * np.float32(1.01)
    np.savez(golden / "oracle.llama_cpp.npz", **data)
    index = json.loads((golden / "golden.json").read_text())
    entry = index["groups"]["oracle.llama_cpp"]
    entry["sha256"] = sha256_file(golden / "oracle.llama_cpp.npz")
    entry["arrays"]["logits"] = _array_entry(data["logits"])
    (golden / "golden.json").write_text(json.dumps(index))
    result = invoke("check", artifact, "--golden", golden)
    assert result.exit_code == 1, result.output
    assert "LEAVES the stored original at stage logits" in result.output


# --------------------------------------------------------------------------- one-line errors


def test_moved_gguf_is_a_one_line_error(files, tmp_path):
    path, artifact = files["f32"]
    gone = tmp_path / "gone" / path.name
    out = edited_copy(artifact, tmp_path, lambda m: m["source"].update(path=str(gone)))
    assert_user_error(invoke("check", out, "--oracle", "llama.cpp"), str(gone), "moved or deleted")


def test_changed_gguf_is_a_one_line_error(files, tmp_path):
    path, artifact = files["f32"]
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    out = repoint(artifact, copy, tmp_path)
    with open(copy, "r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\1\2\3\4")
    assert_user_error(invoke("check", out, "--oracle", "llama.cpp"), "sha256", "changed since")


def test_hugging_face_and_preset_artifacts_are_refused(tmp_path, llama_cpp):
    assert_user_error(
        invoke("check", "--preset", "worked-example", "--oracle", "llama.cpp"),
        "needs an artifact imported from a GGUF file",
        "preset 'worked-example'",
    )


def test_prompt_beyond_the_context_is_a_one_line_error(files):
    _, artifact = files["f32"]
    result = invoke("check", artifact, "--oracle", "llama.cpp", "--seq-len", 30)  # + 8 default steps
    assert_user_error(result, "prompt of 30 tokens plus 8 decode steps", "context of 32")


def test_without_llama_cpp_the_option_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert_user_error(
        invoke("check", "--preset", "worked-example", "--oracle", "llama.cpp"), "llama-cpp-python", "[llamacpp]"
    )
