"""Backend names -> runners. Unknown or unavailable backends are errors that list what exists."""

from __future__ import annotations

import torch

from artifact import Artifact, load_onnx
from artifact.errors import BackendUnavailableError
from exporters.lowerings import unsupported_backends
from models.artifacts import artifact_config
from runners.eager import TORCH_DTYPES, eager_runner
from runners.ort import PROVIDERS, OrtRunner, SessionLoader, available_providers
from runners.reference import ReferenceRunner

BACKENDS = {
    "eager": "PyTorch eager at the export dtype (float32 unless exported with --dtype)",
    "eager-f64": "PyTorch eager, float64 (the reference oracle)",
    "eager-cuda": "PyTorch eager on the GPU at the export dtype, TF32 off",
    "ort-cpu": "ONNX Runtime, CPUExecutionProvider",
    "ort-cuda": "ONNX Runtime, CUDAExecutionProvider (TF32 off), IO binding on the GPU",
    "ort-trt": "ONNX Runtime, TensorrtExecutionProvider (CUDA for the nodes TensorRT does not take)",
    "onnx-reference": "onnx.reference.ReferenceEvaluator (pure Python)",
}
DEFAULT_BACKENDS = ("eager", "ort-cpu", "onnx-reference")
GPU_BACKENDS = ("eager-cuda", "ort-cuda", "ort-trt")
# Export dtypes each backend runs; a backend missing here runs every dtype. ONNX Runtime's CPU provider
# has float16 kernels for the ops these graphs use but no bfloat16 MatMul/Add (onnxruntime 1.32).
DTYPES = {"ort-cpu": ("float32", "float16")}


def artifact_dtype(artifact: Artifact) -> str:
    """The export dtype of an artifact (the manifest's default: float32)."""
    return artifact.manifest.dtype


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install raises instead of answering False
        return False


def available_backends() -> list[str]:
    providers = available_providers()
    names = []
    for name in BACKENDS:
        if name in PROVIDERS:
            needed = [PROVIDERS[name]] + (["CUDAExecutionProvider"] if name == "ort-trt" else [])
            if not all(p in providers for p in needed):
                continue
        if name == "eager-cuda" and not _cuda_available():
            continue
        names.append(name)
    return names


def check_backend(name: str, dtype: str | None = None) -> None:
    """Refuse unknown, unavailable, or (given the export dtype) unsupported backends, naming the alternatives."""
    available = available_backends()
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}; available here: {', '.join(available)}"
        )
    if name not in available:
        why = ""
        if name in ("ort-cuda", "ort-trt"):
            why = (
                " (needs onnxruntime-gpu: pip install '.[cuda]', an NVIDIA GPU and its driver"
                + (", and the TensorRT libraries" if name == "ort-trt" else "")
                + ")"
            )
        elif name == "eager-cuda":
            why = " (needs a CUDA build of torch and an NVIDIA GPU)"
        raise BackendUnavailableError(
            f"backend {name!r} ({BACKENDS[name]}) is not available on this machine{why}; "
            f"available here: {', '.join(available)}"
        )
    if dtype is not None and dtype not in DTYPES.get(name, (dtype,)):
        able = [n for n in available if dtype in DTYPES.get(n, (dtype,)) and n != "eager-f64"]
        raise BackendUnavailableError(
            f"backend {name!r} cannot run {dtype} artifacts ({BACKENDS[name]} runs "
            f"{', '.join(DTYPES[name])}); for {dtype} use {', '.join(able)}"
            + ("" if "ort-cuda" in able else " here, or ort-cuda on a GPU machine")
        )


def create_runner(
    name: str,
    artifact: Artifact,
    graph: str | None = None,
    *,
    protos: dict | None = None,
    eager_model=None,
    tf32: bool = False,
    by_block: bool = False,
    prepack: bool = True,
):
    """Build the runner called `name` for one graph of `artifact` (the only one by default).

    protos ({graph name: ModelProto}) avoids re-reading files; eager_model reuses a rebuilt model.
    tf32: GPU backends' speed mode (TF32 matmuls); parity checks keep it off.
    by_block: `eager` and `eager-f64` keep eager_model as it is and cast it a block at a time while they run
    (runners.eager.computing_in), rather than converting it whole, so the two can share one model.
    prepack: ONNX Runtime backends lay constant weights out for their kernels once (runners.ort.SessionLoader);
    False holds the weights once, at some speed.
    """
    dtype = artifact_dtype(artifact)
    check_backend(name, dtype)
    why = unsupported_backends(artifact.manifest).get(name)
    if why:  # e.g. the reference evaluator on an ort-lowered artifact
        raise BackendUnavailableError(f"backend {name!r} cannot run {artifact.location}: {why}")
    target = artifact.graph(graph)
    config = artifact_config(artifact)
    if name in ("eager", "eager-f64", "eager-cuda"):
        torch_dtype = torch.float64 if name == "eager-f64" else TORCH_DTYPES[dtype]
        by_block = by_block and name != "eager-cuda"
        model = eager_model if eager_model is None or by_block else eager_model.to(torch_dtype)
        device = "cuda" if name == "eager-cuda" else "cpu"
        return eager_runner(artifact, torch_dtype, name, target.name, protos, model, device=device, by_block=by_block)
    if name in PROVIDERS:
        loader = SessionLoader(target.model_path, PROVIDERS[name], tf32=tf32, prepack=prepack)
        return OrtRunner(
            loader, target.input_specs, target.output_names, config, name=name, kv_cache=target.entry.kv_cache
        )
    proto = (protos or {}).get(target.name) or load_onnx(target.model_path)
    return ReferenceRunner(proto, target.input_specs, target.output_names, config)


def dtype_unsupported(dtype: str) -> dict[str, str]:
    """{backend: why} for the known backends that cannot run artifacts of this export dtype."""
    able = [n for n in BACKENDS if dtype in DTYPES.get(n, (dtype,)) and n != "eager-f64"]
    return {
        name: f"it runs {', '.join(dtypes)} artifacts, not {dtype}; for {dtype} use {', '.join(able)}"
        for name, dtypes in DTYPES.items()
        if dtype not in dtypes
    }
