"""toolkit/explain/walkthrough.py: the worked-example walkthrough and the gradient check, including that both can fail."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import toolkit.explain.walkthrough as trace_mod
from models.llama import ProbedBlockConfig
from models.registry import build_model
from models.worked_example import build_worked_example, worked_example_inputs
from toolkit.explain.walkthrough import gradient_check, render_text, worked_example_walkthrough

# hand-derived worked-example quantities (see tests/models/test_llama.py for the derivation)
P0 = 1 / (1 + math.exp((4 + 4 * math.sin(1)) / math.sqrt(2)))  # head 0, query 1, key 0
SIG2 = 1 / (1 + math.exp(-2))
PROBE = [[1.0, 0.0, -1.0], [0.0, 1.0, -1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


@pytest.fixture(scope="module")
def trace():
    return worked_example_walkthrough()


def _stub_gradient_check(model, x):
    # the failure-detection tests below only concern the other checks; skip the slow finite differences
    return {
        "loss": "L",
        "input_coordinates": 0,
        "parameter_coordinates": 0,
        "delta": 1e-6,
        "max_abs_error": 0.0,
        "tolerance": 2e-5,
        "passed": True,
    }


# ---------------------------------------------------------------------------------------------
# the real trace


def test_trace_input_and_stage_shapes(trace):
    assert trace["input"]["shape"] == [1, 3, 4]
    assert trace["input"]["rows"] == [[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]]
    shapes = {name: s["shape"] for name, s in trace["stages"].items()}
    assert shapes == {
        "block.0.attention_norm": [1, 3, 4],
        "block.0.attention_weights": [1, 2, 3, 3],
        "block.0.attention_branch": [1, 3, 4],
        "block.0.after_attention": [1, 3, 4],
        "block.0.feed_forward_norm": [1, 3, 4],
        "block.0.feed_forward_branch": [1, 3, 4],
        "block.0.output": [1, 3, 4],
        "logits": [1, 3, 3],
    }
    assert trace["config"]["eps"] == 0.0 and trace["config"]["heads"] == 2 and trace["config"]["width"] == 4


def test_trace_masked_attention_exactly_zero(trace):
    entries = trace["attention"]
    assert [(e["head"], e["query"]) for e in entries] == [(h, q) for h in range(2) for q in range(3)]
    expected_masked = {0: [1, 2], 1: [2], 2: []}
    for e in entries:
        assert e["masked_keys"] == expected_masked[e["query"]]
        assert e["masked_exactly_zero"] is True
        for key in e["masked_keys"]:
            assert e["probabilities"][key] == 0.0
        assert sum(e["probabilities"]) == pytest.approx(1.0, abs=1e-15)
    head0_q1 = entries[1]["probabilities"]
    assert head0_q1[0] == pytest.approx(P0, rel=1e-12)
    assert entries[2]["probabilities"] == pytest.approx([1 / 3] * 3, rel=1e-14)


def test_trace_causality_passes(trace):
    c = trace["causality"]
    assert c["passed"] is True
    assert c["changed"] == "token 2 only"
    assert len(c["prefix_rows_bitwise_equal"]) == 8 and all(c["prefix_rows_bitwise_equal"].values())


def test_trace_gradient_check_passes_with_expected_coordinates(trace):
    g = trace["gradient_check"]
    assert g["input_coordinates"] == 12  # 1 x 3 x 4
    assert g["parameter_coordinates"] == 120  # 2*4 + 4*16 + 3*4*4
    assert g["passed"] is True
    # central differences with delta 1e-6 in float64: rounding error ~1e-9, far below the tolerance
    assert 0 <= g["max_abs_error"] < 1e-7 <= g["tolerance"]


def test_trace_residual_merges_exact(trace):
    merges = trace["residual_merges"]
    assert set(merges) == {"attention", "feed_forward"}
    assert merges["attention"]["max_abs_deviation"] == 0.0
    assert merges["feed_forward"]["max_abs_deviation"] == 0.0


def test_trace_pre_vs_post_rows_differ_and_match_hand_values(trace):
    c = trace["pre_vs_post"]
    assert c["stage"] == "after_attention" and c["token"] == 1
    # pre: x1 + attention = (0,2,0,0) + (2 p0, 2(1-p0), 0, 0)
    np.testing.assert_allclose(c["pre_norm"], [2 * P0, 4 - 2 * P0, 0, 0], rtol=1e-12, atol=1e-15)
    # post (the chapter's Post-LN, the original Transformer's): LayerNorm(x + MHA(x)). MHA on the raw row 2*e1
    # equals MHA on its RMSNorm (rms 1, unit gain), so the sum is the same v; LayerNorm subtracts v's mean
    # (1) and divides by its standard deviation, eps 0, gain 1, bias 0.
    v = np.array([2 * P0, 4 - 2 * P0, 0, 0])
    centred = v - v.mean()
    layer_norm = centred / np.sqrt((centred**2).mean())
    np.testing.assert_allclose(c["post_norm"], layer_norm, rtol=1e-12, atol=1e-14)
    assert sum(c["post_norm"]) == pytest.approx(0, abs=1e-14)  # mean-subtracted ...
    assert not np.allclose(c["post_norm"], v / np.sqrt((v**2).mean()), atol=0.1)  # ... so not RMSNorm's v / rms(v)
    assert not np.allclose(c["pre_norm"], c["post_norm"], atol=1e-3)
    assert c["pre_norm_formula"] == "x + MHA(RMSNorm(x))"
    assert c["post_norm_formula"].startswith("LayerNorm(x + MHA(x))") and "v - mean(v)" in c["post_norm_formula"]
    assert c["post_norm_parameters"] == {
        "gain": [1.0] * 4,
        "bias": [0.0] * 4,
        "eps": 0.0,
        "note": "the worked example has no LayerNorm: gain from its attention_norm (all ones), bias 0",
    }


def test_post_norm_contrast_is_layernorm_of_the_residual_sum_for_any_token(trace):
    """Every token: MHA(x) from the block's own attention module (same weights, raw input), LayerNorm in numpy."""
    model = build_worked_example().double()
    x = torch.from_numpy(worked_example_inputs()["hidden_states"]).double()
    with torch.no_grad():
        branch = model.block[0].attention(x)[0].numpy()
        after = model(x)["block.0.after_attention"]
    s = x.numpy() + branch
    want = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True))
    for token in range(3):
        c = trace_mod.pre_vs_post(model, x, after, token)
        np.testing.assert_allclose(c["post_norm"], want[0, token], rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(c["pre_norm"], after[0, token].numpy())


def test_trace_text_shows_the_layernorm_contrast(trace):
    text = render_text(trace)
    assert "Post-LN LayerNorm(x + MHA(x))" in text and "Pre-LN  x + MHA(RMSNorm(x))" in text
    assert "LayerNorm mean-subtracted, eps 0; the worked example has no LayerNorm" in text
    (post,) = [line for line in text.splitlines() if line.startswith("  post: ")]
    assert post.startswith("  post: [" + ", ".join(f"{v: .6f}" for v in trace["pre_vs_post"]["post_norm"]) + "]")


def test_trace_probe_logits(trace):
    probe = trace["probe"]
    assert probe["matrix"] == PROBE
    y0 = 4 + 4 * SIG2
    np.testing.assert_allclose(probe["logits"][0], [y0, 0, -y0], rtol=1e-14, atol=0)
    y = np.array(trace["stages"]["block.0.output"]["rows"])
    np.testing.assert_allclose(probe["logits"], y @ np.array(PROBE), rtol=1e-13, atol=1e-14)


def test_trace_parameter_ledger(trace):
    p = trace["parameters"]
    assert p["total"] == 120 and p["formula"] == 120 and p["tensor_count"] == 9 and p["bias_free"] is True
    assert [t["scalars"] for t in p["tensors"]] == [4, 16, 16, 16, 16, 4, 16, 16, 16]


def test_trace_is_json_serialisable_and_renders(trace):
    json.dumps(trace, allow_nan=False)
    text = render_text(trace)
    assert "FAIL" not in text and "MASKED NOT ZERO" not in text
    assert "causality" in text and text.count("PASS") == 2
    assert "masked exactly 0" in text


# ---------------------------------------------------------------------------------------------
# the trace's checks can fail


def _patched_builder(patch_stages):
    """A build_worked_example replacement whose forward post-processes the real stages."""

    def build(placement="pre"):
        model = build_worked_example(placement)
        real_forward = model.forward

        def forward(x, position_offset=0):
            return patch_stages(dict(real_forward(x, position_offset)), x)

        model.forward = forward
        return model

    return build


def test_trace_detects_causality_violation(monkeypatch):
    def leak_last_token(stages, x):
        # every row of the output now depends on the last token
        stages["block.0.output"] = stages["block.0.output"] + x[:, -1:, :].sum(-1, keepdim=True)
        return stages

    monkeypatch.setattr(trace_mod, "build_worked_example", _patched_builder(leak_last_token))
    monkeypatch.setattr(trace_mod, "gradient_check", _stub_gradient_check)
    t = worked_example_walkthrough()
    assert t["causality"]["passed"] is False
    assert t["causality"]["prefix_rows_bitwise_equal"]["block.0.output"] is False
    assert t["causality"]["prefix_rows_bitwise_equal"]["block.0.attention_norm"] is True
    assert t["residual_merges"]["feed_forward"]["max_abs_deviation"] > 0
    assert "FAIL" in render_text(t)


def test_trace_detects_masked_probability_leak(monkeypatch):
    def leak_mask(stages, x):
        stages["block.0.attention_weights"] = stages["block.0.attention_weights"] + 1e-300
        return stages

    monkeypatch.setattr(trace_mod, "build_worked_example", _patched_builder(leak_mask))
    monkeypatch.setattr(trace_mod, "gradient_check", _stub_gradient_check)
    t = worked_example_walkthrough()
    flags = [(e["query"], e["masked_exactly_zero"]) for e in t["attention"]]
    assert flags == [(0, False), (1, False), (2, True)] * 2  # query 2 has no masked keys
    assert "MASKED NOT ZERO" in render_text(t)


# ---------------------------------------------------------------------------------------------
# gradient_check on its own


class _Toy(nn.Module):
    """output = (x @ W)^2, optionally with a gradient that is wrong while the value is right."""

    def __init__(self, width, broken=False):
        super().__init__()
        self.config = SimpleNamespace(width=width)
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(width, width, generator=g, dtype=torch.float64))
        self.broken = broken

    def forward(self, x):
        y = x @ self.weight
        # y * y.detach() has the value y^2 but autograd sees only half of d(y^2) = 2 y dy
        return {"block.0.output": y * y.detach() if self.broken else y * y}


def _x(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gradient_check_passes_on_correct_toy():
    g = gradient_check(_Toy(3), _x((1, 2, 3)))
    assert g["passed"] is True
    assert g["input_coordinates"] == 6 and g["parameter_coordinates"] == 9
    assert g["max_abs_error"] < 1e-7


def test_gradient_check_fails_on_wrong_analytic_gradient():
    g = gradient_check(_Toy(3, broken=True), _x((1, 2, 3)))
    assert g["passed"] is False
    assert g["max_abs_error"] > 1e-2


class _HalfGradient(nn.Module):
    """The real worked-example block, with the value unchanged but the analytic gradient halved."""

    def __init__(self):
        super().__init__()
        self.inner = build_worked_example()
        self.config = self.inner.config

    def forward(self, x):
        out = self.inner(x)["block.0.output"]
        return {"block.0.output": 0.5 * out + 0.5 * out.detach()}


def test_gradient_check_fails_on_detached_worked_example():
    x = torch.from_numpy(worked_example_inputs()["hidden_states"])
    g = gradient_check(_HalfGradient(), x)
    assert g["input_coordinates"] == 12 and g["parameter_coordinates"] == 120
    assert g["passed"] is False
    assert g["max_abs_error"] > g["tolerance"]


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_gradient_check_passes_on_random_block(placement):
    model = build_model(
        "block", ProbedBlockConfig(width=4, heads=2, ff_width=4, max_positions=4, norm_placement=placement), seed=3
    )
    g = gradient_check(model, _x((1, 3, 4), 4))
    assert g["parameter_coordinates"] == 120
    assert g["passed"] is True


class _DisconnectedParameter(nn.Module):
    """A parameter that changes the output but is cut from autograd: its .grad stays None."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(width=2)
        self.scale = nn.Parameter(torch.tensor([2.0, 3.0], dtype=torch.float64))

    def forward(self, x):
        return {"block.0.output": x * self.scale.detach()}


def test_gradient_check_reports_disconnected_parameter_as_failure():
    g = gradient_check(_DisconnectedParameter(), _x((1, 2, 2)))
    assert g["passed"] is False
