"""Parameter and memory ledgers and artifact descriptions, shared by `inspect`, `presets` and `trace`."""

from __future__ import annotations

from collections import Counter

import onnx
import torch

from artifact import load_onnx
from artifact.errors import ModelFileError
from models.artifacts import artifact_config, open_artifact
from models.registry import get_family

BYTES_FLOAT32 = 4
# Training state per parameter in float32: the weight, its gradient, Adam's two moments.
TRAINING_STATE_COPIES = 4

GROUPS = (  # (group, predicate on the parameter name), first match wins
    ("token embedding", lambda n: "embed_tokens" in n),
    ("position embedding", lambda n: "embed_positions" in n),
    ("cross-attention", lambda n: ".cross_attention." in n),
    ("attention", lambda n: ".attention." in n),
    ("norms", lambda n: "norm." in n),
    ("feed-forward", lambda n: ".feed_forward." in n),
    ("vocabulary head", lambda n: "lm_head" in n),
)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct trainable scalars (a tied tensor counts once)."""
    return sum(p.numel() for p in model.parameters())


def expected_parameter_count(family: str, config) -> int:
    return get_family(family).parameter_formula(config)


def _group(name: str) -> str:
    return next((group for group, match in GROUPS if match(name)), "other")


def parameter_ledger(model: torch.nn.Module, family: str, config) -> dict:
    """Named tensors and groups with sizes; the family's formula is checked against the real sum.

    A mismatch raises: a ledger that disagrees with the tensors is a bug, not a warning.
    """
    tensors = [
        {"name": n, "shape": list(p.shape), "scalars": p.numel(), "group": _group(n)}
        for n, p in model.named_parameters()
    ]
    total = parameter_count(model)
    formula = expected_parameter_count(family, config)
    if total != formula:
        raise ModelFileError(
            f"parameter ledger mismatch for {family}: formula gives {formula:,}, tensors sum to {total:,}"
        )
    groups: dict[str, dict] = {}
    for tensor in tensors:
        group = groups.setdefault(tensor["group"], {"tensors": 0, "scalars": 0})
        group["tensors"] += 1
        group["scalars"] += tensor["scalars"]
    biases = [t["name"] for t in tensors if t["name"].endswith(".bias")]
    return {
        "tensors": tensors,
        "groups": groups,
        "tensor_count": len(tensors),
        "total": total,
        "formula": formula,
        "bias_free": not biases,
    }


def memory_ledger(parameters: int, config, batch: int, sequence: int) -> dict:
    """Lower-bound training memory and the sizes that scale with the batch shape.

    The 16 bytes per parameter (weights, gradients, two Adam moments in float32)
    exclude activations; 6*P*D training FLOPs is the usual estimate, not a count.
    """
    heads = config.heads
    vocab = getattr(config, "vocab_size", None)
    tokens = batch * sequence
    return {
        "training_state_bytes": TRAINING_STATE_COPIES * BYTES_FLOAT32 * parameters,
        "training_state_note": "lower bound: float32 weights + gradients + Adam m + v; excludes activations",
        "batch": batch,
        "sequence": sequence,
        "attention_scores_per_layer": {
            "elements": batch * heads * sequence * sequence,
            "bytes": BYTES_FLOAT32 * batch * heads * sequence * sequence,
        },
        "logits": None if vocab is None else {"elements": tokens * vocab, "bytes": BYTES_FLOAT32 * tokens * vocab},
        "training_flops_per_step_estimate": 6 * parameters * tokens,
        "flops_note": "estimate: 6 * parameters * tokens (forward + backward), ignores attention's T^2 term",
    }


def describe(path, batch: int = 1, sequence: int | None = None) -> dict:
    """Everything `toolkit inspect` shows about an artifact directory or .onnx file."""
    from runners.eager import model_from_artifact

    artifact = open_artifact(path)
    config = artifact_config(artifact)
    protos = {g.name: load_onnx(g.model_path) for g in artifact.graphs}
    graphs = []
    for graph in artifact.graphs:
        proto = protos[graph.name]
        histogram = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in proto.graph.node)
        graphs.append(
            {
                "name": graph.name,
                "file": str(graph.model_path),
                "inputs": [s.to_dict() for s in graph.input_specs],
                "outputs": [o.to_dict() for o in graph.entry.outputs],
                "opset_imports": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
                "op_histogram": dict(histogram.most_common()),
                "functions": [
                    {
                        "name": f"{f.domain}::{f.name}",
                        "inputs": list(f.input),
                        "outputs": list(f.output),
                        "attributes": list(f.attribute),
                        "nodes": len(f.node),
                        "opset_imports": {o.domain or "ai.onnx": o.version for o in f.opset_import},
                    }
                    for f in proto.functions
                ],
                "initializers": {
                    "count": len(proto.graph.initializer),
                    "bytes": sum(onnx.numpy_helper.to_array(i).nbytes for i in proto.graph.initializer),
                },
            }
        )
    model = model_from_artifact(artifact, protos)
    ledger = parameter_ledger(model, artifact.family, config)
    sequence = config.max_positions if sequence is None else sequence
    manifest = {k: v for k, v in artifact.manifest.to_dict().items() if k != "graphs"}
    return {
        "path": str(path),
        "family": artifact.family,
        "variant": artifact.variant,
        "graphs": graphs,
        "parameters": ledger,
        "memory": memory_ledger(ledger["total"], config, batch, sequence),
        "manifest": manifest,
    }
