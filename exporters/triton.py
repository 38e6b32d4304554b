"""A Triton Inference Server model repository for the onnxruntime backend.

Layout: REPO/NAME/config.pbtxt and REPO/NAME/1/model.onnx. The config declares
every input and output with its Triton dtype and dims (-1 for dynamic axes;
the batch axis is Triton's own when max_batch_size > 0), dynamic batching and
an instance group on CPU or GPU. Written atomically like an artifact.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from artifact import Artifact, swap_in
from artifact.errors import ExportError, ModelFileError

TRITON_DTYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "int64": "TYPE_INT64",
    "bool": "TYPE_BOOL",
}
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}


def _dims(shape) -> list[int]:
    # Triton owns the leading batch axis (max_batch_size > 0); every other symbolic axis is -1.
    return [-1 if isinstance(d, str) or d <= 0 else int(d) for d in shape[1:]]


def _tensor(kind: str, spec: dict) -> str:
    dtype = TRITON_DTYPES.get(spec.dtype)
    if dtype is None:
        raise ExportError(f"tensor {spec['name']!r}: dtype {spec['dtype']} has no Triton equivalent")
    if not spec.shape or spec.shape[0] != "batch":
        raise ExportError(f"tensor {spec['name']!r}: the first axis must be the batch axis for Triton batching")
    dims = ", ".join(str(d) for d in _dims(spec.shape))
    return f'  {{\n    name: "{spec.name}"\n    data_type: {dtype}\n    dims: [ {dims} ]\n  }}'


def config_pbtxt(
    artifact: Artifact,
    name: str,
    *,
    device: str = "cpu",
    instances: int = 1,
    max_batch_size: int = 8,
    max_queue_delay_us: int = 100,
) -> str:
    graph = artifact.graph()
    if device not in KINDS:
        raise ExportError(f"triton device {device!r}: choose one of {', '.join(KINDS)}")
    inputs = ",\n".join(_tensor("input", s) for s in graph.input_specs)
    outputs = ",\n".join(_tensor("output", s) for s in graph.entry.outputs)
    return (
        f'name: "{name}"\n'
        'backend: "onnxruntime"\n'
        f"max_batch_size: {max_batch_size}\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        f"instance_group [\n  {{\n    count: {instances}\n    kind: {KINDS[device]}\n  }}\n]\n"
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}\n"
    )


def write_triton_repo(artifact: Artifact, repo: str | Path, name: str, **options) -> Path:
    """Write REPO/NAME (config.pbtxt + 1/model.onnx); an existing NAME is replaced only if it is a model dir."""
    if len(artifact.graphs) != 1:
        raise ExportError(
            "a Triton repository takes single-graph artifacts; export the encoder-decoder's graphs as separate models"
        )
    repo = Path(repo)
    target = repo / name
    if target.exists() and not (target / "config.pbtxt").is_file():
        raise ModelFileError(f"{target} exists and is not a Triton model directory; choose another --triton-repo")
    text = config_pbtxt(artifact, name, **options)
    repo.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=repo))
    try:
        (tmp / "1").mkdir()
        shutil.copyfile(artifact.graph().model_path, tmp / "1" / "model.onnx")
        (tmp / "config.pbtxt").write_text(text)
        swap_in(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
