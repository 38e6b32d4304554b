"""Model families: which config dataclass, which module, which inputs.

Everything downstream (export, runners, CLI) goes through a Family, so a new
architecture is one more entry here rather than a special case elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from models.llama import BlockConfig, Decoder, DecoderConfig, ProbedBlock, ProbedBlockConfig
from toolkit.errors import ConfigError


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple  # ints for fixed axes, strings for dynamic ones

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    config_cls: type
    module_cls: Callable[..., nn.Module]
    input_specs: Callable[[BlockConfig], tuple[InputSpec, ...]]
    random_inputs: Callable[[BlockConfig, int, int, np.random.Generator], dict[str, np.ndarray]]

    def config_from_dict(self, data) -> BlockConfig:
        return self.config_cls.from_dict(data)

    def stage_names(self, config) -> tuple[str, ...]:
        layers = getattr(config, "layers", 1)
        names = [f"block.{i}.{s}" for i in range(layers) for s in config.stage_names]
        if self.name == "llama":
            return ("embed_tokens", *names, "final_norm", "logits")
        return (*names, "logits")


def _hidden_inputs(config: ProbedBlockConfig, batch: int, seq: int, rng: np.random.Generator):
    return {"hidden_states": rng.standard_normal((batch, seq, config.width))}


def _token_inputs(config: DecoderConfig, batch: int, seq: int, rng: np.random.Generator):
    return {"input_ids": rng.integers(0, config.vocab_size, size=(batch, seq), dtype=np.int64)}


FAMILIES: dict[str, Family] = {
    "block": Family(
        name="block",
        description="one LLaMA-style decoder block with a fixed linear probe read-out",
        config_cls=ProbedBlockConfig,
        module_cls=ProbedBlock,
        input_specs=lambda c: (InputSpec("hidden_states", "float32", ("batch", "sequence", c.width)),),
        random_inputs=_hidden_inputs,
    ),
    "llama": Family(
        name="llama",
        description="stacked LLaMA-style decoder: embedding, blocks, final RMSNorm, vocabulary head",
        config_cls=DecoderConfig,
        module_cls=Decoder,
        input_specs=lambda c: (InputSpec("input_ids", "int64", ("batch", "sequence")),),
        random_inputs=_token_inputs,
    ),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def build_model(family: str, config: BlockConfig, seed: int = 0) -> nn.Module:
    """Construct and deterministically initialise a model; the caller's RNG state is never touched."""
    fam = get_family(family)
    if not isinstance(config, fam.config_cls):
        raise ConfigError(f"family {family!r} expects a {fam.config_cls.__name__}, got {type(config).__name__}")
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(seed)
        model = fam.module_cls(config)
        initialize(model, generator)
    return model.eval()


@torch.no_grad()
def initialize(model: nn.Module, generator: torch.Generator) -> None:
    """Seeded init: projections N(0, 1/fan_in), embeddings N(0, 1), gains 1 + N(0, 0.1^2).

    Gains are perturbed away from 1 on purpose so a backend that drops a gain fails the check.
    """
    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights are initialised once, under their first name
            continue
        seen.add(id(tensor))
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("embed_tokens.weight") or name == "probe":
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        elif tensor.ndim == 2:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(tensor.shape[1]))
