"""Backend names -> runners. Unknown or unavailable backends are errors that list what exists."""

from __future__ import annotations

import torch

from runners.eager import eager_runner
from runners.ort import PROVIDERS, OrtRunner, SessionLoader, available_providers
from runners.reference import ReferenceRunner
from toolkit.artifacts import Artifact, load_onnx
from toolkit.errors import BackendUnavailableError

BACKENDS = {
    "eager": "PyTorch eager, float32 (the export dtype)",
    "eager-f64": "PyTorch eager, float64 (the reference oracle)",
    "ort-cpu": "ONNX Runtime, CPUExecutionProvider",
    "ort-cuda": "ONNX Runtime, CUDAExecutionProvider",
    "onnx-reference": "onnx.reference.ReferenceEvaluator (pure Python)",
}
DEFAULT_BACKENDS = ("eager", "ort-cpu", "onnx-reference")


def available_backends() -> list[str]:
    providers = available_providers()
    return [
        name for name in BACKENDS if name not in PROVIDERS or PROVIDERS[name] in providers
    ]


def check_backend(name: str) -> None:
    available = available_backends()
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}; available here: {', '.join(available)}"
        )
    if name not in available:
        raise BackendUnavailableError(
            f"backend {name!r} ({BACKENDS[name]}) is not available on this machine; "
            f"available here: {', '.join(available)}"
        )


def create_runner(name: str, artifact: Artifact, graph: str | None = None, *, protos: dict | None = None,
                  eager_model=None):
    """Build the runner called `name` for one graph of `artifact` (the only one by default).

    protos ({graph name: ModelProto}) avoids re-reading files; eager_model reuses a rebuilt model.
    """
    check_backend(name)
    target = artifact.graph(graph)
    config = artifact.config()
    if name in ("eager", "eager-f64"):
        dtype = torch.float32 if name == "eager" else torch.float64
        model = None if eager_model is None else eager_model.to(dtype)
        return eager_runner(artifact, dtype, name, target.name, protos, model)
    if name in PROVIDERS:
        loader = SessionLoader(target.model_path, PROVIDERS[name])
        return OrtRunner(loader, target.input_specs, target.output_names, config, name=name)
    proto = (protos or {}).get(target.name) or load_onnx(target.model_path)
    return ReferenceRunner(proto, target.input_specs, target.output_names, config)
