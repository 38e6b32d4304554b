"""Rotary position embeddings: inverse frequencies per scaling type, in float64 so the oracle stays exact.

A RoPE scaling is a dict of a config (`rope_scaling`), the Hugging Face `rope_parameters` less `rope_theta`:

    None or {"rope_type": "default"}   inv_freq[i] = base^(-2i / d)
    {"rope_type": "linear", "factor"}  inv_freq / factor (positions interpolated by the factor)
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        Llama 3.1/3.2: wavelengths longer than original / low_freq_factor are divided by the factor, shorter than
        original / high_freq_factor kept, the band between interpolated smoothly
    {"rope_type": "yarn", "factor", "original_max_position_embeddings", beta_fast=32, beta_slow=1,
     attention_factor, mscale, mscale_all_dim, truncate=True}
        YaRN: a linear ramp between interpolated and extrapolated frequencies over the dimensions whose rotation
        count at the original context lies between beta_slow and beta_fast, and cos/sin scaled by the attention
        factor (default 0.1 ln(factor) + 1)

    {"rope_type": "factors", "factors": [...]}
        llama.cpp's per-frequency divisors (a GGUF's rope_freqs tensor, how Llama 3.1 files carry llama3 scaling)
    {"rope_type": "longrope", "short_factor", "long_factor", "original_max_position_embeddings", "factor",
     attention_factor}
        Phi-3/3.5 long context: inv_freq divided per frequency by short_factor while the longest position of the
        call is within the original context, by long_factor past it (chosen per forward call, as transformers
        does, from max(position) + 1); cos and sin scaled by sqrt(1 + ln(factor) / ln(original)) by default
    {"rope_type": "dynamic", "factor"}
        dynamic NTK: transformers rescales the base only for sequences longer than max_position_embeddings,
        which is the model's context here (longer inputs are refused), so within it the frequencies are default

`d` is the rotated width: the head width, or `partial_rotary_factor` of it. The formulas follow transformers'
modeling_rope_utils.py.
"""

from __future__ import annotations

import math

import torch

from models import validation as v

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "factors", "longrope", "dynamic")
# Types whose frequencies depend on the call's positions: the lowerings' precomputed cos/sin caches cannot hold them.
LENGTH_DEPENDENT = ("longrope",)
# Keys each type reads; "rope_type" names it. Anything else in the dict is refused by validate_rope_scaling.
ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "factors": frozenset({"factors"}),
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"}
    ),
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
REQUIRED_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": ROPE_KEYS["llama3"],
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
    "factors": frozenset({"factors"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings", "factor"}),
    "dynamic": frozenset({"factor"}),
}


def validate_rope_scaling(owner: str, scaling: dict | None, rotated_width: int) -> None:
    """Refuse, naming the key, what the inverse frequencies below do not implement."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        v.fail(owner, "rope_scaling", "null or an object with a rope_type", scaling)
    kind = scaling.get("rope_type", "default")
    v.one_of(owner, "rope_scaling.rope_type", kind, ROPE_TYPES)
    extra = sorted(set(scaling) - ROPE_KEYS[kind] - {"rope_type"})
    if extra:
        v.fail(
            owner,
            f"rope_scaling.{extra[0]}",
            f"absent (rope_type {kind!r} reads {sorted(ROPE_KEYS[kind])})",
            scaling[extra[0]],
        )
    missing = sorted(REQUIRED_KEYS[kind] - set(scaling))
    if missing:
        v.fail(owner, f"rope_scaling.{missing[0]}", f"a value (rope_type {kind!r} needs it)", None)
    if kind == "factors":
        factors = scaling["factors"]
        if not isinstance(factors, list) or not factors:
            v.fail(owner, "rope_scaling.factors", "a list of positive numbers, one per rotated pair", factors)
        for factor in factors:
            v.finite_float(owner, "rope_scaling.factors[]", factor, minimum=0.0, inclusive=False)
        if len(factors) != rotated_width // 2:
            v.fail(owner, "rope_scaling.factors", f"{rotated_width // 2} factors (one per rotated pair)", len(factors))
        return
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = scaling[key]
            if not isinstance(factors, list) or len(factors) != rotated_width // 2:
                v.fail(owner, f"rope_scaling.{key}", f"a list of {rotated_width // 2} numbers (one per pair)", factors)
            for factor in factors:
                v.finite_float(owner, f"rope_scaling.{key}[]", factor, minimum=0.0, inclusive=False)
    for key in sorted(set(scaling) - {"rope_type", "truncate", "short_factor", "long_factor"}):
        value = scaling[key]
        if key in ("attention_factor", "mscale", "mscale_all_dim") and value is None:
            continue
        v.finite_float(owner, f"rope_scaling.{key}", value, minimum=0.0, inclusive=False)
    if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
        v.fail(owner, "rope_scaling.truncate", "true or false", scaling["truncate"])
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        v.fail(owner, "rope_scaling.high_freq_factor", "greater than low_freq_factor", scaling["high_freq_factor"])


def rope_inverse_frequencies(rotated_width: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """inv_freq (rotated_width / 2,) in float64 for the scaling type (see the module docstring)."""
    exponents = torch.arange(0, rotated_width, 2, dtype=torch.float64) / rotated_width
    inv_freq = base ** (-exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    if kind == "longrope":  # the short factors; rope_long_inverse_frequencies gives the long ones
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    if kind == "dynamic":  # default within max_position_embeddings (see the module docstring)
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        original = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(medium, smoothed, scaled)
    # yarn
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength turns `rotations` times over the original context.
        return rotated_width * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated_width - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotated_width // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated


def rope_long_inverse_frequencies(rotated_width: int, base: float, scaling: dict) -> torch.Tensor:
    """LongRoPE's inv_freq past the original context (divided by long_factor)."""
    exponents = torch.arange(0, rotated_width, 2, dtype=torch.float64) / rotated_width
    return base ** (-exponents) / torch.tensor(scaling["long_factor"], dtype=torch.float64)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (YaRN's and LongRoPE's attention temperature); 1 for the others."""
    if scaling and scaling.get("rope_type") == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)
