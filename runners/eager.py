"""PyTorch eager backends, rebuilt from the weights inside the artifact's ONNX files.

`eager` runs at the export dtype (float32, or float16/bfloat16 for a reduced-precision
export); `eager-f64` runs in float64 and is the reference oracle every other backend is
judged against; `eager-cuda` is `eager` on the GPU, with TF32 off so float32 is float32.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from onnx import numpy_helper

from artifact import Artifact, GraphArtifact, validate_onnx
from artifact.errors import ExternalDataError, ModelFileError
from exporters.quantize import SPEC_PARTS, dequantize_weight
from models.artifacts import artifact_config
from models.registry import build_model, get_family
from runners.activations import Int8Activations, RoundedWeight, rounds_activations
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


@contextmanager
def computing_in(model: torch.nn.Module, dtype: torch.dtype):
    """Inside the block every floating parameter and buffer of `model` is `dtype`, as after `model.to(dtype)`,
    yet the model holds no second copy: the tensors outside its blocks (embedding, final norm, head) are cast
    for the whole call, each block's own only while that block runs, and each tensor gets its own values
    back afterwards (the originals are kept, so nothing is rounded twice). One float32 model thus serves
    as the eager backend and as the float64 oracle, holding one block in float64 beyond its weights.
    """
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if all(t.dtype == dtype for t in floats):
        yield model
        return
    blocks, prefixes = [], []  # the outermost ModuleLists' items (a list inside a block belongs to its block)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(p) for p in prefixes):
            blocks += list(module)
            prefixes.append(f"{name}.")
    inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
    originals = {}  # id -> (tensor, its own data) of every tensor cast now

    def cast(tensors):
        for t in tensors:
            if t.is_floating_point() and t.dtype != dtype and id(t) not in originals:
                originals[id(t)] = (t, t.data)
                t.data = t.data.to(dtype)

    def restore(tensors):
        for t in tensors:
            if id(t) in originals:
                t.data = originals.pop(id(t))[1]

    def own(block):
        return [*block.parameters(), *block.buffers()]

    hooks = []
    for block in blocks:
        hooks.append(block.register_forward_pre_hook(lambda m, args: cast(own(m))))
        hooks.append(block.register_forward_hook(lambda m, args, out: restore(own(m))))
    try:
        cast([t for t in floats if id(t) not in inside])
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        restore([t for t, _ in list(originals.values())])


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
        by_block: bool = False,
    ):
        super().__init__(graph.input_specs, graph.output_names, config)
        self.name = name
        self.dtype = dtype
        self.torch_device = torch.device(device)
        # by_block: the model keeps its own dtypes and is cast a block at a time while it runs (computing_in),
        # so the float64 oracle and the eager backend can share it
        self.by_block = by_block and self.torch_device.type == "cpu"
        self.model = model.eval() if self.by_block else model.to(device=self.torch_device, dtype=dtype).eval()
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
            with computing_in(self.model, self.dtype) if self.by_block else nullcontext(), _as_onnxruntime(self.model):
                stages = self.forward(self.model, *args)
        else:
            matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            try:
                with _as_onnxruntime(self.model):
                    stages = self.forward(self.model, *args)
                torch.cuda.synchronize(self.torch_device)  # the run's time includes the kernels
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        return {name: to_numpy(stages[name]) for name in self.output_names}


def _as_onnxruntime(model: torch.nn.Module):
    """Inside it, the weights whose MatMulNBits rounds its activations to int8 (`model.rounded_weights`, by
    parameter name) compute on rounded activations, as ONNX Runtime's CPU kernel does (runners.activations),
    on whichever device the model runs."""
    rounded = getattr(model, "rounded_weights", None)
    if not rounded:
        return nullcontext()
    by_id = {id(p): rounded[name] for name, p in model.named_parameters(remove_duplicate=False) if name in rounded}
    return Int8Activations(by_id)


def _rounded_weight(name: str, place, nbits_nodes: dict, read, where) -> RoundedWeight | None:
    """The RoundedWeight of quantized weight `name` where its MatMulNBits (`nbits_nodes`, by B) rounds its
    activations, else None."""
    spec = place.quantized
    node = nbits_nodes.get(spec["weight"])
    level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0) if node is not None else 0
    zero_points = spec.get("zero_points")
    zero_dtype = None if zero_points is None else read(zero_points).dtype
    if not rounds_activations(level, zero_dtype, spec["bits"], spec["block_size"]):
        return None
    offsets = read(spec["offsets"]) if "offsets" in spec else None  # [blocks, N]
    if place.slice and offsets is not None:
        axis, start, stop = place.slice
        if axis != 1:  # a fused weight is split along N; its K blocks are the whole weight's
            raise ModelFileError(f"{where}: weight {name!r} slices a quantized weight along K (axis {axis})")
        offsets = offsets[:, start:stop]
    if not place.transpose:  # F.linear takes [N, K], the transpose of MatMulNBits' [K, N]
        raise ModelFileError(f"{where}: quantized weight {name!r} is not stored as a MatMul's [K, N]")
    return RoundedWeight(spec["block_size"], None if offsets is None else torch.from_numpy(np.array(offsets)))


def model_from_artifact(artifact: Artifact, protos: dict | None = None) -> torch.nn.Module:
    """Construct the artifact's model and load every weight from the graphs' ONNX initializers.

    Weights in external data are read one tensor at a time straight into the model's parameters, so the
    load holds one copy of the weights plus the tensor in hand, not the graph's copy as well. A quantized
    weight loads dequantized; where its MatMulNBits rounds activations to int8, `model.rounded_weights`
    records it so the eager runners compute that rounding too.
    """
    config = artifact_config(artifact)
    model = build_model(artifact.family, config, init=False)  # every weight is loaded next
    protos = protos or {}
    # state_dict tensors share storage with the parameters (tied weights included): copy_ fills the model
    state = model.state_dict()
    loaded, rounded = set(), {}
    for graph in artifact.graphs:
        proto = protos.get(graph.name) or validate_onnx(graph.model_path)  # without its external data
        initializers = {init.name: init for init in proto.graph.initializer}
        nbits_nodes = {node.input[1]: node for node in proto.graph.node if node.op_type == "MatMulNBits"}
        base_dir = str(graph.model_path.parent)

        def read(name, graph=graph, initializers=initializers, base_dir=base_dir):
            try:
                return numpy_helper.to_array(initializers[name], base_dir=base_dir)
            except (OSError, ValueError) as exc:
                raise ExternalDataError(f"{graph.model_path}: cannot read initializer {name!r} ({exc})") from None

        for name, place in graph.weights.items():
            if name not in state:
                raise ModelFileError(
                    f"{graph.model_path}: the manifest maps unknown weight {name!r}; re-run `toolkit export`"
                )
            if place.initializer not in initializers:
                raise ModelFileError(
                    f"{graph.model_path}: weight {name!r} points at missing initializer {place.initializer!r}"
                )
            if place.quantized:  # a `toolkit quantize` artifact: the reference uses the dequantized weight
                spec = place.quantized
                parts = [spec[key] for key in SPEC_PARTS if key in spec]
                array = dequantize_weight({part: read(part) for part in parts}, spec)
                rounded[name] = _rounded_weight(name, place, nbits_nodes, read, graph.model_path)
            else:
                array = read(place.initializer)
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
            # float16/bfloat16 exports: the model holds the rounded values, widened exactly. An array read from
            # external data is a read-only view of the bytes read, which torch only takes as writable memory.
            array = np.ascontiguousarray(array) if array.flags.writeable else np.array(array, order="C")
            state[name].copy_(to_torch(array))
            loaded.add(name)
            del array
    missing = [name for name in state if name not in loaded]
    if missing:
        raise ModelFileError(f"{artifact.location}: no initializer for weight {missing[0]!r}; re-run `toolkit export`")
    model.rounded_weights = {name: weight for name, weight in rounded.items() if weight is not None}
    return model


def eager_runner(
    artifact: Artifact,
    dtype: torch.dtype,
    name: str,
    graph: str | None = None,
    protos: dict | None = None,
    model: torch.nn.Module | None = None,
    device: str = "cpu",
    by_block: bool = False,
) -> EagerRunner:
    graph_artifact = artifact.graph(graph)
    spec = {g.name: g for g in get_family(artifact.family).graphs(artifact_config(artifact))}[graph_artifact.name]
    model = model if model is not None else model_from_artifact(artifact, protos)
    run = spec.variant(artifact.variant)[2]
    config = artifact_config(artifact)
    return EagerRunner(model, dtype, graph_artifact, run, config, name=name, device=device, by_block=by_block)
