"""Named presets and JSON config files: the ways a user names a model to build."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from artifact.errors import ConfigError
from artifact.jsonfile import read_json
from models.encoder_decoder import EncoderDecoderConfig
from models.gpt import GPTConfig
from models.llama import LlamaConfig, ProbedBlockConfig
from models.presets_limits import check_footprint, check_sizes
from models.registry import build_model, get_family
from models.worked_example import build_worked_example, worked_example_config, worked_example_inputs


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    description: str
    config: object
    seed: int = 0
    builder: Callable[[], torch.nn.Module] | None = None  # for hand-set weights
    inputs: Callable[[], dict[str, np.ndarray]] | None = None  # fixed check inputs, if any

    def build(self) -> torch.nn.Module:
        return self.builder() if self.builder else build_model(self.family, self.config, self.seed)


WORKED_EXAMPLE = "worked-example"
MAX_CONFIG_BYTES = 1 << 20  # a config file is one object of a few dozen fields

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            WORKED_EXAMPLE,
            "block",
            "hand-checkable block: d=4, 2 heads, identity weights, eps=0, fixed probe",
            worked_example_config(),
            builder=build_worked_example,
            inputs=worked_example_inputs,
        ),
        Preset(
            "block-small",
            "block",
            "random pre-norm block: d=12, 3 heads, d_ff=32 (1,752 parameters)",
            ProbedBlockConfig(width=12, heads=3, ff_width=32, max_positions=32, probe_width=5),
        ),
        Preset(
            "block-small-post",
            "block",
            "the same block with post-norm placement (the 2017 order)",
            ProbedBlockConfig(width=12, heads=3, ff_width=32, max_positions=32, probe_width=5, norm_placement="post"),
        ),
        Preset(
            "decoder-small",
            "llama",
            "random stacked LLaMA-style decoder: V=96, 2 layers, d=16, 4 heads, tied head",
            LlamaConfig(vocab_size=96, layers=2, width=16, heads=4, ff_width=40, max_positions=32),
        ),
        Preset(
            "decoder-small-gqa",
            "llama",
            "stacked decoder with grouped-query attention (4 heads, 2 KV heads), untied head",
            LlamaConfig(
                vocab_size=96,
                layers=2,
                width=16,
                heads=4,
                kv_heads=2,
                ff_width=40,
                max_positions=32,
                tie_embeddings=False,
            ),
        ),
        Preset(
            "decoder-small-post",
            "llama",
            "stacked decoder with post-norm blocks (the 2017 order)",
            LlamaConfig(
                vocab_size=96, layers=2, width=16, heads=4, ff_width=40, max_positions=32, norm_placement="post"
            ),
        ),
        Preset(
            "gpt-tiny",
            "gpt",
            "GPT-style decoder: V=290, d=24, 4 heads, d_ff=48, context 24, 1 layer (19,320 parameters)",
            GPTConfig(vocab_size=290, width=24, heads=4, ff_width=48, context=24, layers=1),
        ),
        Preset(
            "vaswani-2017",
            "encoder-decoder",
            "encoder-decoder, 2017 recipe: post-norm, LayerNorm, ReLU, sinusoidal positions, biases",
            EncoderDecoderConfig(
                vocab_size=64,
                width=16,
                heads=4,
                ff_width=64,
                encoder_layers=2,
                decoder_layers=2,
                norm="layernorm",
                ffn="relu",
                positions="sinusoidal",
                norm_placement="post",
                biases=True,
            ),
        ),
        Preset(
            "modern-2026",
            "encoder-decoder",
            "encoder-decoder, 2026 recipe: pre-norm, RMSNorm, SwiGLU, RoPE, no biases",
            EncoderDecoderConfig(
                vocab_size=64,
                width=16,
                heads=4,
                ff_width=64,
                encoder_layers=2,
                decoder_layers=2,
                norm="rmsnorm",
                ffn="swiglu",
                positions="rope",
                norm_placement="pre",
                biases=False,
            ),
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def load_config_file(path: str | Path) -> Preset:
    """Read {"family": ..., "seed": ..., "config": {...}} into an unnamed preset."""
    path = Path(path)
    data = read_json(
        path, error=ConfigError, what="config file", max_bytes=MAX_CONFIG_BYTES, advice="fix the config file"
    )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object with 'family' and 'config', got {type(data).__name__}")
    unknown = set(data) - {"family", "seed", "config"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown)}; expected 'family', 'config', 'seed'")
    if "family" not in data or "config" not in data:
        raise ConfigError(f'{path}: missing \'family\' or \'config\'; e.g. {{"family": "llama", "config": {{...}}}}')
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{path}: 'seed' expected a non-negative integer, got {seed!r}")
    family = get_family(data["family"])
    if isinstance(data["config"], dict):
        check_sizes(data["config"], f"{path}: config", ConfigError)
    try:
        config = family.config_from_dict(data["config"])
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except TypeError as exc:  # dataclass constructor complaints, e.g. a missing required field
        raise ConfigError(f"{path}: {exc}") from None
    check_footprint(family.name, config, path, ConfigError)
    return Preset(name=path.stem, family=family.name, description=f"from {path}", config=config, seed=seed)
