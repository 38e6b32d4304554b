"""The attention of the llama family rebuilt for the standard and ort lowerings (exporters/lowerings.py).

Each block's attention module is replaced as a whole: its boundary values (the q/k/v projections' input, the
o_proj output, the attention_weights stage, the present.{i} caches) are found through the torch weight map and
the stage names, the new nodes recompute it from the model config with the same weights, and the old nodes
become dead. What each layer computes comes from config.layer_attention(i): its sliding window, and its RoPE
base and scaling (none for a layer without RoPE), so layers may differ.

How the switches are rebuilt:

- attention_bias ("qkv", "all"): an Add after each projection; the ort lowering adds one fused bias after its
  fused QKV MatMul, so GroupQueryAttention's packed input is the biased QKV. o_proj's bias is the traced Add
  after the replaced MatMul and stays.
- qk_norm: RMSNormalization before RoPE, over each head's width ("head": q and k reshaped to
  [B, T, heads, head_width]) or over all heads ("full"). GroupQueryAttention then takes q, k and v apart: its
  packed input cannot be normalised in between.
- rotary_dim (partial rotary): RotaryEmbedding's rotary_embedding_dim, cos/sin caches of rotary_dim / 2
  columns; GroupQueryAttention rotates inside (do_rotary) only when that is a multiple of 8 (ONNX Runtime
  refuses other widths).
- layers without RoPE: no rotation (and do_rotary 0). When no layer rotates, GroupQueryAttention reads the packed
  QKV at any head width it takes (a multiple of 8): the multiple of 16 is do_rotary's.
- the gpt family (models/gpt.py): GPTAttention describes its config in these terms. Its learned positions are added
  to the embedding before the first block, so its attention is multi-head, without RoPE, window or q/k norm, at
  the default scale, with its q/k/v/o biases (attention_bias) as above.
- sliding windows: a query at position p sees keys at p - W < j <= p (transformers' window, W keys). The
  Attention op gets it in its boolean mask, the no-cache graph too (is_causal cannot say it).
  GroupQueryAttention's local_window_size W admits the same W keys (checked against the kernel), counted in
  cache slots: exact for caches padded on the left (the continuous batcher's layout), while the model counts
  only the kept keys of past_mask, so a cache with holes inside a row's history would see a narrower window.
- attention_scale and attention_softcap: the scale and softcap attributes of both kernels (both cap the
  scores before the masks, as the model does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from artifact.errors import ExportError
from artifact.format import DEFAULT_LOWERING, SHARED_KV_CACHE
from exporters.replicate import SCOPES_KEY  # torch.onnx's per-node module path metadata
from models.rope import rope_attention_factor, rope_inverse_frequencies

MS_DOMAIN = "com.microsoft"
MS_DOMAIN_VERSION = 1
GQA_HEAD_MULTIPLE = 8  # ONNX Runtime's CPU GroupQueryAttention rejects other head widths
# ... and with do_rotary it wants a head width of a multiple of 16 and cos/sin caches of a multiple of 8 columns
GQA_ROTARY_HEAD_MULTIPLE = 16


@dataclass(frozen=True)
class GPTAttention:
    """A gpt family config in the llama family's switches that the rewrite reads (lowerings.rewritten_config).

    Learned positions are a Gather added to the token embedding, traced as standard ops that pass through, so no
    layer rotates; LayerNorm and the biased GELU MLP pass through too, a plain (ungated) feed-forward for the
    rewrite. The attention biases need no field: _projections reads them from the weight map."""

    layers: int
    heads: int
    kv_heads: int
    head_width: int
    max_positions: int
    eps: float
    qk_norm: str = "none"
    rotary_dim: int | None = None
    attention_scale: float | None = None  # the default head_width ** -0.5, as models/gpt.py
    attention_softcap: float | None = None
    ffn_gated: bool = False

    @classmethod
    def of(cls, config) -> GPTAttention:
        return cls(config.layers, config.heads, config.heads, config.head_width, config.max_positions, config.eps)

    def layer_attention(self, index: int) -> dict:
        return {"window": None, "rope_base": None, "rope_scaling": None}


def attention_plan(lowering: str, config) -> dict:
    """Which kernels a lowering uses for this config: {"gqa", "packed", "attention_op", "rotary_op"}."""
    head = config.head_width
    rotary = getattr(config, "rotary_dim", None) or head
    rotates = any(config.layer_attention(i)["rope_base"] is not None for i in range(getattr(config, "layers", 1)))
    gqa = lowering == "ort" and head % GQA_HEAD_MULTIPLE == 0
    # Rotary inside GroupQueryAttention reads packed QKV: no Split or RotaryEmbedding node per layer; without RoPE
    # anywhere the packed QKV needs no rotation either. A q/k norm between the projection and the kernel needs
    # q, k and v apart.
    packed = (
        gqa
        and (not rotates or (head % GQA_ROTARY_HEAD_MULTIPLE == 0 and rotary % GQA_ROTARY_HEAD_MULTIPLE == 0))
        and getattr(config, "qk_norm", "none") == "none"
    )
    if not rotates:
        rotary_op = None
    elif packed:
        rotary_op = "inside GroupQueryAttention (do_rotary)"
    else:
        rotary_op = "com.microsoft::RotaryEmbedding" if lowering == "ort" else "RotaryEmbedding (opset 23)"
    return {
        "gqa": gqa,
        "packed": packed,
        "attention_op": "com.microsoft::GroupQueryAttention" if gqa else "Attention (opset 23)",
        "rotary_op": rotary_op,
    }


def _trim(names: list[str]) -> list[str]:
    """Drop trailing empty (omitted optional) names."""
    names = list(names)
    while names and names[-1] == "":
        names.pop()
    return names


class AttentionLowering:
    """Mixin of lowerings._Rewriter: the attention rewrite. The host provides node/const/ints/array/weight_in_out,
    replace_output, the graph's producer/consumer maps, graph_inputs/graph_outputs, `shared`, `fused` and
    `notes`, and sets use_gqa/packed_gqa from attention_plan."""

    def lower_attention(self, i: int) -> None:
        c = self.config
        prefix = f"block.{i}.attention"
        layer = c.layer_attention(i)
        heads, kv_heads = c.heads, c.kv_heads
        q_init = self.weights_entry(f"{prefix}.q_proj.weight")["initializer"]
        x = self._matmul(q_init, prefix, "q_proj").input[0]
        for proj in ("k_proj", "v_proj"):
            # Self-attention: K and V project the same input (the trace may share one MatMul for equal weights).
            init = self.weights_entry(f"{prefix}.{proj}.weight")["initializer"]
            if not any(n.op_type == "MatMul" and list(n.input) == [x, init] for n in self.consumers.get(init, [])):
                raise ExportError(
                    f"lowering {self.lowering!r}: {prefix}.{proj} does not read the same input as "
                    f"q_proj (cross-attention); export with --lowering {DEFAULT_LOWERING}"
                )
        o_init, wo = self.weight_in_out(f"{prefix}.o_proj.weight")
        branch = self._matmul(o_init, prefix, "o_proj").output[0]  # o_proj's bias, if any, is added after it
        past = [f"past.{i}.key", f"past.{i}.value"]
        present = [f"present.{i}.key", f"present.{i}.value"]
        has_cache = all(p in self.graph_inputs for p in past)
        probs_name = f"block.{i}.attention_weights"
        want_probs = probs_name in self.graph_outputs

        q, k, v, qkv = self._projections(prefix, x)
        q, k = self._qk_norm(prefix, q, k)
        positions = self._positions(x)
        rope = self._rope_caches(layer) if layer["rope_base"] is not None else None
        if rope is not None and not self.packed_gqa:  # packed: GroupQueryAttention rotates q and k itself
            q, k = self._rotate(q, heads, rope, positions), self._rotate(k, kv_heads, rope, positions)

        outs = [
            self.name("attn"),
            self.name("present_key") if has_cache else "",
            self.name("present_value") if has_cache else "",
            self.name("probs") if want_probs else "",
        ]
        scores = {}  # the scores' multiplier and soft cap, where the config sets them
        if getattr(c, "attention_scale", None) is not None:
            scores["scale"] = float(c.attention_scale)
        if getattr(c, "attention_softcap", None) is not None:
            scores["softcap"] = float(c.attention_softcap)
        window = layer["window"]
        if self.use_gqa:
            if has_cache:
                # The kernel reads only the first seqlens_k rows of a longer past buffer and writes the new
                # keys after them, in place when present is bound to the same buffer (runners/ort.BoundKVCache).
                self.notes["kv_cache"] = SHARED_KV_CACHE
            seqlens, total = self._gqa_lengths(x)
            bias = self._key_padding_bias(x) if "past_mask" in self.graph_inputs else ""
            cache = [past[0], past[1]] if has_cache else ["", ""]
            rotary = [*rope, positions] if self.packed_gqa and rope is not None else ["", "", ""]
            if self.packed_gqa:  # packed QKV (biased), rotated by the kernel if at all: no Split or RotaryEmbedding
                inputs = [qkv, "", "", *cache, seqlens, total, *rotary, bias]
            else:
                inputs = [q, k, v, *cache, seqlens, total, "", "", "", bias]
            if has_cache:
                # query_seqlens (every row's T new tokens): the kernel then takes chunks of T > 1 after a
                # non-empty cache at any batch size, which without it it refuses for batch > 1.
                inputs += ["", "", "", "", "", self._query_lengths(x)]
            attrs = {"num_heads": heads, "kv_num_heads": kv_heads, **scores}
            if self.packed_gqa and rope is not None:
                attrs.update(do_rotary=1, rotary_interleaved=int(c.rope_pairing == "interleaved"))
            if window is not None:
                attrs["local_window_size"] = int(window)  # the W keys p - W < j <= p, as the model
            if want_probs:
                attrs["qk_output"] = 2  # the probabilities, after softmax
            self.node("GroupQueryAttention", _trim(inputs), _trim(outs), domain=MS_DOMAIN, **attrs)
        else:
            attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads, **scores}
            if want_probs:
                attrs["qk_matmul_output_mode"] = 3  # the probabilities, after softmax
            if has_cache:
                inputs = [q, k, v, self._attention_mask(x, window), past[0], past[1]]
            elif window is not None:
                inputs = [q, k, v, self._attention_mask(x, window)]
            else:
                inputs = [q, k, v]
                attrs["is_causal"] = 1  # no cache: queries and keys are the same positions
            self.node("Attention", inputs, _trim(outs), **attrs)
        o_weight = o_init if self.weights_entry(f"{prefix}.o_proj.weight")["transpose"] else self.const(wo, "o_proj_t")
        self.replace_output(branch, self.node("MatMul", [outs[0], o_weight]))
        if want_probs:
            self.replace_output(probs_name, outs[3])
        if has_cache:
            self.replace_output(present[0], outs[1])
            self.replace_output(present[1], outs[2])

    # ---- the parts before the kernel --------------------------------------------------------------------
    def _projections(self, prefix: str, x: str):
        """(q, k, v, packed qkv): [B, T, heads * head_width] each; the ort lowering's one fused projection
        (its bias included) comes back as qkv, and q, k, v are None when GroupQueryAttention reads it packed."""
        c = self.config
        head = c.head_width
        projections = ("q_proj", "k_proj", "v_proj")
        widths = [c.heads * head, c.kv_heads * head, c.kv_heads * head]
        matrices = [self.weight_in_out(f"{prefix}.{p}.weight") for p in projections]
        biases = [self.weights.get(f"{prefix}.{p}.bias") for p in projections]
        if self.lowering != "ort":
            out = []
            for proj, (init, w), bias in zip(projections, matrices, biases, strict=True):
                weight = init
                if not self.weights_entry(f"{prefix}.{proj}.weight")["transpose"]:  # stored [out, in]: a [in, out] copy
                    weight = self.const(w, proj)
                    self.record_moved(f"{prefix}.{proj}.weight", weight)
                y = self.node("MatMul", [x, weight])
                out.append(self.node("Add", [y, bias["initializer"]]) if bias else y)
            return (*out, None)
        bounds = np.cumsum([0, *widths])
        qkv_init = self.const(np.concatenate([w for _, w in matrices], axis=1), "qkv_proj")
        for k, proj in enumerate(projections):
            # The fused tensor holds W^T ([in, out]): its columns, transposed back to torch's layout.
            self.record_fused(f"{prefix}.{proj}.weight", qkv_init, 1, int(bounds[k]), int(bounds[k + 1]), True)
        qkv = self.node("MatMul", [x, qkv_init])
        if any(biases):
            parts = [
                self.array(b["initializer"]) if b else np.zeros(width, np.float32)
                for b, width in zip(biases, widths, strict=True)
            ]
            bias_init = self.const(np.concatenate(parts), "qkv_bias")
            for k, proj in enumerate(projections):
                if biases[k]:
                    self.record_fused(f"{prefix}.{proj}.bias", bias_init, 0, int(bounds[k]), int(bounds[k + 1]), False)
            qkv = self.node("Add", [qkv, bias_init])
        if self.packed_gqa:
            return None, None, None, qkv
        q, k, v = self.node(
            "Split", [qkv, self.ints(widths)], [self.name("q"), self.name("k"), self.name("v")], axis=-1
        )
        return q, k, v, qkv

    def _qk_norm(self, prefix: str, q: str, k: str):
        """RMSNorm of queries and keys before RoPE: over each head ("head") or over all heads ("full")."""
        c = self.config
        kind = getattr(c, "qk_norm", "none")
        if kind == "none":
            return q, k
        out = []
        for value, norm, heads in ((q, "q_norm", c.heads), (k, "k_norm", c.kv_heads)):
            weight = self.weights_entry(f"{prefix}.{norm}.weight")["initializer"]
            if kind == "full":  # one norm over the whole [B, T, heads * head_width] row
                out.append(self._rms_norm(value, weight, c.eps))
                continue
            per_head = self.node("Reshape", [value, self.ints([0, 0, heads, c.head_width])])
            normed = self._rms_norm(per_head, weight, c.eps)
            out.append(self.node("Reshape", [normed, self.ints([0, 0, heads * c.head_width])]))
        return tuple(out)

    def _rms_norm(self, value: str, weight: str, eps: float, outputs=None) -> str:
        # y = x / sqrt(mean(x^2, -1) + eps) * weight, statistics in float32 (stash_type 1)
        return self.node("RMSNormalization", [value, weight], outputs, axis=-1, epsilon=float(eps), stash_type=1)

    def _rotate(self, value: str, heads: int, rope, positions: str) -> str:
        """RoPE on [B, T, heads * head_width] (the first rotary_dim dims of each head when partial)."""
        c = self.config
        cos, sin = rope
        interleaved = int(c.rope_pairing == "interleaved")
        rotary = getattr(c, "rotary_dim", None) or c.head_width
        if self.lowering == "ort":
            return self.node(
                "RotaryEmbedding",
                [value, positions, cos, sin],
                domain=MS_DOMAIN,
                interleaved=interleaved,
                num_heads=heads,
                rotary_embedding_dim=rotary,
            )
        partial = {"rotary_embedding_dim": rotary} if rotary != c.head_width else {}
        return self.node(
            "RotaryEmbedding", [value, cos, sin, positions], interleaved=interleaved, num_heads=heads, **partial
        )

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

    # ---- values shared by every layer, built once from the first layer's input ----------------------------
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

    def _scalar(self, value, dtype, hint: str) -> str:
        key = ("scalar", np.dtype(dtype).name, value)
        if key not in self.shared:
            self.shared[key] = self.const(np.array(value, dtype), hint)
        return self.shared[key]

    def _positions(self, x: str) -> str:
        if "positions" not in self.shared:
            if "position_ids" in self.graph_inputs:
                self.shared["positions"] = "position_ids"
            else:  # the stages graph: every row at positions 0..T-1
                batch, seq, _, _ = self._shape_scalars(x)
                zero, one = self._scalar(0, np.int64, "zero"), self._scalar(1, np.int64, "one")
                steps = self.node("Range", [zero, self.node("Squeeze", [seq]), one])
                shape = self.node("Concat", [batch, seq], axis=0)
                self.shared["positions"] = self.node("Expand", [self.node("Unsqueeze", [steps, self.ints([0])]), shape])
        return self.shared["positions"]

    def _rope_caches(self, layer: dict):
        """(cos, sin) caches [max_positions, rotary_dim / 2] for a layer's RoPE base and scaling."""
        c = self.config
        rotary = getattr(c, "rotary_dim", None) or c.head_width
        scaling = layer["rope_scaling"]
        key = ("rope", layer["rope_base"], json.dumps(scaling, sort_keys=True))
        if key not in self.shared:
            # angle[p, i] = p * inv_freq[i] (models/rope.py: the scaling type's frequencies), in float64 like the
            # oracle, stored as float32; YaRN's attention factor multiplies cos and sin.
            inv_freq = rope_inverse_frequencies(rotary, layer["rope_base"], scaling).numpy()
            angles = np.arange(c.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
            factor = rope_attention_factor(scaling)
            self.shared[key] = (
                self.const((np.cos(angles) * factor).astype(np.float32), "cos_cache"),
                self.const((np.sin(angles) * factor).astype(np.float32), "sin_cache"),
            )
        return self.shared[key]

    def _key_ok(self, x: str) -> str:
        """(B, T_past + T) bool: which keys hold real tokens (past_mask, then the new tokens)."""
        if "key_ok" not in self.shared:
            batch, seq, _, _ = self._shape_scalars(x)
            new = self.node("Expand", [self._scalar(True, np.bool_, "true"), self.node("Concat", [batch, seq], axis=0)])
            past = self.node("Cast", ["past_mask"], to=TensorProto.BOOL)
            self.shared["key_ok"] = self.node("Concat", [past, new], axis=1)
        return self.shared["key_ok"]

    def _slot_positions(self, x: str):
        """(query slots (T,) = T_past + [0, T), key slots (T_past + T,) = [0, T_past + T))."""
        if "slots" not in self.shared:
            _, seq, past, total = self._shape_scalars(x)
            zero, one = self._scalar(0, np.int64, "zero"), self._scalar(1, np.int64, "one")
            keys = self.node("Range", [zero, self.node("Squeeze", [total]), one])
            queries = self.node("Add", [self.node("Range", [zero, self.node("Squeeze", [seq]), one]), past])
            self.shared["slots"] = (queries, keys)
        return self.shared["slots"]

    def _attention_mask(self, x: str, window: int | None = None) -> str:
        """True where a query may attend: causal, not a padding slot, within the window. (B, 1, T, T_past + T)
        with past_mask, (T, T) without."""
        key = ("mask", window)
        if key not in self.shared:
            queries, keys = self._slot_positions(x)
            mask = self.node(
                "LessOrEqual",
                [self.node("Unsqueeze", [keys, self.ints([0])]), self.node("Unsqueeze", [queries, self.ints([1])])],
            )  # (T, T_total)
            if window is not None:
                mask = self.node("And", [mask, self._in_window(x, window)])
            if "past_mask" in self.graph_inputs:
                keys_ok = self.node("Unsqueeze", [self._key_ok(x), self.ints([1, 2])])  # (B, 1, 1, T_total)
                mask = self.node("And", [keys_ok, mask])
            self.shared[key] = mask
        return self.shared[key]

    def _in_window(self, x: str, window: int) -> str:
        """Keys at most window - 1 positions before the query, positions counting the keys past_mask keeps
        (as models/ops.attention): (B, 1, T, T_past + T) with past_mask, (T, T) without."""
        limit = self._scalar(int(window), np.int64, "window")
        if "past_mask" not in self.graph_inputs:
            queries, keys = self._slot_positions(x)
            distance = self.node(
                "Sub",
                [self.node("Unsqueeze", [queries, self.ints([1])]), self.node("Unsqueeze", [keys, self.ints([0])])],
            )  # (T, T_total)
            return self.node("Less", [distance, limit])
        _, _, past, total = self._shape_scalars(x)
        if "kept_positions" not in self.shared:
            # 1 + the position of each kept key; a query's own is among the last T
            counted = self.node(
                "CumSum",
                [self.node("Cast", [self._key_ok(x)], to=TensorProto.INT64), self._scalar(1, np.int64, "one")],
            )  # (B, T_total)
            self.shared["kept_positions"] = counted
        counted = self.shared["kept_positions"]
        queries = self.node("Slice", [counted, past, total, self.ints([1])])  # (B, T)
        distance = self.node(
            "Sub",
            [self.node("Unsqueeze", [queries, self.ints([2])]), self.node("Unsqueeze", [counted, self.ints([1])])],
        )  # (B, T, T_total)
        return self.node("Unsqueeze", [self.node("Less", [distance, limit]), self.ints([1])])

    def _key_padding_bias(self, x: str) -> str:
        """(B, 1, T, T_past + T) float: 0 for real keys, -inf for padding slots (GQA adds its own causal mask)."""
        if "bias" not in self.shared:
            batch, seq, _, total = self._shape_scalars(x)
            keys = self.node("Unsqueeze", [self._key_ok(x), self.ints([1, 2])])  # (B, 1, 1, T_total)
            bias = self.node(
                "Where",
                [keys, self._scalar(0, np.float32, "zero_f"), self._scalar(-np.inf, np.float32, "minus_inf")],
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

    def _gqa_lengths(self, x: str):
        """seqlens_k (B,) int32 = T_past + T - 1 for every row (padding slots count, the bias hides them) and
        total_sequence_length, a scalar int32 T_past + T."""
        if "gqa" not in self.shared:
            batch, _, _, total = self._shape_scalars(x)
            total32 = self.node("Cast", [total], to=TensorProto.INT32)  # (1,)
            last = self.node("Sub", [total32, self.const(np.array([1], np.int32), "one_i32")])
            seqlens = self.node("Expand", [last, batch])
            self.shared["gqa"] = (seqlens, self.node("Squeeze", [total32]))
        return self.shared["gqa"]
