"""Lowerings: graph rewrites of one traced export onto different operator sets.

export_model traces the model once (custom-domain RMSNorm/SwiGLU/GeGLU nodes, attention
and RoPE as primitive ops); a lowering rewrites that ModelProto:

- "functions" (default, portable): unchanged; RMSNorm/SwiGLU/GeGLU are onnx_toolkit
  nodes whose bodies ship as local functions (default opset 20).
- "standard": ONNX opset 23 only, no custom domain: RMSNormalization,
  RotaryEmbedding and Attention; SwiGLU and GeGLU become primitive ops.
- "ort": ONNX Runtime's fused com.microsoft kernels (plus opset 23):
  SkipSimplifiedLayerNormalization (the residual add fused into the next norm),
  one fused QKV projection, GroupQueryAttention, and one fused gate/up
  projection. With a head width that is a multiple of 16 (a rotated width too,
  and no q/k norm) the packed QKV goes straight into GroupQueryAttention, which
  applies the rotary embedding itself (no Split or RotaryEmbedding nodes); at a
  multiple of 8 the projection is
  split and rotated by com.microsoft RotaryEmbedding (a model without RoPE, the
  gpt family, keeps it packed); below that the ort lowering uses the opset-23
  Attention kernel. The manifest records the choice per graph ("attention_op",
  "rotary_op", null without RoPE).

Attention is rebuilt from the config, layer by layer (exporters/lowering_attention.py says how each switch of
the llama family maps onto the kernels, and how a gpt family config is described in those switches: learned
positions, so no RoPE, and biases). Everything else the llama and gpt families' switches change is traced as
standard ops and passes through: LayerNorm, the plain MLP's GELU, the biases, learned positions, the
multipliers and soft caps;
RMSNorm nodes become RMSNormalization in any placement, and in "ort" a SkipSimplifiedLayerNormalization where
the norm reads a residual sum. The KV-cache contract is unchanged:
past.{i}.key/value [B, kv_heads, T_past, head_width] in, present = concat(past, new)
out, position_ids and past_mask as before. GroupQueryAttention graphs also accept
a past buffer longer than past_mask (rows after the history are ignored) and then
return present at that length with the new keys written after the history, in
place when the caller binds present to the same buffer (manifest "kv_cache":
"shared-buffer"; runners/ort.BoundKVCache does so on ONNX Runtime).

What a lowering cannot express is refused with an ExportError naming the feature and the lowering that
handles it (always "functions"); lowering_support says it for every lowering at once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

from artifact import weightless
from artifact.errors import ExportError
from artifact.format import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION, DEFAULT_LOWERING, Manifest
from artifact.protobuf import WEIGHTLESS_BYTES
from artifact.write import PendingWeights, is_pending
from exporters.lowering_attention import (
    MS_DOMAIN,
    MS_DOMAIN_VERSION,
    AttentionLowering,
    GPTAttention,
    attention_plan,
)
from exporters.replicate import topological
from models.rope import LENGTH_DEPENDENT

LOWERINGS = ("functions", "standard", "ort")
STANDARD_OPSET = 23  # RMSNormalization, RotaryEmbedding and Attention appear in opset 23
GATED_FFN_OPS = ("SwiGLU", "GeGLU")  # the custom feed-forward nodes, [out, in] weights as stored
# What each lowering can run on: the ONNX reference evaluator knows no com.microsoft op.
REFERENCE_BACKEND = "onnx-reference"
GPU_ORT_BACKENDS = ("ort-cuda", "ort-trt")  # TensorRT hands GroupQueryAttention to the CUDA provider
GQA_CUDA_DTYPES = ("float16", "bfloat16")  # onnxruntime's CUDA kernel registrations for GroupQueryAttention
# The fields of each family's config that the rewrite rebuilds (attention from the config in
# exporters/lowering_attention.py, norms and the SwiGLU/GeGLU node here) or that change only traced standard ops.
# A field added to a family later is refused by name, when set, until the rewrite knows it.
LLAMA_REBUILT_FIELDS = frozenset(
    {
        # the shape and the 2023 block
        "width", "heads", "kv_heads", "head_dim", "ff_width", "max_positions", "eps", "vocab_size", "layers",
        "tie_embeddings", "probe_width",
        # RoPE: per-layer cos/sin caches, partial rotation, layers without it
        "rope_base", "rope_pairing", "rope_scaling", "rotary_dim", "local_rope_base", "no_rope_layers",
        # attention
        "attention_bias", "qk_norm", "sliding_window", "layer_types", "attention_scale", "attention_softcap",
        # outside attention: traced standard ops, RMSNorm nodes in any placement
        "norm_placement", "norm", "ffn_gated", "ffn_activation", "residual_scale", "embedding_scale",
        "logits_scale", "final_softcap",
    }
)  # fmt: skip
REBUILT_FIELDS = {
    "block": LLAMA_REBUILT_FIELDS,
    "llama": LLAMA_REBUILT_FIELDS,
    # attention through lowering_attention.GPTAttention; the learned positions (context), LayerNorm and the
    # GELU MLP (activation) are traced standard ops
    "gpt": frozenset(
        {"vocab_size", "width", "heads", "ff_width", "context", "layers", "eps", "attention_bias", "activation",
         "tie_embeddings"}
    ),
}  # fmt: skip
FAMILY_REFUSALS = {
    "encoder-decoder": "the encoder-decoder family's cross-attention and bidirectional encoder attention "
    "(and its LayerNorm/ReLU/biases switches)",
}


def check_lowering(name: str) -> str:
    if name not in LOWERINGS:
        raise ExportError(f"unknown lowering {name!r}; choose one of {', '.join(LOWERINGS)}")
    return name


def unsupported_backends(manifest: Manifest) -> dict[str, str]:
    """{backend: why} for backends that cannot run an artifact's graphs (none for most artifacts)."""
    if manifest.lowering != "ort":
        return {}
    out = {
        REFERENCE_BACKEND: "its graphs use ONNX Runtime's com.microsoft kernels, which the ONNX reference "
        "evaluator does not implement; check it with eager and ort-cpu, or re-export "
        "with --lowering standard or functions to run it there"
    }
    gqa = any(str(g.attention_op or "").endswith("GroupQueryAttention") for g in manifest.graphs)
    if gqa and manifest.dtype not in GQA_CUDA_DTYPES:
        why = (
            f"ONNX Runtime's CUDA GroupQueryAttention kernel takes {' and '.join(GQA_CUDA_DTYPES)} only, and this "
            f"artifact is {manifest.dtype}; re-export with --dtype float16 (or --lowering "
            "standard) to run it on the GPU"
        )
        out.update({backend: why for backend in GPU_ORT_BACKENDS})
    return out


def lowering_support(family: str, config) -> dict[str, str | None]:
    """{lowering: None where it can express a `family` model of `config`, else the one-line reason}."""
    return {lowering: _refusal(family, config, lowering) for lowering in LOWERINGS}


def check_supported(family: str, config, lowering: str) -> None:
    """Refuse, before the slow trace, a model the lowering cannot express."""
    check_lowering(lowering)
    reason = _refusal(family, config, lowering)
    if reason is not None:
        raise ExportError(reason)


def _refusal(family: str, config, lowering: str) -> str | None:
    if lowering == DEFAULT_LOWERING:
        return None
    if family in FAMILY_REFUSALS:
        return (
            f"lowering {lowering!r} cannot express {FAMILY_REFUSALS[family]}; "
            f"export it with --lowering {DEFAULT_LOWERING}"
        )
    if family not in REBUILT_FIELDS:
        return (
            f"lowering {lowering!r} knows only the {', '.join(REBUILT_FIELDS)} families, not {family!r}; "
            f"export it with --lowering {DEFAULT_LOWERING}"
        )
    kind = (getattr(config, "rope_scaling", None) or {}).get("rope_type")
    if kind in LENGTH_DEPENDENT:
        return (
            f"lowering {lowering!r} precomputes cos/sin caches, and rope_scaling {kind!r} chooses its frequencies per "
            f"call from the positions; export it with --lowering {DEFAULT_LOWERING}"
        )
    for field in dataclasses.fields(config):
        if not field.init or field.name in REBUILT_FIELDS[family]:
            continue
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        value = getattr(config, field.name)
        if value != default:
            return (
                f"lowering {lowering!r} does not rebuild the switch {field.name}={value!r} (the rewrite does not "
                f"know it); export it with --lowering {DEFAULT_LOWERING}"
            )
    return None


def lower(
    proto: onnx.ModelProto, lowering: str, family: str, config, weights: dict, pending: PendingWeights | None = None
) -> tuple[onnx.ModelProto, dict, dict]:
    """Rewrite one traced graph. Returns (proto, rewritten weights, graph notes).

    weights: the pre-rewrite map {torch name: {"initializer", "transpose"}}. The weights the rewrite moves
    come back in the same form, fused ones as {torch name: {"initializer", "transpose", "slice": [axis, start,
    stop]}}: the torch tensor is initializer[slice along axis], transposed when "transpose" is set.
    pending: the bytes of the graph's pending initializers (artifact.write.PendingWeights, an export that
    releases the model's weights). The rewrite reads weights from it, holds the ones it makes there too, and
    drops the ones it replaces as soon as nothing reads them, so the weights are held about once throughout.
    """
    check_supported(family, config, lowering)
    if lowering == DEFAULT_LOWERING:
        return proto, {}, {}
    rewriter = _Rewriter(proto, lowering, rewritten_config(family, config), weights, pending)
    return rewriter.run()


def rewritten_config(family: str, config):
    """The config as the rewrite reads it: the llama family's switches, which a gpt family config is described in."""
    return GPTAttention.of(config) if family == "gpt" else config


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def convert_opset(proto: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`proto` converted to `opset`, in place: the version converter serialises the model it is given, which
    protobuf refuses past 2 GiB, so it converts the weightless skeleton and the graph takes the converted nodes
    while its weights stay where they are (moving them would copy every byte)."""
    skeleton = weightless(proto)
    held = {t.name for t in proto.graph.initializer} - {t.name for t in skeleton.graph.initializer}
    converted = onnx.version_converter.convert_version(skeleton, opset)
    graph, new = proto.graph, converted.graph
    for field in ("node", "value_info", "output"):
        del getattr(graph, field)[:]
        getattr(graph, field).extend(getattr(new, field))
    del graph.input[:]
    graph.input.extend(i for i in new.input if i.name not in held)  # the skeleton's weights, initializers again
    for i in reversed(range(len(graph.initializer))):  # the small constants as the converter left them
        if graph.initializer[i].name not in held:
            del graph.initializer[i]
    graph.initializer.extend(new.initializer)
    del proto.opset_import[:]
    proto.opset_import.extend(converted.opset_import)
    del proto.functions[:]
    proto.functions.extend(converted.functions)
    proto.ir_version = converted.ir_version
    return proto


class _Rewriter(AttentionLowering):
    def __init__(self, proto, lowering, config, weights, pending=None):
        self.lowering = lowering
        self.config = config
        self.weights = weights
        self.pending = pending
        # The converter drops node metadata; torch.onnx's module scopes are put back by node name.
        scopes = {n.name: list(n.metadata_props) for n in proto.graph.node if n.name}
        # Opset 20 -> 23 for every traced op (the custom nodes pass through untouched), then rewrite at 23.
        self.model = convert_opset(proto, STANDARD_OPSET)
        for n in self.model.graph.node:
            if n.name in scopes and not n.metadata_props:
                n.metadata_props.extend(scopes[n.name])
        self.graph = self.model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.new_nodes: list = []
        self.new_inits: list[str] = []  # names of the initializers the rewrite adds
        self.moved: dict = {}  # the weights the rewrite moved or fused (record_moved, record_fused)
        self.counter = 0
        self.shared: dict = {}
        self.shapes: dict | None = None  # the traced values' dims, read once a norm asks (_shape)
        plan = attention_plan(lowering, config)
        self.use_gqa, self.packed_gqa = plan["gqa"], plan["packed"]
        self.notes = {"attention_op": plan["attention_op"], "rotary_op": plan["rotary_op"]}

    # ---- small builders ---------------------------------------------------------------------------------
    def name(self, hint: str) -> str:
        self.counter += 1
        return f"lowering/{hint}_{self.counter}"

    def node(self, op, inputs, outputs=None, domain="", hint=None, **attrs):
        outputs = outputs if outputs is not None else [self.name(hint or op.lower())]
        self.new_nodes.append(helper.make_node(op, inputs, outputs, name=self.name(op), domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def const(self, array: np.ndarray, hint: str) -> str:
        name = self.name(hint)
        array = np.asarray(array, order="C")  # a 0-d array stays 0-d
        # Made inside the graph at once: a TensorProto added later is copied whole (a fused projection of a
        # large model is hundreds of MB); a weight-sized one is held pending when the export holds weights so.
        tensor = self.graph.initializer.add()
        if self.pending is not None and array.nbytes >= WEIGHTLESS_BYTES:
            tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(array.dtype)
            tensor.dims.extend(array.shape)
            self.pending.add(tensor, array)
        else:
            tensor.CopyFrom(numpy_helper.from_array(array, name))
        self.new_inits.append(name)
        return name

    def ints(self, values, hint="ints") -> str:
        return self.const(np.asarray(values, dtype=np.int64), hint)

    def array(self, name: str) -> np.ndarray:
        if name not in self.inits:
            raise ExportError(f"lowering {self.lowering!r}: expected {name!r} to be an initializer in the traced graph")
        self.read.add(name)
        tensor = self.inits[name]
        if self.pending is not None and is_pending(tensor):
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            return self.pending.array(name).view(dtype).reshape(tuple(tensor.dims))  # a view: no copy
        return numpy_helper.to_array(tensor)

    def release_replaced(self) -> None:
        """Free the pending bytes of every weight read so far whose readers have all been replaced (a layer's
        projections once fused): the originals then leave memory a layer at a time, not after the whole graph.
        Their declarations go with the rest of the dead code at the end."""
        if self.pending is None:
            return
        still_read = {i for n in self.new_nodes for i in n.input}  # a replacement node may read the original
        for name in list(self.read):
            readers = self.consumers.get(name, [])
            if (
                readers
                and name not in self.graph_outputs
                and name not in still_read
                and all(id(n) in self.removed for n in readers)
            ):
                self.pending.pop(name, None)
                self.read.discard(name)

    def record_moved(self, torch_name: str, initializer: str) -> None:
        """The torch tensor is `initializer` transposed (a weight the rewrite stores as [in, out])."""
        self.moved[torch_name] = {"initializer": initializer, "transpose": True}

    def weights_entry(self, torch_name: str) -> dict:
        entry = self.weights.get(torch_name)
        if entry is None:
            raise ExportError(
                f"lowering {self.lowering!r}: no initializer for weight {torch_name!r} in the traced graph"
            )
        return entry

    def weight_in_out(self, torch_name: str) -> tuple[str, np.ndarray]:
        """(initializer name, the weight as [in_features, out_features]) of a torch Linear weight."""
        entry = self.weights_entry(torch_name)
        array = self.array(entry["initializer"])
        return entry["initializer"], (array if entry["transpose"] else array.T)

    def record_fused(self, torch_name: str, fused: str, axis: int, start: int, stop: int, transpose: bool) -> None:
        """The torch tensor is `fused`[start:stop] along `axis`, transposed back when `transpose`."""
        self.moved[torch_name] = {"initializer": fused, "transpose": transpose, "slice": [axis, start, stop]}

    # ---- driver -----------------------------------------------------------------------------------------
    def run(self):
        graph = self.graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.graph_inputs = {i.name for i in graph.input}
        self.graph_outputs = {o.name for o in graph.output}
        self.removed = set()  # ids of nodes replaced outright
        self.read: set[str] = set()  # initializers the rewrite has read (release_replaced)
        layers = getattr(self.config, "layers", 1)
        for i in range(layers):
            self.lower_attention(i)
            self.release_replaced()
        if getattr(self.config, "ffn_gated", True):
            for i in range(layers):
                self.lower_gated_ffn(i)
                self.release_replaced()
        for n in list(graph.node):
            if n.domain == CUSTOM_DOMAIN and n.op_type == "RMSNorm":
                self.lower_norm(n)
            elif n.domain == CUSTOM_DOMAIN and id(n) not in self.removed:
                raise ExportError(
                    f"lowering {self.lowering!r} has no rewrite for {CUSTOM_DOMAIN}::{n.op_type}; "
                    f"export with --lowering {DEFAULT_LOWERING}"
                )
        kept = [n for n in graph.node if id(n) not in self.removed]
        available = self.graph_inputs | set(self.inits) | set(self.new_inits)
        nodes = topological(kept + self.new_nodes, available)
        if nodes is None:
            produced = {o for n in kept + self.new_nodes for o in n.output}
            missing = sorted({i for n in kept + self.new_nodes for i in n.input if i not in available | produced})[:3]
            raise ExportError(
                f"lowering produced a graph with unresolved values {missing or '(a cycle)'}; this is a toolkit bug"
            )
        del graph.node[:]
        graph.node.extend(nodes)
        _dead_code_elimination(graph, self.pending)
        leftovers = sorted({n.op_type for n in graph.node if n.op_type == "Softmax" or n.domain == CUSTOM_DOMAIN})
        if leftovers:
            raise ExportError(
                f"lowering {self.lowering!r} left {leftovers} from the traced graph in place; "
                "the traced attention did not have the expected boundaries"
            )
        # The custom ops are gone, and with them their opset-20 function bodies and domain.
        del self.model.functions[:]
        imports = [o for o in self.model.opset_import if o.domain != CUSTOM_DOMAIN]
        del self.model.opset_import[:]
        self.model.opset_import.extend(imports)
        if any(n.domain == MS_DOMAIN for n in graph.node):
            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, MS_DOMAIN_VERSION))
        # Value infos from the trace describe values that may be gone or renamed; inference restores them.
        del graph.value_info[:]
        return self.model, self.moved, self.notes

    def replace_output(self, old_name: str, new_node_output: str) -> None:
        """Make the value `old_name` come from the new nodes: the old producer's copy is renamed dead."""
        old = self.producer.get(old_name)
        if old is not None:
            for k, out in enumerate(old.output):
                if out == old_name:
                    old.output[k] = self.name("dead")
        for n in self.new_nodes:
            for k, out in enumerate(n.output):
                if out == new_node_output:
                    n.output[k] = old_name
            for k, inp in enumerate(n.input):
                if inp == new_node_output:
                    n.input[k] = old_name

    # ---- norms ------------------------------------------------------------------------------------------
    def lower_norm(self, n) -> None:
        eps = float(_attr(n, "epsilon", 1e-5))
        x, weight = n.input[0], n.input[1]
        self.removed.add(id(n))
        add = self.producer.get(x)
        if self.lowering == "ort" and self._is_residual_sum(add):
            # norm(a + b) and the sum itself (the residual stream) in one kernel.
            self.removed.add(id(add))
            outputs = [n.output[0], "", "", x]
            self.node(
                "SkipSimplifiedLayerNormalization",
                [add.input[0], add.input[1], weight],
                outputs,
                domain=MS_DOMAIN,
                epsilon=eps,
            )
            self.producer[x] = self.new_nodes[-1]
            return
        self._rms_norm(x, weight, eps, [n.output[0]])

    def _is_residual_sum(self, add) -> bool:
        """An Add of two computed tensors of one shape: SkipSimplifiedLayerNormalization adds `skip` to `input`
        elementwise, so a broadcasting Add (or one with a weight or constant) must stay apart."""
        if add is None or add.op_type != "Add" or add.domain != "" or id(add) in self.removed:
            return False
        if not all(self._is_activation(v) for v in add.input):
            return False
        shapes = [self._shape(v) for v in add.input]
        if None in shapes or len(shapes[0]) != len(shapes[1]):
            return False
        for a, b in zip(*shapes, strict=True):
            # Equal sizes, or two symbolic sizes (batch, sequence); a literal size against another is a broadcast.
            if (isinstance(a, int) or isinstance(b, int)) and a != b:
                return False
        return True

    def _shape(self, value: str):
        """The value's dims (ints, None for symbolic ones) from the traced graph's types, or None if unknown."""
        if self.shapes is None:
            self.shapes = {}
            for info in [*self.graph.value_info, *self.graph.input, *self.graph.output]:
                if info.type.tensor_type.HasField("shape"):
                    dims = info.type.tensor_type.shape.dim
                    self.shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        return self.shapes.get(value)

    def _is_activation(self, value: str) -> bool:
        """A computed tensor (not a weight or constant), so an Add of two is a residual add."""
        producer = self.producer.get(value)
        return value not in self.inits and not (producer is not None and producer.op_type == "Constant")

    # ---- feed-forward -----------------------------------------------------------------------------------
    def lower_gated_ffn(self, i: int) -> None:
        """The SwiGLU or GeGLU node of block i: its projections as MatMuls (in "ort" gate and up as one)."""
        names = [f"block.{i}.feed_forward.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        wanted = [self.weights.get(name, {}).get("initializer") for name in names]
        # The node reading this layer's weights (the first if identical weights repeat across layers).
        nodes = [
            n
            for n in self.graph.node
            if n.domain == CUSTOM_DOMAIN
            and n.op_type in GATED_FFN_OPS
            and id(n) not in self.removed
            and list(n.input[1:]) == wanted
        ]
        if not nodes:
            raise ExportError(
                f"lowering {self.lowering!r}: no {CUSTOM_DOMAIN}::SwiGLU or GeGLU node reads block.{i}'s "
                f"feed-forward weights in the traced graph; export with --lowering {DEFAULT_LOWERING}"
            )
        n = nodes[0]
        x, gate_name, up_name, down_name = n.input
        gate, up, down = (self.array(v) for v in (gate_name, up_name, down_name))  # torch [out, in] layout
        self.removed.add(id(n))
        down_t = self.const(down.T, "down_proj_t")
        self.record_moved(names[2], down_t)
        if self.lowering == "ort":
            g, u = self._gate_up(x, names, gate, up)
        else:
            gate_t, up_t = self.const(gate.T, "gate_proj_t"), self.const(up.T, "up_proj_t")
            self.record_moved(names[0], gate_t)
            self.record_moved(names[1], up_t)
            g, u = self.node("MatMul", [x, gate_t]), self.node("MatMul", [x, up_t])
        if n.op_type == "SwiGLU":
            activated = self.node("Mul", [g, self.node("Sigmoid", [g])])  # silu(g) = g * sigmoid(g)
        else:
            approximate = next(a.s.decode() for a in n.attribute if a.name == "approximate")
            activated = self.node("Gelu", [g], approximate=approximate)
        self.node("MatMul", [self.node("Mul", [activated, u]), down_t], [n.output[0]])

    def _gate_up(self, x: str, names: list[str], gate: np.ndarray, up: np.ndarray):
        """One MatMul for gate and up (torch [out, in] weights): x @ [gate^T | up^T], then split the halves."""
        fused = self.const(np.concatenate([gate.T, up.T], axis=1), "gate_up_proj")
        self.record_fused(names[0], fused, 1, 0, gate.shape[0], True)
        self.record_fused(names[1], fused, 1, gate.shape[0], gate.shape[0] + up.shape[0], True)
        both = self.node("MatMul", [x, fused])
        return self.node(
            "Split", [both, self.ints([gate.shape[0], up.shape[0]])], [self.name("gate"), self.name("up")], axis=-1
        )


def _dead_code_elimination(graph, pending: PendingWeights | None = None) -> None:
    """Drop nodes whose outputs nothing reads, then unused initializers (and their pending bytes)."""
    needed = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    for i in reversed(range(len(graph.initializer))):  # in place: re-adding the kept ones would copy them
        if graph.initializer[i].name not in needed:
            if pending is not None:
                pending.pop(graph.initializer[i].name, None)
            del graph.initializer[i]


def custom_domains(lowering: str) -> dict[str, int]:
    """The non-default operator domains an export with `lowering` imports."""
    check_lowering(lowering)
    return {"functions": {CUSTOM_DOMAIN: CUSTOM_DOMAIN_VERSION}, "standard": {}, "ort": {MS_DOMAIN: MS_DOMAIN_VERSION}}[
        lowering
    ]
