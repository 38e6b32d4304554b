"""GPT-style decoder: learned absolute positions, LayerNorm, GELU MLP with biases, untied head.

x = tok[ids] + pos[0..T)
h = x + attn(ln_a(x));  y = h + W2 gelu(W1 ln_f(h) + b1) + b2     (per block)
logits = ln_final(y) @ head
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models import validation as v
from models.layers import MLP, Attention, Block, past_length, run_stack, stage_names
from models.llama import check_token_ids


@dataclass
class GPTConfig(v.ConfigFields):
    vocab_size: int = 290
    width: int = 24
    heads: int = 4
    ff_width: int = 48
    context: int = 24  # learned positions: windows longer than this cannot be embedded
    layers: int = 1
    eps: float = 1e-5
    attention_bias: bool = False  # GPT-2 checkpoints carry Q/K/V/O biases
    activation: str = "gelu"  # exact erf GELU; "gelu_tanh" is GPT-2's approximation
    tie_embeddings: bool = False
    head_width: int = field(init=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("vocab_size", "width", "heads", "ff_width", "context", "layers"):
            v.positive_int(owner, name, getattr(self, name))
        if self.width % self.heads:
            v.fail(owner, "heads", f"a divisor of width={self.width} (heads only split the width)", self.heads)
        self.head_width = self.width // self.heads
        v.finite_float(owner, "eps", self.eps, minimum=0.0, inclusive=True)
        v.one_of(owner, "activation", self.activation, ("gelu", "gelu_tanh"))
        for name in ("attention_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                v.fail(owner, name, "true or false", getattr(self, name))

    @property
    def max_positions(self) -> int:
        return self.context

    @property
    def stage_names(self) -> tuple[str, ...]:
        return stage_names("pre", cross=False)


class GPTBlock(Block):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.placement = "pre"
        self.attention_norm = nn.LayerNorm(config.width, eps=config.eps)
        self.attention = Attention(config.width, config.heads, bias=config.attention_bias, causal=True)
        self.feed_forward_norm = nn.LayerNorm(config.width, eps=config.eps)
        self.feed_forward = MLP(config.width, config.ff_width, config.activation, bias=True)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.width)
        self.embed_positions = nn.Embedding(config.context, config.width)
        self.block = nn.ModuleList([GPTBlock(config) for _ in range(config.layers)])
        self.final_norm = nn.LayerNorm(config.width, eps=config.eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, past=None, past_mask=None, position_ids=None) -> dict[str, torch.Tensor]:
        """Stages by name; with `past` (one cache pair per block) also `present.{i}.key/value`."""
        B, T = input_ids.shape
        start = past_length(past)
        if not torch.onnx.is_in_onnx_export():
            check_token_ids(input_ids, self.config, start)
        # Every window starts at position 0; cached tokens hold the positions before T_past.
        positions = torch.arange(T, device=input_ids.device) + start if position_ids is None else position_ids
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)  # (B, T, width)
        stages = {"embed_tokens": x}
        x = run_stack(self.block, x, stages, "block", past=past, past_mask=past_mask, position_ids=position_ids)
        stages["final_norm"] = self.final_norm(x)
        stages["logits"] = self.lm_head(stages["final_norm"])  # (B, T, vocab)
        return stages


def parameter_formula(config: GPTConfig) -> int:
    # 2Vd (embedding + untied head) + Cd (positions) + L(4d^2 + 2d*d_ff + d_ff + 5d) + 2d (final LN);
    # per layer 5d = two LayerNorms (scale + shift) + the second FFN bias.
    V, d, C, L, f = config.vocab_size, config.width, config.context, config.layers, config.ff_width
    heads = 1 if config.tie_embeddings else 2
    attention_biases = 4 * d if config.attention_bias else 0
    return heads * V * d + C * d + L * (4 * d * d + attention_biases + 2 * d * f + f + 5 * d) + 2 * d
