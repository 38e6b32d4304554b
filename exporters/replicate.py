"""Export a deep decoder by tracing one block and replicating it.

torch.export spends seconds of symbolic-shape reasoning per block, so a
30-block model costs minutes to trace while every block is the same graph
with other weights. This module traces a one-block copy of the model whose
parameters are fresh random values (so every initializer can be traced back
to the parameter it came from by its bytes, as stored or transposed), then

  - copies the nodes of block 0 once per further block, renaming the values
    they produce and swapping in that block's initializers,
  - threads each copy's hidden-state input from the previous copy's output,
  - renames the per-block graph inputs and outputs (past.{i}.*, present.{i}.*,
    block.{i}.*) and puts them in the order the full model declares,
  - writes the real weights into every initializer.

Anything it cannot account for (an initializer folded from a weight other than
by a transpose, a value leaving block 0 other than its output, more than one
hidden-state candidate) makes it return None, and the caller traces the whole
model instead: slower, never different.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import heapq
from collections import defaultdict

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

from artifact import array_digest, weightless

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
BLOCK_LIST = "block"  # the ModuleList attribute holding the blocks of every stacked family
REPLICABLE_FAMILIES = ("llama", "gpt")


def replicable(family: str, config) -> bool:
    return family in REPLICABLE_FAMILIES and getattr(config, "layers", 1) > 1


def one_block_model(model: nn.Module, family: str, config, seed: int = 0):
    """(config with one block, its model with distinct random parameters and the real buffers)."""
    from models.registry import build_model

    small_config = dataclasses.replace(config, layers=1)
    small = build_model(family, small_config, init=False)
    generator = torch.Generator().manual_seed(seed)
    real_buffers = dict(model.named_buffers())
    with torch.no_grad():
        for param in small.parameters():
            # Distinct random values make each initializer's bytes name exactly one parameter.
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
        for name, buffer in small.named_buffers():
            buffer.copy_(real_buffers[name])
    return small_config, small.eval()


def _initializer_sources(small: nn.Module, proto: onnx.ModelProto) -> dict[str, tuple[str, bool]] | None:
    """{initializer: (parameter name, transposed)} for initializers holding a parameter; None if an
    initializer looks derived from a parameter some other way (it could not be refilled)."""
    arrays = [(init.name, numpy_helper.to_array(init)) for init in proto.graph.initializer]
    # A digest can only match an initializer of the same dtype and shape; the others (the transposed
    # copy of a 49k-row embedding, say) are not hashed at all.
    kinds = {(array.dtype.str, array.shape) for _, array in arrays}
    by_digest = {}
    for name, param in small.named_parameters(remove_duplicate=False):
        array = param.detach().numpy()
        if (array.dtype.str, array.shape) in kinds:
            by_digest.setdefault(array_digest(array), (name, False))
        if array.ndim == 2 and (array.dtype.str, array.shape[::-1]) in kinds:
            by_digest.setdefault(array_digest(array.T), (name, True))
    buffers = {array_digest(b.detach().numpy()) for b in small.buffers()}
    shapes = {tuple(p.shape) for p in small.parameters()} | {tuple(p.shape)[::-1] for p in small.parameters()}
    sources = {}
    for name, array in arrays:
        key = array_digest(array)
        if key in by_digest:
            sources[name] = by_digest[key]
        elif key not in buffers and array.dtype.kind == "f" and (
                array.size >= small.config.width or tuple(array.shape) in shapes):
            return None  # a weight-sized constant we cannot trace back: maybe a folded weight
    return sources


def _scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            try:
                return list(ast.literal_eval(prop.value))
            except (ValueError, SyntaxError):
                return []
    return []


def _layer_name(name: str, i: int) -> str | None:
    """block.0.x -> block.{i}.x, past.0.key -> past.{i}.key, present.0.value -> present.{i}.value."""
    for prefix in ("block.0.", "past.0.", "present.0."):
        if name.startswith(prefix):
            return f"{prefix.split('.')[0]}.{i}.{name[len(prefix):]}"
    return None


def replicate(model: nn.Module, small: nn.Module, proto: onnx.ModelProto, config,
              input_names: list[str], output_names: list[str]) -> onnx.ModelProto | None:
    """The full model's graph built from `proto`, the traced graph of the one-block `small`.

    input_names / output_names: the full model's graph inputs and outputs in order.
    Returns None when the traced graph does not have the shape this rewrite relies on.
    """
    replicated = replicate_with_weights(model, small, proto, config, input_names, output_names)
    return None if replicated is None else replicated[0]


def replicate_with_weights(model: nn.Module, small: nn.Module, proto: onnx.ModelProto, config,
                           input_names: list[str], output_names: list[str]) -> tuple[onnx.ModelProto, dict] | None:
    """replicate(), plus where each parameter of `model` was written: {name: {"initializer", "transpose"}}.

    The map is what onnx_export's byte search would find, known here without hashing the weights
    again: an initializer holding the weight as stored before one holding it transposed, the first
    of each in graph order; tied names share their weight's entry. Parameters written nowhere are absent.
    """
    sources = _initializer_sources(small, proto)
    if sources is None:
        return None
    graph = proto.graph
    scope = f"model.{BLOCK_LIST}.0"
    in_block = [scope in _scopes(n) for n in graph.node]
    if not any(in_block) or any(n.attribute and any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute)
                                for n in graph.node):
        return None
    block_nodes = [n for n, b in zip(graph.node, in_block) if b]
    produced = {o for n in block_nodes for o in n.output}
    outside_consumed = {i for n, b in zip(graph.node, in_block) if not b for i in n.input}
    leaving = produced & outside_consumed
    if len(leaving) != 1:
        return None
    (block_output,) = leaving

    inferred = onnx.shape_inference.infer_shapes(weightless(proto))  # types only: no weight bytes needed
    types = {v.name: v.type for v in (*inferred.graph.value_info, *graph.input, *graph.output)}
    graph_inputs = {v.name for v in graph.input}
    initializers = {t.name for t in graph.initializer}
    external = {i for n in block_nodes for i in n.input if i and i not in produced}
    hidden = []
    for name in external - graph_inputs - initializers:
        tensor = types.get(name)
        if tensor is None:
            continue
        dims = tensor.tensor_type.shape.dim
        if tensor.tensor_type.elem_type == onnx.TensorProto.FLOAT and len(dims) == 3 \
                and dims[2].dim_value == config.width:
            hidden.append(name)
    if len(hidden) != 1:
        return None
    (hidden_input,) = hidden
    graph_outputs = {v.name for v in graph.output}
    if any(_layer_name(name, 1) is None for name in produced & graph_outputs):
        return None  # a block output we do not know how to rename
    # Graph inputs named per block (past.0.*) get block i's; the rest (position_ids, masks) are shared.
    per_block_inputs = {name for name in external & graph_inputs if _layer_name(name, 1) is not None}

    real = dict(model.named_parameters(remove_duplicate=False))
    weights_of_block0 = {init: src for init, src in sources.items() if src[0].startswith(f"{BLOCK_LIST}.0.")}

    # Initializers in order: the traced ones (weights refilled from `model`), then each block's copies.
    # A plan entry is a TensorProto kept as traced, or (name, parameter, transposed) filled in at the end.
    plan = [(t.name, *sources[t.name]) if t.name in sources else t for t in graph.initializer]
    copies, last_output = [], block_output
    for i in range(1, config.layers):
        renamed = {hidden_input: last_output}
        for init, (param, transposed) in weights_of_block0.items():
            target = _layer_name(init.removeprefix("model."), i)
            new_name = f"model.{target}" if target and init.startswith("model.") else f"{init}__{BLOCK_LIST}{i}"
            renamed[init] = new_name
            plan.append((new_name, param.replace(f"{BLOCK_LIST}.0.", f"{BLOCK_LIST}.{i}.", 1), transposed))
        for name in per_block_inputs:
            renamed[name] = _layer_name(name, i)
        for name in produced:
            renamed[name] = _layer_name(name, i) if name in graph_outputs else f"{name}__{BLOCK_LIST}{i}"
        for node in block_nodes:
            clone = copy.deepcopy(node)
            clone.name = f"{node.name}__{BLOCK_LIST}{i}"
            clone.input[:] = [renamed.get(x, x) for x in node.input]
            clone.output[:] = [renamed[x] for x in node.output]
            copies.append(clone)
        last_output = renamed[block_output]

    rest = []
    for node, b in zip(graph.node, in_block):
        if not b:
            node = copy.deepcopy(node)
            node.input[:] = [last_output if x == block_output else x for x in node.input]
        rest.append(node)
    nodes = topological(rest + copies)
    if nodes is None:
        return None

    values = {v.name: v for v in (*graph.input, *graph.output)}

    def value_info(name: str) -> onnx.ValueInfoProto | None:
        if name in values:
            return values[name]
        for source in values:
            for i in range(1, config.layers):
                if _layer_name(source, i) == name:
                    info = copy.deepcopy(values[source])
                    info.name = name
                    return info
        return None

    result = copy.deepcopy(proto)
    del result.graph.node[:], result.graph.initializer[:], result.graph.value_info[:]
    del result.graph.input[:], result.graph.output[:]
    result.graph.node.extend(nodes)
    for names, field in ((input_names, result.graph.input), (output_names, result.graph.output)):
        for name in names:
            info = value_info(name)
            if info is None:
                return None
            field.append(info)
    placed = []
    for entry in plan:
        if isinstance(entry, onnx.TensorProto):
            result.graph.initializer.add().CopyFrom(entry)
            continue
        # Filled in place: the model's weights are hundreds of MB, so they are copied once, not per step.
        name, param, transposed = entry
        array = real[param].detach().to(torch.float32).numpy()
        array = np.ascontiguousarray(array.T if transposed else array)
        tensor = result.graph.initializer.add()
        tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
        tensor.dims.extend(array.shape)
        tensor.raw_data = array.astype("<f4", copy=False).tobytes()
        placed.append((name, param, transposed))
    return result, _weight_entries(model, placed)


def _weight_entries(model: nn.Module, placed: list[tuple[str, str, bool]]) -> dict[str, dict]:
    """{parameter name: {"initializer", "transpose"}} from (initializer, parameter, transposed) in graph order."""
    params = dict(model.named_parameters(remove_duplicate=False))
    stored, transposed = {}, {}
    for init, param, is_transposed in placed:
        (transposed if is_transposed else stored).setdefault(id(params[param]), init)
    weights = {}
    for name, param in params.items():  # every name of a tied parameter, as state_dict lists them
        if id(param) in stored:
            weights[name] = {"initializer": stored[id(param)], "transpose": False}
        elif id(param) in transposed:
            weights[name] = {"initializer": transposed[id(param)], "transpose": True}
    return weights


def topological(nodes: list[onnx.NodeProto], available: set[str] | None = None) -> list[onnx.NodeProto] | None:
    """Nodes in an order where every value is produced before use (stable: a graph already in order keeps
    its order), or None when there is none (a cycle, or, given `available`, an input that is neither
    available nor produced by a node)."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    if available is not None:
        known = set(available) | set(producer) | {""}
        if any(x not in known for n in nodes for x in n.input):
            return None
    waiting = [sum(1 for x in set(n.input) if x in producer) for n in nodes]
    users = defaultdict(list)
    for k, n in enumerate(nodes):
        for x in set(n.input):
            if x in producer:
                users[producer[x]].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for user in users[k]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    return order if len(order) == len(nodes) else None
