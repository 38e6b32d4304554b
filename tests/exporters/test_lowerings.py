"""Lowerings (exporters/lowerings.py): each is a graph rewrite of the same export, judged against
the float64 eager oracle rebuilt from the artifact's own weights."""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from artifact.errors import BackendUnavailableError, ExportError
from exporters.lowerings import MS_DOMAIN, unsupported_backends
from exporters.onnx_export import export_model
from models.artifacts import artifact_config
from models.llama import LlamaConfig
from models.presets import get_preset
from models.registry import build_model, get_family
from runners.eager import model_from_artifact
from runners.registry import create_runner
from toolkit.check.crosscheck import cross_check
from toolkit.cli import main

# The block family (hand-set weights) and a GQA stack; block-small and decoder-small go the same way.
CHECKED_PRESETS = ("worked-example", "decoder-small-gqa")
BACKENDS = {"standard": ("eager", "ort-cpu", "onnx-reference"), "ort": ("eager", "ort-cpu")}
# head_width 8: ONNX Runtime's GroupQueryAttention takes it (the presets' head widths 2 and 4 it refuses).
GQA_CONFIG = LlamaConfig(vocab_size=64, layers=2, width=32, heads=4, kv_heads=2, ff_width=48, max_positions=32)
# head_width 16: GroupQueryAttention also rotates (do_rotary), so Q/K/V stay packed in one tensor.
PACKED_CONFIG = LlamaConfig(vocab_size=64, layers=2, width=64, heads=4, kv_heads=2, ff_width=48, max_positions=32)


def ops(artifact) -> collections.Counter:
    proto = onnx.load(str(artifact.model_path))
    return collections.Counter((n.domain, n.op_type) for n in proto.graph.node)


@pytest.fixture(scope="module")
def preset_exports(tmp_path_factory):
    out = {}
    for preset in CHECKED_PRESETS:
        spec = get_preset(preset)
        for lowering in ("standard", "ort"):
            path = tmp_path_factory.mktemp(f"{preset}-{lowering}")
            out[preset, lowering] = export_model(
                spec.build(), spec.family, spec.config, path / "a", preset=spec.name, seed=spec.seed, lowering=lowering
            )
    return out


@pytest.fixture(scope="module")
def serving_exports(tmp_path_factory):
    model = build_model("llama", GQA_CONFIG, seed=3)
    out = {}
    for lowering in ("standard", "ort"):  # the functions lowering's cache graph is tested in test_export.py
        path = tmp_path_factory.mktemp(f"serving-{lowering}")
        out[lowering] = export_model(model, "llama", GQA_CONFIG, path / "a", variant="serving", lowering=lowering)
    return model, out


@pytest.mark.parametrize("lowering", ["standard", "ort"])
@pytest.mark.parametrize("preset", CHECKED_PRESETS)
def test_presets_pass_check_stage_by_stage(preset_exports, preset, lowering):
    artifact = preset_exports[preset, lowering]
    report = cross_check(artifact, BACKENDS[lowering])
    failures = [(b.name, b.first_divergence) for b in report.backends if not b.passed]
    assert report.passed, failures
    # Every stage of the stages variant is still an output, attention probabilities included.
    spec = get_preset(preset)
    assert artifact.output_names == list(get_family(spec.family).stage_names(spec.config))


def test_standard_is_plain_opset_23(preset_exports):
    artifact = preset_exports["decoder-small-gqa", "standard"]
    proto = onnx.load(str(artifact.model_path))
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 23)}
    assert not proto.functions
    counts = ops(artifact)
    layers = artifact_config(artifact).layers
    assert counts["", "Attention"] == layers
    assert counts["", "RotaryEmbedding"] == 2 * layers  # queries and keys
    assert counts["", "RMSNormalization"] == 2 * layers + 1  # two per block and the final norm
    assert not any(domain for domain, _ in counts)
    manifest = artifact.manifest.to_dict()
    assert (manifest["lowering"], manifest["opset"], manifest["custom_domains"]) == ("standard", 23, {})


def test_ort_fuses_residual_adds_and_projections(preset_exports):
    artifact = preset_exports["decoder-small-gqa", "ort"]
    counts = ops(artifact)
    layers = artifact_config(artifact).layers
    # Every norm after the first reads a residual sum, so it carries that add.
    assert counts[MS_DOMAIN, "SkipSimplifiedLayerNormalization"] == 2 * layers
    assert counts["", "RMSNormalization"] == 1
    assert counts["", "Add"] == 0
    # One MatMul for Q/K/V, one for gate/up, o_proj, down_proj per block, plus the head.
    assert counts["", "MatMul"] == 4 * layers + 1
    # Head width 4: GroupQueryAttention refuses it, the opset-23 Attention kernel runs instead.
    assert artifact.graphs[0].entry.attention_op == "Attention (opset 23)"
    assert artifact.manifest.custom_domains == {MS_DOMAIN: 1}


@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_eager_reference_rebuilds_the_exported_weights(preset_exports, lowering):
    spec = get_preset("decoder-small-gqa")
    original = spec.build().state_dict()
    rebuilt = model_from_artifact(preset_exports["decoder-small-gqa", lowering]).state_dict()
    assert original.keys() == rebuilt.keys()
    for name, tensor in original.items():
        torch.testing.assert_close(rebuilt[name], tensor, rtol=0, atol=0, msg=name)
    if lowering == "ort":
        weights = preset_exports["decoder-small-gqa", lowering].graphs[0].weights
        assert weights["block.0.attention.k_proj.weight"].slice == (1, 16, 24)  # after 4 heads x 4 of Q


def test_kv_cache_decode_steps_on_every_lowering(serving_exports):
    _, artifacts = serving_exports
    assert artifacts["ort"].graphs[0].entry.attention_op == "com.microsoft::GroupQueryAttention"
    assert ops(artifacts["ort"])[MS_DOMAIN, "GroupQueryAttention"] == GQA_CONFIG.layers
    for lowering, artifact in artifacts.items():
        report = cross_check(artifact, BACKENDS[lowering], decode_steps=3)
        assert report.passed, (lowering, [(b.name, b.first_divergence) for b in report.backends])
        assert "decode.2.logits" in report.stages


@pytest.fixture(scope="module", params=["interleaved", "half"])  # GGUF and Hugging Face checkpoints' pairings
def packed_export(request, tmp_path_factory):
    config = dataclasses.replace(PACKED_CONFIG, rope_pairing=request.param)
    model = build_model("llama", config, seed=5)
    return export_model(
        model, "llama", config, tmp_path_factory.mktemp("packed") / "a", variant="serving", lowering="ort"
    )


def test_packed_gqa_rotates_inside_the_kernel(packed_export, serving_exports):
    counts = ops(packed_export)
    layers = PACKED_CONFIG.layers
    assert counts[MS_DOMAIN, "GroupQueryAttention"] == layers
    # The fused QKV MatMul feeds the kernel directly: nothing splits or rotates it on the way.
    assert counts["", "Split"] == layers  # gate/up only
    assert counts[MS_DOMAIN, "RotaryEmbedding"] == counts["", "RotaryEmbedding"] == 0
    proto = onnx.load(str(packed_export.model_path))
    for node in (n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        pairing = artifact_config(packed_export).rope_pairing
        assert (attrs["do_rotary"], attrs["rotary_interleaved"]) == (1, int(pairing == "interleaved"))
        assert list(node.input[1:3]) == ["", ""] and node.input[9] == "position_ids"
    entry = packed_export.graphs[0].entry.data
    assert (entry["rotary_op"], entry["kv_cache"]) == ("inside GroupQueryAttention (do_rotary)", "shared-buffer")
    # Head width 8 is below the rotating kernel's multiple of 16: separate RotaryEmbedding nodes remain.
    small = ops(serving_exports[1]["ort"])
    assert small[MS_DOMAIN, "RotaryEmbedding"] == 2 * GQA_CONFIG.layers
    assert serving_exports[1]["ort"].graphs[0].entry.data["rotary_op"] == "com.microsoft::RotaryEmbedding"


def test_packed_gqa_decode_steps_pass_check(packed_export):
    report = cross_check(packed_export, BACKENDS["ort"], decode_steps=3)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]
    assert "decode.2.logits" in report.stages


@pytest.mark.parametrize(
    "positions",
    [
        [[3, 4, 5], [5, 6, 7]],  # each row continues its own history
        [[0, 2, 4], [7, 1, 3]],  # arbitrary positions: the kernel must rotate by each entry, not count from the first
    ],
)
def test_packed_gqa_padded_batch_matches_the_oracle(packed_export, positions):
    assert_padded_batch_matches_the_oracle(packed_export, positions, seed=1)


def assert_padded_batch_matches_the_oracle(artifact, positions, seed: int) -> None:
    """Two rows, a left-padded cache of 5 and 3 new tokens at `positions`: ort-cpu against float64 eager."""
    c = artifact_config(artifact)
    rng = np.random.default_rng(seed)
    batch, past, new = 2, 5, 3
    kv_heads = getattr(c, "kv_heads", c.heads)  # the gpt family's config has none: multi-head attention
    feed = {
        "input_ids": rng.integers(0, c.vocab_size, (batch, new)),
        "past_mask": np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=np.int64),
        "position_ids": np.array(positions, dtype=np.int64),
    }
    for i in range(c.layers):
        for kind in ("key", "value"):
            feed[f"past.{i}.{kind}"] = rng.standard_normal((batch, kv_heads, past, c.head_width)).astype(np.float32)
    oracle = create_runner("eager-f64", artifact).run(feed)
    got = create_runner("ort-cpu", artifact).run(feed)
    for name, expected in oracle.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_padded_batch_with_a_cache_matches_the_oracle(serving_exports, lowering):
    """Rows with different histories (left-padded cache, per-row positions) and a multi-token chunk
    after a non-empty cache: the path the serving batcher uses, against the float64 oracle."""
    _, artifacts = serving_exports
    assert_padded_batch_matches_the_oracle(artifacts[lowering], [[3, 4, 5], [5, 6, 7]], seed=0)


@pytest.mark.parametrize("preset", ["vaswani-2017", "modern-2026"])
@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_models_a_lowering_cannot_express_are_refused(tmp_path, preset, lowering):
    spec = get_preset(preset)
    with pytest.raises(
        ExportError, match=f"lowering '{lowering}' cannot express .*cross-attention.*--lowering functions"
    ):
        export_model(spec.build(), spec.family, spec.config, tmp_path / "a", lowering=lowering)
    assert not (tmp_path / "a").exists()


def test_unknown_lowering_is_refused(tmp_path):
    spec = get_preset("decoder-small")
    with pytest.raises(ExportError, match="unknown lowering 'fast'; choose one of functions, standard, ort"):
        export_model(spec.build(), spec.family, spec.config, tmp_path / "a", lowering="fast")


def test_gpu_backends_are_refused_for_float32_group_query_attention(packed_export, preset_exports):
    """ONNX Runtime registers its CUDA GroupQueryAttention for float16 and bfloat16 only."""
    why = unsupported_backends(packed_export.manifest)
    assert set(why) == {"onnx-reference", "ort-cuda", "ort-trt"}
    assert (
        "takes float16 and bfloat16 only, and this artifact is float32; re-export with --dtype float16"
        in why["ort-cuda"]
    )
    as_float16 = dataclasses.replace(packed_export.manifest, dtype="float16")
    assert set(unsupported_backends(as_float16)) == {"onnx-reference"}
    # The opset-23 Attention fallback (head width 4) has no such limit.
    assert set(unsupported_backends(preset_exports["decoder-small-gqa", "ort"].manifest)) == {"onnx-reference"}


def test_reference_evaluator_refuses_ort_artifacts_clearly(preset_exports):
    artifact = preset_exports["worked-example", "ort"]
    with pytest.raises(BackendUnavailableError, match="onnx-reference.*com.microsoft.*--lowering standard"):
        create_runner("onnx-reference", artifact)


def test_cli_export_and_check_with_a_lowering(tmp_path):
    runner = CliRunner()
    out = tmp_path / "ort"
    result = runner.invoke(main, ["export", "--preset", "worked-example", "--lowering", "ort", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "lowering ort" in result.output
    assert json.loads((out / "manifest.json").read_text())["lowering"] == "ort"
    result = runner.invoke(main, ["check", str(out)])
    assert result.exit_code == 0, result.output
    assert "not checking onnx-reference" in result.output and "RESULT: PASS" in result.output
    result = runner.invoke(main, ["check", str(out), "--backends", "eager,onnx-reference"])
    assert result.exit_code == 2
    assert "Error: backend 'onnx-reference' cannot run" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(
        main, ["export", "--preset", "vaswani-2017", "--lowering", "standard", "--out", str(tmp_path / "seq2seq")]
    )
    assert result.exit_code == 2
    assert "Error: lowering 'standard' cannot express" in result.output


# --------------------------------------------------------------------------- graphs past protobuf's 2 GiB


def _opset20_matmul(weight: np.ndarray) -> onnx.ModelProto:
    """x @ weight, then a Reshape by a small constant shape (an initializer the converter reads), at opset 20."""
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul"), helper.make_node("Reshape", ["y", "shape"], ["z"], name="reshape")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, weight.shape[0]])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array([-1], np.int64), "shape")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_opset_conversion_is_the_converter_s_with_the_weights_kept():
    from exporters.lowerings import STANDARD_OPSET, convert_opset

    weight = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)  # above WEIGHTLESS_BYTES
    want = onnx.version_converter.convert_version(_opset20_matmul(weight), STANDARD_OPSET)
    got = convert_opset(_opset20_matmul(weight), STANDARD_OPSET)
    assert [o.version for o in got.opset_import] == [STANDARD_OPSET]
    assert [(n.op_type, list(n.input)) for n in got.graph.node] == [(n.op_type, list(n.input)) for n in want.graph.node]
    assert [i.name for i in got.graph.input] == ["x"]  # the weight is an initializer again, not an input
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in got.graph.initializer}
    assert sorted(inits) == ["shape", "w"] and inits["w"].tobytes() == weight.tobytes()
    onnx.checker.check_model(got, full_check=True)


@pytest.mark.slow
def test_a_graph_past_2_gib_converts_and_types():
    """The lowering converts opsets and the precision pass types values of a graph whose weights exceed protobuf's
    2 GiB limit on one message (a float32 model of about 540M parameters): both work on the weightless copy."""
    from exporters.lowerings import STANDARD_OPSET, convert_opset
    from exporters.precision import _element_types

    proto = _opset20_matmul(np.zeros((8, 1), np.float32))
    # Filled in place, as the exporter fills weights: protobuf copies a message added whole by serialising it.
    columns = (2**31 + 2**20) // 32  # 2 GiB + 1 MiB
    proto.graph.initializer[0].dims[:] = [8, columns]
    proto.graph.initializer[0].raw_data = bytes(8 * columns * 4)
    assert len(proto.graph.initializer[0].raw_data) > 2**31  # a whole-model serialisation fails (EncodeError)
    types = _element_types(proto)
    assert types["z"] == onnx.TensorProto.FLOAT
    converted = convert_opset(proto, STANDARD_OPSET)
    assert [o.version for o in converted.opset_import] == [STANDARD_OPSET]
    assert len(converted.graph.initializer[0].raw_data) == 8 * columns * 4
