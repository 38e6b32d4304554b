"""Receipts: executable evidence that a language model trains and is causal.

Each function takes any stage-dict language model (`model(input_ids)["logits"]`)
and returns a small dict a test or the CLI can print and assert on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy over the valid targets only; padded targets carry ignore_index."""
    B, T, V = logits.shape
    valid = targets != ignore_index
    if not bool(valid.any()):
        raise ValueError("token_cross_entropy: every target is padding; nothing to average")
    # Only valid positions enter the loss at all: a padded position's logits never reach it (not even x 0,
    # which would turn an -inf logit into NaN).
    return F.cross_entropy(logits[valid], targets[valid], reduction="mean")


def gradient_receipt(
    model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> dict:
    """One backward pass; every named parameter tensor must get a finite, non-zero gradient norm."""
    model.zero_grad(set_to_none=True)
    loss = token_cross_entropy(model(input_ids)["logits"], targets, ignore_index)
    loss.backward()
    norms = {}
    for name, parameter in model.named_parameters():
        norms[name] = math.nan if parameter.grad is None else float(parameter.grad.norm())
    dead = [n for n, v in norms.items() if not (math.isfinite(v) and v > 0)]
    model.zero_grad(set_to_none=True)
    return {
        "loss": float(loss.detach()),
        "gradient_norms": norms,
        "tensors": len(norms),
        "dead": dead,
        "passed": not dead,
    }


@torch.no_grad()
def causality_receipt(model: torch.nn.Module, input_ids: torch.Tensor, vocab_size: int) -> dict:
    """Changing only the last token must leave every earlier position's logits bitwise unchanged."""
    changed = input_ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % vocab_size
    before, after = model(input_ids)["logits"], model(changed)["logits"]
    prefix_equal = bool(torch.equal(before[:, :-1], after[:, :-1]))
    last_changed = not torch.equal(before[:, -1], after[:, -1])
    return {
        "prefix_bitwise_equal": prefix_equal,
        "last_position_changed": last_changed,
        "passed": prefix_equal and last_changed,
    }


@torch.no_grad()
def padding_receipt(model: torch.nn.Module, input_ids: torch.Tensor, valid_length: int, pad_id: int) -> dict:
    """Padding after the valid tokens must leave the valid positions' logits unchanged."""
    B, T = input_ids.shape
    if not 0 < valid_length < T:
        raise ValueError(f"padding_receipt: valid_length must be in (0, {T}), got {valid_length}")
    valid = model(input_ids[:, :valid_length])["logits"]
    padded = input_ids.clone()
    padded[:, valid_length:] = pad_id
    with_padding = model(padded)["logits"][:, :valid_length]
    max_abs = float((valid - with_padding).abs().max())
    # Same math on a longer buffer may reassociate sums; float64 keeps the difference at rounding level.
    tolerance = 1e-12 if valid.dtype == torch.float64 else 1e-5
    return {"max_abs": max_abs, "tolerance": tolerance, "passed": max_abs <= tolerance}
