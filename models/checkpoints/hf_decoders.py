"""Hugging Face decoders shaped like Llama: llama (Llama 1-3.x), mistral, qwen2 (Qwen2/2.5), qwen3.

Each is the llama family with switches (models/llama.py): explicit head_dim, RoPE scaling (linear, llama3,
yarn; models/rope.py), attention biases (Qwen2's on q/k/v, Llama's and Qwen3's attention_bias on all four),
Qwen3's per-head q/k RMSNorm, and a sliding window on every layer (Mistral; Qwen2/3 when every layer type is
sliding). The math follows transformers' modeling_{llama,mistral,qwen2,qwen3}.py. Every config key is
implemented, inert or refused (config_keys.KeyPolicy); layer types that differ between layers are refused.
"""

from __future__ import annotations

from pathlib import Path

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
}
# RoPE types transformers computes from the sequence length at run time: refused by name.
DYNAMIC_ROPE = {"dynamic": "dynamic NTK", "longrope": "LongRoPE's short/long factors"}


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
    # Slices each projection into pretraining_tp pieces and sums them: the same function.
    extra_inert = {"pretraining_tp"}
    if model_type == "llama":
        implemented.add("attention_bias")
        # LlamaForCausalLM has no window: a config that gives one was written for another architecture.
        only["sliding_window"] = Only(
            _no_window, lambda raw, ours: f"null or >= max_position_embeddings = {ours.max_positions} (no window)"
        )
        only["use_sliding_window"] = Only(
            lambda v, raw, ours: v is False or _no_window(raw.get("sliding_window"), {}, ours),
            lambda raw, ours: f"false, or a sliding_window >= max_position_embeddings = {ours.max_positions}",
        )
    elif model_type == "mistral":
        implemented.add("sliding_window")
    else:  # qwen2, qwen3
        implemented |= {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
        if model_type == "qwen3":
            implemented.add("attention_bias")
    return KeyPolicy(model_type, frozenset(implemented), only, inert | extra_inert)


def _rope(hf: dict, where: Path, model_type: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 5's rope_parameters or 4's rope_scaling + rope_theta."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise refusal(where, key, value, model_type, "an object with rope_type and its parameters")
    # transformers 5 (convert_rope_params_to_dict): a legacy rope_scaling replaces rope_parameters whole, and
    # rope_theta and partial_rotary_factor come from the top level where the dict does not give them.
    merged = dict(legacy or params or {})
    if any(isinstance(v, dict) for v in merged.values()):
        raise refusal(where, "rope_parameters", merged, model_type, "one RoPE for every layer (not per layer type)")
    theta = merged.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if not is_number(theta) or theta <= 0:
        raise refusal(where, "rope_theta", theta, model_type, "a positive number")
    kind = merged.pop("rope_type", None) or merged.pop("type", "default")
    merged.pop("type", None)
    partial = merged.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refusal(where, "partial_rotary_factor", partial, model_type, "null or 1.0 (RoPE on every dimension)")
    if kind in DYNAMIC_ROPE or kind not in ROPE_TYPES:
        why = f" ({DYNAMIC_ROPE[kind]} change with the sequence length at run time)" if kind in DYNAMIC_ROPE else ""
        raise refusal(where, "rope_type", kind, model_type, f"{', '.join(ROPE_TYPES)}{why}")
    if kind == "default":
        if merged:
            key = sorted(merged)[0]
            raise refusal(
                where, f"rope_parameters.{key}", merged[key], model_type, 'nothing else with rope_type "default"'
            )
        return float(theta), None
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in merged:
        # transformers' standardize_rope_params: the top-level key (Phi-3 style), else the context.
        merged["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings")
        )
    return float(theta), {"rope_type": kind, **merged}


def _window(hf: dict, where: Path, model_type: str, layers) -> int | None:
    """The sliding window every layer uses, or None; per-layer windows are refused."""
    window = hf.get("sliding_window")
    if model_type == "mistral":
        return window
    if model_type == "llama":
        return None  # only a window the key policy accepts (no window at all) gets here
    types = hf.get("layer_types")
    if types is None:  # transformers 4 files: derived as Qwen2Config derives it
        use = hf.get("use_sliding_window", False) is True and window is not None
        first = hf.get("max_window_layers", 28)
        if not is_int(first) or not is_int(layers):
            raise refusal(where, "max_window_layers", first, model_type, "an integer")
        types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or not is_int(layers) or len(types) != layers:
        raise refusal(where, "layer_types", types, model_type, f"a list of num_hidden_layers = {layers} layer types")
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise refusal(where, "layer_types", types, model_type, '"full_attention" and "sliding_attention"')
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1:
        raise refusal(
            where, "layer_types", types, model_type, "the same type on every layer (per-layer windows are not built)"
        )
    if window is None:
        raise refusal(where, "sliding_window", window, model_type, "a window for the sliding_attention layers")
    return window


def _bias(hf: dict, where: Path, model_type: str) -> str:
    if model_type == "qwen2":
        return "qkv"  # Qwen2Attention: q/k/v projections with bias, o_proj without
    if model_type == "mistral":
        return "none"
    value = hf.get("attention_bias", False)
    if not isinstance(value, bool):
        raise refusal(where, "attention_bias", value, model_type, "true or false")
    return "all" if value else "none"


def decoder_config(hf: dict, where: Path, model_type: str, tie) -> LlamaConfig:
    theta, scaling = _rope(hf, where, model_type)
    heads, layers = hf.get("num_attention_heads"), hf.get("num_hidden_layers")
    for key in ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        if hf.get(key) is None:
            raise ModelFileError(f"{where}: missing {key!r}")
    window = _window(hf, where, model_type, layers)
    max_positions = hf.get("max_position_embeddings") or 2048
    if window is not None and is_int(window) and is_int(max_positions) and window >= max_positions:
        window = None  # never masks anything within the context
    eps = hf.get("rms_norm_eps") or 1e-6
    if not is_number(eps):
        raise refusal(where, "rms_norm_eps", eps, model_type, "a number")
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            layers=layers,
            width=hf["hidden_size"],
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
            ff_width=hf["intermediate_size"],
            max_positions=max_positions,
            rope_base=theta,
            eps=float(eps),
            tie_embeddings=tie,
            rope_pairing="half",  # Hugging Face rotates (i, i + head_width/2)
            head_dim=hf.get("head_dim"),
            rope_scaling=scaling,
            attention_bias=_bias(hf, where, model_type),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def decoder_names(c: LlamaConfig, tensors: dict, where) -> dict:
    """transformers' tensor names (model.layers.{i}.self_attn.q_proj ...) to ours, shapes from the config."""
    d, f, hd = c.width, c.ff_width, c.head_width
    q, kv = c.heads * hd, c.kv_heads * hd
    state = {"embed_tokens.weight": take_tensor(tensors, "model.embed_tokens.weight", (c.vocab_size, d), where)}
    for i in range(c.layers):
        hf, ours = f"model.layers.{i}.", f"block.{i}."
        names = [
            ("input_layernorm.weight", "attention_norm.weight", (d,)),
            ("self_attn.q_proj.weight", "attention.q_proj.weight", (q, d)),
            ("self_attn.k_proj.weight", "attention.k_proj.weight", (kv, d)),
            ("self_attn.v_proj.weight", "attention.v_proj.weight", (kv, d)),
            ("self_attn.o_proj.weight", "attention.o_proj.weight", (d, q)),
            ("post_attention_layernorm.weight", "feed_forward_norm.weight", (d,)),
            ("mlp.gate_proj.weight", "feed_forward.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", "feed_forward.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", "feed_forward.down_proj.weight", (d, f)),
        ]
        if c.attention_bias != "none":
            names += [
                (f"self_attn.{p}_proj.bias", f"attention.{p}_proj.bias", (w,))
                for p, w in zip("qkv", (q, kv, kv), strict=True)
            ]
        if c.attention_bias == "all":
            names.append(("self_attn.o_proj.bias", "attention.o_proj.bias", (d,)))
        if c.qk_norm:
            names += [("self_attn.q_norm.weight", "attention.q_norm.weight", (hd,))]
            names += [("self_attn.k_norm.weight", "attention.k_norm.weight", (hd,))]
        for src, dst, shape in names:
            state[ours + dst] = take_tensor(tensors, hf + src, shape, where)
    state["final_norm.weight"] = take_tensor(tensors, "model.norm.weight", (d,), where)
    return state
