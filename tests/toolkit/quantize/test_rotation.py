"""`toolkit quantize --rotate SEED`: the residual stream turned by a random rotation before the weights are rounded.

The rotated float artifact is held to the source export's own logits (the same function) and its weights to numpy's
products with the rotation (E R, R^T diag(g) W, W R) computed here from the source's; the quantized artifact to
`toolkit check` (its eager reference is the rotated model) and to the source's graph (the same nodes: the same
decode speed).
"""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from artifact.write import pack_artifact, write_artifact
from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.presets import get_preset
from models.registry import build_model, get_family
from tests.toolkit.quantize.planted import CONFIG
from tests.toolkit.quantize.test_quantize import ort_logits
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.check.crosscheck import cross_check
from toolkit.quantize.rotation import hadamard, rotate_artifact, rotation_matrix

pytestmark = pytest.mark.slow


def export(directory, lowering="ort", variant="serving", family="llama", model=None, config=None):
    config = config or get_family(family).config_from_dict(CONFIG)
    model = model or build_model(family, config, seed=0)
    export_model(model, family, config, directory, variant=variant, lowering=lowering)
    return directory


def initializers(directory) -> dict[str, np.ndarray]:
    proto = onnx.load(str(directory / "model.onnx"))
    return {t.name: numpy_helper.to_array(t, base_dir=str(directory)) for t in proto.graph.initializer}


@pytest.mark.parametrize("order", [4, 12, 20, 48, 64, 576, 960, 2048])
def test_hadamard_matrices_of_the_widths_decoders_use(order):
    """Entries +-1 and H H^T = n I (the definition), for Sylvester's orders, Paley's (12 = 11 + 1, 20, 48) and their
    products (SmolLM2's 576 = 8 x 72, 960); none for an order no product of them has."""
    h = hadamard(order)
    assert set(np.unique(h)) == {-1, 1}
    np.testing.assert_array_equal(h @ h.T, order * np.eye(order, dtype=np.int64))
    assert hadamard(100) is None


def test_rotation_matrix_is_a_seeded_randomized_hadamard_or_a_haar_rotation():
    r, kind = rotation_matrix(576, 3)
    assert kind.startswith("randomized Hadamard")
    np.testing.assert_allclose(r @ r.T, np.eye(576), atol=1e-12)
    np.testing.assert_allclose(np.abs(r), 1 / np.sqrt(576), rtol=1e-12)  # every channel spread evenly over all
    np.testing.assert_array_equal(r, rotation_matrix(576, 3)[0])
    assert np.abs(r - rotation_matrix(576, 4)[0]).max() > 0.01
    r, kind = rotation_matrix(100, 3)  # no Hadamard matrix of order 100 is built: a Haar rotation
    assert kind.startswith("random orthogonal")
    np.testing.assert_allclose(r @ r.T, np.eye(100), atol=1e-12)
    assert np.abs(np.abs(r) - np.eye(100)).max() > 0.5


@pytest.mark.parametrize("lowering", ["functions", "standard", "ort"])
def test_the_rotated_artifact_computes_the_source_in_rotated_weights(tmp_path, lowering):
    """Every lowering's graph: the rotated float artifact's logits are the source's (float32 rounding), its table is
    E R, every RMSNorm gain 1, each projection reading a norm R^T diag(g) W and each writing the stream W R (in the
    layout the graph holds it), computed here with numpy from the source's weights; the tied head is untied."""
    source = open_artifact(export(tmp_path / "float", lowering))
    report = rotate_artifact(source, tmp_path / "rotated", 7)
    rotated = open_artifact(tmp_path / "rotated")
    expected = ort_logits(source)
    np.testing.assert_allclose(ort_logits(rotated), expected, atol=1e-4 * np.abs(expected).max())
    assert report["untied_head"] and rotated.manifest.config["tie_embeddings"] is False
    r = rotation_matrix(CONFIG["width"], 7)[0]
    before, after = initializers(tmp_path / "float"), initializers(tmp_path / "rotated")
    weight_map = source.graphs[0].entry.data["weights"]
    table = weight_map["embed_tokens.weight"]["initializer"]
    np.testing.assert_allclose(after[table], before[table] @ r, atol=1e-5)
    gains = {weight_map[k]["initializer"] for k in weight_map if k.endswith("norm.weight")}
    assert len(gains) == 2 * CONFIG["layers"] + 1
    for gain in gains:
        np.testing.assert_array_equal(after[gain], np.ones(CONFIG["width"], np.float32))
    layer_gains = {"attention": "block.{}.attention_norm.weight", "feed_forward": "block.{}.feed_forward_norm.weight"}
    checked = collections.Counter()
    for name, entry in weight_map.items():
        stored = entry["initializer"]
        if not name.startswith("block.") or stored in gains or "inv_freq" in name:
            continue
        layer, module = name.split(".")[1], name.split(".")[2]
        kind = name.split(".")[3]
        # The stored array's axis that runs along the width: B [in, out] when stored transposed, else [out, in].
        along_in = 0 if entry.get("transpose") else 1
        if kind in ("o_proj", "down_proj"):  # writers: the output (width) side turned
            out_axis = 1 - along_in
            want = before[stored] @ r if out_axis == 1 else r.T @ before[stored]
            checked["writers"] += 1
        else:
            g = before[weight_map[layer_gains[module].format(layer)]["initializer"]].astype(np.float64)
            b = before[stored].astype(np.float64)
            want = r.T @ (g[:, None] * b) if along_in == 0 else (b * g[None, :]) @ r
            checked["readers"] += 1
        np.testing.assert_allclose(after[stored], want, atol=1e-5, err_msg=name)
    assert checked["writers"] >= 2 * CONFIG["layers"] and checked["readers"] >= 3 * CONFIG["layers"]
    head = rotated.graphs[0].entry.data["weights"]["lm_head.weight"]
    final = before[weight_map["final_norm.weight"]["initializer"]].astype(np.float64)
    assert head["transpose"] is True and head["initializer"] != table
    np.testing.assert_allclose(after[head["initializer"]], r.T @ (final[:, None] * before[table].T), atol=1e-5)


def test_a_head_that_reads_the_table_through_a_transpose_turns_the_table_and_gives_the_gather_its_own(tmp_path):
    """A tied head held once (the head MatMul reads Transpose(table), as large exports hold it): the table becomes
    the head's T diag(g) R, the Gather reads a new initializer E R, and the weight map follows both; the logits are
    the source's and the eager model rebuilt from the rotated artifact computes them too."""
    export(tmp_path / "copied")
    source = open_artifact(tmp_path / "copied")
    manifest = source.manifest.to_dict()
    proto = onnx.load(str(tmp_path / "copied" / "model.onnx"))
    table = manifest["graphs"][0]["weights"]["embed_tokens.weight"]["initializer"]
    (head,) = [n for n in proto.graph.node if n.output[0] == "logits"]
    copy = head.input[1]
    proto.graph.node.insert(0, onnx.helper.make_node("Transpose", [table], ["table_t"], perm=[1, 0]))
    head.input[1] = "table_t"
    proto.graph.initializer.remove(next(t for t in proto.graph.initializer if t.name == copy))
    extra = {name: (tmp_path / "copied" / name).read_bytes() for name in manifest.get("extra_files") or {}}
    write_artifact(tmp_path / "float", pack_artifact(manifest, {manifest["graphs"][0]["name"]: proto}, extra))
    source = open_artifact(tmp_path / "float")
    report = rotate_artifact(source, tmp_path / "rotated", 0)
    rotated = open_artifact(tmp_path / "rotated")
    expected = ort_logits(source)
    np.testing.assert_allclose(ort_logits(rotated), expected, atol=1e-4 * np.abs(expected).max())
    r = rotation_matrix(CONFIG["width"], 0)[0]
    before, after = initializers(tmp_path / "float"), initializers(tmp_path / "rotated")
    weights = rotated.graphs[0].entry.data["weights"]
    embedding = weights["embed_tokens.weight"]["initializer"]
    assert embedding != table and weights["lm_head.weight"] == {"initializer": table, "transpose": False}
    np.testing.assert_allclose(after[embedding], before[table] @ r, atol=1e-5)
    final = before[manifest["graphs"][0]["weights"]["final_norm.weight"]["initializer"]].astype(np.float64)
    np.testing.assert_allclose(after[table], (before[table] * final[None, :]) @ r, atol=1e-5)
    assert report["untied_head"] and rotated.manifest.config["tie_embeddings"] is False
    check = cross_check(rotated, ["eager", "ort-cpu"], batch=1, sequence=5)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


def test_quantize_rotate_keeps_the_graph_and_checks_against_the_rotated_model(tmp_path):
    """`toolkit quantize --recipe gptq --rotate 0`: the manifest records the rotation and how far the rotated float
    model's logits moved; the quality report is against the source float model; the graph has the nodes of the same
    recipe without --rotate (so its speed); `toolkit check` passes (the reference is the rotated model)."""
    export(tmp_path / "float")
    common = ("quantize", tmp_path / "float", "--bits", "4", "--recipe", "gptq", "--quiet")
    result = invoke(*common, "--rotate", "0", "--out", tmp_path / "q", "--json", tmp_path / "q.json")
    assert result.exit_code == 0, result.output
    assert "rotated first (--rotate 0): randomized Hadamard of order 64" in result.stdout
    assert invoke(*common, "--out", tmp_path / "plain").exit_code == 0
    quantized = open_artifact(tmp_path / "q")
    made = quantized.manifest.quantization
    assert made["rotation"]["seed"] == 0 and made["rotation"]["writers"] == 2 * CONFIG["layers"]
    assert made["rotation"]["logits_max_abs_vs_float"] < 1e-4 * made["rotation"]["logits_max_abs"]
    assert made["source"]["directory"] == str((tmp_path / "float").resolve())
    assert json.loads((tmp_path / "q.json").read_text())["quality"]["perplexity_float"] == pytest.approx(
        open_artifact(tmp_path / "plain").manifest.quantization["quality"]["perplexity_float"]
    )

    def ops(directory):
        return collections.Counter(n.op_type for n in onnx.load(str(directory / "model.onnx")).graph.node)

    assert ops(tmp_path / "q") == ops(tmp_path / "plain")
    assert not list(tmp_path.glob(".q.rotated-*")), "the rotated float artifact is removed"
    check = cross_check(quantized, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


def test_rotate_refuses_what_it_cannot_turn(tmp_path):
    """One line and exit 2, nothing written: the GGUF recipe (its blocks are the weights), a stages export (its
    stage outputs are the residual stream), and a GPT decoder (a second embedding, of positions, adds to the stream)."""
    export(tmp_path / "stages", variant="stages")
    result = invoke("quantize", tmp_path / "stages", "--bits", "4", "--recipe", "rtn", "--rotate", "0", "--out",
                    tmp_path / "q1")  # fmt: skip
    assert_user_error(result, "--rotate", "the residual stream", "--variant serving")
    preset = get_preset("gpt-tiny")
    export(tmp_path / "gpt", family="gpt", model=preset.build(), config=preset.config)
    result = invoke("quantize", tmp_path / "gpt", "--bits", "4", "--recipe", "rtn", "--rotate", "0", "--out",
                    tmp_path / "q2")  # fmt: skip
    assert_user_error(result, "--rotate", "found 2", "embed_positions")
    assert not (tmp_path / "q1").exists() and not (tmp_path / "q2").exists()
    assert not list(tmp_path.glob(".q*"))


def test_a_rotation_that_moves_the_logits_is_refused_before_anything_is_quantized(tmp_path, monkeypatch):
    """The pipeline's own check of the rotated float model: a matrix that is not orthogonal (R scaled by 1.01)
    changes the function, and quantize stops with one line naming how far the logits moved, writing nothing."""
    from toolkit.quantize import rotation

    export(tmp_path / "float")
    turned = rotation.rotation_matrix
    monkeypatch.setattr(rotation, "rotation_matrix", lambda width, seed: (1.01 * turned(width, seed)[0], "scaled"))
    result = invoke("quantize", tmp_path / "float", "--bits", "4", "--recipe", "rtn", "--rotate", "0", "--out",
                    tmp_path / "q")  # fmt: skip
    assert_user_error(result, "--rotate", "logits moved by", "quantize without --rotate")
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))
