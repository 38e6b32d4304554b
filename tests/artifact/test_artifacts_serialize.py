"""Writing and re-reading artifacts without redundant passes: serialize_model assembles the bytes
protobuf would write (protobuf's own SerializeToString is the oracle), write_and_load checks the
written files once (every load_artifact check, on the temporary directory) and returns them at the
final path, and validate_onnx checks the manifest hash on the bytes it parses, before parsing them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import artifact.read as artifact_read
from artifact import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    CorruptModelError,
    HashMismatchError,
    serialize_model,
    sha256_bytes,
    validate_onnx,
    write_and_load,
)


def model_with_every_field() -> onnx.ModelProto:
    """Fields on both sides of `graph` (7) in the model and of `initializer` (5) in the graph, and
    initializers whose lengths take 1-, 2- and 3-byte varints."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(n).astype(np.float32) for n in (3, 40, 5000, 70000)]
    inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)]
    inits.append(helper.make_tensor("listed", TensorProto.FLOAT, [2], [1.5, -2.0]))  # float_data, no raw_data
    inits.append(helper.make_tensor("empty", TensorProto.FLOAT, [0], []))
    nodes = [helper.make_node("Add", ["x", f"w{i}"], [f"y{i}"], name=f"add{i}") for i in range(len(weights))]
    graph = helper.make_graph(
        nodes,
        "every",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(4)],
        inits,
        doc_string="graph doc",
        value_info=[helper.make_tensor_value_info("v", TensorProto.FLOAT, [1])],
    )
    graph.sparse_initializer.add().values.CopyFrom(helper.make_tensor("s", TensorProto.FLOAT, [1], [1.0]))
    graph.quantization_annotation.add(tensor_name="w0")
    graph.metadata_props.add(key="graph", value="prop")
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 20)],
        producer_name="p",
        producer_version="1",
        domain="d",
        model_version=3,
        doc_string="model doc",
    )
    model.metadata_props.add(key="k", value="v")
    model.functions.add(name="f", domain="custom")
    model.training_info.add()
    return model


def test_serialize_model_writes_what_protobuf_writes():
    model = model_with_every_field()
    assert serialize_model(model) == model.SerializeToString()


@pytest.mark.parametrize("case", ["no graph", "empty graph", "only initializers"])
def test_serialize_model_edge_cases(case):
    model = onnx.ModelProto(ir_version=10)
    if case == "empty graph":
        model.graph.SetInParent()
    elif case == "only initializers":
        model.graph.initializer.append(numpy_helper.from_array(np.ones(300, np.float32), "w"))
    assert serialize_model(model) == model.SerializeToString()


def test_serialize_model_on_an_exported_artifact(exported):
    data = exported("block-small").model_path.read_bytes()
    model = onnx.ModelProto.FromString(data)
    assert serialize_model(model) == data == model.SerializeToString()


def artifact_files(model: onnx.ModelProto, **extra: bytes) -> dict[str, bytes]:
    data = model.SerializeToString()
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": "llama",
        "variant": "stages",
        "config": {},
        "extra_files": {n: sha256_bytes(d) for n, d in extra.items()},
        "graphs": [
            {
                "name": "model",
                "file": MODEL_FILE,
                # what tiny()'s graph declares: the loader holds the two to each other
                "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}],
                "weights": {},
                "sha256": sha256_bytes(data),
            }
        ],
    }
    return {MODEL_FILE: data, **extra, MANIFEST_FILE: json.dumps(manifest).encode()}


def tiny() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array([1.0, -2.0], np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    return model


def test_write_and_load_loads_once_and_returns_the_artifact_at_its_place(tmp_path, monkeypatch):
    calls = []
    real = artifact_read.load_artifact

    def counting(path, **kwargs):
        calls.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(artifact_read, "load_artifact", counting)
    out = tmp_path / "a"
    artifact = write_and_load(out, artifact_files(tiny(), **{"tokenizer.json": b"{}"}))
    assert len(calls) == 1 and calls[0].parent == tmp_path and calls[0] != out  # the temporary directory
    again = real(out)
    assert artifact.directory == again.directory == out
    assert artifact.manifest == again.manifest
    assert [(g.name, g.model_path, g.entry) for g in artifact.graphs] == [
        (g.name, g.model_path, g.entry) for g in again.graphs
    ]
    assert artifact.model_path == out / MODEL_FILE and artifact.model_path.is_file()


@pytest.mark.parametrize("damage", ["model hash", "extra file hash"])
def test_write_and_load_refuses_what_does_not_load_and_leaves_nothing(tmp_path, damage):
    files = artifact_files(tiny(), **{"tokenizer.json": b"{}"})
    manifest = json.loads(files[MANIFEST_FILE])
    if damage == "model hash":
        manifest["graphs"][0]["sha256"] = "0" * 64
    else:
        manifest["extra_files"]["tokenizer.json"] = "0" * 64
    files[MANIFEST_FILE] = json.dumps(manifest).encode()
    with pytest.raises(HashMismatchError, match=r"sha256 .* does not match the manifest's 000000000000"):
        write_and_load(tmp_path / "a", files)
    assert list(tmp_path.iterdir()) == []


def test_the_hash_is_checked_before_the_bytes_are_parsed(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\xff not protobuf")
    with pytest.raises(HashMismatchError, match=r"m\.onnx: sha256 .* does not match"):
        validate_onnx(path, sha256="0" * 64)
    with pytest.raises(CorruptModelError, match=r"m\.onnx: not a readable ONNX model"):
        validate_onnx(path, sha256=sha256_bytes(path.read_bytes()))


def tensor_with_text(where: str) -> onnx.ModelProto:
    """tiny() with the text "é é" in one text field of a tensor (an initializer or a Constant's value)."""
    model = tiny()
    text = "\u00e9\u00e9"
    if where == "initializer name":
        model.graph.initializer[0].name = text
        model.graph.node[0].input[1] = text
    elif where == "initializer doc_string":
        model.graph.initializer[0].doc_string = text
    elif where == "initializer metadata":
        model.graph.initializer[0].metadata_props.add(key="k", value=text)
    elif where == "constant tensor name":
        value = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), text)
        model.graph.node.insert(0, helper.make_node("Constant", [], ["c"], value=value))
    return model


@pytest.mark.parametrize(
    "where", ["initializer name", "initializer doc_string", "initializer metadata", "constant tensor name"]
)
def test_tensor_text_that_is_not_utf8_is_corrupt(tmp_path, where):
    model = tensor_with_text(where)
    (tmp_path / "ok.onnx").write_bytes(model.SerializeToString())
    validate_onnx(tmp_path / "ok.onnx")  # the well-formed file passes
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString().replace("\u00e9\u00e9".encode(), b"\x80\x80\x80\x80"))
    with pytest.raises(CorruptModelError, match=r"m\.onnx: not a readable ONNX model \(.*not UTF-8"):
        validate_onnx(path)
