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
import functools
import heapq
from collections import defaultdict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

from artifact import array_digest, weightless
from artifact.write import PendingWeights

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
BLOCK_LIST = "block"  # the ModuleList attribute holding the blocks of every stacked family
REPLICABLE_FAMILIES = ("llama", "gpt")
TRACE_VOCAB = 97  # the one-block model's vocabulary: a prime, so no other axis of the graph has its size


def replicable(family: str, config) -> bool:
    """Whether a `family` model of `config` is exported by tracing one block per kind of layer and replicating."""
    layers = getattr(config, "layers", 1)
    return family in REPLICABLE_FAMILIES and layers > 1 and len(layer_kinds(config)[1]) < layers


def layer_kinds(config) -> tuple[list[int], list[int]]:
    """(each layer's kind, the first layer of each kind). Layers of one kind compute the same function of their
    own weights (config.layer_attention: window, RoPE base and scaling). A config whose layers differ only in
    values their attention holds as buffers (per_layer_data: Gemma 2/3's local and global layers, SmolLM3's
    layers with and without RoPE) is one kind; the others are one kind per distinct layer_attention."""
    layers = getattr(config, "layers", 1)
    if not hasattr(config, "layer_attention") or getattr(config, "per_layer_data", ()):
        return [0] * layers, [0]  # per_layer_data: the layers' differences are buffers, refilled per layer
    seen: dict[str, int] = {}
    kinds, firsts = [], []
    for i in range(layers):
        key = repr(sorted(config.layer_attention(i).items()))
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(i)
        kinds.append(seen[key])
    return kinds, firsts


def one_block_model(model: nn.Module, family: str, config, seed: int = 0):
    """(config with one block per kind of layer, its model with distinct random parameters and the real buffers).
    Block j of the small model is the first layer of kind j (layer_kinds)."""
    from models.registry import build_model

    _, firsts = layer_kinds(config)
    per_layer = {
        k: [getattr(config, k)[i] for i in firsts]
        for k in ("layer_types", "no_rope_layers")
        if getattr(config, k, None)
    }
    # A small vocabulary: the traced graph's embedding and head are placeholders the real ones replace, and at a
    # 128k vocabulary they would be GBs the trace copies twice. Only the logits' declared width depends on it.
    vocab = min(config.vocab_size, TRACE_VOCAB)
    small_config = dataclasses.replace(config, layers=len(firsts), vocab_size=vocab, **per_layer)
    from models.llama import LAYER_DATA

    token = LAYER_DATA.set(tuple(getattr(config, "per_layer_data", ())))
    try:
        small = build_model(family, small_config, init=False)
    finally:
        LAYER_DATA.reset(token)
    generator = torch.Generator().manual_seed(seed)
    real_buffers = dict(model.named_buffers())
    data = set(layer_data_buffers(small))
    with torch.no_grad():
        for param in small.parameters():
            # Distinct random values make each initializer's bytes name exactly one parameter.
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
        for name, buffer in small.named_buffers():
            if name in data:  # refilled per layer like a weight, so traced back by its bytes like one
                random = torch.rand(buffer.shape, generator=generator, dtype=torch.float64) * 2**40 + 2**41
                buffer.copy_(random.to(buffer.dtype))
            else:
                buffer.copy_(real_buffers[_template_source(name, firsts)])
    return small_config, small.eval()


def layer_data_buffers(model: nn.Module) -> list[str]:
    """The buffers that hold a layer's own values (models.layers.Attention layer_data: window, RoPE
    frequencies): each layer's copy of the traced block reads its own."""
    return [
        f"{name}.{buffer}" for name, module in model.named_modules() for buffer in getattr(module, "layer_data", ())
    ]


def _template_source(name: str, firsts: list[int]) -> str:
    """The full model's name of a small model's block.j.x: block.{firsts[j]}.x (the layer block j stands for)."""
    head, dot, rest = name.partition(f"{BLOCK_LIST}.")
    if not dot or head not in ("", "model."):
        return name
    index, _, tail = rest.partition(".")
    return f"{head}{BLOCK_LIST}.{firsts[int(index)]}.{tail}" if index.isdigit() else name


class Initializer(NamedTuple):
    """A traced initializer as _initializer_sources reads it: its array is read only when its kind can match."""

    name: str
    kind: tuple[str, tuple[int, ...]]  # (numpy dtype str, shape)
    array: Callable[[], np.ndarray]


def proto_initializers(proto: onnx.ModelProto) -> list[Initializer]:
    def kind(init):
        return onnx.helper.tensor_dtype_to_np_dtype(init.data_type).str, tuple(init.dims)

    return [Initializer(t.name, kind(t), functools.partial(numpy_helper.to_array, t)) for t in proto.graph.initializer]


def ir_initializers(model) -> list[Initializer]:
    """The initializers of a traced onnx_ir model, before serialisation: a parameter's array is a view of it."""
    return [
        Initializer(v.name, (v.const_value.dtype.numpy().str, tuple(v.const_value.shape)), v.const_value.numpy)
        for v in model.graph.initializers.values()
    ]


def release_traced_weights(model, small: nn.Module, sources: dict[str, tuple[str, bool]]) -> None:
    """Drop the trace's copies of the small model's weights from the onnx_ir `model` before it is serialised
    (each becomes a data-less placeholder of its dtype and shape), and the small model's parameters: the
    replicated graph fills every weight from the full model, so what the trace holds of them is only dead
    weight, two copies of one block, beside the full model. Its buffers stay (the trace's constants)."""
    import onnx_ir as ir

    for name in sources:
        value = model.graph.initializers[name]
        tensor = value.const_value
        value.const_value = ir.ExternalTensor(
            "replicated", offset=None, length=None, dtype=tensor.dtype, shape=tensor.shape, name=name
        )
    with torch.no_grad():
        for param in small.parameters():
            param.data = torch.empty(0, dtype=param.dtype)


def initializer_sources(small: nn.Module, initializers: list[Initializer]) -> dict[str, tuple[str, bool]] | None:
    """{initializer: (parameter name, transposed)} for initializers holding a parameter; None if an
    initializer looks derived from a parameter some other way (it could not be refilled)."""

    # A digest can only match an initializer of the same dtype and shape; the others (the transposed
    # copy of a 49k-row embedding, say) are not hashed at all. Each initializer's array is read when its
    # digest is taken and dropped after: together they are as large as the embedding and head.
    kinds = {init.kind for init in initializers}
    by_digest = {}
    for name, param in small.named_parameters(remove_duplicate=False):
        array = param.detach().numpy()
        if (array.dtype.str, array.shape) in kinds:
            by_digest.setdefault(array_digest(array), (name, False))
        if array.ndim == 2 and (array.dtype.str, array.shape[::-1]) in kinds:
            by_digest.setdefault(array_digest(array.T), (name, True))
    named_buffers = dict(small.named_buffers())
    data = layer_data_buffers(small)
    for name in data:
        array = named_buffers[name].detach().numpy()
        for dtype in (array.dtype, np.float32, np.float64):  # as stored, or cast to either float
            by_digest.setdefault(array_digest(array.astype(dtype)), (name, False))
    buffers = {array_digest(b.detach().numpy()) for b in small.buffers()}
    shapes = {tuple(p.shape) for p in small.parameters()} | {tuple(p.shape)[::-1] for p in small.parameters()}
    sources = {}
    for init in initializers:
        array = init.array()
        key = array_digest(array)
        if key in by_digest:
            sources[init.name] = by_digest[key]
        elif (
            key not in buffers
            and array.dtype.kind == "f"
            and (array.size >= small.config.width or tuple(array.shape) in shapes)
        ):
            return None  # a weight-sized constant we cannot trace back: maybe a folded weight
    if not set(data) <= {source for source, _ in sources.values()}:
        return None  # a layer's value folded into something else: each layer could not get its own
    return sources


def _scopes(node: onnx.NodeProto) -> list[str]:
    """The module scopes torch.onnx recorded on `node`; [] when it recorded none readable."""
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            try:
                return list(ast.literal_eval(prop.value))
            except (ValueError, SyntaxError):
                return []
    return []


def _layer_name(name: str, i: int, template: int = 0) -> str | None:
    """block.0.x -> block.{i}.x, past.0.key -> past.{i}.key, present.0.value -> present.{i}.value (from block
    `template` in place of 0)."""
    for prefix in (f"block.{template}.", f"past.{template}.", f"present.{template}."):
        if name.startswith(prefix):
            return f"{prefix.split('.')[0]}.{i}.{name[len(prefix) :]}"
    return None


def replicate(
    model: nn.Module, small: nn.Module, proto: onnx.ModelProto, config, input_names: list[str], output_names: list[str]
) -> onnx.ModelProto | None:
    """The full model's graph built from `proto`, the traced graph of the one-block `small`.

    input_names / output_names: the full model's graph inputs and outputs in order.
    Returns None when the traced graph does not have the shape this rewrite relies on.
    """
    replicated = replicate_with_weights(model, small, proto, config, input_names, output_names)
    return None if replicated is None else replicated[0]


def replicate_with_weights(
    model: nn.Module,
    small: nn.Module,
    proto: onnx.ModelProto,
    config,
    input_names: list[str],
    output_names: list[str],
    *,
    weights: WeightFill | None = None,
    sources: dict[str, tuple[str, bool]] | None = None,
) -> tuple[onnx.ModelProto, dict] | None:
    """replicate(), plus where each parameter of `model` was written: {name: {"initializer", "transpose"}}.

    The map is what onnx_export's byte search would find, known here without hashing the weights
    again: an initializer holding the weight as stored before one holding it transposed, the first
    of each in graph order; tied names share their weight's entry. Parameters written nowhere are absent.
    weights: how the parameters are written (float32, kept in the model, by default).
    sources: initializer_sources of the trace when the caller took them before serialising it (and released
    the traced weights, release_traced_weights); else they are read from `proto`.
    """
    if sources is None:
        sources = initializer_sources(small, proto_initializers(proto))
    if sources is None:
        return None
    small_data = set(layer_data_buffers(small))
    data_types = {  # "window"/"inv_freq": the dtype the trace holds it in
        sources[t.name][0].rsplit(".", 1)[-1]: t.data_type
        for t in proto.graph.initializer
        if t.name in sources and sources[t.name][0] in small_data
    }
    if small.config.layers > 1:
        return _replicate_kinds(model, small, proto, config, input_names, output_names, sources, weights, data_types)
    block = _find_block(proto, config.width)
    if block is None:
        return None
    block_weights = {init: src for init, src in sources.items() if src[0].startswith(f"{BLOCK_LIST}.0.")}
    # Initializers in order: the traced ones (weights refilled from `model`), then each block's copies.
    plan = _traced_plan(proto.graph, sources)
    copies, last_output = [], block.output
    for i in range(1, config.layers):
        renamed = _renaming(block, block_weights, i, last_output)
        plan.extend(_block_plan(block_weights, renamed, i))
        copies.extend(_clone_nodes(block.nodes, renamed, i))
        last_output = renamed[block.output]
    nodes = topological(_rewired_nodes(proto.graph, block, last_output) + copies)
    return _finished(proto, nodes, input_names, output_names, plan, model, small, config, weights, data_types)


def _finished(proto, nodes, input_names, output_names, plan, model, small, config, weights, data_types):
    """The replicated graph with its initializers filled from `model`, and the weight map; None when the
    nodes do not order or assemble (the caller then traces the whole model)."""
    if nodes is None:
        return None
    result = _assembled(proto, nodes, input_names, output_names, config.layers)
    if result is None:
        return None
    _declare_vocabulary(result.graph, small.config.vocab_size, config.vocab_size)
    # Each layer's own window and RoPE frequencies, in the dtype their template's initializer was traced in.
    data = {name: data_types[name.rsplit(".", 1)[-1]] for name in layer_data_buffers(model)}
    placed = _fill_initializers(
        result.graph, plan, dict(model.named_parameters(remove_duplicate=False)), weights or WeightFill(), data, model
    )
    return result, _weight_entries(model, [p for p in placed if p[1] not in data])


@dataclasses.dataclass(frozen=True)
class WeightFill:
    """How replicate writes the model's parameters into the graph.

    dtype: the numpy dtype of the written weights. Writing them in the export dtype (float16, bfloat16) at once
    saves the float32 copy of every weight that a conversion afterwards would hold; the graph's arithmetic stays
    float32 until exporters.precision rewrites it, told which initializers are already converted.
    release: free each parameter once its last initializer holds it. The graph then holds the only copy of the
    weights, and the model is left without them (callers that export and discard an imported model).
    """

    dtype: np.dtype = np.dtype(np.float32)
    release: bool = False
    # With release, each weight's bytes are held here, its initializer marked pending (artifact.write), until
    # the artifact is written.
    pending: PendingWeights = dataclasses.field(default_factory=PendingWeights)


@dataclasses.dataclass(frozen=True)
class _Block:
    """Block 0 of a traced one-block graph: its nodes and the values that cross its boundary."""

    in_block: list[bool]  # per node of the graph, whether it is one of block 0's
    nodes: list[onnx.NodeProto]
    produced: set[str]  # every value its nodes produce
    output: str  # the one value that leaves it: the hidden state after the block
    hidden_input: str  # the hidden state entering it
    exposed: set[str]  # values it produces that are graph outputs (present.0.*, block.0.*)
    per_block_inputs: set[str]  # graph inputs named per block (past.0.*); the rest (position_ids, masks) are shared


def _replicate_kinds(model, small, proto, config, input_names, output_names, sources, weights, data_types):
    """replicate_with_weights for layers of several kinds: the small model's block j is the template of kind j,
    and every layer of the full model is a copy of its kind's template (the templates themselves are dropped).

    The trace computes what the templates share (masks, RoPE tables) once, in whichever block came first; those
    values are kept as computed there when they do not depend on the hidden state, else this returns None."""
    graph, kinds = proto.graph, layer_kinds(config)[0]
    count = small.config.layers
    templates = [_template(proto, config.width, j) for j in range(count)]
    if any(t is None for t in templates):
        return None
    for j in range(count - 1):  # the chain: template j's output is template j+1's hidden input
        templates[j] = dataclasses.replace(templates[j], output=templates[j + 1].hidden_input)
    last = _chain_output(graph, templates)
    if last is None:
        return None
    templates[-1] = dataclasses.replace(templates[-1], output=last)
    shared = _shared_nodes(graph, templates)
    if shared is None:
        return None
    template_weights = [
        {init: src for init, src in sources.items() if src[0].startswith(f"{BLOCK_LIST}.{j}.")} for j in range(count)
    ]
    dropped = {init for w in template_weights for init in w}
    plan = [e for e in _traced_plan(graph, sources) if isinstance(e, onnx.TensorProto) or e[0] not in dropped]
    copies, last_output = [], templates[0].hidden_input
    for i, kind in enumerate(kinds):
        block, block_weights = templates[kind], template_weights[kind]
        renamed = _renaming(block, block_weights, i, last_output, template=kind)
        plan.extend(_block_plan(block_weights, renamed, i, template=kind))
        copies.extend(_clone_nodes(block.nodes, renamed, i))
        last_output = renamed[block.output]
    # Outside the blocks, what read a template's output reads the last layer's (the logits; shapes elsewhere).
    ends = {t.output for t in templates}
    outside = []
    for k, node in enumerate(graph.node):
        if not any(t.in_block[k] for t in templates):
            node = copy.deepcopy(node)
            node.input[:] = [last_output if x in ends else x for x in node.input]
            outside.append(node)
    nodes = topological(outside + shared + copies)
    return _finished(proto, nodes, input_names, output_names, plan, model, small, config, weights, data_types)


def _template(proto: onnx.ModelProto, width: int, index: int) -> _Block | None:
    """Block `index` of a several-block trace: its nodes, its hidden input and what it exposes (its output is
    set by the caller from the chain)."""
    graph = proto.graph
    in_block = _in_block_zero(graph.node, index)
    if in_block is None:
        return None
    nodes = [n for n, b in zip(graph.node, in_block, strict=True) if b]
    produced = {o for n in nodes for o in n.output}
    graph_inputs = {v.name for v in graph.input}
    initializers = {t.name for t in graph.initializer}
    external = {i for n in nodes for i in n.input if i and i not in produced}
    hidden_input = _hidden_input(proto, external - graph_inputs - initializers, width)
    if hidden_input is None:
        return None
    exposed = produced & {v.name for v in graph.output}
    if any(_layer_name(name, 1, index) is None for name in exposed):
        return None
    per_block_inputs = {name for name in external & graph_inputs if _layer_name(name, 1, index) is not None}
    return _Block(in_block, nodes, produced, "", hidden_input, exposed, per_block_inputs)


def _chain_output(graph: onnx.GraphProto, templates: list[_Block]) -> str | None:
    """The last template's value that the nodes after the blocks read (the hidden state into the final norm)."""
    inside = [any(t.in_block[k] for t in templates) for k in range(len(graph.node))]
    read = {i for n, b in zip(graph.node, inside, strict=True) if not b for i in n.input}
    leaving = templates[-1].produced & read
    return next(iter(leaving)) if len(leaving) == 1 else None


def _shared_nodes(graph: onnx.GraphProto, templates: list[_Block]) -> list[onnx.NodeProto] | None:
    """The template nodes computing values another template reads (other than the chain), with what they need
    from their own template; None when that depends on the hidden state (it would differ per layer)."""
    producer = {o: n for t in templates for n in t.nodes for o in n.output}
    chain = {t.hidden_input for t in templates} | {t.output for t in templates}
    wanted = [
        x
        for j, t in enumerate(templates)
        for n in t.nodes
        for x in n.input
        if x in producer and x not in t.produced and x not in chain
    ]
    kept, seen = [], set()
    while wanted:
        value = wanted.pop()
        node = producer.get(value)
        if node is None or id(node) in seen:
            continue
        if any(x in chain for x in node.input):
            return None
        seen.add(id(node))
        kept.append(node)
        wanted.extend(x for x in node.input if x in producer)
    return [copy.deepcopy(n) for n in kept]


def _find_block(proto: onnx.ModelProto, width: int, index: int = 0) -> _Block | None:
    """Block `index` of `proto` and its boundary, or None when the graph is not one this rewrite can replicate."""
    graph = proto.graph
    in_block = _in_block_zero(graph.node, index)
    if in_block is None:
        return None
    nodes = [n for n, b in zip(graph.node, in_block, strict=True) if b]
    produced = {o for n in nodes for o in n.output}
    output = _leaving_value(graph.node, in_block, produced)
    if output is None:
        return None
    graph_inputs = {v.name for v in graph.input}
    initializers = {t.name for t in graph.initializer}
    external = {i for n in nodes for i in n.input if i and i not in produced}
    hidden_input = _hidden_input(proto, external - graph_inputs - initializers, width)
    if hidden_input is None:
        return None
    exposed = produced & {v.name for v in graph.output}
    if any(_layer_name(name, 1, index) is None for name in exposed):
        return None  # a block output we do not know how to rename
    per_block_inputs = {name for name in external & graph_inputs if _layer_name(name, 1, index) is not None}
    return _Block(in_block, nodes, produced, output, hidden_input, exposed, per_block_inputs)


def _in_block_zero(nodes, index: int = 0) -> list[bool] | None:
    """Per node, whether its scopes put it in block `index`; None when none does or a node holds a subgraph."""
    scope = f"model.{BLOCK_LIST}.{index}"
    in_block = [scope in _scopes(n) for n in nodes]
    if not any(in_block) or any(
        n.attribute and any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute) for n in nodes
    ):
        return None
    return in_block


def _leaving_value(nodes, in_block: list[bool], produced: set[str]) -> str | None:
    """The one value of block 0 that a node outside it reads, or None when there is not exactly one."""
    outside_consumed = {i for n, b in zip(nodes, in_block, strict=True) if not b for i in n.input}
    leaving = produced & outside_consumed
    if len(leaving) != 1:
        return None
    (output,) = leaving
    return output


def _hidden_input(proto: onnx.ModelProto, candidates: set[str], width: int) -> str | None:
    """The one candidate typed as a float32 hidden state (rank 3, last axis `width`), or None."""
    inferred = onnx.shape_inference.infer_shapes(weightless(proto))  # types only: no weight bytes needed
    graph = proto.graph
    types = {v.name: v.type for v in (*inferred.graph.value_info, *graph.input, *graph.output)}
    hidden = []
    for name in candidates:
        tensor = types.get(name)
        if tensor is None:
            continue
        dims = tensor.tensor_type.shape.dim
        if tensor.tensor_type.elem_type == onnx.TensorProto.FLOAT and len(dims) == 3 and dims[2].dim_value == width:
            hidden.append(name)
    if len(hidden) != 1:
        return None
    (hidden_input,) = hidden
    return hidden_input


def _traced_plan(graph: onnx.GraphProto, sources: dict[str, tuple[str, bool]]) -> list:
    """The traced initializers as plan entries: (name, parameter, transposed) for a weight, else the TensorProto."""
    # A weight entry is filled in from the full model at the end; a TensorProto is kept as traced.
    return [(t.name, *sources[t.name]) if t.name in sources else t for t in graph.initializer]


def _renaming(
    block: _Block, block_weights: dict[str, tuple[str, bool]], i: int, hidden: str, template: int = 0
) -> dict[str, str]:
    """{template block's name: block i's name} for what block i's copy reads and produces; it reads `hidden`."""
    renamed = {block.hidden_input: hidden}
    for init in block_weights:
        renamed[init] = _initializer_name(init, i, template)
    for name in block.per_block_inputs:
        renamed[name] = _layer_name(name, i, template)
    for name in block.produced:
        renamed[name] = _layer_name(name, i, template) if name in block.exposed else f"{name}__{BLOCK_LIST}{i}"
    return renamed


def _initializer_name(init: str, i: int, template: int = 0) -> str:
    """Block i's name for the template block's initializer: model.block.{i}.x for model.block.{template}.x, else
    init__block{i}."""
    target = _layer_name(init.removeprefix("model."), i, template)
    return f"model.{target}" if target and init.startswith("model.") else f"{init}__{BLOCK_LIST}{i}"


def _block_plan(
    block_weights: dict[str, tuple[str, bool]], renamed: dict[str, str], i: int, template: int = 0
) -> list[tuple[str, str, bool]]:
    """Block i's initializer plan entries: the template's weights renamed, each holding block i's parameter."""
    return [
        (renamed[init], param.replace(f"{BLOCK_LIST}.{template}.", f"{BLOCK_LIST}.{i}.", 1), transposed)
        for init, (param, transposed) in block_weights.items()
    ]


def _clone_nodes(nodes: list[onnx.NodeProto], renamed: dict[str, str], i: int) -> list[onnx.NodeProto]:
    """Copies of block 0's nodes as block i's: names suffixed, inputs and outputs renamed."""
    clones = []
    for node in nodes:
        clone = copy.deepcopy(node)
        clone.name = f"{node.name}__{BLOCK_LIST}{i}"
        clone.input[:] = [renamed.get(x, x) for x in node.input]
        clone.output[:] = [renamed[x] for x in node.output]
        clones.append(clone)
    return clones


def _rewired_nodes(graph: onnx.GraphProto, block: _Block, last_output: str) -> list[onnx.NodeProto]:
    """The traced nodes, with those outside block 0 reading the last block's output in place of block 0's."""
    nodes = []
    for node, b in zip(graph.node, block.in_block, strict=True):
        if not b:
            node = copy.deepcopy(node)
            node.input[:] = [last_output if x == block.output else x for x in node.input]
        nodes.append(node)
    return nodes


def _assembled(
    proto: onnx.ModelProto, nodes: list[onnx.NodeProto], input_names: list[str], output_names: list[str], layers: int
) -> onnx.ModelProto | None:
    """A copy of `proto` with `nodes` and the named inputs and outputs, no initializers; None if one is undeclared."""
    values = {v.name: v for v in (*proto.graph.input, *proto.graph.output)}
    result = onnx.ModelProto()  # a field-by-field copy: a deep copy would copy the traced weights first
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(result, field, getattr(proto, field))
    result.opset_import.extend(proto.opset_import)
    result.functions.extend(proto.functions)
    result.metadata_props.extend(proto.metadata_props)
    result.graph.name, result.graph.doc_string = proto.graph.name, proto.graph.doc_string
    result.graph.node.extend(nodes)
    for names, field in ((input_names, result.graph.input), (output_names, result.graph.output)):
        for name in names:
            info = _declaration(values, name, layers)
            if info is None:
                return None
            field.append(info)
    return result


def _declare_vocabulary(graph: onnx.GraphProto, traced: int, real: int) -> None:
    """Declare the real vocabulary where the one-block trace declared its own (the logits' last axis)."""
    for value in (*graph.input, *graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value == traced:
                dim.dim_value = real


def _declaration(values: dict[str, onnx.ValueInfoProto], name: str, layers: int) -> onnx.ValueInfoProto | None:
    """The traced declaration of `name`, or of the block 0 value it is block i's copy of, renamed; else None."""
    if name in values:
        return values[name]
    for source in values:
        for i in range(1, layers):
            if _layer_name(source, i) == name:
                info = copy.deepcopy(values[source])
                info.name = name
                return info
    return None


def _fill_initializers(
    graph: onnx.GraphProto,
    plan: list,
    params: dict[str, nn.Parameter],
    fill: WeightFill,
    data: dict[str, int] | None = None,
    model: nn.Module | None = None,
) -> list[tuple[str, str, bool]]:
    """Append the plan's initializers to `graph`, weights from `params` as `fill` says; return the weight entries.
    data: {layer-data buffer of `model`: ONNX dtype}, written as they are (neither converted nor released)."""
    data = data or {}
    buffers = dict(model.named_buffers()) if data else {}
    last_use = {
        id(params[entry[1]]): k
        for k, entry in enumerate(plan)
        if not isinstance(entry, onnx.TensorProto) and entry[1] not in data
    }
    data_type = onnx.helper.np_dtype_to_tensor_dtype(fill.dtype)
    early = _shared_first(plan, params, fill, last_use) if fill.release else {}
    placed = []
    for k, entry in enumerate(plan):
        if isinstance(entry, onnx.TensorProto):
            graph.initializer.add().CopyFrom(entry)
            continue
        if entry[1] in data:
            array = buffers[entry[1]].detach().cpu().numpy()
            array = array.astype(onnx.helper.tensor_dtype_to_np_dtype(data[entry[1]]))
            graph.initializer.append(numpy_helper.from_array(array, entry[0]))
            placed.append(entry)
            continue
        # Filled in place: the model's weights are hundreds of MB, so they are copied once, not per step.
        name, param, transposed = entry
        array = early.pop(k) if k in early else _weight_array(params[param].detach(), transposed, fill.dtype, param)
        tensor = graph.initializer.add()
        tensor.name, tensor.data_type = name, data_type
        tensor.dims.extend(array.shape)
        if fill.release:  # the array may share the parameter's memory, which the release below hands over
            fill.pending.add(tensor, array)
        else:
            tensor.raw_data = array.tobytes()
        del array
        placed.append((name, param, transposed))
        if fill.release and last_use.get(id(params[param])) == k:
            params[param].data = torch.empty(0, dtype=params[param].dtype)
    return placed


def _shared_first(plan: list, params: dict[str, nn.Parameter], fill: WeightFill, last_use: dict) -> dict:
    """{plan index: array} of the weights that more than one initializer holds (a tied embedding and its
    transposed head), converted before the rest and their parameters released at once. Converted in plan order,
    such a parameter would be held in its stored dtype beside every other weight's converted copy until its
    last initializer (0.27 GB more at the end of a 0.5B export widened from bfloat16)."""
    uses: dict[int, list[int]] = defaultdict(list)
    for k, entry in enumerate(plan):
        if not isinstance(entry, onnx.TensorProto) and entry[1] in params and id(params[entry[1]]) in last_use:
            uses[id(params[entry[1]])].append(k)
    early = {}
    for indices in uses.values():
        if len(indices) < 2:
            continue
        for k in indices:
            _, param, transposed = plan[k]
            early[k] = _weight_array(params[param].detach(), transposed, fill.dtype, param)
        del last_use[id(params[param])]  # released here: the main loop finds no last use to release it at
        params[param].data = torch.empty(0, dtype=params[param].dtype)
    return early


def _weight_array(tensor: torch.Tensor, transposed: bool, dtype: np.dtype, name: str) -> np.ndarray:
    """The weight as written: C-contiguous, transposed when asked, in `dtype`. A tensor already in `dtype` (an
    import that kept bfloat16) is not widened to float32 on the way."""
    import ml_dtypes

    from exporters.precision import convert_numpy

    tensor = tensor.T if transposed else tensor
    same = {np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16}.get(dtype)
    if tensor.dtype == same == torch.bfloat16:  # numpy has no bfloat16: its bits, viewed as ml_dtypes'
        return _dense(tensor, tensor.dtype).view(torch.int16).numpy().view(dtype)
    if tensor.dtype == same:
        return _dense(tensor, tensor.dtype).numpy()
    # A float32 parameter stored as written is its own memory; any other is widened (and transposed) in one
    # pass: no intermediate the size of the weight (a tied head: 0.5 GB).
    array = _dense(tensor, torch.float32).numpy()
    return array if dtype == np.float32 else convert_numpy(array, dtype, f"weight {name!r}")


TRANSPOSE_STRIP = 128  # columns of a transposed copy written per step


def _dense(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as a C-contiguous tensor of `dtype` (itself when it is one). A transposed 2-D view is copied a
    strip of columns at a time, so that the rows it reads and the strip it writes stay in cache, where one strided
    copy of the whole view does not."""
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype)
    if tensor.dim() == 2 and tensor.stride(0) == 1 and tensor.shape[0] > 1:
        for start in range(0, tensor.shape[1], TRANSPOSE_STRIP):
            out[:, start : start + TRANSPOSE_STRIP].copy_(tensor[:, start : start + TRANSPOSE_STRIP])
    else:
        out.copy_(tensor)
    return out


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
