"""Writing and re-reading artifacts without redundant passes: serialize_model assembles the bytes
protobuf would write (protobuf's own SerializeToString is the oracle), write_and_load checks the
written files once (every load_artifact check, on the temporary directory) and returns them at the
final path, and validate_onnx checks the manifest hash on the bytes it parses, before parsing them.
"""

from __future__ import annotations

import copy
import hashlib
import io
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
from artifact.protobuf import WEIGHTLESS_BYTES, Malformed, read_skeleton


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


# ------------------------------------------------------------------------------ reading a graph without its weights


def skeleton_of(data: bytes, threshold: int) -> tuple[onnx.ModelProto, dict[int, int], str]:
    digest = hashlib.sha256()
    skeleton, left_out = read_skeleton(io.BytesIO(data), len(data), digest, threshold)
    return onnx.ModelProto.FromString(skeleton), left_out, digest.hexdigest()


def without_raw_over(model: onnx.ModelProto, threshold: int) -> onnx.ModelProto:
    """The oracle: protobuf's own message with every initializer's raw_data over `threshold` bytes cleared."""
    model = copy.deepcopy(model)
    for tensor in model.graph.initializer:
        if len(tensor.raw_data) > threshold:
            tensor.ClearField("raw_data")
    return model


@pytest.mark.parametrize("threshold", [0, 100, 1000, 30000, 1 << 20])
def test_read_skeleton_leaves_out_exactly_the_raw_data_over_the_threshold(threshold):
    """Every field on both sides of the graph and the initializers (raw_data of 12 bytes to 280 kB, float_data, an
    empty tensor): the skeleton is protobuf's own message less those raw_data, left_out their lengths by index,
    and the digest is the whole file's."""
    model = model_with_every_field()
    data = model.SerializeToString()
    skeleton, left_out, digest = skeleton_of(data, threshold)
    assert skeleton == without_raw_over(model, threshold)
    want = {i: len(t.raw_data) for i, t in enumerate(model.graph.initializer) if len(t.raw_data) > threshold}
    assert left_out == want and (threshold > 1 << 19 or want)
    assert digest == sha256_bytes(data)


def test_read_skeleton_counts_initializers_across_a_graph_split_in_two():
    """protobuf merges a message field that occurs twice (two serialised models, concatenated, parse as one whose
    graph has both initializer lists): the indices of what is left out follow the merged list."""
    first, second = tiny(), model_with_every_field()
    data = first.SerializeToString() + second.SerializeToString()
    merged = onnx.ModelProto.FromString(data)
    skeleton, left_out, _ = skeleton_of(data, 1000)
    assert skeleton == without_raw_over(merged, 1000)
    assert left_out == {i: len(t.raw_data) for i, t in enumerate(merged.graph.initializer) if len(t.raw_data) > 1000}


def test_read_skeleton_keeps_a_group_as_protobuf_does():
    """An unknown field of wire type 3 (a group, up to its end tag) is an unknown field to protobuf, not an error."""
    model = tiny()
    group = bytes([(15 << 3) | 3, 8, 1, (15 << 3) | 4])  # field 15 (unused): start group, field 1 = 1, end group
    data = model.SerializeToString() + group
    skeleton, _, _ = skeleton_of(data, 0)
    want = without_raw_over(onnx.ModelProto.FromString(data), 0)
    assert skeleton.SerializeToString() == want.SerializeToString() and skeleton.SerializeToString().endswith(group)


def test_validate_onnx_without_weights_refuses_what_a_full_parse_refuses(tmp_path):
    """Differential, with protobuf's parser as the oracle: the file truncated at every length and with bytes
    flipped at random, validate_onnx reading the graph without its weights accepts exactly what it accepts when
    it parses everything, and returns the same model less the raw_data left out."""
    rng = np.random.default_rng(1)
    sizes = (3, 40, 5000, 70000)  # the last over WEIGHTLESS_BYTES
    inits = [numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"w{i}") for i, n in enumerate(sizes)]
    graph = helper.make_graph(
        [helper.make_node("Add", [f"x{i}", f"w{i}"], [f"y{i}"], name=f"add{i}") for i in range(len(sizes))],
        "checkable",
        [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [n]) for i, n in enumerate(sizes)],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [n]) for i, n in enumerate(sizes)],
        inits,
        doc_string="graph doc",
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], producer_name="p", doc_string="d")
    model.ir_version = 10
    model.metadata_props.add(key="k", value="v")
    data = model.SerializeToString()
    rng = np.random.default_rng(0)
    cases = [data[:n] for n in sorted({*range(0, 200), *rng.integers(0, len(data), 300).tolist()})]
    for _ in range(600):
        damaged = bytearray(data)
        for at in rng.integers(0, len(data), rng.integers(1, 4)):
            damaged[at] ^= int(rng.integers(1, 256))
        cases.append(bytes(damaged))
    path, accepted = tmp_path / "m.onnx", 0
    for case in [data, *cases]:
        path.write_bytes(case)
        outcomes = []
        for weights in (True, False):
            try:
                outcomes.append(validate_onnx(path, weights=weights))
            except CorruptModelError as exc:
                outcomes.append(type(exc))
        full, skeleton = outcomes
        if isinstance(full, onnx.ModelProto):
            accepted += 1
            assert skeleton == without_raw_over(full, WEIGHTLESS_BYTES), case
        else:
            assert skeleton is full, case
    assert accepted > 100  # flips inside the weights' bytes leave a readable model


def test_validate_onnx_without_weights_checks_the_hash_of_every_byte(tmp_path):
    """The skipped weight bytes are hashed too: a flip inside them is a hash mismatch, and a broken file whose
    hash is not the manifest's reports the hash first, as a full read does."""
    data = model_with_every_field().SerializeToString()
    path = tmp_path / "m.onnx"
    flipped = bytearray(data)
    flipped[data.index(model_with_every_field().graph.initializer[3].raw_data) + 1000] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(HashMismatchError, match=r"m\.onnx: sha256 .* does not match"):
        validate_onnx(path, sha256=sha256_bytes(data), weights=False)
    path.write_bytes(data[:-7])
    with pytest.raises(HashMismatchError, match=r"m\.onnx: sha256 .* does not match"):
        validate_onnx(path, sha256=sha256_bytes(data), weights=False)
    with pytest.raises(CorruptModelError, match=r"m\.onnx: not a readable ONNX model \(Malformed: .*past"):
        validate_onnx(path, sha256=sha256_bytes(data[:-7]), weights=False)


def test_read_skeleton_refuses_broken_framing():
    model = model_with_every_field()
    data = model.SerializeToString()
    for broken in (data[:-1], data + b"\x0a\x05ab", data + b"\x0f", data + b"\xff" * 11):
        with pytest.raises(Malformed):
            read_skeleton(io.BytesIO(broken), len(broken), hashlib.sha256())
