"""Encoder-decoder transformer with component switches, 2017 to 2026 as a config change.

Encoder block: self-attention (bidirectional) -> FFN. Decoder block: masked
self-attention -> cross-attention (queries from the decoder, keys/values from
the encoder output) -> FFN. Each sub-layer is wrapped by the norm placement; a
final norm ends each side; a vocabulary head ends the decoder.

Switches (one factory each in models.layers): norm layernorm|rmsnorm, ffn
relu|gelu|swiglu, positions sinusoidal|rope, norm_placement post|pre, biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from artifact.errors import InputError
from models import validation as v
from models.layers import FFNS, NORMS, Attention, Block, make_ffn, make_norm, sinusoidal_table, stage_names
from models.llama import check_token_ids

SWITCHES = ("norm", "ffn", "positions", "norm_placement", "biases")


@dataclass
class EncoderDecoderConfig(v.ConfigFields):
    vocab_size: int = 64
    width: int = 16
    heads: int = 4
    ff_width: int = 64  # the classic 4x width; SwiGLU uses 2/3 of it (three matrices instead of two)
    encoder_layers: int = 2
    decoder_layers: int = 2
    max_positions: int = 32
    eps: float = 1e-5
    rope_base: float = 10000.0
    norm: str = "layernorm"
    ffn: str = "relu"
    positions: str = "sinusoidal"
    norm_placement: str = "post"
    biases: bool = True
    head_width: int = field(init=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("vocab_size", "width", "heads", "ff_width", "encoder_layers", "decoder_layers", "max_positions"):
            v.positive_int(owner, name, getattr(self, name))
        if self.width % self.heads:
            v.fail(owner, "heads", f"a divisor of width={self.width}", self.heads)
        self.head_width = self.width // self.heads
        if self.width % 2:
            v.fail(owner, "width", "an even width (sinusoidal and rotary positions pair dimensions)", self.width)
        v.finite_float(owner, "eps", self.eps, minimum=0.0, inclusive=True)
        v.finite_float(owner, "rope_base", self.rope_base, minimum=0.0, inclusive=False)
        v.one_of(owner, "norm", self.norm, NORMS)
        v.one_of(owner, "ffn", self.ffn, FFNS)
        v.one_of(owner, "positions", self.positions, ("sinusoidal", "rope"))
        v.one_of(owner, "norm_placement", self.norm_placement, ("pre", "post"))
        if not isinstance(self.biases, bool):
            v.fail(owner, "biases", "true or false", self.biases)
        if self.positions == "rope" and self.head_width % 2:
            v.fail(owner, "heads", f"a head count giving an even head width for rope (width={self.width})", self.heads)
        if self.ffn == "swiglu" and self.biases:
            v.fail(owner, "biases", "false with ffn='swiglu' (the SwiGLU op is bias-free)", self.biases)

    @property
    def switches(self) -> dict:
        return {name: getattr(self, name) for name in SWITCHES}


class EncoderDecoderBlock(Block):
    def __init__(self, config: EncoderDecoderConfig, *, decoder: bool):
        super().__init__()
        c = config
        self.placement = c.norm_placement
        rope = c.rope_base if c.positions == "rope" else None
        self.attention_norm = make_norm(c.norm, c.width, c.eps, c.biases)
        self.attention = Attention(c.width, c.heads, bias=c.biases, causal=decoder, rope_base=rope)
        if decoder:
            # Cross-attention compares positions of two different sequences: no rotation there.
            self.cross_attention_norm = make_norm(c.norm, c.width, c.eps, c.biases)
            self.cross_attention = Attention(c.width, c.heads, bias=c.biases, causal=False)
        self.feed_forward_norm = make_norm(c.norm, c.width, c.eps, c.biases)
        self.feed_forward = make_ffn(c.ffn, c.width, c.ff_width, c.biases)


class Stack(nn.Module):
    """Embedding (+ sinusoidal positions) -> blocks -> final norm (-> vocabulary head for the decoder)."""

    def __init__(self, config: EncoderDecoderConfig, *, decoder: bool):
        super().__init__()
        c = config
        self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.width)
        layers = c.decoder_layers if decoder else c.encoder_layers
        self.block = nn.ModuleList([EncoderDecoderBlock(c, decoder=decoder) for _ in range(layers)])
        self.final_norm = make_norm(c.norm, c.width, c.eps, c.biases)
        if decoder:
            self.lm_head = nn.Linear(c.width, c.vocab_size, bias=False)
        if c.positions == "sinusoidal":
            self.register_buffer("position_table", sinusoidal_table(c.max_positions, c.width), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.embed_tokens(ids)  # (B, T, width)
        if self.config.positions == "sinusoidal":
            x = x + self.position_table[:T].to(x.dtype)
        return x


class EncoderDecoder(nn.Module):
    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        self.config = config
        self.encoder = Stack(config, decoder=False)
        self.decoder = Stack(config, decoder=True)

    def encode(self, source_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        B, S = source_ids.shape
        if not torch.onnx.is_in_onnx_export():
            check_token_ids(source_ids, self.config)
        x = self.encoder.embed(source_ids)
        stages = {"encoder.embed_tokens": x}
        for i, block in enumerate(self.encoder.block):
            block_stages = block(x)
            stages.update({f"encoder.block.{i}.{k}": s for k, s in block_stages.items()})
            x = block_stages["output"]
        stages["encoder_output"] = self.encoder.final_norm(x)  # (B, S, width)
        return stages

    def decode(self, input_ids: torch.Tensor, encoder_output: torch.Tensor) -> dict[str, torch.Tensor]:
        B, T = input_ids.shape
        if not torch.onnx.is_in_onnx_export():
            check_token_ids(input_ids, self.config)
            if encoder_output.shape[0] != B or encoder_output.shape[-1] != self.config.width:
                raise InputError(
                    f"input 'encoder_output': expected shape ({B}, S, {self.config.width}), got {tuple(encoder_output.shape)}"
                )
        x = self.decoder.embed(input_ids)
        stages = {"decoder.embed_tokens": x}
        for i, block in enumerate(self.decoder.block):
            block_stages = block(x, encoder_output)
            stages.update({f"decoder.block.{i}.{k}": s for k, s in block_stages.items()})
            x = block_stages["output"]
        stages["decoder.final_norm"] = self.decoder.final_norm(x)
        stages["logits"] = self.decoder.lm_head(stages["decoder.final_norm"])  # (B, T, vocab)
        return stages

    def forward(self, source_ids: torch.Tensor, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        stages = self.encode(source_ids)
        stages.update(self.decode(input_ids, stages["encoder_output"]))
        return stages


def encoder_stage_names(config: EncoderDecoderConfig) -> tuple[str, ...]:
    per_block = stage_names(config.norm_placement, cross=False)
    blocks = [f"encoder.block.{i}.{s}" for i in range(config.encoder_layers) for s in per_block]
    return ("encoder.embed_tokens", *blocks, "encoder_output")


def decoder_stage_names(config: EncoderDecoderConfig) -> tuple[str, ...]:
    per_block = stage_names(config.norm_placement, cross=True)
    blocks = [f"decoder.block.{i}.{s}" for i in range(config.decoder_layers) for s in per_block]
    return ("decoder.embed_tokens", *blocks, "decoder.final_norm", "logits")
