"""LLaMA-style decoder block and stacked decoder, every stage exposed.

Pre-norm (default):  h = x + attn(norm_a(x));  y = h + ffn(norm_f(h))
Post-norm (2017):    h = norm_a(x + attn(x));  y = norm_f(h + ffn(h))
(the placement itself lives in models.layers.Block)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from artifact.errors import InputError
from models import validation as v
from models.layers import Attention, Block, RMSNorm, SwiGLU, past_length, run_stack, stage_names
from models.rope import validate_rope_scaling

BLOCK_STAGES = stage_names("pre", cross=False)
# Post-norm computes the branches before the norms; stage order follows computation.
POST_NORM_STAGES = stage_names("post", cross=False)


@dataclass
class BlockConfig(v.ConfigFields):
    width: int = 16
    heads: int = 4
    ff_width: int = 32
    max_positions: int = 64
    rope_base: float = 10000.0
    eps: float = 1e-5
    norm_placement: str = "pre"
    kv_heads: int | None = None  # None means kv_heads == heads (plain multi-head attention)
    rope_pairing: str = "interleaved"
    # The switches of the decoders people ship (Llama 3, Mistral, Qwen2/3), each off by default:
    head_dim: int | None = None  # None: width / heads; Qwen3 and some Llama 3.2 set it apart
    rope_scaling: dict | None = None  # models/rope.py: linear, llama3, yarn
    attention_bias: str = "none"  # "qkv" (Qwen2: q/k/v projections), "all" (Llama's attention_bias: o too)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    sliding_window: int | None = None  # a query sees itself and the window - 1 positions before it (Mistral)
    head_width: int = field(init=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("width", "heads", "ff_width", "max_positions"):
            v.positive_int(owner, name, getattr(self, name))
        if self.kv_heads is None:
            self.kv_heads = self.heads
        v.positive_int(owner, "kv_heads", self.kv_heads)
        if self.head_dim is None:
            if self.width % self.heads:
                v.fail(owner, "heads", f"a divisor of width={self.width}", self.heads)
            self.head_width = self.width // self.heads
            if self.head_width % 2:
                v.fail(owner, "heads", f"a head count giving an even head width (width={self.width})", self.heads)
        else:
            v.positive_int(owner, "head_dim", self.head_dim)
            if self.head_dim % 2:
                v.fail(owner, "head_dim", "an even number (RoPE rotates pairs)", self.head_dim)
            self.head_width = self.head_dim
        validate_rope_scaling(owner, self.rope_scaling, self.head_width)
        v.one_of(owner, "attention_bias", self.attention_bias, ("none", "qkv", "all"))
        if not isinstance(self.qk_norm, bool):
            v.fail(owner, "qk_norm", "true or false", self.qk_norm)
        if self.sliding_window is not None:
            v.positive_int(owner, "sliding_window", self.sliding_window)
        if self.heads % self.kv_heads:
            v.fail(owner, "kv_heads", f"a divisor of heads={self.heads}", self.kv_heads)
        v.finite_float(owner, "rope_base", self.rope_base, minimum=0.0, inclusive=False)
        v.finite_float(owner, "eps", self.eps, minimum=0.0, inclusive=True)
        v.one_of(owner, "norm_placement", self.norm_placement, ("pre", "post"))
        v.one_of(owner, "rope_pairing", self.rope_pairing, ("interleaved", "half"))

    @property
    def stage_names(self) -> tuple[str, ...]:
        return BLOCK_STAGES if self.norm_placement == "pre" else POST_NORM_STAGES


@dataclass
class LlamaConfig(BlockConfig):
    vocab_size: int = 64
    layers: int = 2
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        v.positive_int(type(self).__name__, "vocab_size", self.vocab_size)
        v.positive_int(type(self).__name__, "layers", self.layers)
        if not isinstance(self.tie_embeddings, bool):
            v.fail(type(self).__name__, "tie_embeddings", "true or false", self.tie_embeddings)
        super().__post_init__()


@dataclass
class ProbedBlockConfig(BlockConfig):
    probe_width: int = 3  # columns of the fixed read-out matrix

    def __post_init__(self) -> None:
        v.positive_int(type(self).__name__, "probe_width", self.probe_width)
        super().__post_init__()


class LlamaBlock(Block):
    """One LLaMA-style block: RMSNorm, RoPE attention (MHA or GQA), SwiGLU; stages by name."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        self.config = config
        self.placement = config.norm_placement
        # Definition order fixes parameter order: norm_a, q, k, v, o, norm_f, gate, up, down.
        self.attention_norm = RMSNorm(config.width, config.eps)
        self.attention = Attention(
            config.width,
            config.heads,
            config.kv_heads,
            bias=config.attention_bias == "all",
            qkv_bias=config.attention_bias == "qkv",
            causal=True,
            rope_base=config.rope_base,
            rope_pairing=config.rope_pairing,
            rope_scaling=config.rope_scaling,
            head_width=config.head_width,
            qk_norm_eps=config.eps if config.qk_norm else None,
            sliding_window=config.sliding_window,
        )
        self.feed_forward_norm = RMSNorm(config.width, config.eps)
        self.feed_forward = SwiGLU(config.width, config.ff_width)

    def forward(
        self, x: torch.Tensor, position_offset: int = 0, past=None, past_mask=None, position_ids=None
    ) -> dict[str, torch.Tensor]:
        return super().forward(x, None, position_offset, past, past_mask, position_ids)


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
        self.block = nn.ModuleList([LlamaBlock(config) for _ in range(config.layers)])
        self.final_norm = RMSNorm(config.width, config.eps)
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
        stages["logits"] = self.lm_head(stages["final_norm"])  # (B, T, vocab)
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
