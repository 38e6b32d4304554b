"""Building blocks shared by every family, one factory per component switch.

A block is three sub-layers (self-attention, optional cross-attention,
feed-forward), each wrapped by the norm placement:
    pre:  h = x + f(norm(x))
    post: h = norm(x + f(x))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.ops import apply_rope, attention, geglu, rms_norm, swiglu
from models.rope import rope_attention_factor, rope_inverse_frequencies, rope_long_inverse_frequencies

NORMS = ("layernorm", "rmsnorm")
FFNS = ("relu", "gelu", "swiglu")
NO_WINDOW = 2**62  # a layer_data window that no distance between two positions reaches


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_norm(kind: str, width: int, eps: float, bias: bool = True) -> nn.Module:
    """rmsnorm: x / rms(x) * g.  layernorm: (x - mean) / sqrt(biased var + eps) * g (+ b)."""
    if kind == "rmsnorm":
        return RMSNorm(width, eps)
    return nn.LayerNorm(width, eps=eps, bias=bias)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with optional RoPE, causal mask and biases.

    With `memory` given it is cross-attention: queries from x, keys/values from memory.
    """

    def __init__(
        self,
        width,
        heads,
        kv_heads=None,
        *,
        bias=False,
        qkv_bias=False,
        causal=True,
        rope_base=None,
        rope_pairing="interleaved",
        rope_scaling=None,
        rotary_dim=None,
        head_width=None,
        qk_norm="none",
        eps=1e-5,
        sliding_window=None,
        scale=None,
        softcap=None,
        layer_data=(),
    ):
        """bias: every projection has one; qkv_bias: q/k/v only (Qwen2). head_width: None is width / heads.
        rotary_dim: RoPE on that many leading dims of each head (None: all). qk_norm: RMSNorm (eps) of queries
        and keys before RoPE, per head ("head": Qwen3, Gemma 3) or over all heads ("full": OLMo 2).
        sliding_window: keys at most window - 1 positions before the query. scale: the scores' multiplier
        (None: head_width ** -0.5). softcap: scores = softcap * tanh(scores / softcap). layer_data: which of
        "window" and "inv_freq" are buffers that the computation reads (no window: NO_WINDOW; no RoPE: zero
        frequencies, a rotation by 0, which leaves q and k bit for bit), so layers that differ only in them
        trace to one graph (exporters/replicate.py); LongRoPE is not held this way."""
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_width = head_width or width // heads
        self.causal, self.rope_pairing, self.sliding_window = causal, rope_pairing, sliding_window
        self.rotary_dim = rotary_dim or self.head_width
        self.scale, self.softcap = scale, softcap
        q_width, kv_width = self.heads * self.head_width, self.kv_heads * self.head_width
        self.q_proj = nn.Linear(width, q_width, bias=bias or qkv_bias)
        self.k_proj = nn.Linear(width, kv_width, bias=bias or qkv_bias)
        self.v_proj = nn.Linear(width, kv_width, bias=bias or qkv_bias)
        self.o_proj = nn.Linear(q_width, width, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            full = qk_norm == "full"
            self.q_norm = RMSNorm(q_width if full else self.head_width, eps)
            self.k_norm = RMSNorm(kv_width if full else self.head_width, eps)
        self.layer_data = layer_data
        if "window" in layer_data:
            window = NO_WINDOW if sliding_window is None else sliding_window
            self.register_buffer("window", torch.tensor(window, dtype=torch.int64), persistent=False)
        self.rope = rope_base is not None or "inv_freq" in layer_data
        if self.rope:
            if rope_base is None:  # a layer without RoPE among layers with it
                inv_freq = torch.zeros(self.rotary_dim // 2, dtype=torch.float64)
            else:
                inv_freq = rope_inverse_frequencies(self.rotary_dim, rope_base, rope_scaling)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.rope_factor = rope_attention_factor(rope_scaling)
            # LongRoPE: the long factors apply to a call whose last position is past the original context.
            self.long_after = None
            if (rope_scaling or {}).get("rope_type") == "longrope":
                long = rope_long_inverse_frequencies(self.rotary_dim, rope_base, rope_scaling)
                self.register_buffer("inv_freq_long", long, persistent=False)
                self.long_after = int(rope_scaling["original_max_position_embeddings"])

    def forward(self, x, memory=None, position_offset: int = 0, past=None, past_mask=None, position_ids=None):
        """Returns (output, probabilities), plus (keys, values) for the cache when `past` is given.

        past: (keys, values) of earlier positions, each (B, kv_heads, T_past, head_width), after
        RoPE; T_past may be 0. The new tokens sit at positions T_past + position_offset + [0, T),
        or at `position_ids` (B, T) when rows of a batch have different histories; past_mask
        (B, T_past) marks the cache slots that hold real tokens (the rest is padding).
        """
        B, T, d = x.shape
        source = x if memory is None else memory
        S = source.shape[1]
        q, k = self.q_proj(x), self.k_proj(source)  # (B, T, heads * head_width), (B, S, kv_heads * head_width)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.heads, self.head_width).transpose(1, 2)  # (B, heads, T, head_width)
        k = k.view(B, S, self.kv_heads, self.head_width).transpose(1, 2)  # (B, kv_heads, S, head_width)
        v = (
            self.v_proj(source).view(B, S, self.kv_heads, self.head_width).transpose(1, 2)
        )  # (B, kv_heads, S, head_width)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's head_width
        if past is not None:
            position_offset = position_offset + past[0].shape[2]
        if self.rope:
            positions = torch.arange(T, device=x.device) + position_offset if position_ids is None else position_ids
            q = self._rotate(q, positions)
            k = self._rotate(k, positions)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, kv_heads, T_past + T, head_width)
            v = torch.cat((past[1], v), dim=2)  # (B, kv_heads, T_past + T, head_width)
        key_mask = None
        if past_mask is not None:
            new = torch.ones(B, T, dtype=torch.bool, device=x.device)
            key_mask = torch.cat((past_mask.to(torch.bool), new), dim=1)  # (B, T_past + T)
        out, probs = attention(
            q,
            k,
            v,
            causal=self.causal,
            key_mask=key_mask,
            window=self.window if "window" in self.layer_data else self.sliding_window,
            scale=self.scale,
            softcap=self.softcap,
        )
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_width))  # (B, T, width)
        return (out, probs) if past is None else (out, probs, (k, v))

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of each head; the rest pass through (partial rotary)."""
        inv_freq = self.inv_freq
        if self.long_after is not None:  # transformers' choice per call: max(position_ids) + 1 > original
            inv_freq = torch.where(positions.max() + 1 > self.long_after, self.inv_freq_long, self.inv_freq)
        if self.rotary_dim == self.head_width:
            return apply_rope(x, positions, inv_freq, self.rope_pairing, self.rope_factor)
        rotated, kept = x[..., : self.rotary_dim], x[..., self.rotary_dim :]  # (B, heads, T, rotary / rest)
        return torch.cat((apply_rope(rotated, positions, inv_freq, self.rope_pairing, self.rope_factor), kept), -1)


class SwiGLU(nn.Module):
    """down_proj(act(gate_proj x) * up_proj x): SwiGLU with SiLU, GeGLU with GELU (Gemma's is tanh-approximated)."""

    def __init__(self, width: int, ff_width: int, activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(width, ff_width, bias=False)
        self.up_proj = nn.Linear(width, ff_width, bias=False)
        self.down_proj = nn.Linear(ff_width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if self.activation == "silu":
            return swiglu(x, *weights)
        return geglu(x, *weights, approximate="tanh" if self.activation == "gelu_tanh" else "none")


class MLP(nn.Module):
    """down_proj(act(up_proj x + b1)) + b2 with act ReLU, exact (erf) GELU or tanh-approximated GELU."""

    def __init__(self, width: int, ff_width: int, activation: str, bias: bool):
        super().__init__()
        self.activation = activation
        self.up_proj = nn.Linear(width, ff_width, bias=bias)
        self.down_proj = nn.Linear(ff_width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up_proj(x)
        if self.activation == "relu":
            hidden = F.relu(hidden)
        else:
            hidden = F.gelu(hidden, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(hidden)


def swiglu_width(ff_width: int) -> int:
    # Three matrices instead of two: 2/3 of the hidden width keeps the parameter count equal.
    return max(1, round(2 * ff_width / 3))


def make_ffn(kind: str, width: int, ff_width: int, bias: bool) -> nn.Module:
    if kind == "swiglu":
        return SwiGLU(width, swiglu_width(ff_width))
    return MLP(width, ff_width, kind, bias)


def sinusoidal_table(positions: int, width: int) -> torch.Tensor:
    # PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)); float64 for the oracle
    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    table = torch.zeros(positions, width, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : width // 2]
    return table


def stage_names(placement: str, cross: bool) -> tuple[str, ...]:
    """Stage names of one block, in computation order."""
    names = []
    for sub in ("attention", "cross_attention") if cross else ("attention",):
        if placement == "pre":
            names += [f"{sub}_norm", f"{sub}_weights", f"{sub}_branch", f"after_{sub}"]
        else:
            names += [f"{sub}_weights", f"{sub}_branch", f"{sub}_norm", f"after_{sub}"]
    names += ["feed_forward_norm", "feed_forward_branch", "output"]
    if placement == "post":
        names[-3:] = ["feed_forward_branch", "feed_forward_norm", "output"]
    return tuple(names)


class Block(nn.Module):
    """Norm placement around self-attention, optional cross-attention, and a feed-forward.

    Subclasses create, in parameter order: attention_norm, attention,
    [cross_attention_norm, cross_attention], feed_forward_norm, feed_forward.
    """

    placement: str = "pre"

    def forward(
        self, x, memory=None, position_offset: int = 0, past=None, past_mask=None, position_ids=None
    ) -> dict[str, torch.Tensor]:
        """Stages by name; with `past` (the self-attention cache) also "present.key"/"present.value"."""
        stages: dict[str, torch.Tensor] = {}
        x = self._attend(
            "attention", x, lambda h: self.attention(h, None, position_offset, past, past_mask, position_ids), stages
        )
        if memory is not None:
            x = self._attend("cross_attention", x, lambda h: self.cross_attention(h, memory), stages)
        if self.placement == "pre":
            norm = self.feed_forward_norm(x)
            branch = self.feed_forward(norm)
            out = x + branch
            stages.update(feed_forward_norm=norm, feed_forward_branch=branch, output=out)
        else:
            branch = self.feed_forward(x)
            out = self.feed_forward_norm(x + branch)
            stages.update(feed_forward_branch=branch, feed_forward_norm=out, output=out)
        return stages

    def _attend(self, sub: str, x, fn, stages) -> torch.Tensor:
        norm_module = getattr(self, f"{sub}_norm")
        if self.placement == "pre":
            norm = norm_module(x)
            branch, weights, *present = fn(norm)
            h = x + branch
            stages.update({f"{sub}_norm": norm, f"{sub}_weights": weights, f"{sub}_branch": branch, f"after_{sub}": h})
        else:
            # In post-norm the norm output *is* the residual stream, so two names share a value.
            branch, weights, *present = fn(x)
            h = norm_module(x + branch)
            stages.update({f"{sub}_weights": weights, f"{sub}_branch": branch, f"{sub}_norm": h, f"after_{sub}": h})
        if present:
            stages["present.key"], stages["present.value"] = present[0]
        return h


def run_stack(
    blocks,
    x,
    stages: dict,
    prefix: str,
    *,
    memory=None,
    position_offset: int = 0,
    past=None,
    past_mask=None,
    position_ids=None,
):
    """Run blocks in order, naming their stages `{prefix}.{i}.{stage}`; returns the last output.

    With `past` (one (keys, values) pair per block) the caches come back as
    `present.{i}.key` / `present.{i}.value`.
    """
    for i, block in enumerate(blocks):
        kwargs = {"position_offset": position_offset}
        if memory is not None:
            kwargs["memory"] = memory
        if past is not None:
            kwargs["past"] = past[i]
        if past_mask is not None:
            kwargs["past_mask"] = past_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        block_stages = block(x, **kwargs)
        if past is not None:
            stages[f"present.{i}.key"] = block_stages.pop("present.key")
            stages[f"present.{i}.value"] = block_stages.pop("present.value")
        stages.update({f"{prefix}.{i}.{k}": s for k, s in block_stages.items()})
        x = block_stages["output"]
    return x


def past_length(past) -> int:
    return 0 if past is None else past[0][0].shape[2]
