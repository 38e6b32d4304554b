"""Fuzzing model loading: load_artifact on artifact directories whose manifest is drawn (field values
replaced, removed, retyped; text damaged) and on ONNX files whose bytes are mutated. Whatever the
input, the outcome is a loaded artifact or a ToolkitError; nothing else escapes. 2,000 cases per
parser, counts printed. The graph is a hand-made tiny model so each case costs milliseconds."""

from __future__ import annotations

import json

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from artifact import FORMAT, FORMAT_VERSION, MANIFEST_FILE, MODEL_FILE, sha256_bytes
from artifact.errors import ToolkitError
from models.artifacts import artifact_config, open_artifact
from models.presets import get_preset

pytestmark = pytest.mark.slow


CASES = 2000
SETTINGS = settings(
    max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
INTERESTING = [0, 1, 8, 127, 128, 255, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]


def tiny_model_bytes(manifest: dict) -> bytes:
    import numpy as np

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.arange(4, dtype=np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    model.metadata_props.add(key="onnx_toolkit.manifest", value=json.dumps(manifest))
    return model.SerializeToString()


def base_manifest() -> dict:
    preset = get_preset("block-small")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": preset.family,
        "variant": "stages",
        "config": preset.config.to_dict(),
        "extra_files": {},
        "graphs": [
            {
                "name": "model",
                "file": MODEL_FILE,
                "sha256": None,
                "weights": {},
                "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
                "outputs": [{"name": "y"}],
            }
        ],
    }


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(
        [
            "model.onnx",
            "../model.onnx",
            "/etc/passwd",
            "float32",
            "int64",
            "complex64",
            "batch",
            "",
            "0" * 64,
            "a" * 64,
            "llama",
            "block",
            "gpt",
        ]
    ),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["name", "dtype", "shape", "file", "x", ""]) | st.text(max_size=4), inner, max_size=3
        )
    ),
    max_leaves=8,
)


def paths_in(value, prefix=()):
    """Every (path, container) position inside a JSON value, for drawing where to mutate."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_in(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_in(item, prefix + (i,))


@st.composite
def manifests(draw, model_sha: str) -> str:
    manifest = base_manifest()
    manifest["graphs"][0]["sha256"] = model_sha
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(list(paths_in(manifest))[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(JSON_VALUES)
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    text = json.dumps(manifest)
    damage = draw(st.integers(0, 11))
    if damage == 0:
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == 1:
        text = "[" * 3000 + "]" * 3000
    return text


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "byte", "varint", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "varint":  # protobuf lengths and versions are varints
            value = draw(st.sampled_from(INTERESTING))
            out = bytearray()
            while True:
                out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
                value >>= 7
                if not value:
                    break
            data[at : at + len(out)] = out
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 12))]
    return bytes(data)


def outcome(call) -> str:
    try:
        call()
    except ToolkitError as exc:
        assert str(exc) and "\n" not in str(exc), repr(exc)
        return "refused"
    return "loaded"


def test_fuzz_manifest_loading(tmp_path, fuzz_summary):
    directory = tmp_path / "artifact"
    directory.mkdir()
    model = tiny_model_bytes(base_manifest())
    (directory / MODEL_FILE).write_bytes(model)
    counts = {"cases": 0, "loaded": 0, "refused": 0}

    @SETTINGS
    @given(manifests(sha256_bytes(model)))
    def run(text):
        counts["cases"] += 1
        (directory / MANIFEST_FILE).write_text(text)
        counts[outcome(lambda: artifact_config(open_artifact(directory)))] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of artifact manifest loading "
        f"({counts['loaded']} loaded, {counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES and counts["loaded"] > 0


def test_fuzz_onnx_loading(tmp_path, fuzz_summary):
    path = tmp_path / "model.onnx"
    manifest = base_manifest()
    del manifest["graphs"][0]["sha256"]
    valid = tiny_model_bytes(manifest)
    path.write_bytes(valid)
    assert open_artifact(path).graph().name == "model"  # the seed itself loads
    counts = {"cases": 0, "loaded": 0, "refused": 0}

    @SETTINGS
    @given(mutated(valid))
    def run(data):
        counts["cases"] += 1
        path.write_bytes(data)
        counts[outcome(lambda: open_artifact(path))] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of artifact ONNX loading "
        f"({counts['loaded']} loaded, {counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES
    assert onnx.load_from_string(valid).graph.name == "tiny"
