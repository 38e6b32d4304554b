"""toolkit/explain/inspect.py and `toolkit inspect`: parameter ledger by group, memory ledger, GQA counts.

Every expected number is computed by hand here from the architecture description.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

import models.registry as registry
from artifact.errors import ModelFileError
from models.llama import LlamaConfig, ProbedBlockConfig
from models.presets import get_preset
from models.registry import build_model
from toolkit.cli import main
from toolkit.explain.inspect import describe, memory_ledger, parameter_count, parameter_ledger

GPT_TINY = 19_320  # 2*290*24 + 24*24 + (4*24^2 + 2*24*48 + 48 + 5*24) + 2*24


def _preset_model(name):
    spec = get_preset(name)
    return spec.build(), spec.family, spec.config


# ---------------------------------------------------------------------------------------------
# memory ledger


def test_gpt_tiny_training_state_is_16_bytes_per_parameter():
    config = get_preset("gpt-tiny").config
    ledger = memory_ledger(GPT_TINY, config, batch=1, sequence=24)
    # float32 weight + gradient + Adam m + Adam v = 4 copies x 4 bytes
    assert ledger["training_state_bytes"] == 16 * 19_320 == 309_120


@pytest.mark.parametrize("batch,sequence", [(1, 24), (3, 7), (2, 1)])
def test_gpt_tiny_batch_dependent_sizes_by_hand(batch, sequence):
    config = get_preset("gpt-tiny").config  # 4 heads, vocabulary 290
    ledger = memory_ledger(GPT_TINY, config, batch=batch, sequence=sequence)
    scores = batch * 4 * sequence * sequence
    logits = batch * sequence * 290
    assert ledger["batch"] == batch and ledger["sequence"] == sequence
    assert ledger["attention_scores_per_layer"] == {"elements": scores, "bytes": 4 * scores}
    assert ledger["logits"] == {"elements": logits, "bytes": 4 * logits}
    assert ledger["training_flops_per_step_estimate"] == 6 * 19_320 * batch * sequence


def test_memory_ledger_hand_values_for_one_shape():
    ledger = memory_ledger(GPT_TINY, get_preset("gpt-tiny").config, batch=3, sequence=7)
    assert ledger["attention_scores_per_layer"] == {"elements": 588, "bytes": 2_352}  # 3*4*7*7
    assert ledger["logits"] == {"elements": 6_090, "bytes": 24_360}  # 3*7*290
    assert ledger["training_flops_per_step_estimate"] == 2_434_320  # 6 * 19,320 * 21


def test_memory_ledger_without_a_vocabulary_has_no_logits_entry():
    config = ProbedBlockConfig(width=12, heads=3, ff_width=32)
    ledger = memory_ledger(1_752, config, batch=2, sequence=5)
    assert ledger["logits"] is None
    assert ledger["attention_scores_per_layer"]["elements"] == 2 * 3 * 5 * 5
    assert ledger["training_state_bytes"] == 16 * 1_752


# ---------------------------------------------------------------------------------------------
# parameter ledger


def test_gpt_tiny_ledger_groups_by_hand_and_sum_to_the_total():
    ledger = parameter_ledger(*_preset_model("gpt-tiny"))
    d, V, C, f = 24, 290, 24, 48
    expected_groups = {
        "token embedding": {"tensors": 1, "scalars": V * d},  # 6,960
        "position embedding": {"tensors": 1, "scalars": C * d},  # 576
        "attention": {"tensors": 4, "scalars": 4 * d * d},  # 2,304
        "norms": {"tensors": 6, "scalars": 6 * d},  # 3 LayerNorms x (gain + shift) = 144
        "feed-forward": {"tensors": 4, "scalars": 2 * d * f + f + d},  # 2,376
        "vocabulary head": {"tensors": 1, "scalars": V * d},  # 6,960
    }
    assert ledger["groups"] == expected_groups
    assert sum(g["scalars"] for g in ledger["groups"].values()) == ledger["total"] == GPT_TINY
    assert sum(g["tensors"] for g in ledger["groups"].values()) == ledger["tensor_count"] == 17
    assert ledger["formula"] == GPT_TINY
    assert ledger["bias_free"] is False
    assert sum(t["scalars"] for t in ledger["tensors"]) == GPT_TINY


@pytest.mark.parametrize(
    "preset", ["worked-example", "block-small", "decoder-small", "decoder-small-gqa", "vaswani-2017", "modern-2026"]
)
def test_groups_sum_to_the_total_and_every_tensor_is_grouped(preset):
    model, family, config = _preset_model(preset)
    ledger = parameter_ledger(model, family, config)
    assert sum(g["scalars"] for g in ledger["groups"].values()) == ledger["total"]
    assert ledger["total"] == sum(p.numel() for p in model.parameters())
    assert "other" not in ledger["groups"]
    for tensor in ledger["tensors"]:
        assert tensor["scalars"] == int(torch.tensor(tensor["shape"]).prod()), tensor["name"]


def test_encoder_decoder_ledger_separates_cross_attention():
    ledger = parameter_ledger(*_preset_model("vaswani-2017"))
    d = 16
    # 2 decoder layers x (4 projections of d^2 + 4 biases of d)
    assert ledger["groups"]["cross-attention"] == {"tensors": 2 * 8, "scalars": 2 * (4 * d * d + 4 * d)}
    # 2 encoder + 2 decoder self-attentions
    assert ledger["groups"]["attention"] == {"tensors": 4 * 8, "scalars": 4 * (4 * d * d + 4 * d)}
    assert ledger["bias_free"] is False
    assert parameter_ledger(*_preset_model("modern-2026"))["bias_free"] is True


def test_tied_head_counts_once():
    model, family, config = _preset_model("decoder-small")  # V=96, d=16, tied
    ledger = parameter_ledger(model, family, config)
    assert "vocabulary head" not in ledger["groups"]
    assert ledger["groups"]["token embedding"]["scalars"] == 96 * 16
    assert parameter_count(model) == ledger["total"]


def test_ledger_raises_when_the_family_formula_disagrees(monkeypatch):
    family = registry.FAMILIES["gpt"]
    monkeypatch.setitem(registry.FAMILIES, "gpt", dataclasses.replace(family, parameter_formula=lambda c: 19_321))
    with pytest.raises(ModelFileError, match=r"mismatch for gpt: formula gives 19,321, tensors sum to 19,320"):
        parameter_ledger(*_preset_model("gpt-tiny"))


def test_ledger_raises_when_a_tensor_is_missing_from_the_formula():
    model, family, config = _preset_model("gpt-tiny")
    model.extra = torch.nn.Parameter(torch.zeros(3))  # a tensor the formula does not know
    with pytest.raises(ModelFileError, match="tensors sum to 19,323"):
        parameter_ledger(model, family, config)


# ---------------------------------------------------------------------------------------------
# grouped-query attention counts


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("tie", [True, False])
def test_gqa_parameter_formula_matches_real_tensors(kv_heads, tie):
    V, d, heads, f, L = 20, 16, 4, 24, 2
    kv_width = kv_heads * (d // heads)
    block = 2 * d + 2 * d * d + 2 * d * kv_width + 3 * d * f  # gains, Q and O, K and V, gate/up/down
    hand = (1 if tie else 2) * V * d + L * block + d
    config = LlamaConfig(
        vocab_size=V, width=d, heads=heads, kv_heads=kv_heads, ff_width=f, layers=L, tie_embeddings=tie
    )
    model = build_model("llama", config)
    assert sum(p.numel() for p in model.parameters()) == hand
    ledger = parameter_ledger(model, "llama", config)
    assert ledger["total"] == ledger["formula"] == hand
    k_shape = dict(model.named_parameters())["block.0.attention.k_proj.weight"].shape
    assert tuple(k_shape) == (kv_width, d)


def test_decoder_small_gqa_preset_count_by_hand():
    # V=96, d=16, 4 heads, 2 kv heads (kv width 8), d_ff=40, 2 layers, untied:
    # 2*96*16 = 3,072; block 32 + 512 + 256 + 1,920 = 2,720; x2 = 5,440; + 16 = 8,528
    ledger = parameter_ledger(*_preset_model("decoder-small-gqa"))
    assert ledger["total"] == 8_528


# ---------------------------------------------------------------------------------------------
# describe / `toolkit inspect`


def test_inspect_cli_shows_the_ledger_by_group_and_training_bytes(exported):
    artifact = exported("gpt-tiny")
    result = CliRunner().invoke(main, ["inspect", str(artifact.directory), "--batch", "3", "--seq-len", "7"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "parameters: 19,320 in 17 tensors; formula 19,320 (checked)" in out
    assert "training state 309,120 bytes" in out
    for group, tensors, scalars in [
        ("token embedding", 1, "6,960"),
        ("position embedding", 1, "576"),
        ("attention", 4, "2,304"),
        ("norms", 6, "144"),
        ("feed-forward", 4, "2,376"),
        ("vocabulary head", 1, "6,960"),
    ]:
        row = [*group.split(), str(tensors), "tensors", scalars]
        assert any(line.split() == row for line in out.splitlines()), group
    assert "B*h*T*T = 588 (2,352 bytes float32)" in out
    assert "B*T*V = 6,090 (24,360 bytes float32)" in out
    assert "LayerNormalization x3" in out and "Gelu x1" in out


def test_inspect_cli_json_defaults_to_batch_one_full_context(exported):
    result = CliRunner().invoke(main, ["inspect", str(exported("gpt-tiny").directory), "--format", "json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["family"] == "gpt" and info["variant"] == "stages"
    assert info["memory"]["training_state_bytes"] == 309_120
    assert info["memory"]["batch"] == 1 and info["memory"]["sequence"] == 24
    assert info["memory"]["attention_scores_per_layer"]["elements"] == 1 * 4 * 24 * 24
    assert info["parameters"]["total"] == GPT_TINY and info["parameters"]["tensor_count"] == 17
    assert [g["name"] for g in info["graphs"]] == ["model"]


def test_describe_encoder_decoder_lists_both_graphs(exported):
    info = describe(exported("vaswani-2017").directory, batch=2, sequence=5)
    assert [g["name"] for g in info["graphs"]] == ["encoder", "decoder"]
    encoder, decoder = info["graphs"]
    assert [i["name"] for i in encoder["inputs"]] == ["source_ids"]
    assert [i["name"] for i in decoder["inputs"]] == ["input_ids", "encoder_output"]
    assert info["parameters"]["total"] == 18_496
    assert info["memory"]["training_state_bytes"] == 16 * 18_496
    assert info["memory"]["logits"]["elements"] == 2 * 5 * 64


def test_inspect_cli_missing_path_is_a_one_line_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
