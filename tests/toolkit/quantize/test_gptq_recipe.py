"""`toolkit quantize --recipe gptq`: E[x^T x] read from the float model, the calibration text it samples, and the
recipe end to end on the one-layer decoder of test_quantize.py.

GPTQ's rounding itself is held to its objective in tests/exporters/test_gptq.py; here the second moments are held
to forward hooks on the float64 model (a second way of reading the same inputs), the sampled text to the float
model's own likelihood, and the artifact to round-to-nearest's logit error and to its dequantized reference.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from artifact.errors import ConfigError
from exporters.quantize import (
    HEAD,
    GraphWeights,
    constant_matmul_weights,
    head_copies,
    head_copy,
    prepare_proto,
    torch_weight,
)
from models.artifacts import artifact_config, open_artifact
from models.registry import has_cache, lm_defaults
from runners.decoding.generate import CachedLM
from runners.eager import model_from_artifact
from runners.registry import create_runner
from tests.models.test_checkpoints import hf_llama
from tests.peak_memory import ROOT
from tests.toolkit.quantize.planted import export_planted, planted_model
from tests.toolkit.quantize.test_importance import LOUD, LOUDER
from tests.toolkit.quantize.test_quantize import mnb_dequantize, ort_logits, quantized, source  # noqa: F401 (fixtures)
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.check.crosscheck import cross_check
from toolkit.quantize import importance, pipeline
from toolkit.quantize.importance import hessians
from toolkit.quantize.sensitivity import (
    Calibration,
    _whole_rows,
    calibration,
    calibration_ids,
    sampled_calibration,
    weights_of,
)

pytestmark = pytest.mark.slow


def hessian_inputs(artifact):
    """(the constant MatMul weights, the weight map, the folded transposes, the tied head's B or None) of the
    artifact's one graph: what hessians() takes."""
    graph = artifact.graphs[0]
    proto = onnx.load(graph.model_path)
    weights = GraphWeights(proto, str(graph.model_path.parent), graph.model_path)
    prepared, folded = prepare_proto(proto, weights)
    matmul_b = set(constant_matmul_weights(prepared, weights))
    source_map = graph.entry.data["weights"]
    head = torch_weight(weights, source_map[HEAD])
    return matmul_b, source_map, folded, head_copy(head_copies(weights, matmul_b, head), head)


def test_hessians_are_the_second_moments_of_each_weights_input(tmp_path):
    """hessians(): for each MatMul B, E[x^T x] over the calibration text of the input its torch weight reads,
    equal to forward pre-hooks' on the float64 model (q_proj, o_proj and the tied head, called as modules); the
    tied head's B, a folded transpose the weight map does not name, only when passed as `also`."""
    artifact = open_artifact(export_planted(tmp_path / "float", 1, [0, 32], 0.01))
    matmul_b, source_map, folded, head_b = hessian_inputs(artifact)
    assert head_b is not None and head_b not in weights_of(matmul_b, source_map, folded, head=True)
    with pytest.raises(ConfigError, match=f"MatMul weight {head_b} holds no weight"):
        hessians(calibration(artifact), matmul_b, source_map, folded)
    found = hessians(calibration(artifact), matmul_b, source_map, folded, {head_b: HEAD})
    held = weights_of(matmul_b, source_map, folded, head=True)
    held[head_b] = [{"name": HEAD}]
    assert set(found) == set(held) == matmul_b
    config, model = planted_model(1, [0, 32], 0.01, torch.float64)
    seen = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "o_proj", "lm_head")):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0]))
    with torch.no_grad():
        model(torch.tensor([calibration_ids(artifact, config)]))
    by_name = {e["name"]: b for b, entries in held.items() for e in entries}
    assert len(seen) == 5
    for name, x in seen.items():
        flat = x.reshape(-1, x.shape[-1]).numpy()
        want = flat.T @ flat / len(flat)
        got = found[by_name[f"{name}.weight"]]
        assert got.shape == want.shape == (flat.shape[1], flat.shape[1])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max(), err_msg=name)


def test_the_calibration_text_is_sampled_on_the_backend_asked_for(source, monkeypatch):  # noqa: F811
    """sampled_calibration's backend names the runner that samples (the recipes' ort-cpu unless told): the eager
    float64 model writes a text of the same shape from the same prompts."""
    import runners.registry

    made, create = [], runners.registry.create_runner
    monkeypatch.setattr(
        runners.registry, "create_runner", lambda name, *a, **k: made.append(name) or create(name, *a, **k)
    )
    base = calibration(source)
    ort, f64 = (sampled_calibration(source, base, 2, 20, backend=b).feed["input_ids"] for b in ("ort-cpu", "eager-f64"))
    assert made == ["ort-cpu", "eager-f64"]
    piece = len(base.feed["input_ids"][0]) // 2
    assert ort.shape == f64.shape == (2, 20) and np.array_equal(ort[:, :piece], f64[:, :piece])


def test_hessians_of_many_rows_sum_every_pass(tmp_path, monkeypatch):
    """A text of 7 rows run 3 rows a pass (3 + 3 + 1): the same E[x^T x] as one pass over all 7 (which the test
    above holds to the float64 model), so no row is dropped or counted twice."""
    artifact = open_artifact(export_planted(tmp_path / "float", 1, [0, 32], 0.01))
    matmul_b, source_map, folded, head_b = hessian_inputs(artifact)
    base = calibration(artifact)
    ids = np.random.default_rng(0).integers(0, artifact_config(artifact).vocab_size, (7, 12))
    text = Calibration(base.model, base.runner, {"input_ids": ids, **lm_defaults(base.runner.input_specs, ids)})
    whole = hessians(text, matmul_b, source_map, folded, {head_b: HEAD})
    monkeypatch.setattr(importance, "PASS_ROWS", 3)
    passes = hessians(text, matmul_b, source_map, folded, {head_b: HEAD})
    assert set(passes) == set(whole) == matmul_b
    for b, want in whole.items():
        np.testing.assert_allclose(passes[b], want, rtol=1e-9, atol=1e-12 * np.abs(want).max(), err_msg=b)


def test_the_sampled_calibration_text_is_the_float_models_own(source):  # noqa: F811
    """rows x tokens ids, each row opening with a slice of the calibration text and continued by sampling the float
    model: the same for the same seed, and far likelier under the float model (eager, float64 softmax) than ids
    drawn uniformly."""
    config = artifact_config(source)
    base = calibration(source)
    sampled = sampled_calibration(source, base, 4, 40)
    ids = sampled.feed["input_ids"]
    assert ids.shape == (4, 40) and ids.dtype == np.int64 and 0 <= ids.min() and ids.max() < config.vocab_size
    assert np.array_equal(ids, sampled_calibration(source, base, 4, 40).feed["input_ids"])
    text = base.feed["input_ids"][0].tolist()
    piece = len(text) // 4
    for i, row in enumerate(ids):
        assert row[:piece].tolist() == text[i * piece : (i + 1) * piece]
    model = model_from_artifact(source).double().eval()

    def mean_log_likelihood(rows):
        with torch.no_grad():
            logits = model(torch.from_numpy(rows))["logits"].double()
        log_probs = torch.log_softmax(logits[:, piece - 1 : -1], dim=-1)
        return float(log_probs.gather(-1, torch.from_numpy(rows[:, piece:, None])).mean())

    uniform = np.random.default_rng(0).integers(0, config.vocab_size, ids.shape)
    uniform[:, :piece] = ids[:, :piece]
    assert mean_log_likelihood(ids) > mean_log_likelihood(uniform) + 0.5


def test_the_gptq_recipe_is_closer_to_float_than_round_to_nearest(source, quantized, tmp_path):  # noqa: F811
    """--recipe gptq: round-to-nearest's layout (uint8 zero points, no offsets), logits nearer the float model's
    than rtn's, and the artifact checks against its dequantized reference with cached decode steps."""
    target, report = tmp_path / "gptq", tmp_path / "gptq.json"
    options = ("--recipe", "gptq", "--bits", 4, "--accuracy-level", 0, "--greedy-tokens", 4)
    result = invoke("quantize", source.directory, *options, "--out", target, "--json", report)
    assert result.exit_code == 0 and "(block 32, gptq," in result.stdout, result.output
    artifact = open_artifact(target)
    made = artifact.manifest.quantization
    assert made["quantizer"]["tool"] == "exporters.gptq" and "GPTQ" in made["quantizer"]["algorithm"]
    proto = onnx.load(str(artifact.model_path))
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and not [i for i in proto.graph.initializer if i.name.endswith("_offsets")]
    assert all(len(n.input) > 3 and n.input[3] for n in nodes)  # integer zero points, as rtn's
    # Held-out text of the kind GPTQ calibrates on: the float model's own, sampled with another seed. (On
    # uniform random ids, which this random model never writes, GPTQ is no better than rtn.)
    held_out = sampled_calibration(source, calibration(source), 8, 48, seed=1).feed["input_ids"]
    float_logits = ort_logits(source, held_out)
    error = {
        "gptq": np.abs(ort_logits(artifact, held_out) - float_logits).mean(),
        "rtn": np.abs(ort_logits(quantized[4][0], held_out) - float_logits).mean(),
    }
    assert error["gptq"] < error["rtn"], error
    assert json.loads(report.read_text())["quality"]["logits_mean_abs"] > 0
    check = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


def test_gptq_damping_reaches_every_weight_and_the_manifest(source, tmp_path, monkeypatch):  # noqa: F811
    """--gptq-damping: every weight GPTQ rounds is rounded with it, and the manifest records it (the default where
    it is not given, tested beside it; what the damping changes in the rounding is tests/exporters/test_gptq.py's)."""
    real, seen = pipeline.gptq_blocks, []

    def spy(*args):
        seen.append(args[5])
        return real(*args)

    monkeypatch.setattr(pipeline, "gptq_blocks", spy)
    options = ("--recipe", "gptq", "--bits", 4, "--accuracy-level", 0, "--greedy-tokens", 2, "--gptq-damping", 0.01)
    result = invoke("quantize", source.directory, *options, "--out", tmp_path / "q")
    assert result.exit_code == 0, result.output
    made = open_artifact(tmp_path / "q").manifest.quantization
    assert made["gptq_damping"] == 0.01
    assert seen and seen == [0.01] * made["quantized_matmuls"], seen


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        (("--recipe", "rtn", "--gptq-damping", 0.01), ("--gptq-damping", "--recipe rtn")),
        (("--recipe", "gptq", "--gptq-damping", "nan"), ("--gptq-damping", "nan")),
        (("--recipe", "gptq", "--gptq-damping", "inf"), ("--gptq-damping", "inf")),
        (("--recipe", "gptq", "--gptq-damping", 0), ("--gptq-damping",)),
    ],
)
def test_gptq_damping_is_refused_where_it_means_nothing(source, tmp_path, options, fragments):  # noqa: F811
    """Not GPTQ, or not a finite share above 0: one line, exit 2, nothing written."""
    out = tmp_path / "q"
    assert_user_error(invoke("quantize", source.directory, "--bits", 4, *options, "--out", out), *fragments)
    assert not out.exists()


def test_the_gptq_recipe_needs_bits(source, tmp_path):  # noqa: F811
    out = tmp_path / "q"
    assert_user_error(invoke("quantize", source.directory, "--recipe", "gptq", "--out", out), "--bits is required")
    assert not out.exists()


@pytest.mark.parametrize("zero_points", ["integer", "offsets"])
def test_widths_that_do_not_fill_a_block_quantize_and_check_with_gptq(tmp_path, zero_points):
    """Width 48 and FFN 80: every K leaves its last block of 32 partial, padded as the k-quant recipes pad it. The
    graph computes its dequantized weights: check passes at level 0 on all three backends with cached decode
    steps."""
    config = {"vocab_size": 96, "layers": 1, "width": 48, "heads": 4, "kv_heads": 2, "ff_width": 80}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"family": "llama", "seed": 0, "config": config}))
    assert invoke("export", "--config", path, "--variant", "serving", "--out", tmp_path / "float").exit_code == 0
    options = ("--recipe", "gptq", "--zero-points", zero_points, "--accuracy-level", 0, "--greedy-tokens", 2)
    result = invoke("quantize", tmp_path / "float", "--bits", 4, *options, "--out", tmp_path / "q")
    assert result.exit_code == 0 and "(block 32, gptq," in result.stdout, result.output
    quantization = open_artifact(tmp_path / "q").manifest.quantization
    assert quantization["zero_points_chosen"][zero_points] == quantization["quantized_matmuls"]
    check = invoke("check", tmp_path / "q", "--backends", "eager,ort-cpu,onnx-reference", "--decode-steps", 2)
    assert check.exit_code == 0 and "RESULT: PASS" in check.output, check.output


def _head_and_rest(proto, vocab_size):
    """(the vocabulary projection's MatMulNBits node, its bits, the set of every other MatMulNBits' bits)."""
    head, head_bits, rest = None, None, set()
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            if attrs["N"] == vocab_size:
                assert head is None, "two MatMulNBits of the vocabulary's width"
                head, head_bits = node, attrs["bits"]
            else:
                rest.add(attrs["bits"])
    assert head is not None, "no MatMulNBits of the vocabulary's width"
    return head, head_bits, rest


def test_head_bits_puts_the_vocabulary_projection_alone_at_8_bits(source, tmp_path):  # noqa: F811
    """--head-bits 8: gptq rounds the head at 8 bits and every other MatMul at 4, the head's values (read back by
    the MatMulNBits spec, mnb_dequantize) far nearer the float head's than at 4 bits; kquant --head-bits 8 writes
    exactly mixed's weights (mixed is kquant with an 8-bit head); the manifest and the summary line say so."""
    vocab = artifact_config(source).vocab_size
    float_head = model_from_artifact(source).lm_head.weight.detach().double().numpy().T  # [K, N]
    errors = {}
    for head_bits in (4, 8):
        target = tmp_path / f"gptq-{head_bits}"
        options = ("--recipe", "gptq", "--bits", 4, "--head-bits", head_bits, "--greedy-tokens", 2)
        result = invoke("quantize", source.directory, *options, "--out", target)
        assert result.exit_code == 0, result.output
        assert ("8-bit head" in result.stdout) == (head_bits == 8), result.stdout
        artifact = open_artifact(target)
        assert artifact.manifest.quantization["head_bits"] == head_bits
        proto = onnx.load(str(artifact.model_path))
        head, bits, rest = _head_and_rest(proto, vocab)
        assert (bits, rest) == (head_bits, {4})
        errors[head_bits] = np.abs(mnb_dequantize(proto, head) - float_head).mean()
    assert errors[8] < errors[4] / 8, errors
    made = {}
    for recipe, extra in (("kquant", ("--head-bits", 8)), ("mixed", ())):
        target = tmp_path / recipe
        result = invoke("quantize", source.directory, "--recipe", recipe, "--bits", 4, *extra, "--out", target)
        assert result.exit_code == 0, result.output
        proto = onnx.load(str(open_artifact(target).model_path))
        assert _head_and_rest(proto, vocab)[1] == 8
        made[recipe] = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert made["kquant"].keys() == made["mixed"].keys()
    assert all(np.array_equal(made["kquant"][name], made["mixed"][name]) for name in made["mixed"])


def test_measured_keeps_the_head_at_head_bits_with_every_other_weight_promoted(source, tmp_path):  # noqa: F811
    """--recipe measured --head-bits 4: the head is not among the weights measured, so with every other weight
    allowed 8 bits (--promote-share 1, all promoted) it alone stays at 4."""
    options = ("--recipe", "measured", "--bits", 4, "--head-bits", 4, "--promote-share", 1, "--greedy-tokens", 2)
    result = invoke("quantize", source.directory, *options, "--out", tmp_path / "q")
    assert result.exit_code == 0, result.output
    artifact = open_artifact(tmp_path / "q")
    assert artifact.manifest.quantization["promotion"]["share_promoted"] == 1
    proto = onnx.load(str(artifact.model_path))
    assert _head_and_rest(proto, artifact_config(source).vocab_size)[1:] == (4, {8})


@pytest.mark.parametrize(
    "options, fragment",
    [
        (("--recipe", "gptq", "--bits", 8, "--head-bits", 4), "--head-bits 4 is narrower than --bits 8"),
        (("--recipe", "rtn", "--bits", 4, "--head-bits", 8), "--head-bits applies to --recipe kquant"),
        (("--bits", 4, "--head-bits", 8), "not the default recipe (name one with --recipe)"),
    ],
)
def test_head_bits_is_refused_where_it_means_nothing(source, tmp_path, options, fragment):  # noqa: F811
    assert_user_error(invoke("quantize", source.directory, *options, "--out", tmp_path / "q"), fragment)
    assert not (tmp_path / "q").exists()


def test_gptq_with_float_minimums_holds_them_as_offsets(source, quantized, tmp_path):  # noqa: F811
    """--recipe gptq --zero-points offsets --head-bits 8: mixed's layout (float minimums as offsets beside each
    4-bit MatMulNBits, an 8-bit head), every weight rounded by GPTQ; logits on held-out text of the float model's
    own nearer the float model's than round-to-nearest's and mixed's, the manifest and the quantizer entry say
    so, and the artifact checks against its dequantized reference with cached decode steps."""
    options = ("--bits", 4, "--accuracy-level", 0, "--greedy-tokens", 2)
    made = {}
    for name, extra in (
        ("gptq", ("--recipe", "gptq", "--zero-points", "offsets", "--head-bits", 8)),
        ("mixed", ("--recipe", "mixed")),
    ):
        result = invoke("quantize", source.directory, *options, *extra, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
        made[name] = open_artifact(tmp_path / name)
    quantization = made["gptq"].manifest.quantization
    proto = onnx.load(str(made["gptq"].model_path))
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert quantization["zero_points"] == "offsets"
    assert quantization["zero_points_chosen"] == {"integer": 0, "offsets": len(nodes)}
    assert "float minimums" in quantization["quantizer"]["algorithm"]
    assert len([i for i in proto.graph.initializer if i.name.endswith("_offsets")]) == len(nodes)
    assert not [n for n in nodes if len(n.input) > 3 and n.input[3]]  # no integer zero points
    assert _head_and_rest(proto, artifact_config(source).vocab_size)[1:] == (8, {4})
    held_out = sampled_calibration(source, calibration(source), 8, 48, seed=1).feed["input_ids"]
    float_logits = ort_logits(source, held_out)
    error = {name: np.abs(ort_logits(artifact, held_out) - float_logits).mean() for name, artifact in made.items()}
    error["rtn"] = np.abs(ort_logits(quantized[4][0], held_out) - float_logits).mean()
    assert error["gptq"] < min(error["rtn"], error["mixed"]), error
    check = cross_check(made["gptq"], ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


def test_gptq_auto_takes_each_weight_as_integer_or_offsets_gptq_makes_it(tmp_path):
    """--recipe gptq --zero-points auto: each MatMulNBits weight is, bit for bit, the one --zero-points integer or
    offsets makes of it (which one is exporters/gptq.py's rule, held there to the output error), with offsets
    beside exactly the ones taken from offsets; the manifest counts each kind and the artifact checks against its
    dequantized reference with cached decode steps. On the planted loud-channel model (tests/toolkit/quantize/
    test_importance.py) the down projection whose small weights meet loud channels takes float minimums and the
    rest integer zero points."""
    planted = export_planted(tmp_path / "float", 1, LOUD, 1 / LOUDER)
    options = ("--recipe", "gptq", "--bits", 4, "--accuracy-level", 0, "--greedy-tokens", 2)
    graphs, artifacts = {}, {}
    for mode in ("integer", "offsets", "auto"):
        result = invoke("quantize", planted, *options, "--zero-points", mode, "--out", tmp_path / mode)
        assert result.exit_code == 0, result.output
        artifacts[mode] = open_artifact(tmp_path / mode)
        graphs[mode] = onnx.load(str(artifacts[mode].model_path))

    def matmuls(proto):  # [([B, scales], whether an Add adds block offsets to its output)] in graph order
        arrays = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        added = {
            i for n in proto.graph.node if n.op_type == "Add" and any(x.endswith("_offsets") for x in n.input)
            for i in n.input
        }  # fmt: skip
        nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
        return [([arrays[name] for name in n.input[1:3]], n.output[0] in added) for n in nodes]

    made = {mode: matmuls(proto) for mode, proto in graphs.items()}
    taken = {"integer": 0, "offsets": 0}
    for auto, integer, offsets in zip(made["auto"], made["integer"], made["offsets"], strict=True):
        mode = "offsets" if auto[1] else "integer"
        other = {"integer": integer, "offsets": offsets}[mode]
        assert other[1] == auto[1] and all(np.array_equal(a, b) for a, b in zip(auto[0], other[0], strict=True))
        taken[mode] += 1
    quantization = artifacts["auto"].manifest.quantization
    assert quantization["zero_points"] == "auto" and quantization["zero_points_chosen"] == taken
    assert taken["offsets"] >= 1 and taken["integer"] >= 1, taken
    assert "output error" in quantization["quantizer"]["algorithm"]
    check = cross_check(artifacts["auto"], ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert check.passed, [(b.name, b.first_divergence) for b in check.backends]


# hessians() of every MatMul weight of an artifact in a fresh child, its peak counted from the float model loaded.
HESSIANS_CHILD = """
import json, sys
from exporters.quantize import HEAD
from models.artifacts import open_artifact
from tests.toolkit.quantize.test_gptq_recipe import hessian_inputs
from toolkit.bench.machine import peak_rss_kb
from toolkit.quantize.importance import hessians
from toolkit.quantize.sensitivity import calibration
artifact = open_artifact(sys.argv[1])
matmul_b, source_map, folded, head_b = hessian_inputs(artifact)
calibrated = calibration(artifact)
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # VmHWM from here
base = peak_rss_kb() * 1024
found = hessians(calibrated, matmul_b, source_map, folded, {head_b: HEAD} if head_b else {})
print(json.dumps({"extra": peak_rss_kb() * 1024 - base, "held": sum(h.nbytes for h in found.values())}))
"""


def test_hessians_hold_one_copy_of_the_second_moments(tmp_path):
    """gptq sizes its passes by E[x^T x] of the weights each measures, so measuring them costs about that once:
    a 4-layer Llama with a 4096-wide feed-forward (520 MiB of second moments, most of them the down projections')
    peaks 1.00x them above the loaded float model (measured; with each mean made beside its sum, 1.98x)."""
    hf_llama(width=256, heads=4, kv_heads=2, ff=4096, layers=4, vocab=1000).save_pretrained(tmp_path / "hf")
    exported = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "float", "--no-verify", "--quiet")
    assert exported.exit_code == 0, exported.output
    out = subprocess.run(
        [sys.executable, "-c", HESSIANS_CHILD, str(tmp_path / "float")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["held"] > 500 * 2**20
    assert measured["extra"] < 1.25 * measured["held"], measured


def test_gptq_measures_in_passes_what_half_the_memory_cannot_hold_at_once(source, tmp_path, monkeypatch):  # noqa: F811
    """With half the memory available holding only the largest weight's E[x^T x], the recipe measures the second
    moments in several forward passes and writes exactly the weights of one pass; a weight whose own would not
    fit is refused up front, with the numbers, before any output is written."""
    from toolkit import memory

    monkeypatch.setenv("TOOLKIT_PROGRESS", "1")  # the progress lines say how many passes
    config = artifact_config(source)
    largest = 8 * max(config.width, config.ff_width) ** 2
    options = ("--recipe", "gptq", "--bits", 4, "--greedy-tokens", 2)
    result = invoke("quantize", source.directory, *options, "--out", tmp_path / "one")
    assert result.exit_code == 0 and "passes to fit" not in result.stderr, result.stderr
    monkeypatch.setattr(memory, "available_memory", lambda: 2 * largest + 16)
    result = invoke("quantize", source.directory, *options, "--out", tmp_path / "passes")
    assert result.exit_code == 0, result.output
    assert "passes to fit half the memory available" in result.stderr, result.stderr
    made = {}
    for name in ("one", "passes"):
        proto = onnx.load(str(open_artifact(tmp_path / name).model_path))
        made[name] = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert made["one"].keys() == made["passes"].keys()
    assert all(np.array_equal(made["one"][k], made["passes"][k]) for k in made["one"])
    monkeypatch.setattr(memory, "available_memory", lambda: largest)
    monkeypatch.delenv("TOOLKIT_PROGRESS")
    result = invoke("quantize", source.directory, *options, "--out", tmp_path / "refused")
    assert_user_error(result, "alone takes", "more than half of the", "use --recipe mixed")
    assert not (tmp_path / "refused").exists()


def test_gptq_samples_a_stages_export_whole_rows_at_a_time(tmp_path, monkeypatch):
    """A stages export has no KV cache: the calibration text is sampled by feeding every row whole at each token.
    On this one-layer model it is the text the serving export samples through its cache (the same seed; a deeper
    model can sample a near-tie the other way), and the two quantize to the same MatMulNBits weights, bit for
    bit; the progress line says why the sampling is slower."""
    config = {"vocab_size": 96, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"family": "llama", "seed": 0, "config": config}))
    made = {}
    for variant in ("stages", "serving"):
        assert invoke("export", "--config", path, "--variant", variant, "--out", tmp_path / variant).exit_code == 0
        artifact = open_artifact(tmp_path / variant)
        assert has_cache(artifact.input_specs) == (variant == "serving")
        made[variant] = sampled_calibration(artifact, calibration(artifact), 4, 40).feed["input_ids"]
    assert np.array_equal(made["stages"], made["serving"])
    # The text alone says little on a random model whose next token hardly depends on the context: the logits of
    # each step, whole rows against the serving graph's cache, are held to the same function.
    whole = _whole_rows(create_runner("ort-cpu", open_artifact(tmp_path / "stages")))
    cached = CachedLM(create_runner("ort-cpu", open_artifact(tmp_path / "serving")), 16).step
    rng = np.random.default_rng(0)
    for width in (5, 1, 1, 3):
        ids = rng.integers(0, config["vocab_size"], (2, width))
        np.testing.assert_allclose(whole(ids), cached(ids), rtol=1e-5, atol=1e-5)
    weights = {}
    monkeypatch.setenv("TOOLKIT_PROGRESS", "1")
    for variant in ("stages", "serving"):
        options = ("--bits", 4, "--recipe", "gptq", "--greedy-tokens", 2)
        result = invoke("quantize", tmp_path / variant, *options, "--out", tmp_path / f"q-{variant}")
        assert result.exit_code == 0, result.output
        assert ("no KV cache in this stages export: every row is fed whole" in result.stderr) == (
            variant == "stages"
        ), result.stderr
        proto = onnx.load(str(open_artifact(tmp_path / f"q-{variant}").model_path))
        arrays = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
        weights[variant] = [[arrays[name] for name in n.input[1:]] for n in nodes]
    assert len(weights["stages"]) == len(weights["serving"]) > 0
    for a, b in zip(weights["stages"], weights["serving"], strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
