"""Weights in an external data file beside each graph (artifact.write.externalize): written page-aligned and
hashed in the manifest, run by every backend, and refused when missing, truncated, swapped or unlisted."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from artifact import MANIFEST_FILE, MODEL_FILE
from artifact.write import EXTERNAL_ALIGNMENT, EXTERNAL_DATA_ENV, EXTERNAL_MIN_TENSOR_BYTES
from tests.toolkit.test_cli import assert_user_error, invoke

DATA = f"{MODEL_FILE}.data"


def export(out, *extra, preset="decoder-small-gqa"):
    result = invoke("export", "--preset", preset, "--out", out, *extra)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    return export(tmp_path_factory.mktemp("ext") / "artifact", "--external-data")


def test_weights_are_beside_the_graph_page_aligned_and_hashed(external):
    manifest = json.loads((external / MANIFEST_FILE).read_text())
    (entry,) = manifest["graphs"]
    assert list(entry["external_data"]) == [DATA]
    graph = onnx.load(str(external / MODEL_FILE), load_external_data=False)
    moved = [t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in graph.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert moved and all(len(t.raw_data) < EXTERNAL_MIN_TENSOR_BYTES for t in kept)
    size = (external / DATA).stat().st_size
    for tensor in moved:
        info = {e.key: e.value for e in tensor.external_data}
        assert info["location"] == DATA
        offset, length = int(info["offset"]), int(info["length"])
        assert offset % EXTERNAL_ALIGNMENT == 0 and offset + length <= size
    # The same weights as an export that keeps them inside the graph.
    inside = onnx.load(str(export(external.parent / "inside", "--no-external-data") / MODEL_FILE))
    loaded = onnx.load(str(external / MODEL_FILE))
    assert {t.name: t.raw_data for t in loaded.graph.initializer} == {
        t.name: t.raw_data for t in inside.graph.initializer
    }


def test_every_backend_runs_it(external):
    result = invoke("check", external, "--backends", "eager,ort-cpu,onnx-reference")
    assert result.exit_code == 0 and "RESULT: PASS" in result.output, result.output


def test_the_size_threshold_chooses_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv(EXTERNAL_DATA_ENV, "1000")  # a tiny model is above it
    assert (export(tmp_path / "small-threshold") / DATA).is_file()
    monkeypatch.delenv(EXTERNAL_DATA_ENV)  # the default (1 GiB) keeps a tiny model inside
    assert not (export(tmp_path / "default") / DATA).exists()
    monkeypatch.setenv(EXTERNAL_DATA_ENV, "lots")
    assert_user_error(invoke("export", "--preset", "decoder-small", "--out", tmp_path / "bad"), EXTERNAL_DATA_ENV)


def test_kv_cache_graph_with_external_data_decodes(tmp_path):
    out = export(tmp_path / "serving", "--external-data", "--variant", "serving", preset="decoder-small")
    result = invoke("check", out, "--decode-steps", 3)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("damage", ["missing", "truncated", "swapped", "unlisted"])
def test_damaged_external_data_is_refused_naming_the_file(external, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(external, copy)
    data = copy / DATA
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "swapped":  # another model's weights of exactly the same length
        other = export(tmp_path / "other", "--external-data", preset="decoder-small-gqa")
        blob = bytearray((other / DATA).read_bytes())
        blob[-1] ^= 1
        data.write_bytes(bytes(blob))
    else:  # the graph still reads the file, but the manifest no longer lists (and hashes) it
        manifest = json.loads((copy / MANIFEST_FILE).read_text())
        del manifest["graphs"][0]["external_data"]
        (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    fragment = {"missing": "missing", "truncated": "sha256", "swapped": "sha256", "unlisted": "does not list"}[damage]
    assert_user_error(invoke("check", copy), DATA, fragment)


def test_quantize_reads_and_writes_external_data(external, tmp_path, monkeypatch):
    monkeypatch.setenv(EXTERNAL_DATA_ENV, "1000")
    q8 = ("--bits", "8", "--accuracy-level", "0", "--out", tmp_path / "q8", "--greedy-tokens", "2")  # checkable
    result = invoke("quantize", external, *q8)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q8" / DATA).is_file()
    assert invoke("check", tmp_path / "q8", "--backends", "eager,ort-cpu").exit_code == 0
