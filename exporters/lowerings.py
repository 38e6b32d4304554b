"""Lowerings: graph rewrites of one traced export onto different operator sets.

export_model traces the model once (custom-domain RMSNorm/SwiGLU nodes, attention
and RoPE as primitive ops); a lowering rewrites that ModelProto:

- "functions" (default, portable): unchanged; RMSNorm/SwiGLU are onnx_toolkit
  nodes whose bodies ship as local functions (default opset 20).
- "standard": ONNX opset 23 only, no custom domain: RMSNormalization,
  RotaryEmbedding and Attention; SwiGLU becomes primitive ops.
- "ort": ONNX Runtime's fused com.microsoft kernels (plus opset 23):
  SkipSimplifiedLayerNormalization (the residual add fused into the next norm),
  one fused QKV projection, GroupQueryAttention, and one fused gate/up
  projection. With a head width that is a multiple of 16 the packed QKV goes
  straight into GroupQueryAttention, which applies the rotary embedding itself
  (no Split or RotaryEmbedding nodes); at a multiple of 8 the projection is
  split and rotated by com.microsoft RotaryEmbedding; below that the ort
  lowering uses the opset-23 Attention kernel. The manifest records the choice
  per graph ("attention_op", "rotary_op").

Each attention module is replaced as a whole: its boundary values (the q/k/v
projections' input, the o_proj output, the attention_weights stage, the
present.{i} caches) are found through the torch weight map and the stage names,
the new nodes recompute it from the model config with the same weights, and the
old nodes become dead and are removed. The KV-cache contract is unchanged:
past.{i}.key/value [B, kv_heads, T_past, head_width] in, present = concat(past, new)
out, position_ids and past_mask as before. GroupQueryAttention graphs also accept
a past buffer longer than past_mask (rows after the history are ignored) and then
return present at that length with the new keys written after the history, in
place when the caller binds present to the same buffer (manifest "kv_cache":
"shared-buffer"; runners/ort.BoundKVCache does so on ONNX Runtime).

What a lowering cannot express is refused with an ExportError naming the feature
and the lowering that handles it (always "functions").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from artifact.errors import ExportError
from artifact.format import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION, DEFAULT_LOWERING, SHARED_KV_CACHE, Manifest
from exporters.replicate import SCOPES_KEY, topological  # SCOPES_KEY: torch.onnx's per-node module path metadata
from models.rope import rope_attention_factor, rope_inverse_frequencies

LOWERINGS = ("functions", "standard", "ort")
STANDARD_OPSET = 23  # RMSNormalization, RotaryEmbedding and Attention appear in opset 23
MS_DOMAIN = "com.microsoft"
MS_DOMAIN_VERSION = 1
GQA_HEAD_MULTIPLE = 8  # ONNX Runtime's CPU GroupQueryAttention rejects other head widths
GQA_ROTARY_HEAD_MULTIPLE = 16  # ... and with do_rotary it wants a multiple of 16
# What each lowering can run on: the ONNX reference evaluator knows no com.microsoft op.
REFERENCE_BACKEND = "onnx-reference"
GPU_ORT_BACKENDS = ("ort-cuda", "ort-trt")  # TensorRT hands GroupQueryAttention to the CUDA provider
GQA_CUDA_DTYPES = ("float16", "bfloat16")  # onnxruntime's CUDA kernel registrations for GroupQueryAttention


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


def check_supported(family: str, config, lowering: str) -> None:
    """Refuse, before the slow trace, a model the lowering cannot express."""
    check_lowering(lowering)
    if lowering == DEFAULT_LOWERING:
        return
    refusals = {
        "gpt": "the gpt family's LayerNorm, GELU MLP with biases and learned positions",
        "encoder-decoder": "the encoder-decoder family's cross-attention and bidirectional encoder attention "
        "(and its LayerNorm/ReLU/biases switches)",
    }
    if family in refusals:
        raise ExportError(
            f"lowering {lowering!r} cannot express {refusals[family]}; export it with --lowering {DEFAULT_LOWERING}"
        )
    if family not in ("block", "llama"):
        raise ExportError(
            f"lowering {lowering!r} knows only the block and llama families, not {family!r}; "
            f"export it with --lowering {DEFAULT_LOWERING}"
        )

    # Switches of the llama family whose attention the rewrite below does not rebuild (RoPE scaling and an
    # explicit head_dim it does: they change only the cos/sin caches and the projection widths).
    def on(key, off=None):
        return getattr(config, key, off) != off

    switches = {
        "attention_bias": ("biases on the attention projections", on("attention_bias", "none")),
        "qk_norm": ("RMSNorm of queries and keys", on("qk_norm", "none")),
        "sliding_window": ("sliding-window attention", on("sliding_window")),
        "norm_placement": (
            "norms after the branches or a parallel residual",
            getattr(config, "norm_placement", "pre") in ("sandwich", "branch_post", "parallel"),
        ),
        "norm": ("LayerNorm", on("norm", "rmsnorm")),
        "ffn_gated": ("a plain MLP", not getattr(config, "ffn_gated", True)),
        "rotary_dim": ("partial rotary embeddings", on("rotary_dim")),
        "attention_scale": ("a scores scale other than 1/sqrt(head width)", on("attention_scale")),
        "attention_softcap": ("soft-capped attention scores", on("attention_softcap")),
        "residual_scale": ("scaled residual branches", on("residual_scale")),
        "ffn_activation": ("a feed-forward other than SwiGLU", on("ffn_activation", "silu")),
        "layer_types": ("layers that differ from each other", not getattr(config, "uniform_layers", True)),
        "no_rope_layers": ("layers without RoPE", on("no_rope_layers")),
    }
    for key, (what, on) in switches.items():
        if on:
            raise ExportError(
                f"lowering {lowering!r} does not rebuild {what} ({key}={getattr(config, key)!r}); "
                f"export it with --lowering {DEFAULT_LOWERING}"
            )


def lower(
    proto: onnx.ModelProto, lowering: str, family: str, config, weights: dict
) -> tuple[onnx.ModelProto, dict, dict]:
    """Rewrite one traced graph. Returns (proto, fused weights, graph notes).

    weights: the pre-rewrite map {torch name: {"initializer", "transpose"}}. Fused weights
    come back as {torch name: {"initializer", "transpose", "slice": [axis, start, stop]}}:
    the torch tensor is initializer[slice along axis], transposed when "transpose" is set.
    """
    check_supported(family, config, lowering)
    if lowering == DEFAULT_LOWERING:
        return proto, {}, {}
    rewriter = _Rewriter(proto, lowering, config, weights)
    return rewriter.run()


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Rewriter:
    def __init__(self, proto, lowering, config, weights):
        self.lowering = lowering
        self.config = config
        self.weights = weights
        # Opset 20 -> 23 for every traced op (the custom nodes pass through untouched), then rewrite at 23.
        self.model = onnx.version_converter.convert_version(proto, STANDARD_OPSET)
        # The converter drops node metadata; torch.onnx's module scopes are put back by node name.
        scopes = {n.name: list(n.metadata_props) for n in proto.graph.node if n.name}
        for n in self.model.graph.node:
            if n.name in scopes and not n.metadata_props:
                n.metadata_props.extend(scopes[n.name])
        self.graph = self.model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.new_nodes: list = []
        self.new_inits: list = []
        self.fused: dict = {}
        self.counter = 0
        self.shared: dict = {}
        head = config.head_width
        self.use_gqa = lowering == "ort" and head % GQA_HEAD_MULTIPLE == 0
        # Rotary inside GroupQueryAttention reads packed QKV: no Split or RotaryEmbedding node per layer.
        self.packed_gqa = self.use_gqa and head % GQA_ROTARY_HEAD_MULTIPLE == 0
        self.notes = {
            "attention_op": ("com.microsoft::GroupQueryAttention" if self.use_gqa else "Attention (opset 23)"),
            "rotary_op": (
                "inside GroupQueryAttention (do_rotary)"
                if self.packed_gqa
                else "com.microsoft::RotaryEmbedding"
                if lowering == "ort"
                else "RotaryEmbedding (opset 23)"
            ),
        }

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
        self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def ints(self, values, hint="ints") -> str:
        return self.const(np.asarray(values, dtype=np.int64), hint)

    def array(self, name: str) -> np.ndarray:
        if name not in self.inits:
            raise ExportError(f"lowering {self.lowering!r}: expected {name!r} to be an initializer in the traced graph")
        return numpy_helper.to_array(self.inits[name])

    def weight_in_out(self, torch_name: str) -> tuple[str, np.ndarray]:
        """(initializer name, the weight as [in_features, out_features]) of a torch Linear weight."""
        entry = self.weights.get(torch_name)
        if entry is None:
            raise ExportError(
                f"lowering {self.lowering!r}: no initializer for weight {torch_name!r} in the traced graph"
            )
        array = self.array(entry["initializer"])
        return entry["initializer"], (array if entry["transpose"] else array.T)

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
        layers = getattr(self.config, "layers", 1)
        for i in range(layers):
            self.lower_attention(i)
        for i in range(layers):
            self.lower_swiglu(i)
        for n in list(graph.node):
            if n.domain == CUSTOM_DOMAIN and n.op_type == "RMSNorm":
                self.lower_norm(n)
            elif n.domain == CUSTOM_DOMAIN and id(n) not in self.removed:
                raise ExportError(
                    f"lowering {self.lowering!r} has no rewrite for {CUSTOM_DOMAIN}::{n.op_type}; "
                    f"export with --lowering {DEFAULT_LOWERING}"
                )
        kept = [n for n in graph.node if id(n) not in self.removed]
        available = self.graph_inputs | set(self.inits) | {i.name for i in self.new_inits}
        nodes = topological(kept + self.new_nodes, available)
        if nodes is None:
            produced = {o for n in kept + self.new_nodes for o in n.output}
            missing = sorted({i for n in kept + self.new_nodes for i in n.input if i not in available | produced})[:3]
            raise ExportError(
                f"lowering produced a graph with unresolved values {missing or '(a cycle)'}; this is a toolkit bug"
            )
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(self.new_inits)
        _dead_code_elimination(graph)
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
        return self.model, self.fused, self.notes

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
        residual = (
            self.lowering == "ort"
            and add is not None
            and add.op_type == "Add"
            and add.domain == ""
            and all(self._is_activation(v) for v in add.input)
        )
        if residual:
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
        # y = x / sqrt(mean(x^2, -1) + eps) * weight, statistics in float32 (stash_type 1)
        self.node("RMSNormalization", [x, weight], [n.output[0]], axis=-1, epsilon=eps, stash_type=1)

    def _is_activation(self, value: str) -> bool:
        """A computed tensor (not a weight or constant), so an Add of two is a residual add."""
        producer = self.producer.get(value)
        return value not in self.inits and not (producer is not None and producer.op_type == "Constant")

    # ---- feed-forward -----------------------------------------------------------------------------------
    def lower_swiglu(self, i: int) -> None:
        names = [f"block.{i}.feed_forward.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        wanted = [self.weights.get(name, {}).get("initializer") for name in names]
        # The SwiGLU node reading this layer's weights (the first if identical weights repeat across layers).
        nodes = [
            n
            for n in self.graph.node
            if n.domain == CUSTOM_DOMAIN
            and n.op_type == "SwiGLU"
            and id(n) not in self.removed
            and list(n.input[1:]) == wanted
        ]
        if not nodes:
            raise ExportError(
                f"lowering {self.lowering!r}: no {CUSTOM_DOMAIN}::SwiGLU node reads block.{i}'s "
                f"feed-forward weights in the traced graph; export with --lowering {DEFAULT_LOWERING}"
            )
        n = nodes[0]
        x, gate_name, up_name, down_name = n.input
        gate, up, down = (self.array(v) for v in (gate_name, up_name, down_name))  # torch [out, in] layout
        self.removed.add(id(n))
        down_t = self.const(down.T, "down_proj_t")
        if self.lowering == "ort":
            # One MatMul for gate and up: x @ [gate^T | up^T], then split the halves.
            fused = self.const(np.concatenate([gate.T, up.T], axis=1), "gate_up_proj")
            self._record_fused(names[0], fused, 1, 0, gate.shape[0])
            self._record_fused(names[1], fused, 1, gate.shape[0], gate.shape[0] + up.shape[0])
            both = self.node("MatMul", [x, fused])
            g, u = self.node(
                "Split", [both, self.ints([gate.shape[0], up.shape[0]])], [self.name("gate"), self.name("up")], axis=-1
            )
        else:
            g = self.node("MatMul", [x, self.const(gate.T, "gate_proj_t")])
            u = self.node("MatMul", [x, self.const(up.T, "up_proj_t")])
        # silu(g) * u = g * sigmoid(g) * u
        hidden = self.node("Mul", [self.node("Mul", [g, self.node("Sigmoid", [g])]), u])
        self.node("MatMul", [hidden, down_t], [n.output[0]])

    def _record_fused(self, torch_name: str, fused: str, axis: int, start: int, stop: int) -> None:
        # The fused tensor holds W^T ([in, out]): slice its columns, transpose back to torch's layout.
        self.fused[torch_name] = {"initializer": fused, "transpose": True, "slice": [axis, start, stop]}

    # ---- attention --------------------------------------------------------------------------------------
    def lower_attention(self, i: int) -> None:
        c = self.config
        prefix = f"block.{i}.attention"
        heads, kv_heads, head = c.heads, c.kv_heads, c.head_width
        q_init, wq = self.weight_in_out(f"{prefix}.q_proj.weight")
        k_init, wk = self.weight_in_out(f"{prefix}.k_proj.weight")
        v_init, wv = self.weight_in_out(f"{prefix}.v_proj.weight")
        o_init, wo = self.weight_in_out(f"{prefix}.o_proj.weight")
        x = self._matmul(q_init, prefix, "q_proj").input[0]
        for init, proj in ((k_init, "k_proj"), (v_init, "v_proj")):
            # Self-attention: K and V project the same input (the trace may share one MatMul for equal weights).
            if not any(n.op_type == "MatMul" and list(n.input) == [x, init] for n in self.consumers.get(init, [])):
                raise ExportError(
                    f"lowering {self.lowering!r}: {prefix}.{proj} does not read the same input as "
                    "q_proj (cross-attention); export with --lowering functions"
                )
        branch = self._matmul(o_init, prefix, "o_proj").output[0]
        past = [f"past.{i}.key", f"past.{i}.value"]
        present = [f"present.{i}.key", f"present.{i}.value"]
        has_cache = all(p in self.graph_inputs for p in past)
        probs_name = f"block.{i}.attention_weights"
        want_probs = probs_name in self.graph_outputs

        if self.lowering == "ort":
            qkv_init = self.const(np.concatenate([wq, wk, wv], axis=1), "qkv_proj")
            widths = [heads * head, kv_heads * head, kv_heads * head]
            bounds = np.cumsum([0, *widths])
            for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                self._record_fused(f"{prefix}.{proj}.weight", qkv_init, 1, int(bounds[k]), int(bounds[k + 1]))
            qkv = self.node("MatMul", [x, qkv_init])
            if not self.packed_gqa:  # RotaryEmbedding and opset-23 Attention take q, k and v apart
                q, k, v = self.node(
                    "Split", [qkv, self.ints(widths)], [self.name("q"), self.name("k"), self.name("v")], axis=-1
                )
        else:
            q = self.node(
                "MatMul",
                [x, q_init if self.weights[f"{prefix}.q_proj.weight"]["transpose"] else self.const(wq, "q_proj_t")],
            )
            k = self.node(
                "MatMul",
                [x, k_init if self.weights[f"{prefix}.k_proj.weight"]["transpose"] else self.const(wk, "k_proj_t")],
            )
            v = self.node(
                "MatMul",
                [x, v_init if self.weights[f"{prefix}.v_proj.weight"]["transpose"] else self.const(wv, "v_proj_t")],
            )
        positions = self._positions(x)
        cos, sin = self._rope_caches()
        interleaved = int(c.rope_pairing == "interleaved")
        if self.packed_gqa:
            pass  # GroupQueryAttention rotates q and k itself (do_rotary), from the packed projection
        elif self.lowering == "ort":
            q = self.node(
                "RotaryEmbedding",
                [q, positions, cos, sin],
                domain=MS_DOMAIN,
                interleaved=interleaved,
                num_heads=heads,
                rotary_embedding_dim=head,
            )
            k = self.node(
                "RotaryEmbedding",
                [k, positions, cos, sin],
                domain=MS_DOMAIN,
                interleaved=interleaved,
                num_heads=kv_heads,
                rotary_embedding_dim=head,
            )
        else:
            q = self.node("RotaryEmbedding", [q, cos, sin, positions], interleaved=interleaved, num_heads=heads)
            k = self.node("RotaryEmbedding", [k, cos, sin, positions], interleaved=interleaved, num_heads=kv_heads)

        outs = [
            self.name("attn"),
            self.name("present_key") if has_cache else "",
            self.name("present_value") if has_cache else "",
            self.name("probs") if want_probs else "",
        ]
        if self.use_gqa:
            if has_cache:
                # The kernel reads only the first seqlens_k rows of a longer past buffer and writes the new
                # keys after them, in place when present is bound to the same buffer (runners/ort.BoundKVCache).
                self.notes["kv_cache"] = SHARED_KV_CACHE
            seqlens, total = self._gqa_lengths(x, has_cache)
            bias = self._key_padding_bias(x) if "past_mask" in self.graph_inputs else ""
            cache = [past[0], past[1]] if has_cache else ["", ""]
            if self.packed_gqa:
                # Packed QKV, rotated by the kernel: no Split or RotaryEmbedding nodes per layer.
                inputs = [qkv, "", "", *cache, seqlens, total, cos, sin, positions, bias]
            else:
                inputs = [q, k, v, *cache, seqlens, total, "", "", "", bias]
            if has_cache:
                # query_seqlens (every row's T new tokens): the kernel then takes chunks of T > 1 after a
                # non-empty cache at any batch size, which without it it refuses for batch > 1.
                inputs += ["", "", "", "", "", self._query_lengths(x)]
            attrs = {"num_heads": heads, "kv_num_heads": kv_heads}
            if self.packed_gqa:
                attrs.update(do_rotary=1, rotary_interleaved=interleaved)
            if want_probs:
                attrs["qk_output"] = 2  # the probabilities, after softmax
            self.node("GroupQueryAttention", _trim(inputs), _trim(outs), domain=MS_DOMAIN, **attrs)
        else:
            attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads}
            if want_probs:
                attrs["qk_matmul_output_mode"] = 3  # the probabilities, after softmax
            if has_cache:
                inputs = [q, k, v, self._attention_mask(x), past[0], past[1]]
            else:
                inputs = [q, k, v]
                attrs["is_causal"] = 1  # no cache: queries and keys are the same positions
            self.node("Attention", inputs, _trim(outs), **attrs)
        attn = outs[0]
        o_weight = o_init if self.weights[f"{prefix}.o_proj.weight"]["transpose"] else self.const(wo, "o_proj_t")
        new_branch = self.node("MatMul", [attn, o_weight])
        self.replace_output(branch, new_branch)
        if want_probs:
            self.replace_output(probs_name, outs[3])
        if has_cache:
            self.replace_output(present[0], outs[1])
            self.replace_output(present[1], outs[2])

    def _matmul(self, init: str, prefix: str, proj: str):
        """The MatMul applying {prefix}.{proj}: the only one reading its weight, or, when equal weights
        share one initializer (the worked example's identities), the one torch.onnx scoped to that module."""
        users = [n for n in self.consumers.get(init, []) if n.op_type == "MatMul" and n.input[1] == init]
        if len(users) > 1:
            users = [
                n
                for n in users
                if any(p.key == SCOPES_KEY and f"{prefix}.{proj}'" in p.value for p in n.metadata_props)
            ]
        if len(users) != 1:
            raise ExportError(
                f"lowering {self.lowering!r}: expected one MatMul applying {prefix}.{proj} in the "
                f"traced graph, found {len(users)}; export with --lowering {DEFAULT_LOWERING}"
            )
        return users[0]

    # Values shared by every layer, built once from the first layer's input.
    def _shape_scalars(self, x: str):
        if "dims" not in self.shared:
            shape = self.node("Shape", [x])
            batch = self.node("Slice", [shape, self.ints([0]), self.ints([1])], hint="batch")  # (1,)
            seq = self.node("Slice", [shape, self.ints([1]), self.ints([2])], hint="seq")  # (1,)
            if "past_mask" in self.graph_inputs:
                past = self.node(
                    "Slice", [self.node("Shape", ["past_mask"]), self.ints([1]), self.ints([2])], hint="past"
                )
            else:
                past = self.ints([0])
            self.shared["dims"] = (batch, seq, past, self.node("Add", [past, seq], hint="total"))
        return self.shared["dims"]

    def _positions(self, x: str) -> str:
        if "positions" not in self.shared:
            if "position_ids" in self.graph_inputs:
                self.shared["positions"] = "position_ids"
            else:  # the stages graph: every row at positions 0..T-1
                batch, seq, _, _ = self._shape_scalars(x)
                zero, one = self.const(np.array(0, np.int64), "zero"), self.const(np.array(1, np.int64), "one")
                steps = self.node("Range", [zero, self.node("Squeeze", [seq]), one])
                shape = self.node("Concat", [batch, seq], axis=0)
                self.shared["positions"] = self.node("Expand", [self.node("Unsqueeze", [steps, self.ints([0])]), shape])
        return self.shared["positions"]

    def _rope_caches(self):
        if "rope" not in self.shared:
            c = self.config
            # angle[p, i] = p * inv_freq[i] (models/rope.py: the scaling type's frequencies), in float64 like the
            # oracle, stored as float32; YaRN's attention factor multiplies cos and sin.
            scaling = getattr(c, "rope_scaling", None)
            inv_freq = rope_inverse_frequencies(c.head_width, c.rope_base, scaling).numpy()
            angles = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
            factor = rope_attention_factor(scaling)
            self.shared["rope"] = (
                self.const((np.cos(angles) * factor).astype(np.float32), "cos_cache"),
                self.const((np.sin(angles) * factor).astype(np.float32), "sin_cache"),
            )
        return self.shared["rope"]

    def _key_ok(self, x: str) -> str:
        """(B, T_past + T) bool: which keys hold real tokens (past_mask, then the new tokens)."""
        if "key_ok" not in self.shared:
            batch, seq, _, _ = self._shape_scalars(x)
            new = self.node("Expand", [self.const(np.array(True), "true"), self.node("Concat", [batch, seq], axis=0)])
            past = self.node("Cast", ["past_mask"], to=TensorProto.BOOL)
            self.shared["key_ok"] = self.node("Concat", [past, new], axis=1)
        return self.shared["key_ok"]

    def _attention_mask(self, x: str) -> str:
        """(B, 1, T, T_past + T) bool, True where a query may attend: causal and not a padding slot."""
        if "mask" not in self.shared:
            _, seq, past, total = self._shape_scalars(x)
            zero, one = self.const(np.array(0, np.int64), "zero"), self.const(np.array(1, np.int64), "one")
            key_pos = self.node("Range", [zero, self.node("Squeeze", [total]), one])  # (T_total,)
            query_pos = self.node("Add", [self.node("Range", [zero, self.node("Squeeze", [seq]), one]), past])  # (T,)
            causal = self.node(
                "LessOrEqual",
                [
                    self.node("Unsqueeze", [key_pos, self.ints([0])]),
                    self.node("Unsqueeze", [query_pos, self.ints([1])]),
                ],
            )  # (T, T_total)
            keys = self.node("Unsqueeze", [self._key_ok(x), self.ints([1, 2])])  # (B, 1, 1, T_total)
            self.shared["mask"] = self.node("And", [keys, causal])
        return self.shared["mask"]

    def _key_padding_bias(self, x: str) -> str:
        """(B, 1, T, T_past + T) float: 0 for real keys, -inf for padding slots (GQA adds its own causal mask)."""
        if "bias" not in self.shared:
            batch, seq, _, total = self._shape_scalars(x)
            keys = self.node("Unsqueeze", [self._key_ok(x), self.ints([1, 2])])  # (B, 1, 1, T_total)
            bias = self.node(
                "Where",
                [
                    keys,
                    self.const(np.array(0, np.float32), "zero_f"),
                    self.const(np.array(-np.inf, np.float32), "minus_inf"),
                ],
            )
            shape = self.node("Concat", [batch, self.ints([1]), seq, total], axis=0)
            self.shared["bias"] = self.node("Expand", [bias, shape])
        return self.shared["bias"]

    def _query_lengths(self, x: str) -> str:
        """(B,) int32: T, the new tokens of every row."""
        if "query_lengths" not in self.shared:
            batch, seq, _, _ = self._shape_scalars(x)
            self.shared["query_lengths"] = self.node("Expand", [self.node("Cast", [seq], to=TensorProto.INT32), batch])
        return self.shared["query_lengths"]

    def _gqa_lengths(self, x: str, has_cache: bool):
        """seqlens_k (B,) int32 = T_past + T - 1 for every row (padding slots count, the bias hides them) and
        total_sequence_length, a scalar int32 T_past + T."""
        if "gqa" not in self.shared:
            batch, _, _, total = self._shape_scalars(x)
            total32 = self.node("Cast", [total], to=TensorProto.INT32)  # (1,)
            last = self.node("Sub", [total32, self.const(np.array([1], np.int32), "one_i32")])
            seqlens = self.node("Expand", [last, batch])
            self.shared["gqa"] = (seqlens, self.node("Squeeze", [total32]))
        return self.shared["gqa"]


def _trim(names: list[str]) -> list[str]:
    """Drop trailing empty (omitted optional) names."""
    names = list(names)
    while names and names[-1] == "":
        names.pop()
    return names


def _dead_code_elimination(graph) -> None:
    """Drop nodes whose outputs nothing reads, then unused initializers."""
    needed = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def custom_domains(lowering: str) -> dict[str, int]:
    """The non-default operator domains an export with `lowering` imports."""
    check_lowering(lowering)
    return {"functions": {CUSTOM_DOMAIN: CUSTOM_DOMAIN_VERSION}, "standard": {}, "ort": {MS_DOMAIN: MS_DOMAIN_VERSION}}[
        lowering
    ]
