"""Export: custom-domain nodes and functions, graph interface, manifest, atomic artifact writes.

Real exports come from the session-scoped `exported` fixture. Failure-path tests
that need export_model to run past tracing use a canned trace: the (function-less)
graph of an earlier real export of the same preset, so no second torch trace is paid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import artifact as artifacts
import artifact.read as artifact_read
import artifact.write as artifact_write
import exporters.onnx_export as onnx_export
from artifact import METADATA_KEY
from artifact.errors import ConfigError, ExportError, ModelFileError
from exporters.onnx_export import export_model, output_names
from models.artifacts import artifact_config, open_artifact
from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from models.presets import get_preset
from models.registry import get_family
from runners.registry import create_runner
from toolkit.check.crosscheck import cross_check

PRE_NORM = [
    "attention_norm",
    "attention_weights",
    "attention_branch",
    "after_attention",
    "feed_forward_norm",
    "feed_forward_branch",
    "output",
]
PRESETS = ["block-small", "decoder-small"]


def graph_entry(manifest: dict) -> dict:
    """The single graph's manifest entry (per-graph schema), or the manifest itself (flat schema)."""
    return manifest["graphs"][0] if "graphs" in manifest else manifest


def manifest_sha(manifest: dict) -> str:
    entry = graph_entry(manifest)
    return entry["sha256"] if "sha256" in entry else entry["model_sha256"]


def expected_stages(preset_name: str) -> list[str]:
    """Stage names written out from the architecture description, not from the code under test."""
    spec = get_preset(preset_name)
    layers = getattr(spec.config, "layers", 1)
    blocks = [f"block.{i}.{s}" for i in range(layers) for s in PRE_NORM]
    if spec.family == "llama":
        return ["embed_tokens", *blocks, "final_norm", "logits"]
    return [*blocks, "logits"]


def load_proto(artifact) -> onnx.ModelProto:
    return onnx.load(str(artifact.model_path))


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# --------------------------------------------------------------------------- graph structure


@pytest.mark.parametrize(
    "preset,variant", [("block-small", "stages"), ("decoder-small", "stages"), ("decoder-small", "serving")]
)
def test_custom_ops_are_single_nodes_with_expected_counts(exported, preset, variant):
    proto = load_proto(exported(preset, variant))
    config = get_preset(preset).config
    layers = getattr(config, "layers", 1)
    custom = Counter(n.op_type for n in proto.graph.node if n.domain == CUSTOM_DOMAIN)
    # two RMSNorms and one SwiGLU per block, plus the final norm of the stacked decoder
    final_norm = 1 if get_preset(preset).family == "llama" else 0
    assert custom == {"RMSNorm": 2 * layers + final_norm, "SwiGLU": layers}
    other_domains = {n.domain for n in proto.graph.node} - {"", CUSTOM_DOMAIN}
    assert other_domains == set()
    # Lowered pieces of the custom ops must not be left in the main graph: no Sigmoid (SwiGLU's
    # silu) and no ReduceMean / Sqrt (RMSNorm's statistics) outside the functions.
    assert not {"Sigmoid", "ReduceMean", "Sqrt"} & {n.op_type for n in proto.graph.node if n.domain == ""}


@pytest.mark.parametrize("preset", PRESETS)
def test_rms_norm_nodes_carry_the_config_epsilon(exported, preset):
    proto = load_proto(exported(preset))
    eps = get_preset(preset).config.eps
    for node in proto.graph.node:
        if node.op_type == "RMSNorm":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["epsilon"] == pytest.approx(eps, rel=1e-6)


@pytest.mark.parametrize("preset", PRESETS)
def test_functions_and_opset_imports(exported, preset):
    proto = load_proto(exported(preset))
    opsets = {o.domain: o.version for o in proto.opset_import}
    assert opsets.get(CUSTOM_DOMAIN) == CUSTOM_DOMAIN_VERSION
    default = opsets[""]
    functions = Counter((f.domain, f.name) for f in proto.functions)
    assert functions == {(CUSTOM_DOMAIN, "RMSNorm"): 1, (CUSTOM_DOMAIN, "SwiGLU"): 1}
    for function in proto.functions:
        imports = {o.domain: o.version for o in function.opset_import}
        assert imports.get("") == default, f"{function.name} body imports opset {imports}, model uses {default}"
        assert len(function.node) > 0


@pytest.mark.parametrize("preset,variant", [("block-small", "stages"), ("decoder-small", "serving")])
def test_file_passes_the_full_onnx_checker(exported, preset, variant):
    onnx.checker.check_model(str(exported(preset, variant).model_path), full_check=True)


@pytest.mark.parametrize("preset", PRESETS)
def test_stage_outputs_are_named_like_eager_stages(exported, preset):
    proto = load_proto(exported(preset))
    names = [o.name for o in proto.graph.output]
    assert names == expected_stages(preset)
    spec = get_preset(preset)
    # ... and exactly like the dictionary the eager model returns, in its computation order.
    sample = get_family(spec.family).random_inputs(spec.config, 1, 2, np.random.default_rng(0))
    args = [
        torch.from_numpy(np.asarray(v)).to(torch.float32 if np.asarray(v).dtype.kind == "f" else torch.int64)
        for v in sample.values()
    ]
    with torch.no_grad():
        eager = spec.build()(*args)
    assert names == list(eager)
    assert output_names(spec.family, spec.config, "stages") == tuple(names)


def test_serving_variant_of_a_block_outputs_only_logits(exported):
    proto = load_proto(exported("block-small", "serving"))
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert [i.name for i in proto.graph.input] == ["hidden_states"]


def test_serving_variant_of_a_language_model_is_the_kv_cache_graph(exported):
    config = get_preset("decoder-small").config
    proto = load_proto(exported("decoder-small", "serving"))
    cache = [f"{io}.{i}.{kind}" for i in range(config.layers) for kind in ("key", "value") for io in ("x",)]
    assert [o.name for o in proto.graph.output] == ["logits"] + [c.replace("x.", "present.") for c in cache]
    assert [i.name for i in proto.graph.input] == (
        ["input_ids", "position_ids", "past_mask"] + [c.replace("x.", "past.") for c in cache]
    )
    logits = proto.graph.output[0].type.tensor_type
    assert logits.elem_type == onnx.TensorProto.FLOAT
    assert logits.shape.dim[-1].dim_value == config.vocab_size
    mask = proto.graph.input[2].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in mask] == ["batch", "past_sequence"]
    past = proto.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past] == ["batch", config.kv_heads, "past_sequence", config.head_width]


def test_unknown_variant_is_refused(exported):
    spec = get_preset("block-small")
    with pytest.raises(ExportError, match="variant 'debug'"):
        output_names(spec.family, spec.config, "debug")


@pytest.mark.parametrize(
    "preset,elem,fixed", [("block-small", onnx.TensorProto.FLOAT, [12]), ("decoder-small", onnx.TensorProto.INT64, [])]
)
def test_inputs_have_dynamic_batch_and_sequence(exported, preset, elem, fixed):
    proto = load_proto(exported(preset))
    (graph_input,) = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    tensor = graph_input.type.tensor_type
    assert tensor.elem_type == elem
    dims = list(tensor.shape.dim)
    assert len(dims) == 2 + len(fixed)
    batch, sequence = dims[0], dims[1]
    for dim in (batch, sequence):
        assert dim.dim_param and not dim.HasField("dim_value"), f"axis is not symbolic: {dim}"
    assert batch.dim_param != sequence.dim_param
    assert [d.dim_value for d in dims[2:]] == fixed


# --------------------------------------------------------------------------- manifest


@pytest.mark.parametrize("preset", PRESETS)
def test_manifest_describes_the_file(exported, preset):
    artifact = exported(preset)
    manifest, spec = artifact.manifest.to_dict(), get_preset(preset)
    entry = graph_entry(manifest)
    proto = load_proto(artifact)
    assert manifest["format"] == artifacts.FORMAT and manifest["format_version"] == artifacts.FORMAT_VERSION
    assert manifest["family"] == spec.family and manifest["preset"] == preset and manifest["variant"] == "stages"
    assert manifest["seed"] == spec.seed
    assert get_family(spec.family).config_from_dict(manifest["config"]) == spec.config
    assert manifest["opset"] == {o.domain: o.version for o in proto.opset_import}[""]
    assert manifest["custom_domains"] == {CUSTOM_DOMAIN: CUSTOM_DOMAIN_VERSION}
    assert sorted(manifest["custom_ops"]) == ["RMSNorm", "SwiGLU"]
    # interface
    graph_inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    assert [s["name"] for s in entry["inputs"]] == [i.name for i in graph_inputs]
    assert entry["inputs"][0]["dtype"] == ("float32" if spec.family == "block" else "int64")
    assert [type(d) for d in entry["inputs"][0]["shape"][:2]] == [str, str]
    assert [o["name"] for o in entry["outputs"]] == [o.name for o in proto.graph.output]
    assert {o["dtype"] for o in entry["outputs"]} == {"float32"}
    assert entry["stages"] == expected_stages(preset)
    # integrity and provenance
    assert manifest_sha(manifest) == hashlib.sha256(artifact.model_path.read_bytes()).hexdigest()
    versions = manifest["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["onnx"] == onnx.__version__
    assert versions["onnxruntime"] == onnxruntime.__version__


def test_manifest_on_disk_equals_loaded_manifest(exported):
    artifact = exported("block-small")
    assert json.loads((artifact.directory / artifacts.MANIFEST_FILE).read_text()) == artifact.manifest.to_dict()


def _without_hashes(value):
    if isinstance(value, dict):
        return {k: _without_hashes(v) for k, v in value.items() if k not in {"model_sha256", "sha256", "graph"}}
    if isinstance(value, list):
        return [_without_hashes(v) for v in value]
    return value


@pytest.mark.parametrize("preset", PRESETS)
def test_manifest_is_embedded_in_metadata(exported, preset):
    artifact = exported(preset)
    props = {p.key: p.value for p in load_proto(artifact).metadata_props}
    assert METADATA_KEY in props
    embedded = json.loads(props[METADATA_KEY])
    # The embedded copy cannot contain the file's own hash; everything else is the same.
    assert _without_hashes(embedded) == _without_hashes(artifact.manifest.to_dict())


def test_lone_onnx_file_is_self_describing(exported, tmp_path):
    artifact = exported("block-small")
    lone = tmp_path / "elsewhere.onnx"
    shutil.copyfile(artifact.model_path, lone)
    loaded = open_artifact(lone)
    assert loaded.directory is None
    assert loaded.family == "block" and artifact_config(loaded) == get_preset("block-small").config
    assert loaded.output_names == artifact.output_names
    assert loaded.input_specs == artifact.input_specs
    # It runs, and the eager oracle can be rebuilt from the lone file's initializers.
    report = cross_check(loaded, ("ort-cpu",), batch=1, sequence=2)
    assert report.passed
    assert create_runner("ort-cpu", loaded).device == "CPUExecutionProvider"


# --------------------------------------------------------------------------- atomic writes


@pytest.fixture
def canned_trace(exported, monkeypatch):
    """Make export_model's trace step return block-small's already-traced graph (no torch export)."""
    traced = load_proto(exported("block-small"))
    del traced.functions[:]
    del traced.metadata_props[:]

    def fake_trace(*args, **kwargs):
        proto = onnx.ModelProto()
        proto.CopyFrom(traced)
        return proto

    monkeypatch.setattr(onnx_export, "_trace", fake_trace)
    spec = get_preset("block-small")
    return lambda out, **kw: export_model(
        spec.build(), spec.family, spec.config, out, preset=spec.name, seed=spec.seed, **kw
    )


@pytest.fixture
def good_artifact(exported, tmp_path):
    """A copy of a real artifact, to be overwritten by a failing export."""
    target = tmp_path / "artifact"
    shutil.copytree(exported("block-small").directory, target)
    return target


def test_canned_reexport_replaces_an_artifact_cleanly(canned_trace, good_artifact):
    (good_artifact / "stale.txt").write_text("from an older export")
    artifact = canned_trace(good_artifact)
    assert sorted(p.name for p in good_artifact.iterdir()) == [artifacts.MANIFEST_FILE, artifacts.MODEL_FILE]
    assert (
        manifest_sha(artifact.manifest.to_dict())
        == hashlib.sha256((good_artifact / artifacts.MODEL_FILE).read_bytes()).hexdigest()
    )
    assert leftovers(good_artifact.parent, good_artifact.name) == []
    assert open_artifact(good_artifact).family == "block"


def _assert_untouched(directory: Path, before: dict[str, bytes]) -> None:
    assert snapshot(directory) == before
    assert open_artifact(directory).family == "block"
    assert leftovers(directory.parent, directory.name) == []


def test_failed_checker_keeps_previous_artifact(canned_trace, good_artifact, monkeypatch):
    before = snapshot(good_artifact)

    def reject(*args, **kwargs):
        raise onnx.checker.ValidationError("simulated checker failure")

    monkeypatch.setattr(onnx.checker, "check_model", reject)
    with pytest.raises(ExportError, match="checker.*simulated checker failure"):
        canned_trace(good_artifact)
    monkeypatch.undo()  # loading runs the checker too
    _assert_untouched(good_artifact, before)


def test_failed_trace_keeps_previous_artifact(good_artifact, monkeypatch):
    before = snapshot(good_artifact)

    def fail(*args, **kwargs):
        raise ExportError("torch.onnx.export failed: simulated")

    monkeypatch.setattr(onnx_export, "_trace", fail)
    spec = get_preset("block-small")
    with pytest.raises(ExportError, match="simulated"):
        export_model(spec.build(), spec.family, spec.config, good_artifact)
    _assert_untouched(good_artifact, before)


def test_failed_verification_keeps_previous_artifact_and_removes_temp_dir(canned_trace, good_artifact, monkeypatch):
    before = snapshot(good_artifact)
    seen = []

    def reject(path):
        seen.append(Path(path))
        raise ModelFileError(f"{path}: simulated verification failure")

    monkeypatch.setattr(artifact_read, "load_artifact", reject)
    with pytest.raises(ModelFileError, match="simulated verification failure"):
        canned_trace(good_artifact)
    assert seen and seen[0] != good_artifact  # the files were verified in a temporary directory ...
    assert not seen[0].exists()  # ... which is gone now
    monkeypatch.undo()
    _assert_untouched(good_artifact, before)


def test_failed_swap_restores_previous_artifact(canned_trace, good_artifact, monkeypatch):
    before = snapshot(good_artifact)
    real_rename = os.rename

    def flaky_rename(src, dst):
        if ".tmp-" in Path(src).name:  # moving the new files into place fails
            raise OSError("simulated rename failure")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", flaky_rename)
    # Where the OS has no atomic exchange the swap is two renames; the second one fails here.
    monkeypatch.setattr(artifact_write, "_exchange", lambda a, b: False)
    with pytest.raises(OSError, match="simulated rename failure"):
        canned_trace(good_artifact)
    monkeypatch.undo()
    _assert_untouched(good_artifact, before)


def test_refuses_non_empty_non_artifact_directory(canned_trace, tmp_path):
    target = tmp_path / "my-documents"
    target.mkdir()
    (target / "thesis.txt").write_text("do not delete")
    (target / "sub").mkdir()
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(ModelFileError, match="not empty"):
        canned_trace(target)
    assert sorted(p.name for p in target.iterdir()) == before
    assert (target / "thesis.txt").read_text() == "do not delete"
    assert leftovers(tmp_path, target.name) == []


def test_refuses_an_existing_file_as_output(canned_trace, tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"precious")
    with pytest.raises(ModelFileError, match="not a directory"):
        canned_trace(target)
    assert target.read_bytes() == b"precious"


def test_exports_into_an_empty_existing_directory(canned_trace, tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    artifact = canned_trace(target)
    assert artifact.directory == target and (target / artifacts.MODEL_FILE).is_file()
    assert leftovers(tmp_path, "empty") == []


def test_config_of_another_family_is_a_config_error(tmp_path):
    spec = get_preset("decoder-small")
    with pytest.raises(ConfigError, match="ProbedBlockConfig.*LlamaConfig"):
        export_model(spec.build(), "block", spec.config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_family_is_a_config_error(tmp_path):
    spec = get_preset("decoder-small")
    with pytest.raises(ConfigError, match="unknown model family 'mamba'"):
        export_model(spec.build(), "mamba", spec.config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_torch_export_failure_is_one_line_with_root_cause(monkeypatch, tmp_path):
    def explode(*args, **kwargs):
        try:
            raise ValueError("the root cause\nwith a second line of noise")
        except ValueError as inner:
            raise RuntimeError("outer wrapper") from inner

    monkeypatch.setattr(torch.onnx, "export", explode)
    spec = get_preset("block-small")
    with pytest.raises(ExportError, match="ValueError: the root cause") as info:
        export_model(spec.build(), spec.family, spec.config, tmp_path / "out")
    assert "\n" not in str(info.value) and "second line" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_the_trace_is_the_same_without_the_fake_tensor_cache(monkeypatch):
    """_trace turns torch.export's fake-tensor cache off (it costs more than it saves in one export);
    the graph must be byte for byte the one traced with the cache."""
    import contextlib

    spec = get_preset("block-small")  # one block, the smallest graph to trace twice
    model = spec.build()
    (graph,) = get_family(spec.family).graphs(spec.config)
    inputs, names, run = graph.variant("stages")

    def trace():
        return onnx_export._trace(onnx_export._NamedOutputs(model, run, names), spec.config, graph.name, inputs, names)

    without = trace()
    monkeypatch.setattr(onnx_export, "_no_fake_tensor_cache", contextlib.nullcontext)
    assert trace().SerializeToString() == without.SerializeToString()
