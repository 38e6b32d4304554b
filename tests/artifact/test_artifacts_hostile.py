"""Hostile model files: every refusal is its own ModelFileError subclass, raised by the loader
before any runtime (onnxruntime, the reference evaluator) is handed the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from artifact import (
    ALLOWED_OPSETS,
    DEFAULT_MAX_MODEL_BYTES,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_MODEL_BYTES_ENV,
    MODEL_FILE,
    CorruptModelError,
    ExternalDataError,
    HashMismatchError,
    ModelTooLargeError,
    UnsupportedOpsetError,
    load_onnx,
    max_model_bytes,
    sha256_file,
    validate_onnx,
    write_artifact,
)
from artifact.errors import ConfigError, ModelFileError
from models.artifacts import open_artifact
from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION

NEWEST = onnx.defs.onnx_opset_version()
WEIGHT = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5  # hand-chosen, read back exactly


def tiny_model(opsets=(("", 20),), ir_version=10) -> onnx.ModelProto:
    """y = x + W (W an initializer): the smallest graph with a tensor that can live in external data."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(WEIGHT, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = ir_version
    return model


def with_external_weight(model: onnx.ModelProto, location: str, offset: int = 0, length: int | None = None):
    """Point W at external data `location` (nothing is written)."""
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    entries = {"location": location, "offset": str(offset), "length": str(WEIGHT.nbytes if length is None else length)}
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    return model


def save(model, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture
def artifact_dir(exported, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(exported("block-small").directory, target)
    return target


def rewrite_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    edit(manifest)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def rehash(directory: Path) -> None:
    digest = sha256_file(directory / MODEL_FILE)
    rewrite_manifest(directory, lambda m: m["graphs"][0].update(sha256=digest))


@pytest.fixture
def no_runtime(monkeypatch):
    """Fail the test if onnxruntime or the reference evaluator is constructed."""
    import onnxruntime
    from onnx import reference

    calls = []

    def refuse(name):
        def init(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} saw a file the loader should have refused")

        return init

    monkeypatch.setattr(onnxruntime.InferenceSession, "__init__", refuse("InferenceSession"))
    monkeypatch.setattr(reference.ReferenceEvaluator, "__init__", refuse("ReferenceEvaluator"))
    return calls


# --------------------------------------------------------------------------- corrupt and tampered files


def test_a_valid_tiny_model_loads(tmp_path):
    model = load_onnx(save(tiny_model(), tmp_path / "m.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), WEIGHT)


@pytest.mark.parametrize("data", [b"", b"\x08\x07", b"\xff" * 40], ids=["empty", "ir-only", "garbage"])
def test_bytes_that_are_not_a_model_are_corrupt(tmp_path, data, no_runtime):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(CorruptModelError, match=r"bad\.onnx: not a readable ONNX model"):
        open_artifact(path)
    assert no_runtime == []


def test_a_model_the_checker_rejects_is_corrupt(tmp_path):
    model = tiny_model()
    model.graph.node[0].input[1] = "nowhere"  # an input no node, initializer or graph input defines
    with pytest.raises(CorruptModelError, match=r"ONNX checker says: .*nowhere"):
        validate_onnx(save(model, tmp_path / "m.onnx"))


@pytest.mark.parametrize("change", [-4, 4], ids=["short", "long"])
def test_initializer_bytes_that_disagree_with_its_shape_are_corrupt(tmp_path, change, no_runtime):
    model = tiny_model()
    raw = model.graph.initializer[0].raw_data
    model.graph.initializer[0].raw_data = raw[:change] if change < 0 else raw + bytes(change)
    with pytest.raises(
        CorruptModelError, match=rf"'W' holds {WEIGHT.nbytes + change} bytes.*\[2, 3\].*need {WEIGHT.nbytes}"
    ):
        open_artifact(save(model, tmp_path / "m.onnx"))
    assert no_runtime == []


def test_large_initializers_are_checked_without_their_bytes(tmp_path, monkeypatch):
    # Over the threshold the checker sees a typed graph input instead of the data; a graph error is still found.
    monkeypatch.setattr("artifact.WEIGHTLESS_BYTES", 8)
    model = tiny_model()
    model.graph.node[0].input[0] = "nowhere"
    with pytest.raises(CorruptModelError, match=r"ONNX checker says: .*nowhere"):
        validate_onnx(save(model, tmp_path / "m.onnx"))
    loaded = validate_onnx(save(tiny_model(), tmp_path / "ok.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), WEIGHT)


def test_truncated_artifact_model_is_refused_by_the_loader(artifact_dir, no_runtime):
    data = (artifact_dir / MODEL_FILE).read_bytes()
    (artifact_dir / MODEL_FILE).write_bytes(data[: len(data) // 2])
    rehash(artifact_dir)  # the hash agrees: only the parse can tell
    with pytest.raises(CorruptModelError, match=r"model\.onnx: not a readable ONNX model"):
        open_artifact(artifact_dir)
    assert no_runtime == []


def test_hash_mismatch_is_its_own_error(artifact_dir, no_runtime):
    rewrite_manifest(artifact_dir, lambda m: m["graphs"][0].update(sha256="0" * 64))
    with pytest.raises(HashMismatchError, match=r"model\.onnx: sha256 .* does not match the manifest's 000000000000"):
        open_artifact(artifact_dir)
    assert no_runtime == []


def test_modified_extra_file_is_a_hash_mismatch(artifact_dir):
    (artifact_dir / "notes.txt").write_text("original")
    digest = sha256_file(artifact_dir / "notes.txt")
    rewrite_manifest(artifact_dir, lambda m: m.update(extra_files={"notes.txt": digest}))
    open_artifact(artifact_dir)
    (artifact_dir / "notes.txt").write_text("tampered")
    with pytest.raises(HashMismatchError, match=r"notes\.txt: sha256"):
        open_artifact(artifact_dir)


def test_model_file_symlinked_outside_the_artifact_is_refused(artifact_dir, tmp_path):
    outside = tmp_path / "elsewhere.onnx"
    shutil.move(artifact_dir / MODEL_FILE, outside)
    os.symlink(outside, artifact_dir / MODEL_FILE)  # same bytes, same hash: only the location is wrong
    with pytest.raises(ExternalDataError, match=r"model\.onnx: resolves to .*elsewhere\.onnx, outside"):
        open_artifact(artifact_dir)


# --------------------------------------------------------------------------- external data


def test_external_data_inside_the_directory_loads(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + WEIGHT.tobytes())
    path = save(with_external_weight(tiny_model(), "w.bin", offset=8), tmp_path / "m.onnx")
    model = load_onnx(path)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), WEIGHT)


EXTERNAL = {
    "dot-dot": ("../secret.bin", r"climbs out with '\.\.'"),
    "dot-dot inside": ("sub/../../secret.bin", r"climbs out with '\.\.'"),
    "absolute": ("/etc/passwd", r"is an absolute path"),
    "windows absolute": ("C:\\secret.bin", r"is an absolute path"),
    "backslash root": ("\\secret.bin", r"is an absolute path"),
    "symlink outside": ("link.bin", r"resolves to .*secret\.bin, outside"),
    "missing": ("absent.bin", r"no such file next to the model"),
    "past the end": ("w.bin", r"bytes \[16, 40\) lie outside the 24-byte file"),
    "empty": ("", r"empty or invalid"),
}


@pytest.mark.parametrize("case", EXTERNAL)
def test_external_data_outside_the_model_directory_is_refused(tmp_path, case):
    location, pattern = EXTERNAL[case]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (tmp_path / "secret.bin").write_bytes(WEIGHT.tobytes())  # a readable file one level up
    (model_dir / "w.bin").write_bytes(WEIGHT.tobytes())
    os.symlink(tmp_path / "secret.bin", model_dir / "link.bin")
    offset = 16 if case == "past the end" else 0
    path = save(with_external_weight(tiny_model(), location, offset=offset), model_dir / "m.onnx")
    with pytest.raises(ExternalDataError, match=rf"m\.onnx: tensor 'W' external data location .*{pattern}"):
        load_onnx(path)


def test_artifact_with_escaping_external_data_is_refused_before_any_runtime(artifact_dir, tmp_path, no_runtime):
    proto = onnx.load(str(artifact_dir / MODEL_FILE))
    tensor = max(proto.graph.initializer, key=lambda t: len(t.raw_data))
    (tmp_path / "stolen.bin").write_bytes(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../stolen.bin")
    (artifact_dir / MODEL_FILE).write_bytes(proto.SerializeToString())
    rehash(artifact_dir)
    with pytest.raises(ExternalDataError, match=r"climbs out"):
        open_artifact(artifact_dir)
    assert no_runtime == []


# --------------------------------------------------------------------------- opsets and IR versions


@pytest.mark.parametrize(
    "opsets",
    [
        (("", 20),),
        (("", NEWEST), (CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)),
        (("", 23), ("com.microsoft", 1)),
    ],
    ids=["exported", "newest+custom", "standard+ort"],
)
def test_known_opsets_are_accepted(tmp_path, opsets):
    validate_onnx(save(tiny_model(opsets), tmp_path / "m.onnx"))


OPSETS = {
    "default newer than onnx": ((("", NEWEST + 1),), rf"the default domain version {NEWEST + 1}.*1\.\.{NEWEST}"),
    "default version 0": ((("", 0),), r"the default domain version 0"),
    "custom domain v2": (
        (("", 20), (CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION + 1)),
        rf"{CUSTOM_DOMAIN} version {CUSTOM_DOMAIN_VERSION + 1}; this toolkit reads versions "
        rf"1\.\.{CUSTOM_DOMAIN_VERSION}",
    ),
    "com.microsoft v2": ((("", 20), ("com.microsoft", 2)), r"com\.microsoft version 2"),
    "unknown domain": ((("", 20), ("evil.ops", 1)), r"operator domain 'evil\.ops' \(version 1\).*does not know"),
}


@pytest.mark.parametrize("case", OPSETS)
def test_unknown_opsets_are_refused(tmp_path, case):
    opsets, pattern = OPSETS[case]
    with pytest.raises(UnsupportedOpsetError, match=r"m\.onnx: model imports " + pattern):
        validate_onnx(save(tiny_model(opsets), tmp_path / "m.onnx"))


def test_a_function_importing_an_unknown_domain_is_refused(tmp_path):
    model = tiny_model((("", 20), (CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)))
    model.functions.append(
        helper.make_function(
            CUSTOM_DOMAIN,
            "F",
            ["a"],
            ["b"],
            [helper.make_node("Identity", ["a"], ["b"])],
            [helper.make_opsetid("", 20), helper.make_opsetid("other", 3)],
        )
    )
    with pytest.raises(UnsupportedOpsetError, match=rf"function {CUSTOM_DOMAIN}::F imports operator domain 'other'"):
        validate_onnx(save(model, tmp_path / "m.onnx"))


def test_newer_ir_version_is_refused(tmp_path):
    with pytest.raises(UnsupportedOpsetError, match=rf"IR version {onnx.IR_VERSION + 1} is newer"):
        validate_onnx(save(tiny_model(ir_version=onnx.IR_VERSION + 1), tmp_path / "m.onnx"))


def test_allow_list_covers_what_the_exporters_and_lowerings_emit():
    from exporters.functions import OPSET

    assert ALLOWED_OPSETS[""] == NEWEST >= max(OPSET, 23)
    assert ALLOWED_OPSETS[CUSTOM_DOMAIN] == CUSTOM_DOMAIN_VERSION
    assert ALLOWED_OPSETS["com.microsoft"] == 1


# --------------------------------------------------------------------------- size limit


def test_size_limit_from_keyword(tmp_path):
    path = save(tiny_model(), tmp_path / "m.onnx")
    size = path.stat().st_size
    validate_onnx(path, max_bytes=size)
    with pytest.raises(ModelTooLargeError, match=rf"m\.onnx: model is {size:,} bytes, above the limit of {size - 1:,}"):
        validate_onnx(path, max_bytes=size - 1)


def test_size_limit_from_environment(tmp_path, monkeypatch, artifact_dir):
    # The default is this machine's memory (never below 4 GiB), from sysconf, not from this code.
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert max_model_bytes() == max(memory, DEFAULT_MAX_MODEL_BYTES) and DEFAULT_MAX_MODEL_BYTES == 4 * 1024**3
    monkeypatch.setenv(MAX_MODEL_BYTES_ENV, "100")
    with pytest.raises(ModelTooLargeError, match=rf"above the limit of 100; raise it with \${MAX_MODEL_BYTES_ENV}"):
        open_artifact(artifact_dir)
    open_artifact(artifact_dir, max_bytes=10**9)  # the keyword wins over the environment


def test_external_data_counts_towards_the_size_limit(tmp_path):
    (tmp_path / "w.bin").write_bytes(WEIGHT.tobytes() + b"\0" * 1000)
    path = save(with_external_weight(tiny_model(), "w.bin"), tmp_path / "m.onnx")
    total = path.stat().st_size + WEIGHT.nbytes + 1000
    validate_onnx(path, max_bytes=total)
    with pytest.raises(ModelTooLargeError, match=rf"model with its external data is {total:,} bytes"):
        validate_onnx(path, max_bytes=total - 1)


@pytest.mark.parametrize("value", ["lots", "-5", "0", "1.5"])
def test_invalid_size_limit_in_the_environment(monkeypatch, value):
    monkeypatch.setenv(MAX_MODEL_BYTES_ENV, value)
    with pytest.raises(ConfigError, match=rf"\${MAX_MODEL_BYTES_ENV}=.*positive number of bytes"):
        max_model_bytes()


# --------------------------------------------------------------------------- manifest schema


MANIFESTS = {
    "graph file climbs out": (lambda m: m["graphs"][0].update(file="../model.onnx"), r"must be a plain file name"),
    "graph file not a string": (lambda m: m["graphs"][0].update(file=["model.onnx"]), r"must be a plain file name"),
    "graph name not a string": (lambda m: m["graphs"][0].update(name=3), r"graph 'name' must be a non-empty string"),
    "input dtype unknown": (
        lambda m: m["graphs"][0]["inputs"][0].update(dtype="complex64"),
        r"dtype 'complex64' is not one of",
    ),
    "input shape negative": (lambda m: m["graphs"][0]["inputs"][0].update(shape=[-1]), r"shape must be a list"),
    "outputs not a list": (lambda m: m["graphs"][0].update(outputs={"a": 1}), r"'outputs' must be a list"),
    "extra file climbs out": (lambda m: m.update(extra_files={"../x": "0" * 64}), r"'extra_files' must map plain"),
    "family not a string": (lambda m: m.update(family=["llama"]), r"'family' must be a str"),
    "unknown family": (lambda m: m.update(family="mamba"), r"config is invalid.*unknown model family 'mamba'"),
    "config field unknown": (lambda m: m["config"].update(depth=3), r"config is invalid.*unknown field 'depth'"),
    "format_version true": (lambda m: m.update(format_version=True), r"format_version True is not supported"),
    "stages not a list": (lambda m: m["graphs"][0].update(stages=3), r"'stages' must be a list of names, got 3"),
    "slice not a triple": (
        lambda m: next(iter(m["graphs"][0]["weights"].values())).update(slice=5),
        r"'slice' must be \[axis, start, stop\], got 5",
    ),
    "output shape not a list": (
        lambda m: m["graphs"][0]["outputs"][0].update(shape=5),
        r"output .* shape must be a list of sizes and axis names, got 5",
    ),
    "quantization not an object": (
        lambda m: m.update(quantization="int4"),
        r"manifest 'quantization' must be a dict or absent, got 'int4'",
    ),
    "dtype unknown": (lambda m: m.update(dtype="complex64"), r"manifest 'dtype' 'complex64' is not one of"),
}


@pytest.mark.parametrize("case", MANIFESTS)
def test_malformed_manifest_fields_are_model_file_errors(artifact_dir, case):
    edit, pattern = MANIFESTS[case]
    rewrite_manifest(artifact_dir, edit)
    with pytest.raises(ModelFileError, match=pattern):
        open_artifact(artifact_dir)


def test_deeply_nested_manifest_is_not_a_recursion_crash(artifact_dir):
    (artifact_dir / MANIFEST_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelFileError, match=r"invalid JSON \(nested 100,000 levels deep, above the 64 allowed\)"):
        open_artifact(artifact_dir)


def test_oversized_manifest_is_not_read(artifact_dir):
    with open(artifact_dir / MANIFEST_FILE, "ab") as handle:
        handle.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ModelFileError, match=r"manifest\.json: 16,777,217 bytes, above the 16,777,216"):
        open_artifact(artifact_dir)


# --------------------------------------------------------------------------- leftovers of a killed writer


def test_leftover_temp_dirs_are_cleared_by_the_next_write(tmp_path):
    out = tmp_path / "a"
    write_artifact(out, {MANIFEST_FILE: b"{}", MODEL_FILE: b"old"})
    for name in (".a.tmp-dead1", ".a.old-dead2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / MODEL_FILE).write_bytes(b"stale")
    write_artifact(out, {MANIFEST_FILE: b"{}", MODEL_FILE: b"new"})
    assert (out / MODEL_FILE).read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_artifact_moved_aside_by_a_killed_fallback_swap_is_restored(tmp_path):
    # Without an atomic exchange the swap is two renames; a kill between them leaves only `.a.old-*`.
    (tmp_path / ".a.old-dead").mkdir()
    (tmp_path / ".a.old-dead" / MANIFEST_FILE).write_bytes(b"{}")
    (tmp_path / ".a.old-dead" / MODEL_FILE).write_bytes(b"previous")

    def verify(tmp):
        assert (tmp_path / "a" / MODEL_FILE).read_bytes() == b"previous"  # restored before the new write lands
        raise ModelFileError("new files rejected")

    with pytest.raises(ModelFileError, match="new files rejected"):
        write_artifact(tmp_path / "a", {MODEL_FILE: b"new"}, verify=verify)
    assert (tmp_path / "a" / MODEL_FILE).read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_write_refuses_file_names_that_leave_the_directory(tmp_path):
    with pytest.raises(ModelFileError, match=r"'\.\./escape' must be a plain file name"):
        write_artifact(tmp_path / "a", {MODEL_FILE: b"m", "../escape": b"x"})
    assert list(tmp_path.iterdir()) == []


def test_text_fields_that_are_not_utf8_are_corrupt(tmp_path, no_runtime):
    model = tiny_model()
    model.metadata_props.add(key="note", value="\u00e9\u00e9")  # UTF-8: c3 a9 c3 a9
    data = model.SerializeToString().replace("\u00e9\u00e9".encode(), b"\x80\x80\x80\x80")
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    with pytest.raises(CorruptModelError, match=r"m\.onnx: not a readable ONNX model \(.*not UTF-8"):
        open_artifact(path)
    assert no_runtime == []


def test_default_limit_is_the_machine_memory_and_says_so(tmp_path, monkeypatch):
    import artifact.read as read

    path = save(tiny_model(), tmp_path / "m.onnx")
    monkeypatch.delenv(MAX_MODEL_BYTES_ENV, raising=False)
    monkeypatch.setattr(read, "DEFAULT_MAX_MODEL_BYTES", 10)
    monkeypatch.setattr(read, "machine_memory", lambda: path.stat().st_size - 1)
    with pytest.raises(ModelTooLargeError, match=r"above the limit of [\d,]+ \(this machine's memory, 0\.0 GiB\)"):
        validate_onnx(path)
