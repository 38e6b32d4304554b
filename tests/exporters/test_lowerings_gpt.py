"""The gpt family (models/gpt.py) through the standard and ort lowerings (exporters/lowering_attention.GPTAttention).

Two configs: the gpt-tiny preset (head width 6, no attention biases: the opset-23 Attention kernel on both
lowerings) and a two-layer one with biases on every projection at head width 8 (the ort lowering's
GroupQueryAttention reads the packed, biased QKV and rotates nothing). Each export is judged stage by stage and
on cached decode steps against the float64 eager oracle (`toolkit check`), and its ONNX Runtime logits against
the functions lowering's. tests/models/test_hf_decoders_lowerings.py holds GPT-2 checkpoints to transformers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from exporters.lowerings import LOWERINGS, MS_DOMAIN, lowering_support
from exporters.onnx_export import VARIANTS, export_model
from models.gpt import GPTConfig
from models.presets import get_preset
from models.registry import build_model, get_family
from runners.decoding.generate import CachedLM
from runners.registry import create_runner
from tests.exporters.test_lowering_switches import GQA, SEQUENCE, assert_stages_pass_check, node_attributes, ops
from tests.exporters.test_lowerings import BACKENDS, assert_padded_batch_matches_the_oracle
from tests.toolkit.test_cli import invoke

PRESET = get_preset("gpt-tiny")
BIASED = GPTConfig(
    vocab_size=64, width=32, heads=4, ff_width=48, context=32, layers=2, attention_bias=True, activation="gelu_tanh"
)
CONFIGS = {"gpt-tiny": PRESET.config, "biased": BIASED}
TOLERANCE = 1e-4  # ONNX Runtime float32 against ONNX Runtime float32, as assert_padded_batch_matches_the_oracle


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(config name, lowering, variant): artifact}, the functions lowering's included (the logits' yardstick)."""
    models = {"gpt-tiny": PRESET.build(), "biased": build_model("gpt", BIASED, seed=7)}
    out = {}
    for name, config in CONFIGS.items():
        for lowering in LOWERINGS:
            for variant in VARIANTS:
                path = tmp_path_factory.mktemp(f"{name}-{lowering}-{variant}") / "a"
                out[name, lowering, variant] = export_model(
                    models[name], "gpt", config, path, variant=variant, lowering=lowering
                )
    return out


def test_every_lowering_admits_the_gpt_family(exports):
    for name, config in CONFIGS.items():
        assert lowering_support("gpt", config) == {"functions": None, "standard": None, "ort": None}
        assert exports[name, "ort", "serving"].manifest.lowerings == {"functions": None, "standard": None, "ort": None}


@pytest.mark.parametrize("lowering", ["standard", "ort"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stages_pass_check_stage_by_stage(exports, name, lowering):
    """Attention probabilities included: the stages graph keeps every stage as an output."""
    artifact = exports[name, lowering, "stages"]
    assert artifact.output_names == list(get_family("gpt").stage_names(CONFIGS[name]))
    assert_stages_pass_check(artifact, lowering, CONFIGS[name].layers)


@pytest.mark.parametrize("lowering", ["standard", "ort"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_steps_pass_toolkit_check(exports, name, lowering):
    """The serving graph: a prefill and three cached steps on every backend the lowering runs on (the standard
    lowering's on the ONNX reference evaluator too), against float64 eager."""
    artifact = exports[name, lowering, "serving"]
    backends = ",".join(BACKENDS[lowering])
    result = invoke("check", artifact.directory, "--decode-steps", 3, "--seq-len", SEQUENCE, "--backends", backends)
    assert result.exit_code == 0, result.output
    assert "decode.2.logits" in result.output and "RESULT: PASS" in result.output, result.output


@pytest.mark.parametrize("lowering", ["standard", "ort"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_the_functions_lowerings(exports, name, lowering):
    """On ONNX Runtime, prefill (stages graph) and a cached decode past the prefill (serving graph) give the
    functions lowering's logits."""
    rng = np.random.default_rng(len(name))
    ids = rng.integers(0, CONFIGS[name].vocab_size, (2, SEQUENCE))
    kinds = ("functions", lowering)
    prefill = [
        create_runner("ort-cpu", exports[name, kind, "stages"]).run({"input_ids": ids})["logits"] for kind in kinds
    ]
    np.testing.assert_allclose(prefill[1], prefill[0], rtol=0, atol=TOLERANCE)
    steps = []
    for kind in kinds:
        lm = CachedLM(create_runner("ort-cpu", exports[name, kind, "serving"]), CONFIGS[name].max_positions)
        steps.append([lm.step(ids[:, :4])[:, -1]] + [lm.step(ids[:, t : t + 1])[:, -1] for t in range(4, SEQUENCE)])
    np.testing.assert_allclose(np.stack(steps[1], 1), np.stack(steps[0], 1), rtol=0, atol=TOLERANCE)
    # The cached decode continues the prefill: each step's logits are the stages graph's at that position.
    np.testing.assert_allclose(np.stack(steps[1], 1), prefill[1][:, 3:], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_padded_batch_with_a_cache_matches_the_oracle(exports, lowering):
    """Rows with different histories: the learned positions are read at each row's position_ids."""
    assert_padded_batch_matches_the_oracle(exports["biased", lowering, "serving"], [[3, 4, 5], [5, 6, 7]], seed=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_standard_graphs_rebuild_attention_as_plain_opset_23(exports, variant):
    """Attention per layer, nothing rotated; LayerNorm and GELU are the traced standard ops."""
    for name, config in CONFIGS.items():
        artifact = exports[name, "standard", variant]
        proto = onnx.load(str(artifact.model_path))
        assert {(o.domain, o.version) for o in proto.opset_import} == {("", 23)} and not proto.functions
        counts = ops(artifact)
        assert counts["", "Attention"] == config.layers
        assert counts["", "LayerNormalization"] == 2 * config.layers + 1  # two per block and the final norm
        assert counts["", "Gelu"] == config.layers
        assert counts["", "Softmax"] == counts["", "RotaryEmbedding"] == 0
        assert not any(domain for domain, _ in counts)
        entry = artifact.graphs[0].entry.data
        assert (entry["attention_op"], entry["rotary_op"]) == ("Attention (opset 23)", None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ort_graphs_fuse_qkv_and_pack_it_into_group_query_attention(exports, variant):
    """Head width 8 and no RoPE: GroupQueryAttention reads the fused, biased QKV whole (no Split, no do_rotary).
    Head width 6 (gpt-tiny): the Attention kernel after the fused projection's Split."""
    biased = exports["biased", "ort", variant]
    counts = ops(biased)
    layers = BIASED.layers
    assert biased.graphs[0].entry.attention_op == GQA and biased.graphs[0].entry.data["rotary_op"] is None
    assert counts[MS_DOMAIN, "GroupQueryAttention"] == layers and counts["", "Attention"] == 0
    assert counts["", "Split"] == 0 and counts[MS_DOMAIN, "RotaryEmbedding"] == 0
    # One MatMul for Q/K/V, o_proj, up_proj and down_proj per block, plus the head.
    assert counts["", "MatMul"] == 4 * layers + 1
    proto = onnx.load(str(biased.model_path))
    for node in (n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        assert list(node.input[1:3]) == ["", ""]  # packed
    for attrs in node_attributes(biased, "GroupQueryAttention"):
        assert attrs.get("do_rotary", 0) == 0 and (attrs["num_heads"], attrs["kv_num_heads"]) == (4, 4)
        assert "scale" not in attrs  # the kernel's default 1/sqrt(head_width), as models/gpt.py
    assert biased.graphs[0].weights["block.1.attention.k_proj.bias"].slice == (0, 32, 64)  # the fused QKV bias
    tiny = exports["gpt-tiny", "ort", variant]
    counts = ops(tiny)
    assert tiny.graphs[0].entry.attention_op == "Attention (opset 23)"
    assert counts["", "Attention"] == counts["", "Split"] == PRESET.config.layers
    assert counts["", "MatMul"] == 4 * PRESET.config.layers + 1
    assert counts["", "LayerNormalization"] == 2 * PRESET.config.layers + 1
