"""`toolkit quantize --imatrix`: the k-quant search weighted by how much each input channel carries.

The fixture plants the case the weighting is for: one input channel in each block of one layer's down
projection carries 100x larger activations (the up projection's rows scaled up) while the weights that read
them are 100x smaller (the same function). Weighted by its own magnitudes the search spends little on those small weights, whose
errors the large activations then multiply; weighted by the activations' mean squares it keeps them. The
importance itself is held to forward hooks on the float64 model, a second way of reading the same inputs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from exporters.kquant import kquant_blocks
from exporters.quantize import GraphWeights, prepare_proto
from models.artifacts import open_artifact
from tests.toolkit.quantize.planted import export_planted, planted_model
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.quantize.importance import importance
from toolkit.quantize.sensitivity import calibration, calibration_ids, weights_of

pytestmark = pytest.mark.slow

PLANTED = "block.1.feed_forward.down_proj"
LOUD = [0, 32, 64, 96]  # the down projection's input channels that carry 100x: one in each block of 32
LOUDER = 100.0


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # up_proj's rows LOUD grow LOUDER-fold and down_proj's columns LOUD shrink as much: its inputs are loud.
    return export_planted(tmp_path_factory.mktemp("importance") / "float", 1, LOUD, 1 / LOUDER)


def quantize(source, target, *flags):
    report = target.parent / f"{target.name}.json"
    # Float minimums: the weighting moves where their levels fall. An integer zero point holds a level at 0, to
    # which the loud channels' small weights round with or without it (the weighting then changes little here).
    args = ["quantize", source, "--bits", 4, "--recipe", "kquant", "--zero-points", "offsets", "--accuracy-level", 0]
    args += flags
    result = invoke(*args, "--out", target, "--json", report)
    assert result.exit_code == 0, result.output
    return json.loads(report.read_text())


def test_importance_is_the_mean_square_of_each_weights_input(source):
    artifact = open_artifact(source)
    graph = artifact.graphs[0]
    proto = onnx.load(graph.model_path)
    weights = GraphWeights(proto, str(graph.model_path.parent), graph.model_path)
    prepared, folded = prepare_proto(proto, weights)
    matmul_b = {n.input[1] for n in prepared.graph.node if n.op_type == "MatMul" and len(n.input) > 1}
    found = importance(calibration(artifact), matmul_b, graph.entry.data["weights"], folded)
    # The second way: forward pre-hooks on the float64 model's Linear modules (the attention projections are
    # called as modules; the feed-forward's are read in ops.swiglu, so its input is rebuilt from the hooks').
    config, model = planted_model(1, LOUD, 1 / LOUDER, torch.float64)
    seen = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "o_proj")):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0]))
    norms = {}
    for i, block in enumerate(model.block):
        block.feed_forward_norm.register_forward_hook(lambda m, a, out, i=i: norms.__setitem__(i, out))
    ids = torch.tensor([calibration_ids(artifact, config)])
    with torch.no_grad():
        model(ids)
    by_name = {e["name"]: b for b, entries in _held(matmul_b, graph, folded).items() for e in entries}
    for name, x in seen.items():
        want = (x.reshape(-1, x.shape[-1]) ** 2).mean(0).numpy()
        np.testing.assert_allclose(found[by_name[f"{name}.weight"]], want, rtol=1e-4, err_msg=name)
    with torch.no_grad():
        ff = model.block[1].feed_forward
        h = norms[1]
        down_in = torch.nn.functional.silu(h @ ff.gate_proj.weight.T) * (h @ ff.up_proj.weight.T)
    want = (down_in.reshape(-1, down_in.shape[-1]) ** 2).mean(0).numpy()
    np.testing.assert_allclose(found[by_name[f"{PLANTED}.weight"]], want, rtol=1e-4)
    loud = found[by_name[f"{PLANTED}.weight"]]
    assert loud[LOUD].min() > 1000 * np.median(loud)  # the planted channels carry 100x (10^4 in mean square)


def _held(matmul_b, graph, folded):
    return weights_of(matmul_b, graph.entry.data["weights"], folded)


def test_the_weighted_search_keeps_what_the_loud_channels_read(source, tmp_path):
    plain = quantize(source, tmp_path / "plain", "--no-imatrix")
    weighted = quantize(source, tmp_path / "imatrix")  # the default
    # Nearer the float model's logits by a wide margin, and agreeing with its greedy tokens at least as often
    # (the random model's perplexity on random ids says nothing here).
    assert weighted["quality"]["logits_mean_abs"] < 0.5 * plain["quality"]["logits_mean_abs"]
    assert weighted["quality"]["logits_max_abs"] < plain["quality"]["logits_max_abs"]
    assert weighted["quality"]["greedy_agreement"] >= plain["quality"]["greedy_agreement"]
    manifest = json.loads((tmp_path / "imatrix" / "manifest.json").read_text())
    assert manifest["quantization"]["imatrix"] is True
    assert "mean square" in manifest["quantization"]["quantizer"]["algorithm"]
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["quantization"]["imatrix"] is False
    assert (
        "mean square"
        not in json.loads((tmp_path / "plain" / "manifest.json").read_text())["quantization"]["quantizer"]["algorithm"]
    )


def test_the_search_minimises_the_importance_weighted_error():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    channels = np.exp(2 * rng.standard_normal(96)).astype(np.float32)  # mean squares spread over decades
    plain = kquant_blocks(w).dequantize()
    weighted = kquant_blocks(w, importance=channels).dequantize()

    def error(d):
        return float((channels[:, None] * (d - w) ** 2).sum())

    assert error(weighted) < 0.5 * error(plain)
    with pytest.raises(ValueError, match="importance: expected shape"):
        kquant_blocks(w, importance=channels[:-1])


def test_imatrix_applies_to_the_k_quant_recipes_only(source, tmp_path):
    result = invoke("quantize", source, "--bits", 4, "--recipe", "rtn", "--imatrix", "--out", tmp_path / "q")
    assert_user_error(result, "--imatrix applies to --recipe kquant, mixed, measured, not rtn")
    assert not (tmp_path / "q").exists()
