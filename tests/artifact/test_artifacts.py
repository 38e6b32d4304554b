"""Artifact directories: defensive loading (every corruption is a ModelFileError) and atomic writes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from artifact import (
    MANIFEST_FILE,
    MODEL_FILE,
    hashing,
    is_artifact_dir,
    load_onnx,
    sha256_bytes,
    sha256_file,
    write_artifact,
)
from artifact.errors import ModelFileError
from models.artifacts import open_artifact
from runners.registry import create_runner
from toolkit.check.crosscheck import cross_check


def graph_entry(manifest: dict) -> dict:
    """The single graph's manifest entry (per-graph schema), or the manifest itself (flat schema)."""
    return manifest["graphs"][0] if "graphs" in manifest else manifest


def sha_key(manifest: dict) -> str:
    return "sha256" if "graphs" in manifest else "model_sha256"


@pytest.fixture
def artifact_dir(exported, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(exported("block-small").directory, target)
    return target


def read_manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_FILE).read_text())


def write_manifest(directory: Path, manifest) -> None:
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def replace_model_bytes(directory: Path, data: bytes) -> None:
    """Overwrite model.onnx and make the manifest hash agree, so only the bytes themselves are wrong."""
    (directory / MODEL_FILE).write_bytes(data)
    manifest = read_manifest(directory)
    graph_entry(manifest)[sha_key(manifest)] = hashlib.sha256(data).hexdigest()
    write_manifest(directory, manifest)


def test_sha_helpers_agree_with_hashlib(tmp_path):
    data = b"onnx" * 1000
    (tmp_path / "f").write_bytes(data)
    assert sha256_bytes(data) == sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a,
        lambda a: a.T,  # hashed a few rows at a time
        lambda a: a[:, ::3],
        lambda a: a.T[::2],
        lambda a: np.asfortranarray(a),
        lambda a: a[:0].T,
        lambda a: np.float32(2.5),
    ],
)
def test_array_digest_is_the_hash_of_the_c_order_bytes(make, monkeypatch):
    monkeypatch.setattr(hashing, "DIGEST_CHUNK_BYTES", 1000)  # many chunks, the last one short
    array = make(np.arange(700 * 37, dtype=np.float32).reshape(700, 37))
    expected = hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest()
    assert hashing.array_digest(array) == (array.dtype.str, array.shape, expected)


def test_intact_artifact_loads(artifact_dir):
    artifact = open_artifact(artifact_dir)
    assert artifact.directory == artifact_dir
    assert artifact.model_path == artifact_dir / MODEL_FILE
    assert artifact.family == "block" and artifact.variant == "stages"
    assert is_artifact_dir(artifact_dir)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFileError, match="no such file or directory"):
        open_artifact(tmp_path / "nowhere")


def test_missing_manifest(artifact_dir):
    (artifact_dir / MANIFEST_FILE).unlink()
    with pytest.raises(ModelFileError, match=f"missing {MANIFEST_FILE}"):
        open_artifact(artifact_dir)
    assert not is_artifact_dir(artifact_dir)


def test_missing_model(artifact_dir):
    (artifact_dir / MODEL_FILE).unlink()
    with pytest.raises(ModelFileError, match=f"missing {MODEL_FILE}"):
        open_artifact(artifact_dir)


def test_hash_mismatch(artifact_dir):
    data = bytearray((artifact_dir / MODEL_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte somewhere in the weights
    (artifact_dir / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="sha256.*does not match"):
        open_artifact(artifact_dir)


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.97])
@pytest.mark.parametrize("backend", ["eager", "ort-cpu", "onnx-reference"])
def test_truncated_model_with_matching_hash_is_a_model_file_error(artifact_dir, fraction, backend):
    data = (artifact_dir / MODEL_FILE).read_bytes()
    replace_model_bytes(artifact_dir, data[: int(len(data) * fraction)])
    with pytest.raises(ModelFileError, match=str(artifact_dir)):
        create_runner(backend, open_artifact(artifact_dir))


def test_truncated_model_fails_the_check_cleanly(artifact_dir):
    data = (artifact_dir / MODEL_FILE).read_bytes()
    replace_model_bytes(artifact_dir, data[: len(data) // 3])
    with pytest.raises(ModelFileError, match="not a readable ONNX model"):
        cross_check(open_artifact(artifact_dir))


def test_garbage_model_bytes_are_a_model_file_error(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(ModelFileError, match="not a readable ONNX model"):
        load_onnx(path)
    with pytest.raises(ModelFileError, match="noise.onnx"):
        open_artifact(path)


@pytest.mark.parametrize("text", ["{", "", "not json", '{"format": "onnx-toolkit-artifact",}'])
def test_invalid_json_manifest(artifact_dir, text):
    (artifact_dir / MANIFEST_FILE).write_text(text)
    with pytest.raises(ModelFileError, match="invalid JSON"):
        open_artifact(artifact_dir)


def test_non_utf8_manifest(artifact_dir):
    (artifact_dir / MANIFEST_FILE).write_bytes(b"\xff\xfe\xfa{}")
    with pytest.raises(ModelFileError, match="invalid JSON"):
        open_artifact(artifact_dir)


@pytest.mark.parametrize("manifest", [[], "a string", 42, {"format": "something-else", "format_version": 1}])
def test_json_that_is_not_a_toolkit_manifest(artifact_dir, manifest):
    write_manifest(artifact_dir, manifest)
    with pytest.raises(ModelFileError, match="not a toolkit manifest"):
        open_artifact(artifact_dir)


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_wrong_format_version(artifact_dir, version):
    manifest = read_manifest(artifact_dir)
    manifest["format_version"] = version
    write_manifest(artifact_dir, manifest)
    with pytest.raises(ModelFileError, match="format_version"):
        open_artifact(artifact_dir)


@pytest.mark.parametrize("field", ["family", "variant", "config"])
def test_manifest_missing_a_required_field(artifact_dir, field):
    manifest = read_manifest(artifact_dir)
    del manifest[field]
    write_manifest(artifact_dir, manifest)
    with pytest.raises(ModelFileError, match=repr(field)):
        open_artifact(artifact_dir)


def test_manifest_missing_the_model_hash(artifact_dir):
    manifest = read_manifest(artifact_dir)
    del graph_entry(manifest)[sha_key(manifest)]
    write_manifest(artifact_dir, manifest)
    with pytest.raises(ModelFileError, match="sha256"):
        open_artifact(artifact_dir)


def test_manifest_with_null_hash(artifact_dir):
    manifest = read_manifest(artifact_dir)
    graph_entry(manifest)[sha_key(manifest)] = None
    write_manifest(artifact_dir, manifest)
    with pytest.raises(ModelFileError, match="sha256"):
        open_artifact(artifact_dir)


def test_lone_onnx_without_embedded_manifest(tmp_path, exported):
    proto = onnx.load(str(exported("block-small").model_path))
    del proto.metadata_props[:]
    path = tmp_path / "bare.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(ModelFileError, match="no .*metadata"):
        open_artifact(path)


def test_lone_onnx_with_corrupt_embedded_manifest(tmp_path, exported):
    from artifact import METADATA_KEY

    proto = onnx.load(str(exported("block-small").model_path))
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            prop.value = "{broken"
    path = tmp_path / "broken.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(ModelFileError, match="invalid JSON"):
        open_artifact(path)


# --------------------------------------------------------------------------- write_artifact


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_write_creates_directory_with_exact_files(tmp_path):
    out = tmp_path / "deep" / "new"
    write_artifact(out, {MANIFEST_FILE: b"{}", MODEL_FILE: b"model"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {MANIFEST_FILE: b"{}", MODEL_FILE: b"model"}
    assert leftovers(out.parent, "new") == []


def test_write_replaces_an_artifact_completely(tmp_path):
    out = tmp_path / "a"
    write_artifact(out, {MANIFEST_FILE: b"old", MODEL_FILE: b"old", "extra.onnx": b"old"})
    write_artifact(out, {MANIFEST_FILE: b"new", MODEL_FILE: b"new"})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {MANIFEST_FILE: b"new", MODEL_FILE: b"new"}
    assert leftovers(tmp_path, "a") == []


def test_write_failing_verification_leaves_old_artifact_and_no_temp_dir(tmp_path):
    out = tmp_path / "a"
    write_artifact(out, {MANIFEST_FILE: b"old", MODEL_FILE: b"old"})
    verified = []

    def verify(tmp):
        verified.append(Path(tmp))
        assert (Path(tmp) / MODEL_FILE).read_bytes() == b"new"  # verify sees the new files
        raise ModelFileError("bad new files")

    with pytest.raises(ModelFileError, match="bad new files"):
        write_artifact(out, {MANIFEST_FILE: b"new", MODEL_FILE: b"new"}, verify=verify)
    assert verified and not verified[0].exists()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {MANIFEST_FILE: b"old", MODEL_FILE: b"old"}
    assert leftovers(tmp_path, "a") == []


def test_write_failing_verification_creates_nothing(tmp_path):
    def verify(tmp):
        raise ModelFileError("no")

    with pytest.raises(ModelFileError):
        write_artifact(tmp_path / "fresh", {MODEL_FILE: b"x"}, verify=verify)
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_a_non_empty_non_artifact_directory(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ModelFileError, match="not empty.*refusing"):
        write_artifact(out, {MANIFEST_FILE: b"{}", MODEL_FILE: b"m"})
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert leftovers(tmp_path, "home") == []


def test_write_refuses_a_file_path(tmp_path):
    out = tmp_path / "file"
    out.write_text("keep")
    with pytest.raises(ModelFileError, match="not a directory"):
        write_artifact(out, {MODEL_FILE: b"m"})
    assert out.read_text() == "keep"
