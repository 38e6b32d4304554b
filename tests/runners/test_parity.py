"""Parity: float64 eager vs ONNX Runtime vs the ONNX reference evaluator, and a check that can fail.

Random configs (block pre/post, llama tied/untied, GQA, both RoPE pairings) are
exported once per module; sizes differ from the traced sample (B=2, T=3) to
exercise the dynamic axes. Besides toolkit.check.cross_check (whose oracle is
rebuilt from the artifact's initializers), outputs are compared against the
model rebuilt from its seed, which does not depend on the artifact at all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from artifact import MANIFEST_FILE
from artifact.errors import InputError
from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.llama import LlamaConfig, ProbedBlockConfig
from models.presets import get_preset
from models.registry import build_model
from runners.registry import create_runner
from toolkit.check.crosscheck import cross_check, graph_feed

RANDOM_CONFIGS = {
    # post-norm block, grouped-query attention, Hugging Face ("half") RoPE pairing, eps = 0
    "block-post-gqa-half": (
        "block",
        11,
        ProbedBlockConfig(
            width=8,
            heads=4,
            kv_heads=2,
            ff_width=12,
            max_positions=10,
            rope_pairing="half",
            norm_placement="post",
            probe_width=3,
            eps=0.0,
            rope_base=100.0,
        ),
    ),
    # untied stacked decoder, multi-query attention (1 KV head), half pairing
    "llama-untied-mqa-half": (
        "llama",
        5,
        LlamaConfig(
            vocab_size=13,
            layers=2,
            width=8,
            heads=2,
            kv_heads=1,
            ff_width=10,
            max_positions=9,
            rope_pairing="half",
            tie_embeddings=False,
            rope_base=500.0,
        ),
    ),
}
# The two presets cover the remaining legs: a pre-norm block and a tied, interleaved-RoPE decoder.
PRESET_CASES = {"block-small": "block-small", "decoder-small": "decoder-small"}
BACKENDS = {"eager", "ort-cpu", "onnx-reference"}


@pytest.fixture(scope="module")
def random_exports(tmp_path_factory):
    out = {}
    for key, (family, seed, config) in RANDOM_CONFIGS.items():
        directory = tmp_path_factory.mktemp(key) / "artifact"
        export_model(build_model(family, config, seed), family, config, directory, seed=seed)
        out[key] = (open_artifact(directory), family, seed, config)
    return out


@pytest.fixture
def case(request, exported, random_exports):
    """(artifact, family, seed, config) for a case key."""
    key = request.param
    if key in PRESET_CASES:
        spec = get_preset(PRESET_CASES[key])
        return exported(spec.name), spec.family, spec.seed, spec.config
    return random_exports[key]


ALL_CASES = [*PRESET_CASES, *RANDOM_CONFIGS]


def random_feed(family: str, config, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if family == "block":
        return {"hidden_states": rng.standard_normal((batch, seq, config.width)).astype(np.float32)}
    return {"input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64)}


def seed_oracle(family: str, seed: int, config, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float64 eager model rebuilt from (family, config, seed): independent of the exported file."""
    model = build_model(family, config, seed).double()
    args = [torch.from_numpy(v).double() if v.dtype.kind == "f" else torch.from_numpy(v) for v in feed.values()]
    with torch.no_grad():
        return {k: v.numpy() for k, v in model(*args).items()}


def sizes(config):
    return [(1, 1), (3, 7 if config.max_positions >= 7 else config.max_positions), (2, config.max_positions)]


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
def test_cross_check_passes_at_dynamic_sizes(case):
    artifact, family, seed, config = case
    for batch, seq in sizes(config):
        report = cross_check(artifact, batch=batch, sequence=seq, seed=batch * 100 + seq)
        assert {b.name for b in report.backends} == BACKENDS
        first_input = next(iter(report.inputs.values()))
        assert first_input[:2] == [batch, seq]
        for backend in report.backends:
            assert backend.comparison, (batch, seq, backend.name, backend.first_divergence)
            assert [o.name for o in backend.comparison.outputs] == artifact.output_names
        assert report.passed and report.first_divergence is None


@pytest.mark.parametrize("case", ALL_CASES, indirect=True)
@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference"])
def test_backends_match_the_model_rebuilt_from_its_seed(case, backend):
    artifact, family, seed, config = case
    batch, seq = 3, min(7, config.max_positions)
    feed = random_feed(family, config, batch, seq, seed=42)
    got = create_runner(backend, artifact).run(feed)
    want = seed_oracle(family, seed, config, feed)
    assert list(got) == list(want)  # same stages, same order
    for name in want:
        assert got[name].shape == want[name].shape, name
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=5e-5 * scale, err_msg=f"{backend} {name}")


def test_attention_weights_are_causal_at_full_window(random_exports):
    artifact, family, seed, config = random_exports["block-post-gqa-half"]
    feed = random_feed(family, config, 2, config.max_positions, seed=3)
    probs = create_runner("ort-cpu", artifact).run(feed)["block.0.attention_weights"]
    T = config.max_positions
    assert probs.shape == (2, config.heads, T, T)
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(probs[..., future] == 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)


def test_serving_logits_match_stages_logits(exported):
    stages, serving = exported("decoder-small", "stages"), exported("decoder-small", "serving")
    config = get_preset("decoder-small").config
    cache = [f"present.{i}.{kind}" for i in range(config.layers) for kind in ("key", "value")]
    assert serving.output_names == ["logits", *cache]
    for batch, seq in [(1, 1), (3, 7), (2, config.max_positions)]:
        feed = random_feed("llama", config, batch, seq, seed=seq)
        full = create_runner("ort-cpu", stages).run(feed)["logits"]
        only = create_runner("ort-cpu", serving).run(graph_feed(serving.graph(), feed, {}))
        assert only["logits"].shape == (batch, seq, config.vocab_size)
        np.testing.assert_allclose(only["logits"], full, rtol=1e-5, atol=1e-5)
        # The prefill's cache holds one key/value row per prompt position.
        assert only["present.0.key"].shape == (batch, config.kv_heads, seq, config.head_width)
    report = cross_check(serving, batch=2, sequence=4)
    assert report.passed and report.stages == ["logits", *cache]


def test_sequence_beyond_max_positions_is_refused(exported):
    with pytest.raises(InputError, match="33.*max_positions=32"):
        cross_check(exported("decoder-small"), batch=1, sequence=33)


# --------------------------------------------------------------------------- a check that must fail


def corrupt_weight(source: Path, target: Path, weight: str) -> None:
    """Copy an artifact and make its graph (only) use a perturbed copy of `weight`.

    The manifest still maps `weight` to the original initializer, so the eager oracle is
    the true model while ONNX Runtime and the reference evaluator compute with the
    perturbed tensor. The manifest hash is updated so the artifact loads.
    """
    shutil.copytree(source, target)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    entry = manifest["graphs"][0] if "graphs" in manifest else manifest
    model_path = target / entry.get("file", "model.onnx")
    original = entry["weights"][weight]["initializer"]
    proto = onnx.load(str(model_path))
    array = numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == original))
    bad = numpy_helper.from_array((array * 1.5 + 0.25).astype(array.dtype), name=f"{original}__corrupted")
    proto.graph.initializer.append(bad)
    rewired = 0
    for node in proto.graph.node:
        for k, name in enumerate(node.input):
            if name == original:
                node.input[k] = bad.name
                rewired += 1
    assert rewired, f"no node consumes {original}"
    data = proto.SerializeToString()
    model_path.write_bytes(data)
    entry["sha256" if "graphs" in manifest else "model_sha256"] = hashlib.sha256(data).hexdigest()
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "case,weight,stage",
    [
        ("block-small", "block.0.attention_norm.weight", "block.0.attention_norm"),
        ("block-small", "block.0.attention.k_proj.weight", "block.0.attention_weights"),
        ("block-small", "block.0.attention.v_proj.weight", "block.0.attention_branch"),  # probabilities unaffected
        ("block-small", "block.0.feed_forward.up_proj.weight", "block.0.feed_forward_branch"),
        ("block-small", "probe", "logits"),
        # post-norm: the attention norm comes after the attention stages, which must still pass
        ("block-post-gqa-half", "block.0.attention_norm.weight", "block.0.attention_norm"),
        ("block-post-gqa-half", "block.0.feed_forward.down_proj.weight", "block.0.feed_forward_branch"),
        ("decoder-small", "block.1.attention.q_proj.weight", "block.1.attention_weights"),
        ("decoder-small", "final_norm.weight", "final_norm"),
    ],
    indirect=["case"],
)
def test_corrupted_weight_fails_at_the_first_downstream_stage(case, weight, stage, tmp_path):
    artifact = case[0]
    target = tmp_path / "corrupted"
    corrupt_weight(artifact.directory, target, weight)
    report = cross_check(open_artifact(target), batch=2, sequence=4)
    assert not report.passed
    divergence = report.first_divergence
    assert divergence["stage"] == stage
    assert divergence["backend"] in {"ort-cpu", "onnx-reference"}
    assert divergence["index"] == report.stages.index(stage)
    results = {b.name: b for b in report.backends}
    assert results["eager"].passed  # eager is rebuilt from the untouched mapping: it agrees with the oracle
    for name in ("ort-cpu", "onnx-reference"):
        backend = results[name]
        assert not backend.comparison and backend.first_divergence == stage
        upstream = report.stages[: report.stages.index(stage)]
        assert all(backend.comparison[s].passed for s in upstream), name
        assert backend.comparison[stage].max_abs > backend.comparison[stage].allowed
