"""PyTorch eager backends, rebuilt from the weights inside the artifact's .onnx file.

`eager` runs in float32 (the export dtype); `eager-f64` runs in float64 and is
the reference oracle every other backend is judged against.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from models.registry import build_model
from runners.base import Runner
from toolkit.artifacts import Artifact, load_onnx
from toolkit.errors import ModelFileError


class EagerRunner(Runner):
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, input_specs, output_names, config, name="eager"):
        super().__init__(input_specs, output_names, config)
        self.name = name
        self.dtype = dtype
        self.model = model.to(dtype).eval()
        self.device = f"torch {str(dtype).removeprefix('torch.')} cpu"

    @torch.no_grad()
    def _infer(self, feed):
        args = []
        for spec in self.input_specs:
            tensor = torch.from_numpy(feed[spec["name"]])
            args.append(tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
        stages = self.model(*args)
        return {name: stages[name].numpy() for name in self.output_names}


def model_from_artifact(artifact: Artifact, model_proto: onnx.ModelProto | None = None) -> torch.nn.Module:
    """Construct the artifact's model and load every weight from the ONNX initializers."""
    config = artifact.config()
    model = build_model(artifact.family, config)
    proto = model_proto if model_proto is not None else load_onnx(artifact.model_path)
    initializers = {init.name: init for init in proto.graph.initializer}
    mapping = artifact.manifest["weights"]
    state = model.state_dict()
    loaded = {}
    for name, target in state.items():
        entry = mapping.get(name)
        if entry is None or entry.get("initializer") not in initializers:
            raise ModelFileError(
                f"{artifact.model_path}: weight {name!r} is not mapped to an initializer; re-run `toolkit export`"
            )
        array = numpy_helper.to_array(initializers[entry["initializer"]])
        if entry.get("transpose"):
            array = array.T
        if tuple(array.shape) != tuple(target.shape):
            raise ModelFileError(
                f"{artifact.model_path}: weight {name!r} expected shape {tuple(target.shape)}, "
                f"initializer {entry['initializer']!r} has {tuple(array.shape)}"
            )
        loaded[name] = torch.from_numpy(np.array(array, copy=True, order="C"))
    model.load_state_dict(loaded)
    return model


def eager_runner(artifact: Artifact, dtype: torch.dtype, name: str, model_proto=None) -> EagerRunner:
    model = model_from_artifact(artifact, model_proto)
    return EagerRunner(model, dtype, artifact.input_specs, artifact.output_names, artifact.config(), name=name)
