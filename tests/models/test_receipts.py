"""tests/models/receipts.py: gradient, causality and padding receipts, each shown to pass and to fail.

The cross-entropy oracle is numpy (log-sum-exp written out); the failing models are
deliberately broken wrappers (a frozen or detached tensor, a non-causal mixer).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models.presets import get_preset
from models.registry import build_model
from tests.models.receipts import (
    IGNORE_INDEX,
    causality_receipt,
    gradient_receipt,
    padding_receipt,
    token_cross_entropy,
)

LLAMA_PRESETS = ["decoder-small", "decoder-small-gqa", "decoder-small-post"]
LM_PRESETS = ["gpt-tiny", *LLAMA_PRESETS]


def _model(preset, seed=0, dtype=torch.float64):
    spec = get_preset(preset)
    return build_model(spec.family, spec.config, seed=seed).to(dtype)


def _ids(B, T, V, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, V, size=(B, T), dtype=np.int64))


def _np_cross_entropy(logits, targets, ignore=IGNORE_INDEX):
    logits = np.asarray(logits, dtype=np.float64)
    targets = np.asarray(targets)
    total, count = 0.0, 0
    for b in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            if targets[b, t] == ignore:
                continue
            row = logits[b, t]
            m = row.max()
            total += m + math.log(np.exp(row - m).sum()) - row[targets[b, t]]
            count += 1
    return total / count


class NonCausal(nn.Module):
    """Wraps a language model and adds the mean over time of its token embeddings to every position."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        stages = dict(self.inner(input_ids))
        context = self.inner.embed_tokens(input_ids).mean(dim=1, keepdim=True)  # (B, 1, d): sees the future
        stages["logits"] = stages["logits"] + self.inner.lm_head(context)
        return stages


class Detached(nn.Module):
    """Wraps a model so one module's parameters are used through .detach(): no gradient can reach them."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        norm = inner.final_norm
        norm.forward = lambda x: F.layer_norm(
            x, norm.normalized_shape, norm.weight.detach(), norm.bias.detach(), norm.eps
        )

    def forward(self, input_ids):
        return self.inner(input_ids)


def _padded_targets(ids, valid_lengths, V, seed):
    targets = _ids(*ids.shape, V, seed)
    for b, n in enumerate(valid_lengths):
        targets[b, n:] = IGNORE_INDEX
    return targets


# ---------------------------------------------------------------------------------------------
# token_cross_entropy


def test_cross_entropy_of_uniform_logits_is_log_vocab_by_hand():
    logits = torch.zeros(2, 3, 7, dtype=torch.float64)
    targets = torch.tensor([[0, 6, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]])
    assert float(token_cross_entropy(logits, targets)) == pytest.approx(math.log(7), rel=1e-15)


def test_cross_entropy_two_token_example_by_hand():
    # row 0: logits (0, ln 3) target 1 -> -ln(3/4); row 1 is padding (huge logits, ignored);
    # row 2: logits (ln 2, 0) target 1 -> -ln(1/3). Mean over the 2 valid targets, not the 3 positions.
    logits = torch.tensor([[[0.0, math.log(3)], [1e4, -1e4], [math.log(2), 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[1, IGNORE_INDEX, 1]])
    expected = (-math.log(3 / 4) - math.log(1 / 3)) / 2
    assert float(token_cross_entropy(logits, targets)) == pytest.approx(expected, rel=1e-14)


def test_cross_entropy_matches_numpy_and_excludes_padding_from_both_sums():
    V = 11
    logits = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 5, V)) * 3)
    targets = _padded_targets(torch.zeros(3, 5, dtype=torch.long), [5, 2, 1], V, 1)
    got = float(token_cross_entropy(logits, targets))
    assert got == pytest.approx(_np_cross_entropy(logits.numpy(), targets.numpy()), rel=1e-13)
    # the padded positions' logits cannot move the result
    scrambled = logits.clone()
    scrambled[targets == IGNORE_INDEX] = 1e3 * torch.randn(int((targets == IGNORE_INDEX).sum()), V, dtype=torch.float64)
    assert float(token_cross_entropy(scrambled, targets)) == pytest.approx(got, rel=1e-14)
    # dividing by all 15 positions instead of the 8 valid targets would give 8/15 of the value
    assert got != pytest.approx(got * 8 / 15)


def test_cross_entropy_with_a_custom_ignore_index():
    logits = torch.from_numpy(np.random.default_rng(2).standard_normal((1, 4, 5)))
    targets = torch.tensor([[1, 0, 4, 0]])
    got = float(token_cross_entropy(logits, targets, ignore_index=0))
    expected = _np_cross_entropy(logits.numpy(), targets.numpy(), ignore=0)
    assert got == pytest.approx(expected, rel=1e-13)


def test_padded_positions_cannot_poison_the_loss_even_with_masked_logits():
    # position 1 is padding; its logits forbid class 0 (-inf), as a model masking the pad token would
    logits = torch.tensor([[[0.0, 1.0, 2.0], [-math.inf, 0.0, 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[2, IGNORE_INDEX]])
    expected = math.log(1 + math.exp(-1) + math.exp(-2))  # -log softmax(0, 1, 2)[2]
    assert float(token_cross_entropy(logits, targets)) == pytest.approx(expected, rel=1e-14)


def test_cross_entropy_of_all_padding_raises():
    with pytest.raises(ValueError, match="every target is padding"):
        token_cross_entropy(torch.zeros(1, 2, 3), torch.full((1, 2), IGNORE_INDEX))


# ---------------------------------------------------------------------------------------------
# gradient receipt


def test_gpt_tiny_gradient_receipt_every_one_of_17_tensors_gets_a_gradient():
    model = _model("gpt-tiny", seed=1)
    ids = _ids(3, 6, 290, 3)
    targets = _padded_targets(ids, [6, 3, 1], 290, 4)
    receipt = gradient_receipt(model, ids, targets)
    assert receipt["passed"] is True and receipt["dead"] == []
    assert receipt["tensors"] == 17
    assert set(receipt["gradient_norms"]) == {n for n, _ in model.named_parameters()}
    for name, norm in receipt["gradient_norms"].items():
        assert math.isfinite(norm) and norm > 0, name
    with torch.no_grad():
        logits = model(ids)["logits"].numpy()
    assert receipt["loss"] == pytest.approx(_np_cross_entropy(logits, targets.numpy()), rel=1e-12)
    assert all(p.grad is None for p in model.parameters())  # the receipt leaves no gradients behind


def test_gradient_norms_match_an_independent_autograd_pass():
    model = _model("gpt-tiny", seed=2)
    ids = _ids(2, 5, 290, 5)
    targets = _padded_targets(ids, [5, 2], 290, 6)
    receipt = gradient_receipt(model, ids, targets)
    logits = model(ids)["logits"]
    flat_targets = targets.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, 290), flat_targets, ignore_index=IGNORE_INDEX)  # torch's own mean
    loss.backward()
    assert receipt["loss"] == pytest.approx(loss.item(), rel=1e-12)
    for name, p in model.named_parameters():
        assert receipt["gradient_norms"][name] == pytest.approx(float(p.grad.norm()), rel=1e-10), name


@pytest.mark.parametrize("preset", LLAMA_PRESETS)
def test_llama_gradient_receipt_passes(preset):
    model = _model(preset, seed=3)
    V = model.config.vocab_size
    ids = _ids(2, 5, V, 7)
    receipt = gradient_receipt(model, ids, _padded_targets(ids, [5, 3], V, 8))
    assert receipt["passed"] and receipt["tensors"] == len(list(model.parameters()))


def test_gradient_receipt_fails_naming_a_frozen_tensor():
    model = _model("gpt-tiny", seed=4)
    model.block[0].feed_forward.down_proj.bias.requires_grad_(False)
    ids = _ids(2, 4, 290, 9)
    receipt = gradient_receipt(model, ids, _padded_targets(ids, [4, 2], 290, 10))
    assert receipt["passed"] is False
    assert receipt["dead"] == ["block.0.feed_forward.down_proj.bias"]
    assert math.isnan(receipt["gradient_norms"]["block.0.feed_forward.down_proj.bias"])


def test_gradient_receipt_fails_naming_detached_tensors():
    model = Detached(_model("gpt-tiny", seed=5))
    ids = _ids(2, 4, 290, 11)
    receipt = gradient_receipt(model, ids, _padded_targets(ids, [4, 1], 290, 12))
    assert receipt["passed"] is False
    assert receipt["dead"] == ["inner.final_norm.weight", "inner.final_norm.bias"]


def test_gradient_receipt_fails_for_tensors_whose_gradient_is_exactly_zero():
    # with a zero final LayerNorm gain its output is its shift alone: LN's backward multiplies by the
    # gain, so every tensor before the final norm gets an exactly-zero (finite but dead) gradient
    model = _model("gpt-tiny", seed=6)
    with torch.no_grad():
        model.final_norm.weight.zero_()
    ids = _ids(1, 3, 290, 13)
    receipt = gradient_receipt(model, ids, torch.tensor([[1, 2, IGNORE_INDEX]]))
    assert receipt["passed"] is False
    assert set(receipt["dead"]) == {n for n, _ in model.named_parameters()} - {
        "final_norm.weight",
        "final_norm.bias",
        "lm_head.weight",
    }
    assert receipt["gradient_norms"]["block.0.attention.q_proj.weight"] == 0.0


# ---------------------------------------------------------------------------------------------
# causality and padding receipts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("preset", LM_PRESETS)
def test_causality_receipt_passes(preset, dtype):
    model = _model(preset, seed=7, dtype=dtype)
    V = model.config.vocab_size
    receipt = causality_receipt(model, _ids(2, 7, V, 14), V)
    assert receipt == {"prefix_bitwise_equal": True, "last_position_changed": True, "passed": True}


@pytest.mark.parametrize("preset", ["gpt-tiny", "decoder-small"])
def test_causality_receipt_fails_for_a_non_causal_model(preset):
    inner = _model(preset, seed=8)
    V = inner.config.vocab_size
    receipt = causality_receipt(NonCausal(inner), _ids(2, 6, V, 15), V)
    assert receipt["prefix_bitwise_equal"] is False and receipt["passed"] is False


def test_causality_receipt_fails_when_the_last_position_ignores_its_token():
    class Constant(nn.Module):
        def forward(self, input_ids):
            return {"logits": torch.zeros(*input_ids.shape, 5)}

    receipt = causality_receipt(Constant(), torch.tensor([[1, 2, 3]]), 5)
    assert receipt["prefix_bitwise_equal"] is True
    assert receipt["last_position_changed"] is False and receipt["passed"] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("preset", LM_PRESETS)
def test_padding_receipt_passes(preset, dtype):
    model = _model(preset, seed=9, dtype=dtype)
    V = model.config.vocab_size
    receipt = padding_receipt(model, _ids(2, 8, V, 16), valid_length=5, pad_id=0)
    assert receipt["passed"] is True
    assert receipt["tolerance"] == (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("preset", ["gpt-tiny", "decoder-small"])
def test_padding_receipt_fails_for_a_non_causal_model(preset):
    inner = _model(preset, seed=10)
    V = inner.config.vocab_size
    ids = _ids(2, 8, V, 17)
    ids[:, 5:] = 3  # the pad id below differs from these tokens, so padding really changes the input
    receipt = padding_receipt(NonCausal(inner), ids, valid_length=5, pad_id=1)
    assert receipt["passed"] is False and receipt["max_abs"] > 1e-6


@pytest.mark.parametrize("valid_length", [0, 4, -1])
def test_padding_receipt_rejects_a_valid_length_outside_the_window(valid_length):
    with pytest.raises(ValueError, match=r"valid_length must be in \(0, 4\)"):
        padding_receipt(_model("gpt-tiny"), _ids(1, 4, 290, 18), valid_length=valid_length, pad_id=0)
