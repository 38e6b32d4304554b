"""`toolkit quantize --tune-scales STEPS`: each block's scale fitted to the float model once the weights are rounded.

The tuned artifact is held to the untuned one (the same graph, codes and zero points bit for bit; only scales
differ), to the float model on held-out text of its own (nearer than the rounded scales), and to its dequantized
reference (`toolkit check`); the fitted weights' parametrization to the MatMulNBits spec's own dequantization.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.registry import build_model, get_family
from tests.toolkit.quantize.test_quantize import CONFIG, mnb_dequantize, ort_logits
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.check.crosscheck import cross_check
from toolkit.quantize import pipeline, sensitivity, tuning
from toolkit.quantize.sensitivity import calibration, sampled_calibration

pytestmark = pytest.mark.slow

OPTIONS = ("--bits", 4, "--accuracy-level", 0, "--greedy-tokens", 2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """test_quantize's decoder with its logits a twentieth as large: a random model's next-token distributions are
    otherwise all on one token, where no scale moves the KL. The ort lowering fuses QKV and gate/up."""
    config = get_family("llama").config_from_dict(CONFIG)
    model = build_model("llama", config, seed=0)
    with torch.no_grad():
        model.final_norm.weight.mul_(0.05)
    out = tmp_path_factory.mktemp("tuning") / "float"
    export_model(model, "llama", config, out, variant="serving", lowering="ort")
    return open_artifact(out)


def graph(directory):
    proto = onnx.load(str(directory / "model.onnx"))
    values = {t.name: numpy_helper.to_array(t, base_dir=str(directory)) for t in proto.graph.initializer}
    return proto, values


def held_out_kl(source, artifact) -> float:
    """Mean KL(float || quantized) of ONNX Runtime's next-token distributions, computed with numpy in float64, on
    text the float model writes with a seed neither calibration nor tuning samples with."""
    held_out = sampled_calibration(source, calibration(source), 8, 48, seed=7).feed["input_ids"]

    def log_softmax(logits):
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    p, q = log_softmax(ort_logits(source, held_out)), log_softmax(ort_logits(artifact, held_out))
    return float((np.exp(p) * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("recipe", [("--recipe", "rtn"), ("--recipe", "gptq", "--zero-points", "offsets")])
def test_tuned_scales_keep_the_graph_and_codes_and_come_nearer_the_float_model(source, tmp_path, recipe):
    """The same recipe with and without --tune-scales: identical nodes and every initializer but the scales bit for
    bit; the scales moved, the held-out KL the manifest reports lower, logits on held-out text nearer the float
    model's, the CLI says so, and the tuned artifact checks against its dequantized reference."""
    made = {}
    for name, extra in (("rounded", ()), ("tuned", ("--tune-scales", 200))):
        result = invoke("quantize", source.directory, *OPTIONS, *recipe, *extra, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
        made[name] = result
    assert "scales fitted (--tune-scales 200): KL from the float model on 4 held-out rows" in made["tuned"].stdout
    (proto, values), (tuned_proto, tuned_values) = graph(tmp_path / "rounded"), graph(tmp_path / "tuned")
    assert [(n.op_type, list(n.input), list(n.attribute)) for n in proto.graph.node] == [
        (n.op_type, list(n.input), list(n.attribute)) for n in tuned_proto.graph.node
    ]
    scales = {n.input[2] for n in proto.graph.node if n.op_type == "MatMulNBits"}
    assert values.keys() == tuned_values.keys() and scales
    for name, array in values.items():
        if name not in scales:
            np.testing.assert_array_equal(tuned_values[name], array, err_msg=name)
    moved = [np.abs(tuned_values[s] / values[s] - 1).max() for s in scales]
    assert min(moved) > 0 and max(moved) < 0.5, moved
    report = open_artifact(tmp_path / "tuned").manifest.quantization["scales_tuned"]
    assert report["kept"] and report["held_out_kl_after"] < report["held_out_kl_before"], report
    assert report["steps"] == 200 and report["rows"] == tuning.TUNE_ROWS - tuning.HELD_OUT_ROWS
    rounded, tuned = (open_artifact(tmp_path / name) for name in ("rounded", "tuned"))
    kl = {name: held_out_kl(source, artifact) for name, artifact in (("rounded", rounded), ("tuned", tuned))}
    assert kl["tuned"] < 0.9 * kl["rounded"], kl
    check = cross_check(tuned, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


def test_fitted_weights_start_at_the_dequantized_weights(source, tmp_path):
    """Before any step, each torch weight the fit computes is its slice of the MatMulNBits spec's dequantization
    (mnb_dequantize, a loop over the packed bytes), offsets added, for fused weights too (the ort lowering's)."""
    options = ("--recipe", "gptq", "--zero-points", "offsets", "--head-bits", 8)
    assert invoke("quantize", source.directory, *OPTIONS, *options, "--out", tmp_path / "q").exit_code == 0
    artifact = open_artifact(tmp_path / "q")
    proto, values = graph(tmp_path / "q")
    nodes = {n.input[1]: n for n in proto.graph.node if n.op_type == "MatMulNBits"}
    weights = tuning.scaled_weights(artifact)
    assert {w.scales for w in weights} == {n.input[2] for n in nodes.values()}
    names = 0
    for weight in weights:
        weight.log_scale = torch.zeros(weight.levels.shape[0], weight.stored.size // weight.levels.shape[0])
        node = next(n for n in nodes.values() if n.input[2] == weight.scales)
        expected = mnb_dequantize(proto, node)  # [K, N]
        offsets = values.get(f"{node.input[1].rsplit('_Q', 1)[0]}_offsets")
        assert offsets is not None
        expected = expected + np.repeat(offsets, 32, axis=0)[: expected.shape[0]]
        np.testing.assert_allclose(weight.weight().numpy(), expected.T, rtol=1e-6, atol=1e-7)
        names += len(weight.entries)
    assert names == sum(1 for place in artifact.graphs[0].weights.values() if place.quantized)


def test_scales_that_do_not_lower_the_kl_are_not_kept(source, tmp_path, monkeypatch):
    """A fit that overshoots (a learning rate a thousand times too large) raises the held-out KL: the rounded scales
    are kept bit for bit, the manifest and the CLI say so."""
    monkeypatch.setattr(tuning, "LEARNING_RATE", 0.3)
    for name, extra in (("rounded", ()), ("tuned", ("--tune-scales", 5))):
        result = invoke("quantize", source.directory, *OPTIONS, "--recipe", "rtn", *extra, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
    assert "scales left as rounded (--tune-scales 5)" in result.stdout and "not lower" in result.stdout
    report = open_artifact(tmp_path / "tuned").manifest.quantization["scales_tuned"]
    assert not report["kept"] and report["held_out_kl_after"] >= report["held_out_kl_before"]
    values, tuned = graph(tmp_path / "rounded")[1], graph(tmp_path / "tuned")[1]
    for name, array in values.items():
        np.testing.assert_array_equal(tuned[name], array, err_msg=name)


def test_tune_scales_needs_a_step(source, tmp_path):
    result = invoke("quantize", source.directory, *OPTIONS, "--recipe", "rtn", "--tune-scales", 0, "--out", tmp_path)
    assert_user_error(result, "--tune-scales")


@pytest.mark.parametrize("recipe", ["gptq", "rtn"])
def test_the_calibration_seed_chooses_the_text_gptq_and_the_fit_calibrate_on(source, tmp_path, recipe):
    """--calibration-seed: the manifest records the seed; no seed is seed 0 byte for byte; another seed is another
    text, so GPTQ rounds other codes (gptq) and the fit moves the scales elsewhere from the same codes (rtn)."""
    made = {}
    for name, seed in (("unnamed", ()), ("zero", ("--calibration-seed", 0)), ("five", ("--calibration-seed", 5))):
        options = (*OPTIONS, "--recipe", recipe, "--tune-scales", 20, *seed)
        result = invoke("quantize", source.directory, *options, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
        assert open_artifact(tmp_path / name).manifest.quantization["calibration_seed"] == (
            5 if seed and seed[1] else 0
        )
        made[name] = graph(tmp_path / name)
    proto, values = made["unnamed"]
    for name, array in values.items():
        np.testing.assert_array_equal(made["zero"][1][name], array, err_msg=name)
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    codes, scales = [n.input[1] for n in nodes], [n.input[2] for n in nodes]
    other = made["five"][1]
    codes_moved = [name for name in codes if not np.array_equal(other[name], values[name])]
    assert all(not np.array_equal(other[name], values[name]) for name in scales)
    if recipe == "gptq":
        assert codes_moved, "the same GPTQ codes from another calibration text"
    else:
        assert not codes_moved, codes_moved


def test_the_calibration_seed_needs_a_text_to_seed(source, tmp_path):
    """Round-to-nearest without --tune-scales writes no calibration text: a seed for one is refused, not ignored;
    and a seed is at least 0."""
    result = invoke(
        "quantize", source.directory, *OPTIONS, "--recipe", "rtn", "--calibration-seed", 1, "--out", tmp_path / "a"
    )
    assert_user_error(result, "--calibration-seed", "--recipe rtn")
    assert not (tmp_path / "a").exists()
    result = invoke(
        "quantize", source.directory, *OPTIONS, "--recipe", "gptq", "--calibration-seed", -1, "--out", tmp_path / "b"
    )
    assert_user_error(result, "--calibration-seed")


def test_the_fit_after_gptq_fits_on_gptq_s_text_sampled_once(source, tmp_path, monkeypatch):
    """--recipe gptq --tune-scales: the float model writes the calibration text once, and the fit on GPTQ's copy of it
    gives the scales bit for bit that tune_scales gives when it samples the same rows, tokens and seed itself."""
    assert (tuning.TUNE_ROWS, tuning.TUNE_TOKENS) == (pipeline.GPTQ_ROWS, pipeline.GPTQ_TOKENS)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2:4])
        return sampled_calibration(*args, **kwargs)

    monkeypatch.setattr(sensitivity, "sampled_calibration", counted)
    monkeypatch.setattr(pipeline, "sampled_calibration", counted)
    options = (*OPTIONS, "--recipe", "gptq", "--calibration-seed", 3)
    for name, extra in (("rounded", ()), ("tuned", ("--tune-scales", 20))):
        result = invoke("quantize", source.directory, *options, *extra, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
    assert calls == [(pipeline.GPTQ_ROWS, pipeline.GPTQ_TOKENS)] * 2, calls  # once per command
    fitted, report = tuning.tune_scales(source, open_artifact(tmp_path / "rounded"), 20, seed=3)
    assert len(calls) == 3 and report["kept"]
    values = graph(tmp_path / "tuned")[1]
    assert fitted.keys() and all(name in values for name in fitted)
    for name, array in fitted.items():
        np.testing.assert_array_equal(values[name], array.reshape(values[name].shape), err_msg=name)
