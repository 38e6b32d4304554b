"""torch.onnx (dynamo) export with custom-domain RMSNorm/SwiGLU functions.

One export path for every family:
  trace with torch.onnx.export(dynamo=True) -> attach FunctionProtos for the
  custom nodes -> map every torch weight to its initializer -> embed the
  manifest -> full checker + strict shape inference -> atomic artifact write.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

from exporters.functions import OPSET, function_protos
from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from models.registry import get_family
from toolkit import artifacts
from toolkit.errors import ExportError

VARIANTS = ("stages", "serving")
# Traced sample sizes: 2 rather than 1 so torch.export keeps the axes symbolic.
SAMPLE_BATCH, SAMPLE_SEQUENCE = 2, 3


class _NamedOutputs(nn.Module):
    """Wraps a stage-dict model so the traced graph returns exactly `names`, in order."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs):
        stages = self.model(*inputs)
        return tuple(stages[name] for name in self.names)


def output_names(family: str, config, variant: str) -> tuple[str, ...]:
    if variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    stages = get_family(family).stage_names(config)
    return stages if variant == "stages" else ("logits",)


def export_model(
    model: nn.Module,
    family: str,
    config,
    out_dir: str | Path,
    *,
    variant: str = "stages",
    preset: str | None = None,
    seed: int | None = None,
) -> artifacts.Artifact:
    """Export `model` to `out_dir` (model.onnx + manifest.json) and return the loaded artifact."""
    fam = get_family(family)
    names = output_names(family, config, variant)
    specs = fam.input_specs(config)
    model = model.to(torch.float32).eval()
    proto = _trace(_NamedOutputs(model, names), fam, config, specs, names)

    used = {n.op_type for n in proto.graph.node if n.domain == CUSTOM_DOMAIN}
    proto.functions.extend(function_protos(used))
    if not any(o.domain == CUSTOM_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION))

    manifest = {
        "format": artifacts.FORMAT,
        "format_version": artifacts.FORMAT_VERSION,
        "family": family,
        "preset": preset,
        "seed": seed,
        "variant": variant,
        "config": config.to_dict(),
        "opset": OPSET,
        "custom_domains": {CUSTOM_DOMAIN: CUSTOM_DOMAIN_VERSION},
        "custom_ops": sorted(used),
        "inputs": [s.to_dict() for s in specs],
        "outputs": _value_specs(proto.graph.output),
        "stages": list(names),
        "weights": _weight_map(model, proto),
        "versions": _versions(),
    }
    del proto.metadata_props[:]
    proto.metadata_props.add(key=artifacts.METADATA_KEY, value=json.dumps(manifest, sort_keys=True))
    proto.producer_name = "onnx-toolkit"
    try:
        onnx.checker.check_model(proto, full_check=True)
        proto = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(f"exported graph failed the ONNX checker: {exc}") from None

    data = proto.SerializeToString()
    manifest["model_sha256"] = artifacts.sha256_bytes(data)
    files = {
        artifacts.MODEL_FILE: data,
        artifacts.MANIFEST_FILE: (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(),
    }
    artifacts.write_artifact(Path(out_dir), files, verify=artifacts.load_artifact)
    return artifacts.load_artifact(out_dir)


def _trace(wrapper: nn.Module, fam, config, specs, names) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    sequence = min(SAMPLE_SEQUENCE, config.max_positions)
    sample = fam.random_inputs(config, SAMPLE_BATCH, sequence, rng)
    args = tuple(torch.from_numpy(sample[s.name]).to(_torch_dtype(s.dtype)) for s in specs)
    batch = torch.export.Dim("batch", min=1)
    dims = {0: batch}
    if sequence > 1:  # a window of one position cannot have a symbolic length
        dims[1] = torch.export.Dim("sequence", min=1, max=config.max_positions)
    dynamic_shapes = (tuple(dict(dims) for _ in specs),)  # one entry: the wrapper's *inputs
    captured = io.StringIO()
    # torch.onnx narrates its steps on stdout and logs optional-dependency notices; users see our summary instead.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapper,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=[s.name for s in specs],
                output_names=list(names),
                dynamic_shapes=dynamic_shapes,
                optimize=True,
                verify=False,
            )
    except Exception as exc:  # torch.onnx raises many types; all mean the same to the user
        detail = _summary(exc)
        raise ExportError(f"torch.onnx.export failed: {detail}") from exc
    return program.model_proto


def _summary(exc: BaseException) -> str:
    """The one informative line of a torch.onnx failure: its root cause's first line."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else 'no message'}"


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "int64": torch.int64}[name]


def _value_specs(values) -> list[dict]:
    specs = []
    for value in values:
        tensor = value.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        specs.append({"name": value.name, "dtype": dtype, "shape": shape})
    return specs


def _weight_map(model: nn.Module, proto: onnx.ModelProto) -> dict[str, dict]:
    """Where each torch weight lives in the graph: {name: {"initializer", "transpose"}}.

    The exporter's optimiser may fold a Linear's transpose into a fresh
    initializer, so weights are found by exact bytes (as stored or transposed),
    which lets the eager reference be rebuilt from the .onnx file alone.
    """
    by_bytes: dict[tuple, str] = {}
    for init in proto.graph.initializer:
        array = numpy_helper.to_array(init)
        by_bytes.setdefault((array.dtype.str, array.shape, array.tobytes()), init.name)
    mapping = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().cpu().numpy()
        found = by_bytes.get((array.dtype.str, array.shape, array.tobytes()))
        transpose = False
        if found is None and array.ndim == 2:
            flipped = np.ascontiguousarray(array.T)
            found = by_bytes.get((flipped.dtype.str, flipped.shape, flipped.tobytes()))
            transpose = found is not None
        if found is None:
            raise ExportError(
                f"weight {name!r} {tuple(array.shape)} has no matching initializer in the exported graph; "
                "the exporter rewrote it, so the eager reference could not be rebuilt from the file"
            )
        mapping[name] = {"initializer": found, "transpose": transpose}
    return mapping


def _versions() -> dict[str, str]:
    import onnxscript

    import toolkit

    versions = {"toolkit": toolkit.__version__, "torch": torch.__version__, "onnx": onnx.__version__}
    versions["onnxscript"] = onnxscript.__version__
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    return versions
