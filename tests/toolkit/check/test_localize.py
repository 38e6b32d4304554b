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
from toolkit.check.crosscheck import default_inputs
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


def test_add_turned_into_sub_inside_attention_is_named(block, tmp_path):
    # The RoPE rotation's "first * sin + second * cos" is an Add in the attention; make it a Sub.
    original = onnx.load(block.model_path)
    # Adds that are not stage outputs (the residual adds are): the first is inside the attention's RoPE.
    attention_adds = [n for n in original.graph.node if n.op_type == "Add" and "." not in n.output[0]]
    target = attention_adds[0].name

    def mutate(model):
        next(n for n in model.graph.node if n.name == target).op_type = "Sub"

    artifact = mutated_copy(block, tmp_path, mutate)
    result = CliRunner().invoke(
        main, ["check", str(artifact.directory), "--backends", "ort-cpu,onnx-reference", "--localize"]
    )
    assert result.exit_code == 1, result.output
    assert "RESULT: FAIL" in result.output
    # Both ONNX backends are pinned to the mutated node, by op type and name.
    lines = [line for line in result.output.splitlines() if line.startswith("localize ")]
    assert len(lines) == 2
    for line in lines:
        assert f"Sub {target!r}" in line and "export fault" in line


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


def test_localize_on_an_eager_backend_says_why_not(block, tmp_path):
    from toolkit.check.crosscheck import cross_check
    from toolkit.check.localize import localize_report

    report = cross_check(block, ["eager"])
    report.backends[0].comparison.outputs[0].passed = False  # pretend eager failed
    (finding,) = localize_report(report, block)
    assert finding.finding is None and "runs no ONNX graph" in finding.note
