"""`toolkit trace`: the worked example, stage by stage, with its proofs.

Everything is computed in float64 eager from the worked-example preset; the
text and JSON renderings come from the same dict.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from models.worked_example import build_worked_example, worked_example_inputs
from toolkit.explain.inspect import parameter_ledger

GRADIENT_DELTA, GRADIENT_TOLERANCE = 1e-6, 2e-5


def _rows(t: torch.Tensor) -> list:
    return t.detach().numpy().tolist()


def _loss_weights(shape) -> torch.Tensor:
    # A non-uniform, sign-alternating weighting: a uniform one would hide errors that cancel.
    n = int(np.prod(shape))
    weights = torch.arange(1, n + 1, dtype=torch.float64) / n
    signs = torch.tensor([(-1.0) ** i for i in range(n)], dtype=torch.float64)
    return (weights * signs).reshape(shape)


def gradient_check(model: torch.nn.Module, x: torch.Tensor) -> dict:
    """Autograd vs central differences for every input and parameter coordinate of
    L = sum(w * output), w non-uniform; float64 throughout."""
    model = copy.deepcopy(model).double()  # the caller's model keeps its dtype and has no .grad left behind
    x = x.clone().double().requires_grad_(True)
    weights = _loss_weights(x.shape[:-1] + (model.config.width,))

    def loss() -> torch.Tensor:
        return (model(x)["block.0.output"] * weights).sum()

    model.zero_grad()
    loss().backward()
    targets = [("input", x)] + [(n, p) for n, p in model.named_parameters()]
    # No gradient at all (a detached path) counts as zero, so the differences expose it.
    analytic = {name: torch.zeros_like(t) if t.grad is None else t.grad.detach().clone() for name, t in targets}
    worst, checked = 0.0, {}
    with torch.no_grad():
        for name, tensor in targets:
            flat = tensor.data.view(-1)
            for i in range(flat.numel()):
                original = flat[i].item()
                flat[i] = original + GRADIENT_DELTA
                up = loss().item()
                flat[i] = original - GRADIENT_DELTA
                down = loss().item()
                flat[i] = original
                numeric = (up - down) / (2 * GRADIENT_DELTA)
                worst = max(worst, abs(numeric - analytic[name].view(-1)[i].item()))
            checked[name] = flat.numel()
    input_coords = checked.pop("input")
    return {
        "loss": "sum(w * output), w = (-1)^i * (i+1)/n over output coordinates",
        "delta": GRADIENT_DELTA,
        "tolerance": GRADIENT_TOLERANCE,
        "input_coordinates": input_coords,
        "parameter_coordinates": sum(checked.values()),
        "max_abs_error": worst,
        "passed": worst <= GRADIENT_TOLERANCE,
    }


def pre_vs_post(model: torch.nn.Module, x: torch.Tensor, after: torch.Tensor, token: int = 1) -> dict:
    """The chapter's contrast at the first residual merge: Pre-LN `x + MHA(RMSNorm(x))` (the worked example's
    own after_attention) against Post-LN, the original Transformer's `LayerNorm(x + MHA(x))`: the same
    attention on the raw input, then a mean-subtracted LayerNorm. The worked example has RMSNorm gains (all
    ones) and no norm bias, so the LayerNorm takes its attention_norm gain and bias 0, eps as configured."""
    block = model.block[0]
    branch = block.attention(x)[0]  # MHA(x): the same weights, no norm in front
    gain = block.attention_norm.weight.detach()
    post = torch.nn.functional.layer_norm(
        x + branch, (x.shape[-1],), gain, torch.zeros_like(gain), block.attention_norm.eps
    )
    return {
        "stage": "after_attention",
        "token": token,
        "pre_norm_formula": "x + MHA(RMSNorm(x))",
        "post_norm_formula": "LayerNorm(x + MHA(x)), LayerNorm(v) = (v - mean(v)) / sqrt(var(v) + eps) * g + b",
        "post_norm_parameters": {
            "gain": gain.tolist(),
            "bias": [0.0] * len(gain),
            "eps": block.attention_norm.eps,
            "note": "the worked example has no LayerNorm: gain from its attention_norm (all ones), bias 0",
        },
        "pre_norm": after[0, token].tolist(),
        "post_norm": post[0, token].tolist(),
    }


@torch.no_grad()
def worked_example_walkthrough() -> dict:
    model = build_worked_example().double()
    x = torch.from_numpy(worked_example_inputs()["hidden_states"]).double()
    stages = model(x)
    B, T, d = x.shape
    probs = stages["block.0.attention_weights"]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    attention = []
    for head in range(probs.shape[1]):
        for query in range(T):
            row = probs[0, head, query]
            masked = row[future[query]]
            attention.append(
                {
                    "head": head,
                    "query": query,
                    "probabilities": row.tolist(),
                    "masked_keys": future[query].nonzero().flatten().tolist(),
                    "masked_exactly_zero": bool((masked == 0).all()),
                }
            )
    after = stages["block.0.after_attention"]
    merges = {
        "attention": {
            "formula": "after_attention = x + attention_branch",
            "max_abs_deviation": float((after - (x + stages["block.0.attention_branch"])).abs().max()),
        },
        "feed_forward": {
            "formula": "output = after_attention + feed_forward_branch",
            "max_abs_deviation": float(
                (stages["block.0.output"] - (after + stages["block.0.feed_forward_branch"])).abs().max()
            ),
        },
    }
    contrast = pre_vs_post(model, x, after)

    changed = x.clone()
    changed[0, -1] = torch.linspace(-1.0, 1.0, d, dtype=torch.float64)  # only the last token differs
    other = model(changed)
    prefix_equal = {}
    for name, value in stages.items():
        axis = 2 if name.endswith("attention_weights") else 1  # the query axis
        prefix = [slice(None)] * value.ndim
        prefix[axis] = slice(0, T - 1)
        prefix_equal[name] = bool(torch.equal(value[tuple(prefix)], other[name][tuple(prefix)]))
    with torch.enable_grad():
        gradient = gradient_check(build_worked_example(), x)
    return {
        "config": model.config.to_dict(),
        "input": {"name": "hidden_states", "shape": [B, T, d], "rows": _rows(x[0])},
        "stages": {name: {"shape": list(v.shape), "rows": _rows(v[0])} for name, v in stages.items()},
        "attention": attention,
        "residual_merges": merges,
        "probe": {"matrix": _rows(model.probe), "logits": _rows(stages["logits"][0])},
        "pre_vs_post": contrast,
        "causality": {
            "changed": f"token {T - 1} only",
            "prefix_rows_bitwise_equal": prefix_equal,
            "passed": all(prefix_equal.values()),
        },
        "parameters": parameter_ledger(model, "block", model.config),
        "gradient_check": gradient,
    }


def _fmt_row(row) -> str:
    return "[" + ", ".join(f"{v: .6f}" for v in row) + "]"


def render_text(trace: dict) -> str:
    out = []
    cfg = trace["config"]
    out.append(
        f"worked example: d={cfg['width']}, heads={cfg['heads']}, d_ff={cfg['ff_width']}, eps={cfg['eps']}, "
        f"norm={cfg['norm_placement']}, identity weights, unit gains (float64 eager)"
    )
    out.append(f"input hidden_states {trace['input']['shape']}:")
    out += [f"  t{t}: {_fmt_row(r)}" for t, r in enumerate(trace["input"]["rows"])]
    for name, stage in trace["stages"].items():
        out.append(f"{name} {stage['shape']}:")
        if name.endswith("attention_weights"):
            continue  # shown per head and query below
        out += [f"  t{t}: {_fmt_row(r)}" for t, r in enumerate(stage["rows"])]
    out.append("attention probabilities (rows: query, columns: key; future keys masked):")
    for entry in trace["attention"]:
        zero = "masked exactly 0" if entry["masked_exactly_zero"] else "MASKED NOT ZERO"
        mask = f"{entry['masked_keys']} {zero}" if entry["masked_keys"] else "none masked"
        out.append(f"  head {entry['head']} query {entry['query']}: {_fmt_row(entry['probabilities'])}  {mask}")
    out.append("residual merges:")
    for merge in trace["residual_merges"].values():
        out.append(f"  {merge['formula']}: max abs deviation {merge['max_abs_deviation']:.1e}")
    out.append("probe logits = output @ P:")
    out += [f"  t{t}: {_fmt_row(r)}" for t, r in enumerate(trace["probe"]["logits"])]
    c = trace["pre_vs_post"]
    ln = c["post_norm_parameters"]
    out.append(f"pre-norm vs post-norm, {c['stage']} row of token {c['token']}:")
    out.append(f"  pre : {_fmt_row(c['pre_norm'])}  Pre-LN  {c['pre_norm_formula']}")
    out.append(f"  post: {_fmt_row(c['post_norm'])}  Post-LN {c['post_norm_formula'].split(', ')[0]}")
    out.append(f"  (LayerNorm mean-subtracted, eps {ln['eps']:g}; {ln['note']})")
    causal = trace["causality"]
    unchanged = sum(causal["prefix_rows_bitwise_equal"].values())
    out.append(
        f"causality: changing {causal['changed']} leaves earlier rows bitwise unchanged in "
        f"{unchanged}/{len(causal['prefix_rows_bitwise_equal'])} stages: {'PASS' if causal['passed'] else 'FAIL'}"
    )
    p = trace["parameters"]
    out.append(
        f"parameters: {p['total']} scalars in {p['tensor_count']} tensors (formula 2d + 4d^2 + 3*d*d_ff = "
        f"{p['formula']}), bias-free: {p['bias_free']}"
    )
    out += [f"  {t['name']:<40} {str(t['shape']):<8} {t['scalars']:>4}" for t in p["tensors"]]
    g = trace["gradient_check"]
    out.append(
        f"gradient check ({g['loss']}): {g['input_coordinates']} input + {g['parameter_coordinates']} parameter "
        f"coordinates, central differences delta {g['delta']:g}, max abs error {g['max_abs_error']:.2e} "
        f"<= {g['tolerance']:g}: {'PASS' if g['passed'] else 'FAIL'}"
    )
    return "\n".join(out)
