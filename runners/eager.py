"""PyTorch eager backends, rebuilt from the weights inside the artifact's ONNX files.

`eager` runs at the export dtype (float32, or float16/bfloat16 for a reduced-precision
export); `eager-f64` runs in float64 and is the reference oracle every other backend is
judged against; `eager-cuda` is `eager` on the GPU, with TF32 off so float32 is float32.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from onnx import numpy_helper

from artifact import Artifact, GraphArtifact, load_onnx
from artifact.errors import ModelFileError
from exporters.quantize import dequantize_weight
from models.artifacts import artifact_config
from models.registry import build_model, get_family
from runners.base import Runner, check_feed

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy -> torch; bfloat16 (ml_dtypes, which torch.from_numpy does not know) through its bits."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class EagerRunner(Runner):
    def __init__(
        self,
        model: torch.nn.Module,
        dtype: torch.dtype,
        graph: GraphArtifact,
        run,
        config,
        name="eager",
        device: str = "cpu",
    ):
        super().__init__(graph.input_specs, graph.output_names, config)
        self.name = name
        self.dtype = dtype
        self.torch_device = torch.device(device)
        self.model = model.to(device=self.torch_device, dtype=dtype).eval()
        self.forward = run
        where = device
        if self.torch_device.type == "cuda":
            # TF32 matmuls/convolutions keep 10 mantissa bits: off, so float32 on the GPU means float32.
            where = f"{device} ({torch.cuda.get_device_name(self.torch_device)}), tf32 off"
        self.device = f"torch {str(dtype).removeprefix('torch.')} {where}"

    def run(self, inputs, trusted=()):
        if self.dtype != torch.float64:
            return super().run(inputs, trusted)
        # The oracle keeps its own float64 cache between decode steps; validate a view of the feed at the
        # declared dtype, then compute on the float64 values. Its own cache (trusted) is checked by shape
        # through a zero-stride stand-in: casting it would copy it and could overflow a float16 declaration.
        declared = {s.name: s.dtype for s in self.input_specs}

        def view(name, value):
            if not (isinstance(value, np.ndarray) and value.dtype == np.float64):
                return value
            dtype = declared.get(name, np.float32)
            if name in trusted:
                return np.broadcast_to(np.zeros((), dtype=dtype), value.shape)
            return value.astype(dtype)

        views = {k: view(k, v) for k, v in inputs.items()} if isinstance(inputs, dict) else inputs
        check_feed(self.input_specs, views, self.config, trusted)
        start = time.perf_counter()
        outputs = self._infer(inputs)
        self.last_inference_time = time.perf_counter() - start
        return outputs

    @torch.no_grad()
    def _infer(self, feed):
        args = []
        for spec in self.input_specs:
            tensor = to_torch(feed[spec.name])
            tensor = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
            args.append(tensor.to(self.torch_device))
        if self.torch_device.type != "cuda":
            stages = self.forward(self.model, *args)
        else:
            matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            try:
                stages = self.forward(self.model, *args)
                torch.cuda.synchronize(self.torch_device)  # the run's time includes the kernels
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        return {name: to_numpy(stages[name]) for name in self.output_names}


def model_from_artifact(artifact: Artifact, protos: dict | None = None) -> torch.nn.Module:
    """Construct the artifact's model and load every weight from the graphs' ONNX initializers."""
    config = artifact_config(artifact)
    model = build_model(artifact.family, config, init=False)  # every weight is loaded next
    protos = protos or {}
    state = model.state_dict()
    loaded = {}
    for graph in artifact.graphs:
        proto = protos.get(graph.name) or load_onnx(graph.model_path)
        initializers = {init.name: init for init in proto.graph.initializer}
        for name, place in graph.weights.items():
            if name not in state:
                raise ModelFileError(
                    f"{graph.model_path}: the manifest maps unknown weight {name!r}; re-run `toolkit export`"
                )
            if place.initializer not in initializers:
                raise ModelFileError(
                    f"{graph.model_path}: weight {name!r} points at missing initializer {place.initializer!r}"
                )
            array = numpy_helper.to_array(initializers[place.initializer])
            if array.dtype.name in ("float16", "bfloat16"):
                # A reduced-precision export: the model holds the rounded values, widened exactly.
                array = array.astype(np.float32)
            if place.quantized:  # a `toolkit quantize` artifact: the reference uses the dequantized weight
                array = dequantize_weight(initializers, place.quantized)
            if place.slice:  # a fused initializer (lowering "ort": QKV, gate/up): [axis, start, stop]
                axis, start, stop = place.slice
                array = np.take(array, np.arange(start, stop), axis=axis)
            if place.transpose:
                array = array.T
            if tuple(array.shape) != tuple(state[name].shape):
                raise ModelFileError(
                    f"{graph.model_path}: weight {name!r} expected shape {tuple(state[name].shape)}, "
                    f"initializer {place.initializer!r} has {tuple(array.shape)}"
                )
            loaded[name] = torch.from_numpy(np.array(array, copy=True, order="C"))
    missing = [name for name in state if name not in loaded]
    if missing:
        raise ModelFileError(f"{artifact.location}: no initializer for weight {missing[0]!r}; re-run `toolkit export`")
    model.load_state_dict(loaded)
    return model


def eager_runner(
    artifact: Artifact,
    dtype: torch.dtype,
    name: str,
    graph: str | None = None,
    protos: dict | None = None,
    model: torch.nn.Module | None = None,
    device: str = "cpu",
) -> EagerRunner:
    graph_artifact = artifact.graph(graph)
    spec = {g.name: g for g in get_family(artifact.family).graphs(artifact_config(artifact))}[graph_artifact.name]
    model = model if model is not None else model_from_artifact(artifact, protos)
    run = spec.variant(artifact.variant)[2]
    return EagerRunner(model, dtype, graph_artifact, run, artifact_config(artifact), name=name, device=device)
