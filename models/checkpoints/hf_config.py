"""config.json, typed: every field the Hugging Face imports read, with its type and range, checked before any of
them is used (a string where a number belongs, zero heads, a list for a scalar: refused by the field's name).

Which keys an architecture implements, ignores or refuses is config_keys.KeyPolicy's; this is only what each
value may be. Sizes have the upper bounds of models.presets_limits, stated in the error.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError

from artifact.errors import ModelFileError
from artifact.jsonfile import read_json
from artifact.typed import Strict, field_name
from models.checkpoints.config_keys import refusal
from models.presets_limits import MAX_SIZES

MAX_CONFIG_BYTES = 1 << 24  # configs are kilobytes; a few carry long id2label maps


def _size(bound: int, minimum: int = 1):
    return Annotated[int, Field(ge=minimum, le=bound)]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("a finite number is required")
    return value


Finite = Annotated[float, AfterValidator(_finite)]
Positive = Annotated[float, Field(gt=0), AfterValidator(_finite)]
NonNegative = Annotated[float, Field(ge=0), AfterValidator(_finite)]
Fraction = Annotated[float, Field(gt=0, le=1)]

Vocabulary = _size(MAX_SIZES["vocab_size"])
Layers = _size(MAX_SIZES["layers"])
Width = _size(MAX_SIZES["width"])
Heads = _size(MAX_SIZES["heads"])
FeedForward = _size(MAX_SIZES["ff_width"])
Positions = _size(MAX_SIZES["max_positions"])
HeadDim = _size(MAX_SIZES["head_dim"])


class HFConfig(Strict):
    """The fields of config.json the imports read (llama-like decoders and GPT-2); null where a field is absent."""

    model_type: str | None = None
    # Llama-like decoders.
    vocab_size: Vocabulary | None = None
    hidden_size: Width | None = None
    intermediate_size: FeedForward | None = None
    num_hidden_layers: Layers | None = None
    num_attention_heads: Heads | None = None
    num_key_value_heads: Heads | None = None
    max_position_embeddings: Positions | None = None
    original_max_position_embeddings: Positions | None = None
    head_dim: HeadDim | None = None
    rms_norm_eps: NonNegative | None = None
    layer_norm_eps: NonNegative | None = None
    rope_theta: Positive | None = None
    rotary_emb_base: Positive | None = None
    rope_local_base_freq: Positive | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: Fraction | None = None
    rotary_pct: Fraction | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    hidden_act: str | None = None
    hidden_activation: str | None = None
    sliding_window: _size(MAX_SIZES["sliding_window"]) | None = None
    use_sliding_window: bool | None = None
    max_window_layers: _size(MAX_SIZES["layers"], minimum=0) | None = None
    layer_types: list[str] | None = None
    no_rope_layers: list[int] | None = None
    sliding_window_pattern: _size(MAX_SIZES["layers"]) | None = None
    use_parallel_residual: bool | None = None
    query_pre_attn_scalar: Positive | None = None
    attn_logit_softcapping: Positive | None = None
    final_logit_softcapping: Positive | None = None
    embedding_multiplier: Positive | None = None
    attention_multiplier: Positive | None = None
    residual_multiplier: Positive | None = None
    logits_scaling: Positive | None = None
    # GPT-2.
    n_embd: Width | None = None
    n_head: Heads | None = None
    n_inner: FeedForward | None = None
    n_positions: Positions | None = None
    n_ctx: Positions | None = None
    n_layer: Layers | None = None
    layer_norm_epsilon: NonNegative | None = None
    activation_function: str | None = None


# How a refusal says what a field may be, by pydantic's error type.
_KINDS = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "dict_type": "an object",
    "list_type": "a list",
}


def _supported(error: dict) -> str:
    ctx = error.get("ctx") or {}
    if error["type"] in _KINDS:
        return _KINDS[error["type"]]
    for key, words in (("ge", ">= {}"), ("gt", "> {}"), ("le", "at most {:,}"), ("lt", "below {:,}")):
        if key in ctx:
            return words.format(ctx[key])
    return error["msg"].removeprefix("Input should be ").removeprefix("Value error, ")


def read_hf_config(path: Path) -> dict:
    """config.json through the bounded reader, an object whose every field an import reads has its type and
    range; returned as the JSON object (the importers and the key policy read it by key)."""
    raw = read_json(path, what="config.json", max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: expected a JSON object of config fields, got {type(raw).__name__}")
    try:
        HFConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        model_type = raw.get("model_type")
        importer = model_type if isinstance(model_type, str) and model_type else "Hugging Face"
        supported = _supported(first)
        raise refusal(path, field_name(first["loc"]), first.get("input"), importer, supported) from None
    pattern = raw.get("_sliding_window_pattern")  # pydantic keeps underscored names private: checked here
    if pattern is not None and not (isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1):
        raise ModelFileError(
            f"{path}: _sliding_window_pattern: input should be a positive integer, got {pattern!r:.40}"
        )
    return raw
