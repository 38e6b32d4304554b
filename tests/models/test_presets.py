"""Acceptance over every preset: export + cross-check on several shapes, the serving variant of every
family, `toolkit presets`, and multi-query attention end to end.

Expected parameter counts are computed by hand in the comments.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import models.registry as registry
import runners.ort as ort_module
from artifact.errors import ConfigError
from exporters.onnx_export import export_model
from models.artifacts import artifact_config
from models.llama import LlamaConfig
from models.presets import PRESETS, get_preset
from models.registry import FAMILIES, build_model
from toolkit.check.crosscheck import cross_check
from toolkit.cli import main

BACKENDS = ["eager", "ort-cpu", "onnx-reference"]
SHAPES = [(1, "short"), (1, "long"), (3, "short"), (3, "long")]
SERVING = {"block": "worked-example", "llama": "decoder-small", "gpt": "gpt-tiny", "encoder-decoder": "vaswani-2017"}


def _sequence(preset: str, which: str) -> int:
    limit = get_preset(preset).config.max_positions
    return 2 if which == "short" else min(7, limit)


def _assert_passed(report):
    failing = [(b.name, b.first_divergence) for b in report.backends if not b.passed]
    assert report.passed, f"diverging backends: {failing}; first divergence {report.first_divergence}"
    assert [b.name for b in report.backends] == BACKENDS
    for backend in report.backends:
        assert {o.name for o in backend.comparison.outputs} == set(report.stages), backend.name


# ---------------------------------------------------------------------------------------------
# acceptance: every preset, two batch sizes x two sequence lengths


@pytest.mark.parametrize("batch,which", SHAPES, ids=[f"b{b}-{w}" for b, w in SHAPES])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_cross_checks_on_every_backend(exported, preset, batch, which):
    artifact = exported(preset)
    sequence = _sequence(preset, which)
    report = cross_check(artifact, BACKENDS, batch=batch, sequence=sequence, seed=batch * 10 + sequence)
    _assert_passed(report)
    shapes = report.inputs
    assert shapes["input_ids" if "input_ids" in shapes else "hidden_states"][:2] == [batch, sequence]
    if "source_ids" in shapes:  # the source is one token longer than the target, within max_positions
        assert shapes["source_ids"] == [batch, min(sequence + 1, get_preset(preset).config.max_positions)]


def test_the_preset_list_is_what_the_issue_describes():
    assert set(PRESETS) == {
        "worked-example",
        "block-small",
        "block-small-post",
        "decoder-small",
        "decoder-small-gqa",
        "decoder-small-post",
        "gpt-tiny",
        "vaswani-2017",
        "modern-2026",
    }
    assert {p.family for p in PRESETS.values()} == set(FAMILIES)


@pytest.mark.parametrize("family", list(SERVING))
def test_serving_variant_of_every_family_cross_checks(exported, family):
    preset = SERVING[family]
    artifact = exported(preset, "serving")
    outputs = list(artifact.output_names)
    # serving exports the model's answer (plus, for language models, any cache it returns), no stages
    if family == "encoder-decoder":
        assert outputs == ["encoder_output", "logits"]
    else:
        assert outputs[0] == "logits"
    assert not any(".block." in name or name.startswith("block.") or "embed_tokens" in name for name in outputs)
    for batch, which in [(1, "short"), (3, "long")]:
        report = cross_check(artifact, BACKENDS, batch=batch, sequence=_sequence(preset, which))
        _assert_passed(report)
        assert report.stages == outputs


def test_a_broken_backend_output_fails_the_acceptance_check(exported, monkeypatch):
    # the acceptance check can fail: corrupt one ONNX Runtime output and the report must say so
    original = ort_module.OrtRunner._infer

    def corrupt(self, feed):
        out = original(self, feed)
        out["logits"] = out["logits"] + 1e-2
        return out

    monkeypatch.setattr(ort_module.OrtRunner, "_infer", corrupt)
    report = cross_check(exported("gpt-tiny"), BACKENDS, batch=1, sequence=2)
    assert not report.passed
    assert report.first_divergence["backend"] == "ort-cpu" and report.first_divergence["stage"] == "logits"


# ---------------------------------------------------------------------------------------------
# `toolkit presets`


def test_presets_json_lists_every_preset_with_hand_checked_counts():
    result = CliRunner().invoke(main, ["presets", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert set(rows) == set(PRESETS)
    for name, row in rows.items():
        assert row["family"] == PRESETS[name].family
        assert {"name", "family", "parameters", "switches"} <= set(row)
        assert row["parameters"] == sum(p.numel() for p in PRESETS[name].build().parameters()), name
    assert rows["gpt-tiny"]["parameters"] == 19_320
    assert rows["worked-example"]["parameters"] == 120  # 2*4 + 4*16 + 3*4*4
    assert rows["block-small"]["parameters"] == 1_752  # 2*12 + 4*144 + 3*12*32
    assert rows["decoder-small"]["parameters"] == 7_504  # 96*16 + 2*(32 + 1,024 + 1,920) + 16
    assert rows["vaswani-2017"]["parameters"] == 18_496
    assert rows["modern-2026"]["parameters"] == 17_664


def test_presets_json_switches():
    rows = {row["name"]: row for row in json.loads(CliRunner().invoke(main, ["presets", "--format", "json"]).output)}
    assert rows["vaswani-2017"]["switches"] == {
        "norm": "layernorm",
        "ffn": "relu",
        "positions": "sinusoidal",
        "norm_placement": "post",
        "biases": True,
    }
    assert rows["modern-2026"]["switches"] == {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "positions": "rope",
        "norm_placement": "pre",
        "biases": False,
    }
    gpt = rows["gpt-tiny"]["switches"]
    assert (gpt["norm"], gpt["ffn"], gpt["positions"], gpt["norm_placement"]) == ("layernorm", "gelu", "learned", "pre")
    assert rows["decoder-small-gqa"]["switches"]["attention"] == "gqa (2 kv heads)"
    assert rows["decoder-small"]["switches"]["attention"] == "mha"
    assert rows["block-small-post"]["switches"]["norm_placement"] == "post"


def test_presets_text_names_every_preset():
    result = CliRunner().invoke(main, ["presets"])
    assert result.exit_code == 0, result.output
    for name in PRESETS:
        assert any(line.startswith(name + " ") for line in result.output.splitlines()), name
    assert "19,320 params" in result.output


def test_presets_command_fails_when_a_ledger_disagrees(monkeypatch):
    family = registry.FAMILIES["encoder-decoder"]
    monkeypatch.setitem(
        registry.FAMILIES, "encoder-decoder", dataclasses.replace(family, parameter_formula=lambda c: 1)
    )
    result = CliRunner().invoke(main, ["presets", "--format", "json"])
    assert result.exit_code == 2
    assert "parameter ledger mismatch for encoder-decoder" in result.output


# ---------------------------------------------------------------------------------------------
# grouped-query / multi-query attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 3), (4, 8), (6, 4)])
def test_kv_heads_must_divide_heads(heads, kv_heads):
    with pytest.raises(ConfigError, match=r"kv_heads: expected a divisor of heads"):
        LlamaConfig(width=24, heads=heads, kv_heads=kv_heads)


@pytest.fixture(scope="module")
def mqa_artifact(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=32, width=16, heads=4, kv_heads=1, ff_width=24, layers=2, max_positions=8, tie_embeddings=False
    )
    out = tmp_path_factory.mktemp("mqa") / "artifact"
    return export_model(build_model("llama", config, seed=3), "llama", config, out, seed=3), config


def test_multi_query_attention_exports_and_cross_checks(mqa_artifact):
    artifact, config = mqa_artifact
    assert artifact_config(artifact).kv_heads == 1
    for batch, sequence in [(1, 2), (3, 8)]:
        _assert_passed(cross_check(artifact, BACKENDS, batch=batch, sequence=sequence))


def test_multi_query_attention_weights_and_count(mqa_artifact):
    artifact, config = mqa_artifact
    V, d, f, L, kv_width = 32, 16, 24, 2, 4  # one KV head of width 16/4
    hand = 2 * V * d + L * (2 * d + 2 * d * d + 2 * d * kv_width + 3 * d * f) + d
    model = build_model("llama", config)
    assert sum(p.numel() for p in model.parameters()) == hand == FAMILIES["llama"].parameter_formula(config)
    assert FAMILIES["llama"].switches(config)["attention"] == "gqa (1 kv heads)"
    weights = artifact.graphs[0].weights
    assert "block.0.attention.k_proj.weight" in weights and "block.1.attention.v_proj.weight" in weights


def test_mqa_shares_one_key_value_head_across_query_heads():
    # with one KV head, every query head attends over the same keys: equal queries give equal probabilities
    config = LlamaConfig(vocab_size=10, width=8, heads=2, kv_heads=1, ff_width=8, layers=1, max_positions=8)
    model = build_model("llama", config, seed=1).double()
    with torch.no_grad():
        q = model.block[0].attention.q_proj.weight
        q[4:] = q[:4]  # head 1's query projection := head 0's
        probs = model(torch.tensor([[1, 2, 3, 4]]))["block.0.attention_weights"]
    np.testing.assert_array_equal(probs[0, 0].numpy(), probs[0, 1].numpy())
