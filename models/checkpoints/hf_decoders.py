"""Hugging Face decoders shaped like Llama, as switches of the llama family (models/llama_config.py).

    llama      Llama 1-3.x: RoPE scaling (linear, llama3, yarn), head_dim, attention_bias
    mistral    a sliding window on every layer
    qwen2      q/k/v biases; sliding layers from layer_types (or use_sliding_window + max_window_layers)
    qwen3      per-head q/k RMSNorm, attention_bias, head_dim
    gemma2     GeGLU, (1 + w) norms, embeddings scaled by sqrt(width), sandwich norms, alternating sliding
               layers, soft-capped scores and logits, query_pre_attn_scalar
    gemma3_text  Gemma 2 without soft-capping, with per-head q/k norms and a local RoPE base on sliding layers
    olmo2      norms after each branch only, q/k RMSNorm over all heads
    granite    embedding, attention, residual and logits multipliers
    phi3       fused qkv_proj and gate_up_proj, partial rotary, a sliding window
    smollm3    layers without RoPE (no_rope_layers)

The math follows transformers' modeling_*.py. Every config key is implemented, inert or refused
(config_keys.KeyPolicy).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from artifact.errors import ConfigError, ModelFileError
from models.checkpoints.config_keys import KeyPolicy, Only, is_int, is_number, refusal
from models.checkpoints.loading import take_tensor
from models.llama import LlamaConfig
from models.rope import ROPE_TYPES

# model_type -> the class transformers builds from it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
}
GEMMA = ("gemma2", "gemma3_text")
# RoPE types transformers computes from the sequence length at run time: refused by name.
# Keys each type reads beyond the common ones (hidden sizes, heads, eps, RoPE, tie, head_dim).
TYPE_KEYS = {
    "llama": {"attention_bias"},
    "mistral": {"sliding_window"},
    "qwen2": {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"},
    "qwen3": {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "attention_bias"},
    "gemma2": {
        "sliding_window",
        "layer_types",
        "attention_bias",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "hidden_activation",
    },
    "olmo2": {"attention_bias"},
    "granite": {
        "attention_bias",
        "embedding_multiplier",
        "attention_multiplier",
        "residual_multiplier",
        "logits_scaling",
    },
    "phi3": {"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"},
    "smollm3": {"attention_bias", "sliding_window", "use_sliding_window", "layer_types", "no_rope_layers"},
    "gpt_neox": {
        "attention_bias",
        "use_parallel_residual",
        "layer_norm_eps",
        "hidden_act",
        "partial_rotary_factor",
        "rotary_pct",
        "rotary_emb_base",
    },
}
# Gemma 3 keeps Gemma 2's final soft cap as an option (null by default) that transformers applies when set; its
# attention cap transformers' Gemma 3 does not apply, so a value there is refused (null only).
TYPE_KEYS["gemma3_text"] = (TYPE_KEYS["gemma2"] | {"_sliding_window_pattern", "sliding_window_pattern"}) - {
    "attn_logit_softcapping"
}
# Inert per type: dropout (the identity at inference), keys that only derive others already read.
TYPE_INERT = {
    "phi3": {"resid_pdrop", "embd_pdrop"},
    # Only used to fill no_rope_layers when the file does not list them; the list is read.
    "smollm3": {"no_rope_layer_interval"},
    # Gemma 3: bidirectional attention is an option of its image model; the text model checks it is off below.
    "gemma3_text": {"use_bidirectional_attention"},
    "gemma2": {"use_bidirectional_attention"},
    # Dropout; and num_key_value_heads, which GPTNeoXAttention does not read (every head has its own K/V).
    "gpt_neox": {"hidden_dropout", "classifier_dropout", "num_key_value_heads"},
}
# GPT-NeoX's activations: exact GELU, or the tanh approximation under its several names.
NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _no_window(value, raw, ours) -> bool:
    """A window at least as long as the context never masks anything; use_sliding_window=false turns it off."""
    return value is None or (is_int(value) and value >= ours.max_positions) or raw.get("use_sliding_window") is False


def decoder_key_policy(model_type: str, inert: frozenset, common_only: dict) -> KeyPolicy:
    """The keys of a `model_type` config.json; `inert` and `common_only` are PretrainedConfig's own."""
    implemented = {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "tie_word_embeddings",
        "head_dim",
        *TYPE_KEYS[model_type],
    }
    only = {
        "hidden_act": Only(lambda v, raw, ours: v == "silu", '"silu"'),
        "partial_rotary_factor": Only(
            lambda v, raw, ours: v is None or v == 1.0, "null or 1.0 (RoPE on every dimension)"
        ),
        "attn_logit_softcapping": Only(lambda v, raw, ours: v is None, "null (no soft-capping)"),
        "final_logit_softcapping": Only(lambda v, raw, ours: v is None, "null (no soft-capping)"),
        "mlp_bias": Only(lambda v, raw, ours: v is None or v is False, "false (no biases in the MLP)"),
        **common_only,
    }
    if model_type in GEMMA:
        only["hidden_act"] = Only(lambda v, raw, ours: v in (None, "gelu_pytorch_tanh"), 'null or "gelu_pytorch_tanh"')
        only["use_bidirectional_attention"] = Only(lambda v, raw, ours: not v, "false or null (causal attention)")
    if model_type == "llama":
        # LlamaForCausalLM has no window: a config that gives one was written for another architecture.
        only["sliding_window"] = Only(
            _no_window, lambda raw, ours: f"null or >= max_position_embeddings = {ours.max_positions} (no window)"
        )
        only["use_sliding_window"] = Only(
            lambda v, raw, ours: v is False or _no_window(raw.get("sliding_window"), {}, ours),
            lambda raw, ours: f"false, or a sliding_window >= max_position_embeddings = {ours.max_positions}",
        )
    # Slices each projection into pretraining_tp pieces and sums them: the same function.
    extra_inert = {"pretraining_tp", *TYPE_INERT.get(model_type, ())}
    implemented -= TYPE_INERT.get(model_type, set())
    for key in implemented:
        only.pop(key, None)
    return KeyPolicy(model_type, frozenset(implemented), only, (inert | extra_inert) - frozenset(only))


def _rope_dict(value: dict, hf: dict, where: Path, model_type: str) -> tuple[float, dict | None, float | None]:
    """(rope_theta, our rope_scaling, partial_rotary_factor) of one RoPE parameter dict."""
    merged = dict(value)
    theta = merged.pop("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    if not is_number(theta) or theta <= 0:
        raise refusal(where, "rope_theta", theta, model_type, "a positive number")
    kind = merged.pop("rope_type", None) or merged.pop("type", "default")
    merged.pop("type", None)
    partial = merged.pop("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct")))
    if kind not in ROPE_TYPES or kind == "factors":
        raise refusal(where, "rope_type", kind, model_type, "default, linear, llama3, yarn, longrope, dynamic")
    if kind == "default":
        if merged:
            key = sorted(merged)[0]
            raise refusal(
                where, f"rope_parameters.{key}", merged[key], model_type, 'nothing else with rope_type "default"'
            )
        return float(theta), None, partial
    if kind == "longrope" and merged.get("factor") is None:
        # transformers: a missing factor is the context's growth over the original (Phi-3's convention).
        original = merged.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        if is_number(original) and original > 0 and is_number(hf.get("max_position_embeddings")):
            merged["factor"] = hf["max_position_embeddings"] / original
    if kind in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in merged:
        # transformers' standardize_rope_params: the top-level key (Phi-3 style), else the context.
        merged["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings")
        )
    return float(theta), {"rope_type": kind, **merged}, partial


def _rope(hf: dict, where: Path, model_type: str) -> dict:
    """Our RoPE fields from transformers 5's rope_parameters (flat, or per layer type for Gemma 3) or 4's
    rope_scaling + rope_theta. A legacy rope_scaling replaces rope_parameters whole, as transformers 5 does."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise refusal(where, key, value, model_type, "an object with rope_type and its parameters")
    chosen = dict(legacy or params or {})
    nested = {k: v for k, v in chosen.items() if isinstance(v, dict)}
    local = None
    if nested:
        if (
            model_type != "gemma3_text"
            or set(nested) != {"full_attention", "sliding_attention"}
            or len(nested) != len(chosen)
        ):
            raise refusal(where, "rope_parameters", chosen, model_type, "one RoPE for every layer")
        theta, scaling, partial = _rope_dict(chosen["full_attention"], hf, where, model_type)
        local, local_scaling, _ = _rope_dict(chosen["sliding_attention"], {}, where, model_type)
        if local_scaling is not None:
            raise refusal(
                where, "rope_parameters.sliding_attention", chosen["sliding_attention"], model_type, "unscaled"
            )
    else:
        theta, scaling, partial = _rope_dict(chosen, hf, where, model_type)
        if model_type == "gemma3_text" and hf.get("rope_local_base_freq") is not None:
            local = hf["rope_local_base_freq"]
    rotary = None
    if partial not in (None, 1, 1.0):
        if model_type not in ("phi3", "gpt_neox") or not is_number(partial) or not 0 < partial < 1:
            raise refusal(where, "partial_rotary_factor", partial, model_type, "null or 1.0 (RoPE on every dimension)")
        head = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = int(head * partial)  # transformers: int(head_dim * partial_rotary_factor)
    return {"rope_base": theta, "rope_scaling": scaling, "local_rope_base": local, "rotary_dim": rotary}


def _layer_types(hf: dict, where: Path, model_type: str, layers) -> tuple[list | None, int | None]:
    """(layer_types or None when every layer is alike, sliding_window)."""
    window = hf.get("sliding_window")
    if model_type in ("mistral", "phi3"):
        return None, window  # every layer
    if model_type in ("llama", "olmo2", "granite", "gpt_neox"):
        return None, None  # only a window the key policy accepts (no window at all) gets here
    types = hf.get("layer_types")
    if types is None:  # transformers 4 files: derived as the config classes derive them
        if model_type in ("qwen2", "qwen3", "smollm3"):
            use = hf.get("use_sliding_window", False) is True and window is not None
            first = hf.get("max_window_layers", 28) if model_type != "smollm3" else 0
            if not is_int(first) or not is_int(layers):
                raise refusal(where, "max_window_layers", first, model_type, "an integer")
            types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(layers)]
        else:  # gemma2: alternating from layer 0; gemma3: every pattern-th layer full
            pattern = hf.get(
                "sliding_window_pattern", hf.get("_sliding_window_pattern", 2 if model_type == "gemma2" else 6)
            )
            if not is_int(pattern) or pattern < 1 or not is_int(layers):
                raise refusal(where, "sliding_window_pattern", pattern, model_type, "a positive integer")
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or not is_int(layers) or len(types) != layers:
        raise refusal(where, "layer_types", types, model_type, f"a list of num_hidden_layers = {layers} layer types")
    if not set(types) <= {"full_attention", "sliding_attention"}:
        raise refusal(where, "layer_types", types, model_type, '"full_attention" and "sliding_attention"')
    if "sliding_attention" not in types:
        return None, None
    if window is None:
        raise refusal(where, "sliding_window", window, model_type, "a window for the sliding_attention layers")
    if set(types) == {"sliding_attention"}:
        return None, window  # every layer alike: the window applies to all
    return types, window


def _bias(hf: dict, where: Path, model_type: str) -> str:
    if model_type == "qwen2":
        return "qkv"  # Qwen2Attention: q/k/v projections with bias, o_proj without
    if model_type in ("mistral", "phi3"):
        return "none"
    value = hf.get("attention_bias", model_type == "gpt_neox")
    if not isinstance(value, bool):
        raise refusal(where, "attention_bias", value, model_type, "true or false")
    return "all" if value else "none"


def _number(hf: dict, key: str, where: Path, model_type: str, default=None):
    value = hf.get(key, default)
    if value is not None and (not is_number(value) or value <= 0):
        raise refusal(where, key, value, model_type, "a positive number")
    return None if value is None else float(value)


def _type_switches(hf: dict, where: Path, model_type: str, width) -> dict:
    """The switches a model type always has, and those its multipliers and caps set."""
    if model_type in GEMMA:
        scalar = _number(hf, "query_pre_attn_scalar", where, model_type, 256)
        return {
            "norm_placement": "sandwich",
            "ffn_activation": "gelu_tanh",
            # transformers multiplies by sqrt(width) rounded to float32, so the float64 model does too.
            "embedding_scale": float(np.float32(width**0.5)),
            "attention_scale": scalar**-0.5,
            "attention_softcap": _number(hf, "attn_logit_softcapping", where, model_type),
            "final_softcap": _number(hf, "final_logit_softcapping", where, model_type),
            "qk_norm": "head" if model_type == "gemma3_text" else "none",
        }
    if model_type == "olmo2":
        return {"norm_placement": "branch_post", "qk_norm": "full"}
    if model_type == "qwen3":
        return {"qk_norm": "head"}
    if model_type == "granite":
        return {
            "embedding_scale": _number(hf, "embedding_multiplier", where, model_type, 1.0),
            "attention_scale": _number(hf, "attention_multiplier", where, model_type, 1.0),
            "residual_scale": _number(hf, "residual_multiplier", where, model_type, 1.0),
            "logits_scale": _number(hf, "logits_scaling", where, model_type, 1.0),
        }
    if model_type == "gpt_neox":
        act = hf.get("hidden_act", "gelu")
        if act not in NEOX_ACTIVATIONS:
            raise refusal(where, "hidden_act", act, model_type, ", ".join(NEOX_ACTIVATIONS))
        parallel = hf.get("use_parallel_residual", True)
        if not isinstance(parallel, bool):
            raise refusal(where, "use_parallel_residual", parallel, model_type, "true or false")
        return {
            "norm": "layernorm",
            "eps": _number(hf, "layer_norm_eps", where, model_type, 1e-5),
            "ffn_gated": False,
            "ffn_activation": NEOX_ACTIVATIONS[act],
            "norm_placement": "parallel" if parallel else "pre",
        }
    if model_type == "smollm3":
        flags = hf.get("no_rope_layers")
        if flags is not None and (not isinstance(flags, list) or not all(f in (0, 1) for f in flags)):
            raise refusal(where, "no_rope_layers", flags, model_type, "a list of 0/1 flags, one per layer")
        return {"no_rope_layers": None if flags is None or all(flags) else list(flags)}
    return {}


def decoder_config(hf: dict, where: Path, model_type: str, tie) -> LlamaConfig:
    for key in ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        if hf.get(key) is None:
            raise ModelFileError(f"{where}: missing {key!r}")
    rope = _rope(hf, where, model_type)
    layers = hf["num_hidden_layers"]
    types, window = _layer_types(hf, where, model_type, layers)
    max_positions = hf.get("max_position_embeddings") or 2048
    if types is None and window is not None and is_int(window) and is_int(max_positions) and window >= max_positions:
        window = None  # never masks anything within the context
    eps = hf.get("rms_norm_eps") or 1e-6
    if not is_number(eps):
        raise refusal(where, "rms_norm_eps", eps, model_type, "a number")
    heads = hf["num_attention_heads"]
    switches = _type_switches(hf, where, model_type, hf["hidden_size"])
    eps = switches.pop("eps", eps)
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            layers=layers,
            width=hf["hidden_size"],
            heads=heads,
            # GPTNeoXAttention has one K/V head per query head, whatever the file says.
            kv_heads=heads if model_type == "gpt_neox" else hf.get("num_key_value_heads") or heads,
            ff_width=hf["intermediate_size"],
            max_positions=max_positions,
            eps=float(eps),
            tie_embeddings=tie,
            rope_pairing="half",  # Hugging Face rotates (i, i + head_width/2)
            head_dim=hf.get("head_dim"),
            attention_bias=_bias(hf, where, model_type),
            sliding_window=window,
            layer_types=types,
            **rope,
            **switches,
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def _split(tensors: dict, name: str, shape: tuple, parts: dict, where) -> None:
    """Phi-3's fused projections: rows of `name` split into `parts` ({new name: rows}), in order."""
    fused = take_tensor(tensors, name, shape, where)
    start = 0
    for part, rows in parts.items():
        tensors[part] = fused[start : start + rows]
        start += rows


def neox_names(c: LlamaConfig, tensors: dict, where) -> dict:
    """GPT-NeoX's names: query_key_value holds [q, k, v] per head, every linear and norm has a bias."""
    d, f, hd = c.width, c.ff_width, c.head_width
    state = {"embed_tokens.weight": take_tensor(tensors, "gpt_neox.embed_in.weight", (c.vocab_size, d), where)}
    for i in range(c.layers):
        g, ours = f"gpt_neox.layers.{i}.", f"block.{i}."
        for buffer in ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"):
            tensors.pop(g + buffer, None)  # causal-mask and RoPE buffers older checkpoints saved
        qkv = take_tensor(tensors, g + "attention.query_key_value.weight", (3 * d, d), where).view(c.heads, 3, hd, d)
        bias = take_tensor(tensors, g + "attention.query_key_value.bias", (3 * d,), where).view(c.heads, 3, hd)
        for k, p in enumerate("qkv"):
            state[f"{ours}attention.{p}_proj.weight"] = qkv[:, k].reshape(d, d).clone()
            state[f"{ours}attention.{p}_proj.bias"] = bias[:, k].reshape(d).clone()
        for src, dst, shape in (
            ("attention.dense", "attention.o_proj", (d, d)),
            ("mlp.dense_h_to_4h", "feed_forward.up_proj", (f, d)),
            ("mlp.dense_4h_to_h", "feed_forward.down_proj", (d, f)),
            ("input_layernorm", "attention_norm", (d,)),
            ("post_attention_layernorm", "feed_forward_norm", (d,)),
        ):
            state[f"{ours}{dst}.weight"] = take_tensor(tensors, f"{g}{src}.weight", shape, where)
            state[f"{ours}{dst}.bias"] = take_tensor(tensors, f"{g}{src}.bias", shape[:1], where)
    for kind in ("weight", "bias"):
        state[f"final_norm.{kind}"] = take_tensor(tensors, f"gpt_neox.final_layer_norm.{kind}", (d,), where)
    if "embed_out.weight" in tensors:
        tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    return state


def decoder_names(c: LlamaConfig, tensors: dict, where, model_type: str = "llama") -> dict:
    """transformers' tensor names (model.layers.{i}.self_attn.q_proj ...) to ours, shapes from the config."""
    if model_type == "gpt_neox":
        return neox_names(c, tensors, where)
    d, f, hd = c.width, c.ff_width, c.head_width
    q, kv = c.heads * hd, c.kv_heads * hd
    state = {"embed_tokens.weight": take_tensor(tensors, "model.embed_tokens.weight", (c.vocab_size, d), where)}
    norm_names = {
        "pre": ("input_layernorm", None, "post_attention_layernorm", None),
        "sandwich": (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
        "branch_post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    }[c.norm_placement]
    for i in range(c.layers):
        hf, ours = f"model.layers.{i}.", f"block.{i}."
        if model_type == "phi3":
            a = "self_attn."
            _split(
                tensors,
                f"{hf}{a}qkv_proj.weight",
                (q + 2 * kv, d),
                {f"{hf}{a}{p}_proj.weight": w for p, w in zip("qkv", (q, kv, kv), strict=True)},
                where,
            )
            _split(
                tensors,
                f"{hf}mlp.gate_up_proj.weight",
                (2 * f, d),
                {f"{hf}mlp.gate_proj.weight": f, f"{hf}mlp.up_proj.weight": f},
                where,
            )
        names = [
            ("self_attn.q_proj.weight", "attention.q_proj.weight", (q, d)),
            ("self_attn.k_proj.weight", "attention.k_proj.weight", (kv, d)),
            ("self_attn.v_proj.weight", "attention.v_proj.weight", (kv, d)),
            ("self_attn.o_proj.weight", "attention.o_proj.weight", (d, q)),
            ("mlp.gate_proj.weight", "feed_forward.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", "feed_forward.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", "feed_forward.down_proj.weight", (d, f)),
        ]
        for theirs, mine in zip(
            norm_names,
            ("attention_norm", "attention_post_norm", "feed_forward_norm", "feed_forward_post_norm"),
            strict=True,
        ):
            if theirs is not None:
                names.append((f"{theirs}.weight", f"{mine}.weight", (d,)))
        if c.attention_bias != "none":
            names += [
                (f"self_attn.{p}_proj.bias", f"attention.{p}_proj.bias", (w,))
                for p, w in zip("qkv", (q, kv, kv), strict=True)
            ]
        if c.attention_bias == "all":
            names.append(("self_attn.o_proj.bias", "attention.o_proj.bias", (d,)))
        if c.qk_norm != "none":
            full = c.qk_norm == "full"
            names += [("self_attn.q_norm.weight", "attention.q_norm.weight", (q if full else hd,))]
            names += [("self_attn.k_norm.weight", "attention.k_norm.weight", (kv if full else hd,))]
        for src, dst, shape in names:
            state[ours + dst] = take_tensor(tensors, hf + src, shape, where)
    state["final_norm.weight"] = take_tensor(tensors, "model.norm.weight", (d,), where)
    if model_type in GEMMA:
        # Gemma's RMSNorm multiplies by (1 + weight), computed in float32: stored here as that sum.
        for name, tensor in state.items():
            if name.endswith("norm.weight"):
                # float32 even when the import keeps bfloat16. A header's meta tensor only carries the shape, and
                # arithmetic on it would load torch's meta kernels, which nothing else at that point needs.
                widened = tensor.to(torch.float32)
                state[name] = widened if widened.is_meta else 1.0 + widened
    return state
