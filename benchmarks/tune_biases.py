"""Whether a float bias beside each MatMulNBits, fitted with the scales, brings a GPTQ int4 artifact nearer float.

`toolkit quantize --tune-scales` fits each block's scale to the float model's next-token distributions
(toolkit/quantize/tuning.py). MatMulNBits also takes a bias (its input 5, one float per output column), which
costs one add per output and would correct the mean shift a layer's rounding leaves (the bias correction of
Nagel et al., 2019, "Data-Free Quantization Through Weight Equalization and Bias Correction"). This script runs
the same fit as tuning.py (its text, rows, held-out rows, steps, batch and scale learning rate) with a zero-started
bias on every quantized projection added to the trained parameters at `--bias-lr`, writes the fitted scales and
the biases into a copy of the artifact, and measures it with the quantize command's own quality report
(toolkit/quantize/pipeline.evaluate_quality: perplexity, KL from float and greedy agreement on ort-cpu).
`--bias-lr 0` leaves every bias 0 (Adam moves nothing without a gradient step size), which is tuning.py's fit.

The eager model's SwiGLU computes from its three weights alone (models/layers.swiglu), so with `--mlp` its forward
is replaced here by the same arithmetic through the modules, which adds their biases; without it only the
attention projections (and with `--head` the vocabulary projection) carry one. An experiment on the recipe, not
an option of the product: the artifact's eager reference does not know the biases.

    .venv/bin/python benchmarks/tune_biases.py /tmp/rot/permutation/ort /tmp/rot/permutation/gptq-rotated-level-4 \
        /tmp/biases/mlp-1e-3 --bias-lr 1e-3 --mlp --text /usr/share/common-licenses/GPL-3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifact.read import validate_onnx  # noqa: E402
from artifact.write import PendingWeights, pack_artifact, write_artifact  # noqa: E402
from exporters.quantize import GraphWeights  # noqa: E402
from models import layers  # noqa: E402
from models.artifacts import open_artifact  # noqa: E402
from toolkit.quantize.pipeline import evaluate_quality, read_perplexity_text  # noqa: E402
from toolkit.quantize.tuning import (  # noqa: E402
    HELD_OUT_ROWS,
    LEARNING_RATE,
    TUNE_BATCH,
    TUNE_ROWS,
    TUNE_SEED,
    TUNE_TOKENS,
    scaled_weights,
)

BIAS_INPUT = 5  # MatMulNBits: A, B, scales, zero_points, g_idx, bias


def _swiglu_through_modules(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fit(source, quantized, steps: int, bias_lr: float, head: bool, seed: int):
    """(scaled weights with fitted log scales, {torch weight name: fitted bias}, held-out KL before, after)."""
    from torch.nn.utils.stateless import _reparametrize_module

    from runners.eager import eager_runner, model_from_artifact
    from toolkit.quantize.sensitivity import calibration, sampled_calibration

    calibrated = sampled_calibration(source, calibration(source), TUNE_ROWS, TUNE_TOKENS, seed)
    float_model, float_runner, feed = calibrated.model, calibrated.runner, calibrated.feed
    model = model_from_artifact(quantized).eval()
    runner = eager_runner(quantized, torch.float32, "eager", model=model)
    for parameter in [*model.parameters(), *float_model.parameters()]:
        parameter.requires_grad_(False)
    scaled = scaled_weights(quantized)
    biases = {}
    for weight in scaled:
        for name, cut in weight.entries:
            model.get_parameter(name).data = torch.empty(0)
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if module.bias is not None:
                raise SystemExit(f"{name}: the model has a bias there already")
            if name == "lm_head.weight" and not head:
                continue
            module.bias = torch.nn.Parameter(torch.zeros(weight.levels.shape[0] if cut is None else cut[2] - cut[1]))
            biases[name] = module.bias
        weight.log_scale = torch.zeros(weight.levels.shape[0], weight.stored.size // weight.levels.shape[0])
        weight.log_scale.requires_grad_(True)
    rows = len(feed["input_ids"])
    args = [torch.from_numpy(np.asarray(feed[spec.name])) for spec in runner.input_specs]

    def batch(which):
        return [a[which] if a.dim() and a.shape[0] == rows else a for a in args]

    def kl(which) -> torch.Tensor:
        with torch.no_grad():
            target = float_runner.forward(float_model, *batch(which))["logits"].log_softmax(-1)
        values = {}
        for weight in scaled:
            w = weight.weight()
            for name, cut in weight.entries:
                values[name] = w if cut is None else w[cut[1] : cut[2]]
        with _reparametrize_module(model, values):
            logits = runner.forward(model, *batch(which))["logits"]
        return (target.exp() * (target - logits.log_softmax(-1))).sum(-1).mean()

    trained, held_out = rows - HELD_OUT_ROWS, torch.arange(rows - HELD_OUT_ROWS, rows)
    with torch.no_grad():
        before = float(kl(held_out))
    optimizer = torch.optim.Adam(
        [
            {"params": [w.log_scale for w in scaled], "lr": LEARNING_RATE},
            {"params": list(biases.values()), "lr": bias_lr},
        ]
    )
    choose = np.random.default_rng(TUNE_SEED)
    for step in range(steps):
        loss = kl(torch.from_numpy(np.sort(choose.choice(trained, TUNE_BATCH, replace=False))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step + 1} of {steps}: KL {float(loss.detach()):.4f}", file=sys.stderr, flush=True)
    with torch.no_grad():
        after = float(kl(held_out))
    return scaled, {name: b.detach().numpy().astype(np.float32) for name, b in biases.items()}, before, after


def write(quantized, quantized_dir: Path, out_dir: Path, scaled, biases) -> int:
    """Write `quantized` with the fitted scales and the biases (as MatMulNBits' input 5) to out_dir; the number of
    MatMulNBits that took a bias."""
    graph = quantized.graphs[0]
    proto = validate_onnx(graph.model_path)
    weights = GraphWeights(proto, str(graph.model_path.parent), graph.model_path, PendingWeights())
    names_by_scales = {}
    for weight in scaled:
        weights.hold(weights.tensors[weight.scales], weight.tuned().reshape(weights.array(weight.scales).shape))
        names_by_scales[weight.scales] = [name for _, name in sorted((c[1] if c else 0, n) for n, c in weight.entries)]
    added = 0
    for node in proto.graph.node:
        names = names_by_scales.get(node.input[2]) if node.op_type == "MatMulNBits" else None
        if not names or not all(name in biases for name in names):
            continue
        bias = node.input[1] + ".bias"
        proto.graph.initializer.append(numpy_helper.from_array(np.concatenate([biases[n] for n in names]), bias))
        inputs = list(node.input)[:BIAS_INPUT]
        inputs += [""] * (BIAS_INPUT - len(inputs)) + [bias]
        del node.input[:]
        node.input.extend(inputs)
        added += 1
    weights.detach(proto)
    manifest = quantized.manifest.to_dict()
    extra = {name: (quantized_dir / name).read_bytes() for name in manifest.get("extra_files") or {}}
    write_artifact(out_dir, pack_artifact(manifest, {graph.name: proto}, extra, pending=weights.pending))
    return added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("float_artifact", type=Path)
    parser.add_argument("quantized_artifact", type=Path, help="an untuned MatMulNBits artifact of float_artifact")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--bias-lr", type=float, required=True)
    parser.add_argument("--mlp", action="store_true", help="biases on gate/up/down_proj too")
    parser.add_argument("--head", action="store_true", help="a bias on the vocabulary projection too")
    parser.add_argument("--seed", type=int, default=0, help="the calibration text's seed (tuning.py's default 0)")
    parser.add_argument("--text", type=Path, required=True, help="the perplexity text")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.mlp:
        layers.SwiGLU.forward = _swiglu_through_modules
    start, load = time.time(), os.getloadavg()
    source, quantized = open_artifact(args.float_artifact), open_artifact(args.quantized_artifact)
    scaled, biases, before, after = fit(source, quantized, args.steps, args.bias_lr, args.head, args.seed)
    added = write(quantized, args.quantized_artifact, args.out, scaled, biases)
    quality = evaluate_quality(source, open_artifact(args.out), text=read_perplexity_text(source, args.text))
    result = {
        "command": " ".join(sys.argv),
        "bias_lr": args.bias_lr,
        "mlp": args.mlp,
        "head": args.head,
        "matmulnbits_with_bias": added,
        "held_out_kl_before": before,
        "held_out_kl_after": after,
        "perplexity_vs_float": quality["perplexity_quantized"] / quality["perplexity_float"] - 1,
        "quality": quality,
        "seconds": round(time.time() - start, 1),
        "load_average": load,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
