"""Free functions for the math a lowering may want to swap.

RMSNorm, SwiGLU and GeGLU are emitted as single custom-domain nodes while
torch.onnx exports (their bodies are attached as ONNX functions afterwards,
see exporters/functions.py); in eager mode they run as plain torch code.
Attention and RoPE stay free functions so a later lowering can replace them.
"""

import torch
import torch.nn.functional as F

from artifact.format import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # y = x / sqrt(mean(x^2, -1) + eps) * weight
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{CUSTOM_DOMAIN}::RMSNorm",
            (x, weight),
            {"epsilon": float(eps)},
            dtype=x.dtype,
            shape=x.shape,
            version=CUSTOM_DOMAIN_VERSION,
        )
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    # y = down_proj( silu(gate_proj x) * (up_proj x) ), weights in torch's [out, in] layout
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{CUSTOM_DOMAIN}::SwiGLU",
            (x, gate_proj, up_proj, down_proj),
            {},
            dtype=x.dtype,
            shape=(*x.shape[:-1], down_proj.shape[0]),
            version=CUSTOM_DOMAIN_VERSION,
        )
    return F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)


def geglu(
    x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, approximate: str
) -> torch.Tensor:
    # y = down_proj( gelu(gate_proj x) * (up_proj x) ), weights in torch's [out, in] layout; approximate "tanh"
    # or "none". One node, like swiglu's, so the export writes the weights as stored rather than transposed.
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            f"{CUSTOM_DOMAIN}::GeGLU",
            (x, gate_proj, up_proj, down_proj),
            {"approximate": approximate},
            dtype=x.dtype,
            shape=(*x.shape[:-1], down_proj.shape[0]),
            version=CUSTOM_DOMAIN_VERSION,
        )
    return F.linear(F.gelu(F.linear(x, gate_proj), approximate=approximate) * F.linear(x, up_proj), down_proj)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, pairing: str, scale: float = 1.0
) -> torch.Tensor:
    """Rotate dimension pairs of x [B, heads, T, head_width] by angle pos * inv_freq[i], times `scale` (YaRN's
    attention factor multiplies cos and sin; 1 otherwise).

    positions: (T,) shared by the batch, or (B, T) per row (batched serving).
    pairing "interleaved" rotates (2i, 2i+1); "half" rotates (i, i + head_width/2),
    the Hugging Face layout.
    """
    angles = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (T, head_width/2) or (B, T, head_width/2)
    if angles.ndim == 3:
        angles = angles[:, None]  # (B, 1, T, head_width/2): every head of a row shares its positions
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if pairing == "interleaved":
        first, second = x[..., 0::2], x[..., 1::2]  # (B, heads, T, head_width/2) each
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.flatten(-2)  # (B, heads, T, head_width)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]  # (B, heads, T, head_width/2) each
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(head_width) [+ causal mask]) v, returning (output, probabilities).

    q: (B, heads, T_q, head_width); k, v: (B, kv_heads, T_k, head_width), kv_heads dividing heads
    (grouped-query attention repeats each K/V head for heads/kv_heads query heads).
    With causal=True, T_k >= T_q and the last T_q keys are the queries' own positions
    (earlier ones are cached); future keys get -inf so their probabilities are exactly 0.
    key_mask (B, T_k) additionally hides keys per row (padding in a batched cache).
    window: a query at position p sees keys at positions p - window < j <= p (sliding-window attention).
    Positions count the keys key_mask keeps, so left padding in a batched cache takes no place in the window.
    scale: the scores' multiplier (None: head_width ** -0.5); softcap: scores = softcap * tanh(scores / softcap)
    before the masks (Gemma 2).
    """
    _, heads, t_q, head_width = q.shape
    kv_heads, t_k = k.shape[1], k.shape[2]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # (B, heads, T_k, head_width)
        v = v.repeat_interleave(heads // kv_heads, dim=1)  # (B, heads, T_k, head_width)
    scores = (q @ k.transpose(-2, -1)) * (head_width**-0.5 if scale is None else scale)  # (B, heads, T_q, T_k)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        query_pos = torch.arange(t_q, device=q.device) + (t_k - t_q)
        key_pos = torch.arange(t_k, device=q.device)
        future = key_pos[None, :] > query_pos[:, None]  # (T_q, T_k)
        scores = scores.masked_fill(future, float("-inf"))
    if key_mask is not None:
        # key_mask (B, T_k), True where a key may be attended (padding slots of a batched cache are False).
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    if window is not None:
        if key_mask is None:
            key_pos = torch.arange(t_k, device=q.device)[None, :]  # (1, T_k)
        else:
            key_pos = key_mask.to(torch.int64).cumsum(-1) - 1  # (B, T_k): position of each kept key
        query_pos = key_pos[:, t_k - t_q :]  # (B or 1, T_q): the queries are the last T_q keys
        too_old = query_pos[:, :, None] - key_pos[:, None, :] >= window  # (B or 1, T_q, T_k)
        scores = scores.masked_fill(too_old[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return probs @ v, probs
