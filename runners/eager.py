"""PyTorch eager backends, rebuilt from the weights inside the artifact's ONNX files.

`eager` runs in float32 (the export dtype); `eager-f64` runs in float64 and is
the reference oracle every other backend is judged against.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from onnx import numpy_helper

from models.registry import build_model, get_family
from runners.base import Runner, check_feed
from toolkit.artifacts import Artifact, GraphArtifact, load_onnx
from toolkit.errors import ModelFileError


class EagerRunner(Runner):
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, graph: GraphArtifact, run, config, name="eager"):
        super().__init__(graph.input_specs, graph.output_names, config)
        self.name = name
        self.dtype = dtype
        self.model = model.to(dtype).eval()
        self.forward = run
        self.device = f"torch {str(dtype).removeprefix('torch.')} cpu"

    def run(self, inputs):
        if self.dtype != torch.float64:
            return super().run(inputs)
        # The oracle keeps its own float64 cache between decode steps; validate a float32 view of the
        # feed against the float32 declaration, then compute on the float64 values.
        view = {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v
                for k, v in inputs.items()} if isinstance(inputs, dict) else inputs
        check_feed(self.input_specs, view, self.config)
        start = time.perf_counter()
        outputs = self._infer(inputs)
        self.last_inference_time = time.perf_counter() - start
        return outputs

    @torch.no_grad()
    def _infer(self, feed):
        args = []
        for spec in self.input_specs:
            tensor = torch.from_numpy(feed[spec["name"]])
            args.append(tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
        stages = self.forward(self.model, *args)
        return {name: stages[name].numpy() for name in self.output_names}


def model_from_artifact(artifact: Artifact, protos: dict | None = None) -> torch.nn.Module:
    """Construct the artifact's model and load every weight from the graphs' ONNX initializers."""
    config = artifact.config()
    model = build_model(artifact.family, config, init=False)  # every weight is loaded next
    protos = protos or {}
    state = model.state_dict()
    loaded = {}
    for graph in artifact.graphs:
        proto = protos.get(graph.name) or load_onnx(graph.model_path)
        initializers = {init.name: init for init in proto.graph.initializer}
        for name, entry in graph.weights.items():
            if name not in state:
                raise ModelFileError(f"{graph.model_path}: the manifest maps unknown weight {name!r}; re-run `toolkit export`")
            if entry.get("initializer") not in initializers:
                raise ModelFileError(
                    f"{graph.model_path}: weight {name!r} points at missing initializer {entry.get('initializer')!r}"
                )
            array = numpy_helper.to_array(initializers[entry["initializer"]])
            if entry.get("quantized"):  # a `toolkit quantize` artifact: the reference uses the dequantized weight
                from toolkit.quantize import dequantize_weight

                array = dequantize_weight(initializers, entry["quantized"])
            if entry.get("transpose"):
                array = array.T
            if tuple(array.shape) != tuple(state[name].shape):
                raise ModelFileError(
                    f"{graph.model_path}: weight {name!r} expected shape {tuple(state[name].shape)}, "
                    f"initializer {entry['initializer']!r} has {tuple(array.shape)}"
                )
            loaded[name] = torch.from_numpy(np.array(array, copy=True, order="C"))
    missing = [name for name in state if name not in loaded]
    if missing:
        raise ModelFileError(f"{artifact.location}: no initializer for weight {missing[0]!r}; re-run `toolkit export`")
    model.load_state_dict(loaded)
    return model


def eager_runner(artifact: Artifact, dtype: torch.dtype, name: str, graph: str | None = None,
                 protos: dict | None = None, model: torch.nn.Module | None = None) -> EagerRunner:
    graph_artifact = artifact.graph(graph)
    spec = {g.name: g for g in get_family(artifact.family).graphs(artifact.config())}[graph_artifact.name]
    model = model if model is not None else model_from_artifact(artifact, protos)
    run = spec.variant(artifact.variant)[2]
    return EagerRunner(model, dtype, graph_artifact, run, artifact.config(), name=name)
