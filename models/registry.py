"""Model families: which config dataclass, which module, which graphs and inputs.

Everything downstream (export, runners, CLI) goes through a Family, so a new
architecture is one more entry here rather than a special case elsewhere. A
family exports one graph ("model") or several (the encoder-decoder exports an
"encoder" and a "decoder" graph; the decoder takes `encoder_output` as input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from artifact.errors import ConfigError
from artifact.format import TensorSpec, is_cache_input, past_name, present_name
from models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig, decoder_stage_names, encoder_stage_names
from models.gpt import GPT, GPTConfig
from models.gpt import parameter_formula as gpt_parameter_formula
from models.layers import swiglu_width
from models.llama import LlamaConfig, LlamaDecoder, ProbedBlock, ProbedBlockConfig


@dataclass(frozen=True)
class GraphSpec:
    """One exported graph: its inputs, its stage outputs in order, and how eager computes them."""

    name: str
    inputs: tuple[TensorSpec, ...]
    stages: tuple[str, ...]
    serving: tuple[str, ...]  # the outputs of the serving variant
    run: Callable[..., dict]  # (model, *inputs in spec order) -> {stage: tensor}
    # Language models serve through a KV-cache graph with extra inputs and its own eager path.
    serving_inputs: tuple[TensorSpec, ...] | None = None
    serving_run: Callable[..., dict] | None = None

    def variant(self, variant: str) -> tuple[tuple[TensorSpec, ...], tuple[str, ...], Callable[..., dict]]:
        """(inputs, outputs, eager run) of this graph in the given export variant."""
        if variant == "serving" and self.serving_inputs is not None:
            return self.serving_inputs, self.serving, self.serving_run
        return self.inputs, (self.stages if variant == "stages" else self.serving), self.run


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    config_cls: type
    module_cls: Callable[..., nn.Module]
    graphs: Callable[[object], tuple[GraphSpec, ...]]
    random_inputs: Callable[[object, int, int, np.random.Generator], dict[str, np.ndarray]]
    parameter_formula: Callable[[object], int]
    switches: Callable[[object], dict]

    def config_from_dict(self, data):
        return self.config_cls.from_dict(data)

    def input_specs(self, config, variant: str = "stages") -> tuple[TensorSpec, ...]:
        """Inputs of the first graph (the only one for single-graph families)."""
        return self.graphs(config)[0].variant(variant)[0]

    def stage_names(self, config) -> tuple[str, ...]:
        return tuple(name for graph in self.graphs(config) for name in graph.stages)


def _block_stages(config, prefix: str = "") -> list[str]:
    layers = getattr(config, "layers", 1)
    return [f"{prefix}block.{i}.{s}" for i in range(layers) for s in config.stage_names]


def _single(inputs, stages, run=lambda model, *args: model(*args)):
    return (GraphSpec("model", inputs, tuple(stages), ("logits",), run),)


def _cache_pairs(flat):
    return list(zip(flat[0::2], flat[1::2], strict=False))


def _language_model(config, stages) -> tuple[GraphSpec, ...]:
    """A causal LM: the stages graph without a cache, the serving graph with a KV cache.

    Serving inputs: input_ids [B, T_new], position_ids [B, T_new], past_mask [B, T_past]
    (1 = a real cached token, 0 = a padding slot of a batched cache) and past.{i}.key/value
    [B, kv_heads, T_past, head_width] (T_past = 0 for the prefill); outputs: logits and
    present.{i}.key/value (T_past + T_new). Rows of one batch may have different histories.
    """
    kv_heads = getattr(config, "kv_heads", config.heads)
    cache_shape = ("batch", kv_heads, "past_sequence", config.head_width)
    past, present = [], ["logits"]
    for i in range(config.layers):
        for kind in ("key", "value"):
            past.append(TensorSpec(past_name(i, kind), "float32", cache_shape))
            present.append(present_name(past[-1].name))
    serving_inputs = (
        _ids(),
        TensorSpec("position_ids", "int64", ("batch", "sequence")),
        TensorSpec("past_mask", "int64", ("batch", "past_sequence")),
        *past,
    )

    def serving_run(model, ids, position_ids, past_mask, *flat):
        return model(ids, past=_cache_pairs(flat), past_mask=past_mask, position_ids=position_ids)

    return (
        GraphSpec(
            "model",
            (_ids(),),
            tuple(stages),
            tuple(present),
            lambda model, ids: model(ids),
            serving_inputs=serving_inputs,
            serving_run=serving_run,
        ),
    )


def has_cache(input_specs) -> bool:
    return any(is_cache_input(TensorSpec.of(spec).name) for spec in input_specs)


def lm_defaults(specs, input_ids: np.ndarray, past_length: int = 0) -> dict[str, np.ndarray]:
    """The serving inputs a single-history feed implies: an empty (or given-length) cache of real
    tokens and positions continuing after it."""
    batch, new = input_ids.shape
    out = {}
    for spec in map(TensorSpec.of, specs):
        name = spec.name
        if name == "position_ids":
            out[name] = np.broadcast_to(np.arange(past_length, past_length + new, dtype=np.int64), (batch, new)).copy()
        elif name == "past_mask":
            out[name] = np.ones((batch, past_length), dtype=np.int64)
        elif is_cache_input(name) and past_length == 0:
            shape = [batch if d == "batch" else 0 if d == "past_sequence" else d for d in spec.shape]
            out[name] = np.zeros(shape, dtype=spec.dtype)
    return out


def _ids(name="input_ids", axis="sequence"):
    return TensorSpec(name, "int64", ("batch", axis))


def _token_inputs(config, batch: int, seq: int, rng: np.random.Generator):
    return {"input_ids": rng.integers(0, config.vocab_size, size=(batch, seq), dtype=np.int64)}


def _encoder_decoder_inputs(config, batch: int, seq: int, rng: np.random.Generator):
    # A source one token longer than the target, so the two lengths are never confused.
    source = min(seq + 1, config.max_positions)
    return {
        "source_ids": rng.integers(0, config.vocab_size, size=(batch, source), dtype=np.int64),
        "input_ids": rng.integers(0, config.vocab_size, size=(batch, seq), dtype=np.int64),
    }


def _encoder_decoder_graphs(c: EncoderDecoderConfig):
    memory = TensorSpec("encoder_output", "float32", ("batch", "source_sequence", c.width))
    return (
        GraphSpec(
            "encoder",
            (_ids("source_ids", "source_sequence"),),
            encoder_stage_names(c),
            ("encoder_output",),
            lambda model, source_ids: model.encode(source_ids),
        ),
        GraphSpec(
            "decoder",
            (_ids(), memory),
            decoder_stage_names(c),
            ("logits",),
            lambda model, input_ids, encoder_output: model.decode(input_ids, encoder_output),
        ),
    )


def llama_block_formula(config) -> int:
    # 2d (two gains) + 2d^2 (Q, O) + 2*d*kv_width (K, V) + 3*d*d_ff (gate, up, down);
    # with kv_heads == heads this is 2d + 4d^2 + 3*d*d_ff.
    d, kv_width = config.width, config.kv_heads * config.head_width
    return 2 * d + 2 * d * d + 2 * d * kv_width + 3 * d * config.ff_width


def _llama_formula(c: LlamaConfig) -> int:
    embeddings = (1 if c.tie_embeddings else 2) * c.vocab_size * c.width  # the head only when untied
    return embeddings + c.layers * llama_block_formula(c) + c.width


def encoder_decoder_formula(c: EncoderDecoderConfig) -> tuple[int, int, int]:
    """(encoder block, decoder block, whole model) parameter counts from the switches."""
    d, f = c.width, c.ff_width
    norm = (2 * d if c.biases else d) if c.norm == "layernorm" else d
    attention = 4 * d * d + (4 * d if c.biases else 0)
    ffn = 3 * d * swiglu_width(f) if c.ffn == "swiglu" else 2 * d * f + ((f + d) if c.biases else 0)
    encoder_block = 2 * norm + attention + ffn
    decoder_block = 3 * norm + 2 * attention + ffn
    embeddings_and_head = 3 * c.vocab_size * d  # source and target embeddings, untied head
    total = embeddings_and_head + c.encoder_layers * encoder_block + c.decoder_layers * decoder_block + 2 * norm
    return encoder_block, decoder_block, total


def _llama_switches(c) -> dict:
    return {
        "norm": "rmsnorm",
        "ffn": "swiglu",
        "positions": f"rope ({c.rope_pairing})",
        "norm_placement": c.norm_placement,
        "biases": False,
        "attention": "mha" if c.kv_heads == c.heads else f"gqa ({c.kv_heads} kv heads)",
    }


FAMILIES: dict[str, Family] = {
    "block": Family(
        name="block",
        description="one LLaMA-style decoder block with a fixed linear probe read-out",
        config_cls=ProbedBlockConfig,
        module_cls=ProbedBlock,
        graphs=lambda c: _single(
            (TensorSpec("hidden_states", "float32", ("batch", "sequence", c.width)),), [*_block_stages(c), "logits"]
        ),
        random_inputs=lambda c, b, t, rng: {"hidden_states": rng.standard_normal((b, t, c.width))},
        parameter_formula=llama_block_formula,
        switches=_llama_switches,
    ),
    "llama": Family(
        name="llama",
        description="stacked LLaMA-style decoder: embedding, RMSNorm/RoPE/SwiGLU blocks, final RMSNorm, head",
        config_cls=LlamaConfig,
        module_cls=LlamaDecoder,
        graphs=lambda c: _language_model(c, ["embed_tokens", *_block_stages(c), "final_norm", "logits"]),
        random_inputs=_token_inputs,
        parameter_formula=_llama_formula,
        switches=_llama_switches,
    ),
    "gpt": Family(
        name="gpt",
        description="GPT-style decoder: learned positions, LayerNorm, GELU MLP with biases, untied head",
        config_cls=GPTConfig,
        module_cls=GPT,
        graphs=lambda c: _language_model(c, ["embed_tokens", *_block_stages(c), "final_norm", "logits"]),
        random_inputs=_token_inputs,
        parameter_formula=gpt_parameter_formula,
        switches=lambda c: {
            "norm": "layernorm",
            "ffn": "gelu",
            "positions": "learned",
            "norm_placement": "pre",
            "biases": "all projections" if c.attention_bias else "feed-forward only",
            "attention": "mha",
        },
    ),
    "encoder-decoder": Family(
        name="encoder-decoder",
        description="encoder-decoder with cross-attention; exported as an encoder graph and a decoder graph",
        config_cls=EncoderDecoderConfig,
        module_cls=EncoderDecoder,
        graphs=_encoder_decoder_graphs,
        random_inputs=_encoder_decoder_inputs,
        parameter_formula=lambda c: encoder_decoder_formula(c)[2],
        switches=lambda c: dict(c.switches),
    ),
}


def get_family(name: str) -> Family:
    if not isinstance(name, str) or name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def build_model(family: str, config, seed: int = 0, *, init: bool = True) -> nn.Module:
    """Construct and deterministically initialise a model; the caller's RNG state is never touched.

    init=False skips the seeded initialisation for callers that load every weight next.
    """
    fam = get_family(family)
    if not isinstance(config, fam.config_cls):
        raise ConfigError(f"family {family!r} expects a {fam.config_cls.__name__}, got {type(config).__name__}")
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(seed)
        with _NoRandomFills():
            model = fam.module_cls(config)
        if init:
            initialize(model, generator)
    return model.eval()


class _NoRandomFills(torch.overrides.TorchFunctionMode):
    """torch.nn.init's random fills become no-ops while a module is constructed.

    Every state_dict tensor is then either overwritten by initialize() or loaded by the caller
    (init=False), so the modules' own default init is wasted work: seconds for a 135M-parameter
    model. Buffers computed in __init__ (RoPE frequencies) do not use torch.nn.init and are kept.
    """

    SKIPPED = frozenset(
        (
            torch.nn.init.uniform_,
            torch.nn.init.normal_,
            torch.nn.init.trunc_normal_,
            torch.nn.init.kaiming_uniform_,
            torch.nn.init.kaiming_normal_,
            torch.nn.init.xavier_uniform_,
            torch.nn.init.xavier_normal_,
            torch.nn.init.orthogonal_,
        )
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@torch.no_grad()
def initialize(model: nn.Module, generator: torch.Generator) -> None:
    """Seeded init of every tensor: projections N(0, 1/fan_in), embeddings N(0, 1),
    gains 1 + N(0, 0.1^2), biases and shifts N(0, 0.1^2).

    Gains and biases are perturbed away from 1 and 0 on purpose, so a backend
    that drops one fails the check.
    """
    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights are initialised once, under their first name
            continue
        seen.add(id(tensor))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype)
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.1 * noise)
        elif name.endswith(".bias"):
            tensor.copy_(0.1 * noise)
        elif "embed_" in name or name == "probe":
            tensor.copy_(noise)
        elif tensor.ndim == 2:
            tensor.copy_(noise / math.sqrt(tensor.shape[1]))
        else:
            raise ConfigError(f"initialize: no rule for tensor {name!r} {tuple(tensor.shape)}")
