"""torch.onnx (dynamo) export with custom-domain RMSNorm/SwiGLU/GeGLU functions.

One export path for every family:
  trace with torch.onnx.export(dynamo=True) -> attach FunctionProtos for the
  custom nodes -> map every torch weight to its initializer -> embed the
  manifest -> full checker + strict shape inference -> atomic artifact write.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

from artifact.errors import ConfigError, ExportError
from artifact.format import (
    CUSTOM_DOMAIN,
    CUSTOM_DOMAIN_VERSION,
    FORMAT,
    FORMAT_VERSION,
    MODEL_FILE,
    TOOLKIT_VERSION,
    Artifact,
)
from artifact.hashing import array_digest, sha256_bytes
from artifact.protobuf import weightless
from artifact.read import write_and_load
from artifact.write import check_output_dir, is_pending, pack_artifact
from exporters import lowerings, precision, replicate
from exporters.functions import OPSET, function_protos
from models.registry import build_model, get_family

VARIANTS = ("stages", "serving")
SAMPLE_BATCH, SAMPLE_SEQUENCE = 2, 3


class _NamedOutputs(nn.Module):
    """Wraps one graph of a stage-dict model so the traced graph returns exactly `names`, in order."""

    def __init__(self, model: nn.Module, run, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.run = run
        self.names = names

    def forward(self, *inputs):
        stages = self.run(self.model, *inputs)
        return tuple(stages[name] for name in self.names)


def graph_outputs(graph, variant: str) -> tuple[str, ...]:
    if variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return graph.variant(variant)[1]


def output_names(family: str, config, variant: str) -> tuple[str, ...]:
    """Every graph output of an export of `family`, graphs in order."""
    return tuple(n for g in get_family(family).graphs(config) for n in graph_outputs(g, variant))


def graph_file(family, graph) -> str:
    """model.onnx for single-graph families, <graph>.onnx otherwise."""
    return MODEL_FILE if graph.name == "model" else f"{graph.name}.onnx"


def export_model(
    model: nn.Module | Callable[[], nn.Module],
    family: str,
    config,
    out_dir: str | Path,
    *,
    variant: str = "stages",
    preset: str | None = None,
    seed: int | None = None,
    source: dict | Callable[[], dict] | None = None,
    extra_files: dict[str, bytes] | None = None,
    lowering: str = lowerings.DEFAULT_LOWERING,
    dtype: str = "float32",
    external_data: bool | None = None,
    progress=None,
    release_weights: bool = False,
) -> Artifact:
    """Export every graph of `model` into `out_dir` (ONNX files + manifest.json); return the loaded artifact.

    model: the module, or a function that reads it (an imported checkpoint's weights). A function is called
    after the one-block traces, which need only the config: the trace's working memory is then given back
    before the weights take theirs, so the two do not add up in the export's peak.

    source: where the weights came from (an imported checkpoint), or a function returning it, called when the
    manifest is written (the checkpoint's hashes, computed meanwhile on another thread); extra_files: more files for the
    artifact (the tokenizer), written in the same atomic swap and hashed in the manifest.
    lowering: "functions" (custom ops with function bodies), "standard" (opset 23) or "ort"
    (ONNX Runtime's com.microsoft kernels); see exporters/lowerings.py.
    dtype: "float32", "float16" or "bfloat16" for weights and activations (exporters/precision.py).
    external_data: weights in a `.data` file beside each graph (True), inside it (False), or beside it above
    artifact.write.external_data_threshold() bytes (None).
    progress(message): called as each step ends (traced, lowered, converted, written), for a progress display.
    release_weights: the graphs take the model's weights over, each parameter freed once written (in the export
    dtype) into the last initializer that holds it, so the export holds one copy of the weights instead of
    two; the model is left without its weights. The ort and standard lowerings' rewrite (float32 only:
    precision.check_supported) reads the weights it fuses or moves from the released bytes and releases the
    originals a layer at a time.
    """
    progress = progress or (lambda message: None)
    fam = get_family(family)
    if not isinstance(config, fam.config_cls):
        raise ConfigError(f"family {family!r} expects a {fam.config_cls.__name__}, got {type(config).__name__}")
    if variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    lowerings.check_supported(family, config, lowering)
    precision.check_supported(dtype, lowering)
    check_output_dir(Path(out_dir))  # before the slow trace
    read = None if isinstance(model, nn.Module) else model
    if read is None:
        model = _prepared(model, release_weights)
    fill = replicate.WeightFill(
        dtype=precision.numpy_dtype(dtype) if release_weights else np.dtype(np.float32), release=release_weights
    )
    graphs = list(fam.graphs(config))
    # The one-block traces read only the config's buffers (RoPE tables, windows): from a weightless skeleton
    # (parameters allocated, never written, so never resident) when the weights are not read yet.
    skeleton = model if read is None else _prepared(build_model(family, config, init=False), release_weights)
    templates = {}
    for graph in graphs:
        progress(f"tracing {graph.name} ({getattr(config, 'layers', 1)} blocks)")
        templates[graph.name] = _trace_template(skeleton, family, config, graph.name, variant)
    if read is not None:
        del skeleton
        _large_allocations_mapped()
        progress("reading the weights")
        model = _prepared(read(), release_weights)
        progress(f"read {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters")
    protos, entries, used = {}, [], set()
    for graph in graphs:
        inputs, names, run = graph.variant(variant)
        template = templates.pop(graph.name)
        replicated = None
        if template is not None:
            small, proto, sources = template
            replicated = replicate.replicate_with_weights(
                model, small, proto, config, [s.name for s in inputs], list(names), weights=fill, sources=sources
            )
        if replicated is None:
            model = model.to(torch.float32)
            proto = _trace(_NamedOutputs(model, run, names), config, graph.name, inputs, names)
            traced_blocks, weights = getattr(config, "layers", 1), _weight_map(model, proto)
        else:
            (proto, weights), traced_blocks = replicated, len(replicate.layer_kinds(config)[1])
            if any(name not in weights for name in model.state_dict()):  # e.g. a buffer held as an initializer
                weights = {**_weight_map(model, proto), **weights}
        graph_used = {n.op_type for n in proto.graph.node if n.domain == CUSTOM_DOMAIN}
        proto.functions.extend(function_protos(graph_used))
        if not any(o.domain == CUSTOM_DOMAIN for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION))
        used |= graph_used
        protos[graph.name] = proto
        entries.append(
            {
                "name": graph.name,
                "file": graph_file(family, graph),
                "inputs": [s.to_dict() for s in inputs],
                "outputs": _value_specs(proto.graph.output),
                "stages": list(names),
                "custom_ops": sorted(graph_used),
                "traced_blocks": traced_blocks,
                "weights": weights,
            }
        )
    if lowering != lowerings.DEFAULT_LOWERING:
        progress(f"lowering to {lowering}")
        used = _lower(model, family, config, lowering, protos, entries, fill.pending if release_weights else None)
    _check_weights_covered(model, entries)
    if release_weights:  # every weight is in a graph now (a whole-model trace holds them besides the model's copy)
        with torch.no_grad():
            for param in model.parameters():
                param.data = torch.empty(0, dtype=param.dtype)
    if dtype != "float32":
        progress(f"converting to {dtype}")
    converted = frozenset(
        init.name
        for proto in protos.values()
        for init in proto.graph.initializer
        if fill.dtype != np.float32 and init.data_type == onnx.helper.np_dtype_to_tensor_dtype(fill.dtype)
    )
    precision.apply(model, protos, entries, dtype, converted)  # after the weight map, which matches float32 bytes

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": family,
        "preset": preset,
        "seed": seed,
        "variant": variant,
        "config": config.to_dict(),
        "opset": OPSET if lowering == lowerings.DEFAULT_LOWERING else lowerings.STANDARD_OPSET,
        "custom_domains": lowerings.custom_domains(lowering),
        "lowering": lowering,
        "lowerings": lowerings.lowering_support(family, config),
        "dtype": dtype,
        "custom_ops": sorted(used),
        "graphs": entries,
        "source": source() if callable(source) else source,
        "extra_files": {name: sha256_bytes(data) for name, data in (extra_files or {}).items()},
        "versions": _versions(),
    }

    def check(entry: dict, proto: onnx.ModelProto) -> None:
        proto.producer_name = "onnx-toolkit"
        try:
            _check_and_infer(proto)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise ExportError(f"exported {entry['name']} graph failed the ONNX checker: {exc}") from None

    # Each graph's proto is dropped once serialised: hundreds of MB the write can reuse.
    progress("checking and serialising")
    files = pack_artifact(
        manifest, protos, extra_files, before_serialise=check, external_data=external_data, pending=fill.pending
    )
    total = sum(len(d) if not isinstance(d, list) else sum(map(len, d)) for d in files.values())
    progress(f"writing {total / 2**20:,.1f} MiB and verifying it")
    return write_and_load(Path(out_dir), files)


def _trace(wrapper: nn.Module, config, graph_name: str, inputs, names) -> onnx.ModelProto:
    return _trace_program(wrapper, config, graph_name, inputs, names).model_proto


def _trace_program(wrapper: nn.Module, config, graph_name: str, inputs, names):
    """torch.onnx's ONNXProgram of `wrapper`: its onnx_ir model, not yet serialised."""
    rng = np.random.default_rng(0)
    # Traced sizes differ per axis name (and are >= 2) so torch.export keeps each axis symbolic and distinct.
    sizes = {
        "batch": SAMPLE_BATCH,
        "sequence": SAMPLE_SEQUENCE,
        "source_sequence": SAMPLE_SEQUENCE + 1,
        "past_sequence": SAMPLE_SEQUENCE + 2,
    }
    sizes = {k: min(v, config.max_positions) if k != "batch" else v for k, v in sizes.items()}
    if sizes["past_sequence"] + sizes["sequence"] > config.max_positions:
        sizes["past_sequence"] = max(config.max_positions - sizes["sequence"], 0)
    dims = {"batch": torch.export.Dim("batch", min=1)}
    for axis in ("sequence", "source_sequence"):
        if sizes[axis] > 1:  # a window of one position cannot have a symbolic length
            dims[axis] = torch.export.Dim(axis, min=1, max=config.max_positions)
    if sizes["past_sequence"] > 1:  # the prefill runs with an empty cache, so 0 is allowed
        dims["past_sequence"] = torch.export.Dim("past_sequence", min=0, max=config.max_positions)
    args, shapes = [], []
    for spec in inputs:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)
        if spec.dtype == "int64":
            value = torch.from_numpy(rng.integers(0, config.vocab_size, size=shape, dtype=np.int64))
        else:
            value = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        args.append(value)
        shapes.append({axis: dims[d] for axis, d in enumerate(spec.shape) if isinstance(d, str) and d in dims})
    dynamic_shapes = (tuple(shapes),)  # one entry: the wrapper's *inputs
    captured = io.StringIO()
    # torch.onnx narrates its steps on stdout and logs optional-dependency notices; users see our summary instead.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(captured),
            contextlib.redirect_stderr(captured),
            _no_fake_tensor_cache(),
            _no_cyclic_gc(),
        ):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapper,
                tuple(args),
                dynamo=True,
                opset_version=OPSET,
                input_names=[s.name for s in inputs],
                output_names=list(names),
                dynamic_shapes=dynamic_shapes,
                optimize=True,
                verify=False,
            )
    except Exception as exc:  # torch.onnx raises many types; all mean the same to the user
        raise ExportError(f"torch.onnx.export failed for the {graph_name} graph: {_summary(exc)}") from exc
    return program


@contextlib.contextmanager
def _no_fake_tensor_cache():
    """torch.export's fake-tensor dispatch cache, off for the trace: one export sees each op a few
    times, so keying and storing every symbolic-shape result costs more than the hits save. The
    traced graph is the same."""
    import torch._dynamo.config

    if not hasattr(torch._dynamo.config, "fake_tensor_cache_enabled"):
        yield
        return
    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        yield


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cycle collector paused for the trace, which allocates millions of short-lived objects
    and imports torch.onnx's and onnxscript's modules on first use, so full collections would walk
    the whole heap again and again. Reference counting still frees what it can; the cycles left are
    collected after, as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_and_infer(proto: onnx.ModelProto) -> None:
    """Full ONNX checker and strict shape inference, with the inferred types written into `proto`;
    both run on the weightless copy (artifact.protobuf.weightless), which is all they read."""
    skeleton = weightless(proto)
    onnx.checker.check_model(skeleton, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=True).graph
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(inferred.value_info)
    for output, typed in zip(proto.graph.output, inferred.output, strict=False):
        output.type.CopyFrom(typed.type)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 1 << 20, 4 << 20


def _large_allocations_mapped() -> None:
    """From here on, every allocation of 1 MiB or more is mapped on its own, so freeing it gives the memory back
    at once, and free heap above 4 MiB goes back too. glibc raises both thresholds as mapped blocks are freed (up
    to 32 and 64 MiB), and the trace frees many: the weights read and widened next would then come from the heap,
    where a released weight's memory stays resident beside the widened copies (measured: 0.1 GB more at the end
    of a 0.5B export). Set after the trace, whose many short-lived blocks keep the heap's reuse. A no-op where
    there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass


def _prepared(model: nn.Module, release_weights: bool) -> nn.Module:
    """`model` in eval mode, float32 unless its weights are released (they are converted one tensor at a time
    as they are written); a traced model is float32, and so are the buffers (RoPE frequencies) in both cases."""
    if not release_weights:
        return model.to(torch.float32).eval()
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(torch.float32)
    return model.eval()


def _trace_template(model, family: str, config, graph_name: str, variant: str):
    """(small model, traced graph, its initializers' sources): the graph traced from a copy of `model` with one
    block per kind of layer, for exporters.replicate to repeat; None when the family or the traced graph does
    not allow it (the caller then traces the whole model). Only `model`'s buffers are read."""
    if not replicate.replicable(family, config):
        return None
    small_config, small = replicate.one_block_model(model, family, config)
    (small_graph,) = [g for g in get_family(family).graphs(small_config) if g.name == graph_name]
    small_inputs, small_names, small_run = small_graph.variant(variant)
    program = _trace_program(
        _NamedOutputs(small, small_run, small_names), small_config, graph_name, small_inputs, small_names
    )
    # The trace's weights are traced back to the small model's parameters before serialising, then dropped:
    # serialised, they and the small model would be two more copies of a block beside the full model's weights.
    sources = replicate.initializer_sources(small, replicate.ir_initializers(program.model))
    if sources is None:
        return None
    replicate.release_traced_weights(program.model, small, sources)
    proto = program.model_proto
    del program
    return small, proto, sources


def _lower(model, family: str, config, lowering: str, protos: dict, entries: list[dict], pending=None) -> set[str]:
    """Rewrite every traced graph with `lowering`; re-map the weights (fused ones as slices).

    The model's weights are found by content (equal weights of the worked example share one initializer, which
    the rewrite may replace by copies); with `pending` (WeightFill's released bytes) the model holds none, so
    the map is the traced one, less what the rewrite dropped, plus what it moved."""
    used = set()
    for entry in entries:
        proto, moved, notes = lowerings.lower(
            protos[entry["name"]], lowering, family, config, entry["weights"], pending
        )
        protos[entry["name"]] = proto
        if pending is None:
            entry["weights"] = {**_weight_map(model, proto), **moved}
        else:
            kept = {init.name for init in proto.graph.initializer}
            traced = {name: place for name, place in entry["weights"].items() if place["initializer"] in kept}
            entry["weights"] = {**traced, **moved}
        entry["custom_ops"] = sorted({f"{n.domain}::{n.op_type}" for n in proto.graph.node if n.domain})
        entry.update(notes)
        used |= set(entry["custom_ops"])
    return used


def _summary(exc: BaseException) -> str:
    """The one informative line of a torch.onnx failure: its root cause's first line."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else 'no message'}"


def _value_specs(values) -> list[dict]:
    specs = []
    for value in values:
        tensor = value.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        specs.append({"name": value.name, "dtype": dtype, "shape": shape})
    return specs


def _weight_map(model: nn.Module, proto: onnx.ModelProto) -> dict[str, dict]:
    """Where each torch weight used by this graph lives: {name: {"initializer", "transpose"}}.

    The exporter's optimiser may fold a Linear's transpose into a fresh
    initializer, so weights are found by exact bytes (as stored or transposed),
    which lets the eager reference be rebuilt from the .onnx files alone.
    Weights a graph does not use (the decoder's, in the encoder graph) are absent.
    """
    key = array_digest
    by_bytes: dict[tuple, str] = {}
    for init in proto.graph.initializer:
        if not is_pending(init):  # placed by replicate, which maps those itself
            by_bytes.setdefault(key(numpy_helper.to_array(init)), init.name)
    mapping = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().cpu().numpy()
        found = by_bytes.get(key(array))
        transpose = False
        if found is None and array.ndim == 2:
            found = by_bytes.get(key(array.T))
            transpose = found is not None
        if found is not None:
            mapping[name] = {"initializer": found, "transpose": transpose}
    return mapping


def _check_weights_covered(model: nn.Module, entries: list[dict]) -> None:
    for name, tensor in model.state_dict().items():
        if not any(name in entry["weights"] for entry in entries):
            raise ExportError(
                f"weight {name!r} {tuple(tensor.shape)} has no matching initializer in any exported graph; "
                "the exporter rewrote or dropped it, so the eager reference could not be rebuilt from the files"
            )


def _versions() -> dict[str, str]:
    import onnxscript

    versions = {"toolkit": TOOLKIT_VERSION, "torch": torch.__version__, "onnx": onnx.__version__}
    versions["onnxscript"] = onnxscript.__version__
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    return versions
