"""Upper bounds on the model a config may ask for, checked before a module or tensor is built.

Without them a config file of a few bytes ("layers": 100000000, "vocab_size": 10000000000) spins for hours
building modules or fails inside the allocator. Each bound is far above the models people ship (262,144
tokens for Gemma 3's vocabulary, 126 layers and width 16,384 for Llama 3.1 405B), and the weights a config
implies must also fit in the model size limit ($TOOLKIT_MAX_MODEL_BYTES) the loaders use.
"""

from __future__ import annotations

from collections.abc import Mapping

from artifact.errors import ToolkitError
from artifact.read import MAX_MODEL_BYTES_ENV, max_model_bytes
from models.registry import get_family

# Our config fields (the dataclasses' names) and their largest accepted values.
MAX_SIZES = {
    "vocab_size": 1 << 22,
    "layers": 1024,
    "encoder_layers": 1024,
    "decoder_layers": 1024,
    "width": 1 << 16,
    "heads": 1024,
    "kv_heads": 1024,
    "ff_width": 1 << 18,
    "max_positions": 1 << 24,
    "context": 1 << 24,
    "head_dim": 1 << 12,
    "rotary_dim": 1 << 12,
    "probe_width": 1 << 16,
    "sliding_window": 1 << 24,
}
BYTES_PER_PARAMETER = 4  # float32, what a build holds before any export dtype


def check_sizes(fields: Mapping, where, error: type[ToolkitError]) -> None:
    """Refuse an integer field above its MAX_SIZES bound (types and lower bounds are the dataclasses' checks)."""
    for name, bound in MAX_SIZES.items():
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            raise error(
                f"{where}: {name} = {value:,} is above the limit; at most {bound:,} is accepted, fix the config"
            )


def check_footprint(family: str, config, where, error: type[ToolkitError]) -> None:
    """Refuse a config whose float32 weights (and position table) exceed the model size limit."""
    parameters = get_family(family).parameter_formula(config)
    table = getattr(config, "max_positions", 0) * getattr(config, "width", 0) if family == "encoder-decoder" else 0
    needed = (parameters + table) * BYTES_PER_PARAMETER
    limit = max_model_bytes()
    if needed > limit:
        raise error(
            f"{where}: the config describes {parameters:,} parameters ({needed:,} bytes as float32), above the "
            f"model size limit of {limit:,} bytes; at most {limit // BYTES_PER_PARAMETER:,} parameters are accepted "
            f"(raise ${MAX_MODEL_BYTES_ENV} if this machine can hold it)"
        )
