"""--localize: fault injection into an exported graph must be pinned to exactly the mutated node."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import toolkit.check.localize as localize
from artifact import MANIFEST_FILE, MODEL_FILE, sha256_file
from models.artifacts import open_artifact
from toolkit.check.crosscheck import default_inputs, graph_feed
from toolkit.check.localize import EPS32, localize_stage, node_scale
from toolkit.cli import main


def mutated_copy(artifact, tmp_path, mutate):
    """Copy an artifact, apply mutate(ModelProto) to its graph and re-hash it, as a faulty export would be."""
    out = tmp_path / "mutated"
    shutil.copytree(artifact.directory, out)
    model = onnx.load(out / MODEL_FILE)
    mutate(model)
    onnx.save(model, out / MODEL_FILE)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["graphs"][0]["sha256"] = sha256_file(out / MODEL_FILE)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return open_artifact(out)


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    from exporters.onnx_export import export_model
    from models.presets import get_preset

    spec = get_preset("block-small")
    out = tmp_path_factory.mktemp("localize") / "block"
    export_model(spec.build(), spec.family, spec.config, out, preset=spec.name, seed=spec.seed)
    return open_artifact(out)


def add_to_sub_is_named(artifact, tmp_path, target):
    """Turn the Add node `target` into a Sub; `check --localize` must pin both ONNX backends to it, by op and name."""

    def mutate(model):
        next(n for n in model.graph.node if n.name == target).op_type = "Sub"

    mutated = mutated_copy(artifact, tmp_path, mutate)
    result = CliRunner().invoke(
        main, ["check", str(mutated.directory), "--backends", "ort-cpu,onnx-reference", "--localize"]
    )
    assert result.exit_code == 1, result.output
    assert "RESULT: FAIL" in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("localize ")]
    assert len(lines) == 2
    for line in lines:
        assert f"Sub {target!r}" in line and "export fault" in line


def test_add_turned_into_sub_inside_attention_is_named(block, tmp_path):
    # The RoPE rotation's "first * sin + second * cos" is an Add in the attention; make it a Sub.
    original = onnx.load(block.model_path)
    # Adds that are not stage outputs (the residual adds are): the first is inside the attention's RoPE.
    attention_adds = [n for n in original.graph.node if n.op_type == "Add" and "." not in n.output[0]]
    add_to_sub_is_named(block, tmp_path, attention_adds[0].name)


def test_changed_epsilon_inside_the_rmsnorm_function_is_named(block, tmp_path):
    original = onnx.load(block.model_path)
    calls = [n for n in original.graph.node if n.op_type == "RMSNorm"]
    target = calls[1].name  # the feed-forward norm

    def mutate(model):
        call = next(n for n in model.graph.node if n.name == target)
        next(a for a in call.attribute if a.name == "epsilon").f = 0.5

    artifact = mutated_copy(block, tmp_path, mutate)
    feed, _ = default_inputs(artifact, None, None, 0)
    found = localize_stage(artifact, "ort-cpu", "block.0.feed_forward_norm", feed)
    assert found.finding is not None and found.finding.cause == "graph"
    # The first value that leaves the model is mean(x^2) + eps, inside that call's inlined body.
    assert found.finding.op_type == "Add"
    assert found.finding.function == f"onnx_toolkit::RMSNorm call {target}"


def test_a_correct_graph_has_no_divergent_node(block):
    feed, _ = default_inputs(block, None, None, 0)
    for backend in ("ort-cpu", "onnx-reference"):
        found = localize_stage(block, backend, "logits", feed)
        assert found.finding is None, found.describe()
        assert found.nodes_checked > 0


def test_a_backend_kernel_fault_is_blamed_on_the_backend(block, monkeypatch):
    # Fault injection into the backend, not the graph: one Softmax output is off by 1e-3 (a wrong kernel);
    # everything downstream then consumes the wrong value, as it would in a real runtime.
    real = localize.run_backend_all

    def faulty(backend, model, feed):
        values = real("onnx-reference", model, feed)
        softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
        values[softmax.output[0]] = values[softmax.output[0]] + np.float32(1e-3)
        return values

    monkeypatch.setattr(localize, "run_backend_all", faulty)
    feed, _ = default_inputs(block, None, None, 0)
    found = localize_stage(block, "ort-cpu", "block.0.attention_branch", feed)
    assert found.finding is not None and found.finding.cause == "backend"
    assert found.finding.op_type == "Softmax"
    assert found.finding.max_abs == pytest.approx(1e-3, rel=1e-3)


def test_matmul_bound_is_higham_gamma_k():
    # K = 3 terms: bound (K + 1) * eps32 * max(|A| @ |B|); |A| @ |B| by hand = [[1*4 + 2*5 + 3*6]] = 32.
    a = np.array([[1.0, -2.0, 3.0]])
    b = np.array([[4.0], [5.0], [-6.0]])
    magnitude, steps = node_scale("MatMul", [a, b], a @ b)
    assert magnitude == 32.0 and steps == 4
    assert steps * EPS32 * magnitude == pytest.approx(4 * 2.0**-23 * 32)
    assert node_scale("Reshape", [a], a) == (3.0, 0)  # data movement must be exact


def test_matmulnbits_bound_is_the_matmul_bound_of_its_dequantized_weight():
    # K = 32 in one 4-bit block, N = 1, every code 9 with the default zero point 8 and scale 0.5: W = 0.5.
    # |A| @ |W| by hand: 0.5 * (1 + 2 + ... + 32) = 264; 33 rounding steps, as for a MatMul over 32 terms.
    packed = np.full((1, 1, 16), 9 | (9 << 4), dtype=np.uint8)
    a = -np.arange(1.0, 33.0)[None, :]
    attributes = {"K": 32, "N": 1, "bits": 4, "block_size": 32}
    magnitude, steps = node_scale(
        "MatMulNBits", [a, packed, np.array([0.5]), None], a @ np.full((32, 1), 0.5), attributes
    )
    assert (magnitude, steps) == (264.0, 33)


def test_localize_on_an_eager_backend_says_why_not(block, tmp_path):
    from toolkit.check.crosscheck import cross_check
    from toolkit.check.localize import localize_report

    report = cross_check(block, ["eager"])
    report.backends[0].comparison.outputs[0].passed = False  # pretend eager failed
    (finding,) = localize_report(report, block)
    assert finding.finding is None and "runs no ONNX graph" in finding.note


# --------------------------------------------------------------------------- weight-only quantized graphs


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A 2-layer Llama quantized to int4 (MatMulNBits, block 32) with the default recipe, as `toolkit quantize`
    writes it, at accuracy level 0: float32 activations, so that check holds it to its dequantized weights."""
    from exporters.onnx_export import export_model
    from models.registry import build_model, get_family
    from toolkit.quantize.pipeline import quantize_artifact

    config = get_family("llama").config_from_dict(
        {"vocab_size": 96, "layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128, "max_positions": 48}
    )
    base = tmp_path_factory.mktemp("localize-int4")
    export_model(build_model("llama", config, seed=0), "llama", config, base / "float", variant="serving")
    return quantize_artifact(base / "float", base / "int4", bits=4, accuracy_level=0).artifact


def test_a_quantized_artifact_checks_on_every_default_backend(quantized):
    # onnx-reference evaluates MatMulNBits from runners/contrib_ops.py; without it the default check is refused.
    result = CliRunner().invoke(main, ["check", str(quantized.directory)])
    assert result.exit_code == 0, result.output
    assert "onnx-reference   PASS" in result.output


def test_a_correct_quantized_graph_has_no_divergent_node(quantized):
    feed = graph_feed(quantized.graphs[0], default_inputs(quantized, None, None, 0)[0], {})  # with an empty cache
    for backend in ("ort-cpu", "onnx-reference"):
        found = localize_stage(quantized, backend, "logits", feed)
        assert found.finding is None, found.describe()
        assert found.nodes_checked > 0
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(quantized.model_path).graph.node)


def test_add_turned_into_sub_in_a_quantized_graph_is_named(quantized, tmp_path):
    # The RoPE rotation's "first * sin + second * cos": the first Add of two products.
    nodes = onnx.load(quantized.model_path).graph.node
    products = {out for n in nodes if n.op_type == "Mul" for out in n.output}
    add_to_sub_is_named(
        quantized, tmp_path, next(n for n in nodes if n.op_type == "Add" and set(n.input) <= products).name
    )


def test_a_matmulnbits_kernel_fault_is_blamed_on_the_backend(quantized, monkeypatch):
    real = localize.run_backend_all

    def faulty(backend, model, feed):
        values = real("onnx-reference", model, feed)
        node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
        # 1e-4 on one element: several times the kernel's float32 bound, (K + 1) eps max(|A| @ |W|)
        wrong = values[node.output[0]].copy()
        wrong.flat[0] += np.float32(1e-4)
        values[node.output[0]] = wrong
        return values

    monkeypatch.setattr(localize, "run_backend_all", faulty)
    feed = graph_feed(quantized.graphs[0], default_inputs(quantized, None, None, 0)[0], {})  # with an empty cache
    found = localize_stage(quantized, "ort-cpu", "logits", feed)
    assert found.finding is not None and found.finding.cause == "backend"
    assert found.finding.op_type == "MatMulNBits"
    assert found.finding.max_abs == pytest.approx(1e-4, rel=1e-2)


def test_a_graph_with_kernels_the_reference_lacks_is_not_localised(tmp_path):
    """An `ort` lowering's GroupQueryAttention has no reference kernel: the localisation says so, no traceback."""
    from exporters.onnx_export import export_model
    from models.presets import get_preset

    spec = get_preset("decoder-small-gqa")
    export_model(spec.build(), spec.family, spec.config, tmp_path / "ort", lowering="ort", variant="serving")
    artifact = open_artifact(tmp_path / "ort")
    feed = graph_feed(artifact.graphs[0], default_inputs(artifact, None, None, 0)[0], {})
    found = localize_stage(artifact, "ort-cpu", "logits", feed)
    assert found.finding is None and found.nodes_checked == 0
    assert "com.microsoft::SkipSimplifiedLayerNormalization" in found.note
    assert "--lowering standard or functions" in found.note
    # Through the CLI: a failing check (an Add turned into a Sub) with --localize keeps its verdict, exit 1.

    def mutate(model):
        next(n for n in model.graph.node if n.name == "lowering/Mul_110").op_type = "Add"  # SwiGLU: gate * up

    mutated = mutated_copy(artifact, tmp_path, mutate)
    result = CliRunner().invoke(main, ["check", str(mutated.directory), "--backends", "ort-cpu", "--localize"])
    assert result.exit_code == 1 and "RESULT: FAIL" in result.output, result.output
    assert "not localised: the graph holds com.microsoft::" in result.output and "Traceback" not in result.output


def test_a_contrib_op_named_like_a_reference_op_is_still_foreign(block, tmp_path):
    """The reference evaluator's extra Gelu is the standard one: a com.microsoft::Gelu (ONNX Runtime's own op)
    has no reference kernel, so the localisation says so instead of failing inside the evaluator."""

    def mutate(model):
        node = next(n for n in model.graph.node if n.op_type == "Mul")
        node.op_type, node.domain = "Gelu", "com.microsoft"
        del node.input[1:]
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))

    mutated = mutated_copy(block, tmp_path, mutate)
    feed = graph_feed(mutated.graphs[0], default_inputs(mutated, None, None, 0)[0], {})
    found = localize_stage(mutated, "ort-cpu", "logits", feed)
    assert found.finding is None and found.nodes_checked == 0
    assert "not localised: the graph holds com.microsoft::Gelu" in found.note
