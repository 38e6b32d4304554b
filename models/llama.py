"""LLaMA-style decoder block and stacked decoder, every stage exposed.

Pre-norm (default):  h = x + attn(norm_a(x));                 y = h + ffn(norm_f(h))
Post-norm (2017):    h = norm_a(x + attn(x));                 y = norm_f(h + ffn(h))
Sandwich (Gemma 2):  h = x + post_a(attn(norm_a(x)));         y = h + post_f(ffn(norm_f(h)))
Branch post (OLMo 2): h = x + post_a(attn(x));                y = h + post_f(ffn(h))
Parallel (GPT-NeoX): y = x + attn(norm_a(x)) + ffn(norm_f(x))
Granite scales each branch by residual_scale before the add. The configs are in models/llama_config.py.
"""

from __future__ import annotations

import contextvars

import torch
import torch.nn as nn

from artifact.errors import InputError
from models.layers import MLP, Attention, Block, SwiGLU, make_norm, past_length, run_stack
from models.llama_config import (
    BLOCK_STAGES,
    BRANCH_POST_STAGES,
    POST_NORM_STAGES,
    BlockConfig,
    LlamaConfig,
    ProbedBlockConfig,
)

__all__ = [
    "BLOCK_STAGES",
    "BRANCH_POST_STAGES",
    "POST_NORM_STAGES",
    "BlockConfig",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaDecoder",
    "ProbedBlock",
    "ProbedBlockConfig",
    "check_token_ids",
]


# Set while exporters/replicate.py builds the one-block model of a per_layer_data config: its single layer has
# nothing to differ from, yet must trace to the graph every layer of the full model shares.
LAYER_DATA: contextvars.ContextVar[tuple] = contextvars.ContextVar("layer_data", default=())


class LlamaBlock(Block):
    """One LLaMA-style block: RMSNorm, RoPE attention (MHA or GQA), SwiGLU; stages by name."""

    def __init__(self, config: BlockConfig, index: int = 0):
        super().__init__()
        self.config = config
        self.placement = config.norm_placement
        layer = config.layer_attention(index)
        layer_data = getattr(config, "per_layer_data", ()) or LAYER_DATA.get()
        # Definition order fixes parameter order: norm_a, q, k, v, o, [post_a], norm_f, gate, up, down, [post_f].
        if self.placement != "branch_post":
            self.attention_norm = make_norm(config.norm, config.width, config.eps)
        self.attention = Attention(
            config.width,
            config.heads,
            config.kv_heads,
            bias=config.attention_bias == "all",
            qkv_bias=config.attention_bias == "qkv",
            causal=True,
            rope_base=layer["rope_base"],
            rope_pairing=config.rope_pairing,
            rope_scaling=layer["rope_scaling"],
            rotary_dim=config.rotary_dim,
            head_width=config.head_width,
            qk_norm=config.qk_norm,
            eps=config.eps,
            sliding_window=layer["window"],
            scale=config.attention_scale,
            softcap=config.attention_softcap,
            layer_data=layer_data,
        )
        if self.placement in ("sandwich", "branch_post"):
            self.attention_post_norm = make_norm(config.norm, config.width, config.eps)
        if self.placement != "branch_post":
            self.feed_forward_norm = make_norm(config.norm, config.width, config.eps)
        if config.ffn_gated:
            self.feed_forward = SwiGLU(config.width, config.ff_width, config.ffn_activation)
        else:
            self.feed_forward = MLP(config.width, config.ff_width, config.ffn_activation, bias=True)
        if self.placement in ("sandwich", "branch_post"):
            self.feed_forward_post_norm = make_norm(config.norm, config.width, config.eps)

    def forward(
        self, x: torch.Tensor, position_offset: int = 0, past=None, past_mask=None, position_ids=None
    ) -> dict[str, torch.Tensor]:
        if self.placement == "post" or (self.placement == "pre" and self.config.residual_scale is None):
            return super().forward(x, None, position_offset, past, past_mask, position_ids)
        B, T, d = x.shape
        scale = self.config.residual_scale
        stages: dict[str, torch.Tensor] = {}
        if self.placement == "parallel":
            return self._parallel(x, position_offset, past, past_mask, position_ids)
        # Attention sub-layer: x + post_a(attn(norm_a(x))), each part where the placement has it.
        h = x
        if self.placement != "branch_post":
            h = stages["attention_norm"] = self.attention_norm(x)
        branch, weights, *present = self.attention(h, None, position_offset, past, past_mask, position_ids)
        if self.placement != "pre":
            branch = self.attention_post_norm(branch)
        if scale is not None:
            branch = branch * scale
        h = x + branch  # (B, T, width): the residual stream
        stages.update(attention_weights=weights, attention_branch=branch, after_attention=h)
        if present:
            stages["present.key"], stages["present.value"] = present[0]
        # Feed-forward sub-layer, the same way.
        f = h
        if self.placement != "branch_post":
            f = stages["feed_forward_norm"] = self.feed_forward_norm(h)
        branch = self.feed_forward(f)
        if self.placement != "pre":
            branch = self.feed_forward_post_norm(branch)
        if scale is not None:
            branch = branch * scale
        stages.update(feed_forward_branch=branch, output=h + branch)
        return stages

    def _parallel(self, x, position_offset, past, past_mask, position_ids) -> dict[str, torch.Tensor]:
        """GPT-NeoX's parallel residual: both branches read the block input x."""
        a = self.attention_norm(x)
        attention, weights, *present = self.attention(a, None, position_offset, past, past_mask, position_ids)
        f = self.feed_forward_norm(x)
        branch = self.feed_forward(f)
        stages = dict(attention_norm=a, attention_weights=weights, attention_branch=attention)
        stages.update(feed_forward_norm=f, feed_forward_branch=branch, output=x + attention + branch)
        if present:
            stages["present.key"], stages["present.value"] = present[0]
        return stages


class ProbedBlock(nn.Module):
    """A single block with a fixed linear read-out: probe logits = output @ probe."""

    def __init__(self, config: ProbedBlockConfig):
        super().__init__()
        self.config = config
        self.block = nn.ModuleList([LlamaBlock(config)])
        # A buffer, not a parameter: the read-out is fixed and outside the block's parameter count.
        self.register_buffer("probe", torch.zeros(config.width, config.probe_width))

    def forward(self, hidden_states: torch.Tensor, position_offset: int = 0) -> dict[str, torch.Tensor]:
        B, T, d = hidden_states.shape
        if not torch.onnx.is_in_onnx_export() and T + position_offset > self.config.max_positions:
            raise InputError(
                f"input 'hidden_states': sequence length {T} (+ offset {position_offset}) exceeds "
                f"max_positions={self.config.max_positions}; shorten the input"
            )
        stages = {f"block.0.{k}": s for k, s in self.block[0](hidden_states, position_offset).items()}
        stages["logits"] = stages["block.0.output"] @ self.probe  # (B, T, probe_width)
        return stages


class LlamaDecoder(nn.Module):
    """Token embedding -> N blocks -> final RMSNorm -> vocabulary head (tied by default)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.width)
        self.block = nn.ModuleList([LlamaBlock(config, i) for i in range(config.layers)])
        self.final_norm = make_norm(config.norm, config.width, config.eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_offset: int = 0, past=None, past_mask=None, position_ids=None
    ) -> dict[str, torch.Tensor]:
        """Stages by name. `past`: one (keys, values) cache pair per block (T_past may be 0); then the
        updated caches come back as `present.{i}.key/value` and positions continue after T_past.
        Batched serving passes past_mask (B, T_past; 0 = padding slot) and position_ids (B, T)."""
        B, T = input_ids.shape
        if not torch.onnx.is_in_onnx_export():
            check_token_ids(input_ids, self.config, position_offset + past_length(past))
        x = self.embed_tokens(input_ids)  # (B, T, width)
        if self.config.embedding_scale is not None:
            x = x * self.config.embedding_scale
        stages = {"embed_tokens": x}
        x = run_stack(
            self.block,
            x,
            stages,
            "block",
            position_offset=position_offset,
            past=past,
            past_mask=past_mask,
            position_ids=position_ids,
        )
        stages["final_norm"] = self.final_norm(x)
        logits = self.lm_head(stages["final_norm"])  # (B, T, vocab)
        if self.config.logits_scale is not None:
            logits = logits / self.config.logits_scale
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        stages["logits"] = logits
        return stages


def check_token_ids(input_ids: torch.Tensor, config: LlamaConfig, position_offset: int = 0) -> None:
    if input_ids.dtype != torch.int64:
        raise InputError(f"input 'input_ids': expected dtype int64, got {input_ids.dtype}")
    T = input_ids.shape[1]
    if T + position_offset > config.max_positions:
        raise InputError(
            f"input 'input_ids': sequence length {T} (+ offset {position_offset}) exceeds "
            f"max_positions={config.max_positions}; shorten the input"
        )
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"input 'input_ids': token id {bad} outside [0, {config.vocab_size}); "
                "use ids from the model's vocabulary"
            )
