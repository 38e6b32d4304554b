"""Parameter ledgers and artifact descriptions, shared by `toolkit inspect`, `presets` and `trace`."""

from __future__ import annotations

from collections import Counter

import onnx
import torch

from toolkit.artifacts import load_artifact, load_onnx
from toolkit.errors import ModelFileError


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct trainable scalars (a tied tensor counts once)."""
    return sum(p.numel() for p in model.parameters())


def block_parameter_formula(config) -> int:
    # 2d (two gains) + 2d^2 (Q, O) + 2*d*kv_width (K, V) + 3*d*d_ff (gate, up, down);
    # with kv_heads == heads this is 2d + 4d^2 + 3*d*d_ff.
    d, kv_width = config.width, config.kv_heads * config.head_width
    return 2 * d + 2 * d * d + 2 * d * kv_width + 3 * d * config.ff_width


def expected_parameter_count(family: str, config) -> int:
    block = block_parameter_formula(config)
    if family == "block":
        return block
    if family == "llama":
        heads = 1 if config.tie_embeddings else 2  # embedding, plus the head when untied
        return heads * config.vocab_size * config.width + config.layers * block + config.width
    raise ModelFileError(f"no parameter formula for family {family!r}")


def parameter_ledger(model: torch.nn.Module, family: str, config) -> dict:
    """Named tensors with shapes and sizes, and the formula checked against the real sum."""
    tensors = [{"name": n, "shape": list(p.shape), "scalars": p.numel()} for n, p in model.named_parameters()]
    total = parameter_count(model)
    formula = expected_parameter_count(family, config)
    if total != formula:
        raise ModelFileError(f"parameter ledger mismatch: formula gives {formula:,}, tensors sum to {total:,}")
    biases = [t["name"] for t in tensors if t["name"].endswith(".bias")]
    return {"tensors": tensors, "tensor_count": len(tensors), "total": total, "formula": formula,
            "bias_free": not biases}


def describe(path) -> dict:
    """Everything `toolkit inspect` shows about an artifact directory or .onnx file."""
    from runners.eager import model_from_artifact

    artifact = load_artifact(path)
    proto = load_onnx(artifact.model_path)
    histogram = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in proto.graph.node)
    functions = [
        {"name": f"{f.domain}::{f.name}", "inputs": list(f.input), "outputs": list(f.output),
         "attributes": list(f.attribute), "nodes": len(f.node),
         "opset_imports": {o.domain or "ai.onnx": o.version for o in f.opset_import}}
        for f in proto.functions
    ]
    model = model_from_artifact(artifact, proto)
    ledger = parameter_ledger(model, artifact.family, artifact.config())
    initializer_bytes = sum(onnx.numpy_helper.to_array(i).nbytes for i in proto.graph.initializer)
    return {
        "path": str(path),
        "family": artifact.family,
        "variant": artifact.variant,
        "inputs": artifact.input_specs,
        "outputs": artifact.manifest["outputs"],
        "opset_imports": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "op_histogram": dict(histogram.most_common()),
        "functions": functions,
        "parameters": ledger,
        "initializers": {"count": len(proto.graph.initializer), "bytes": initializer_bytes},
        "manifest": {k: v for k, v in artifact.manifest.items() if k != "weights"},
    }
