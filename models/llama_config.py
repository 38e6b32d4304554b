"""Configs of the llama family: the block's switches, checked field by field, and what each layer computes.

The defaults are a 2023 Llama block. Each further switch is off by default and named after the checkpoints
that turn it on; models/checkpoints maps config.json and GGUF metadata onto them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models import validation as v
from models.layers import stage_names
from models.rope import rope_attention_factor, validate_rope_scaling

BLOCK_STAGES = stage_names("pre", cross=False)
# Post-norm computes the branches before the norms; stage order follows computation.
POST_NORM_STAGES = stage_names("post", cross=False)
# OLMo 2 normalises each branch's output only: no norm before the branches.
BRANCH_POST_STAGES = tuple(s for s in BLOCK_STAGES if s not in ("attention_norm", "feed_forward_norm"))
# GPT-NeoX's parallel residual: both branches read the block input, no residual stream between them.
PARALLEL_STAGES = tuple(s for s in BLOCK_STAGES if s != "after_attention")
# pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + post_norm(f(norm(x))) (Gemma 2/3);
# branch_post: x + post_norm(f(x)) (OLMo 2); parallel: x + attn(norm_a(x)) + ffn(norm_f(x)) (GPT-NeoX).
NORM_PLACEMENTS = ("pre", "post", "sandwich", "branch_post", "parallel")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _optional_positive(owner: str, name: str, value) -> None:
    if value is not None:
        v.finite_float(owner, name, value, minimum=0.0, inclusive=False)


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
    # The switches of the decoders people ship, each off by default:
    head_dim: int | None = None  # None: width / heads; Qwen3, Gemma and some Llama 3.2 set it apart
    rope_scaling: dict | None = None  # models/rope.py: linear, llama3, yarn, llama.cpp's factors
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head only (partial rotary)
    attention_bias: str = "none"  # "qkv" (Qwen2: q/k/v projections), "all" (Llama's attention_bias: o too)
    qk_norm: str = "none"  # RMSNorm of queries and keys before RoPE: "head" (Qwen3, Gemma 3), "full" (OLMo 2)
    sliding_window: int | None = None  # a query sees itself and the window - 1 positions before it (Mistral)
    attention_scale: float | None = None  # scores multiplier; None: head_width ** -0.5 (Gemma, Granite)
    attention_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    residual_scale: float | None = None  # h = x + scale * branch (Granite's residual_multiplier)
    ffn_activation: str = "silu"  # gated: "silu" SwiGLU, "gelu_tanh" GeGLU (Gemma); plain: "gelu", "gelu_tanh"
    ffn_gated: bool = True  # False: down_proj(act(up_proj x + b) ) + b, a plain MLP with biases (GPT-NeoX)
    norm: str = "rmsnorm"  # "layernorm": mean-subtracted, with a bias (GPT-NeoX)
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
        if self.rotary_dim is not None:
            v.positive_int(owner, "rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.head_width:
                v.fail(owner, "rotary_dim", f"an even number <= head width {self.head_width}", self.rotary_dim)
        validate_rope_scaling(owner, self.rope_scaling, self.rotary_dim or self.head_width)
        v.one_of(owner, "attention_bias", self.attention_bias, ("none", "qkv", "all"))
        v.one_of(owner, "qk_norm", self.qk_norm, ("none", "head", "full"))
        v.one_of(owner, "ffn_activation", self.ffn_activation, ("silu", "gelu_tanh", "gelu"))
        if not isinstance(self.ffn_gated, bool):
            v.fail(owner, "ffn_gated", "true or false", self.ffn_gated)
        if not self.ffn_gated and self.ffn_activation == "silu":
            v.fail(owner, "ffn_activation", '"gelu" or "gelu_tanh" for a plain MLP', self.ffn_activation)
        v.one_of(owner, "norm", self.norm, ("rmsnorm", "layernorm"))
        if self.sliding_window is not None:
            v.positive_int(owner, "sliding_window", self.sliding_window)
        for name in ("attention_scale", "attention_softcap", "residual_scale"):
            _optional_positive(owner, name, getattr(self, name))
        if self.heads % self.kv_heads:
            v.fail(owner, "kv_heads", f"a divisor of heads={self.heads}", self.kv_heads)
        v.finite_float(owner, "rope_base", self.rope_base, minimum=0.0, inclusive=False)
        v.finite_float(owner, "eps", self.eps, minimum=0.0, inclusive=True)
        v.one_of(owner, "norm_placement", self.norm_placement, NORM_PLACEMENTS)
        v.one_of(owner, "rope_pairing", self.rope_pairing, ("interleaved", "half"))

    @property
    def stage_names(self) -> tuple[str, ...]:
        special = {"post": POST_NORM_STAGES, "branch_post": BRANCH_POST_STAGES, "parallel": PARALLEL_STAGES}
        return special.get(self.norm_placement, BLOCK_STAGES)

    def layer_attention(self, index: int) -> dict:
        """What layer `index`'s attention computes: its window, and its RoPE base and scaling (None: no RoPE)."""
        return {"window": self.sliding_window, "rope_base": self.rope_base, "rope_scaling": self.rope_scaling}


@dataclass
class LlamaConfig(BlockConfig):
    vocab_size: int = 64
    layers: int = 2
    tie_embeddings: bool = True
    embedding_scale: float | None = None  # x = embed(ids) * scale (Gemma: sqrt(width); Granite's multiplier)
    logits_scale: float | None = None  # logits = lm_head(h) / scale (Granite's logits_scaling)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    # Per-layer switches (None: every layer alike). With layer_types, sliding_window applies to the
    # "sliding_attention" layers only (Gemma 2/3, Qwen2); without, to every layer (Mistral).
    layer_types: list | None = None
    local_rope_base: float | None = None  # the sliding layers' RoPE base, unscaled (Gemma 3)
    no_rope_layers: list | None = None  # per layer 1: RoPE, 0: none (SmolLM3)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        v.positive_int(owner, "vocab_size", self.vocab_size)
        v.positive_int(owner, "layers", self.layers)
        if not isinstance(self.tie_embeddings, bool):
            v.fail(owner, "tie_embeddings", "true or false", self.tie_embeddings)
        for name in ("embedding_scale", "logits_scale", "final_softcap", "local_rope_base"):
            _optional_positive(owner, name, getattr(self, name))
        if self.layer_types is not None:
            if not isinstance(self.layer_types, list) or len(self.layer_types) != self.layers:
                v.fail(owner, "layer_types", f"a list of {self.layers} layer types", self.layer_types)
            for kind in self.layer_types:
                v.one_of(owner, "layer_types[]", kind, LAYER_TYPES)
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                v.fail(owner, "sliding_window", "a window for the sliding_attention layers", None)
        if self.no_rope_layers is not None:
            if not isinstance(self.no_rope_layers, list) or len(self.no_rope_layers) != self.layers:
                v.fail(owner, "no_rope_layers", f"a list of {self.layers} flags", self.no_rope_layers)
            for flag in self.no_rope_layers:
                v.one_of(owner, "no_rope_layers[]", flag, (0, 1))
        super().__post_init__()

    def layer_attention(self, index: int) -> dict:
        sliding = (
            self.layer_types[index] == "sliding_attention" if self.layer_types else self.sliding_window is not None
        )
        local = sliding and self.local_rope_base is not None
        rope = self.no_rope_layers is None or self.no_rope_layers[index] == 1
        return {
            "window": self.sliding_window if sliding else None,
            "rope_base": (self.local_rope_base if local else self.rope_base) if rope else None,
            "rope_scaling": None if local else self.rope_scaling,
        }

    @property
    def uniform_layers(self) -> bool:
        """Every layer computes the same function of its own weights (one traced block can stand for all)."""
        return all(self.layer_attention(i) == self.layer_attention(0) for i in range(self.layers))

    @property
    def per_layer_data(self) -> tuple[str, ...]:
        """What the layers differ in, when that is only values their attention can hold as buffers
        (models.layers.Attention layer_data): "window" where the windows differ, "inv_freq" where the RoPE
        frequencies do, no layer has LongRoPE and every layer's cos and sin take the same factor (a layer
        without RoPE rotates by zero frequencies, factor 1). One traced block then stands for every layer
        (exporters/replicate.layer_kinds). Empty for uniform layers and for layers that differ otherwise."""
        if self.uniform_layers:
            return ()
        layers = [self.layer_attention(i) for i in range(self.layers)]
        factors = set()
        for layer in layers:
            scaling = layer["rope_scaling"] or {}
            if scaling.get("rope_type") == "longrope":
                return ()
            factors.add(rope_attention_factor(scaling) if layer["rope_base"] is not None else 1.0)
        if len(factors) > 1:
            return ()
        windows = {layer["window"] for layer in layers}
        ropes = {(layer["rope_base"], repr(layer["rope_scaling"])) for layer in layers}
        return (("window",) if len(windows) > 1 else ()) + (("inv_freq",) if len(ropes) > 1 else ())


@dataclass
class ProbedBlockConfig(BlockConfig):
    probe_width: int = 3  # columns of the fixed read-out matrix

    def __post_init__(self) -> None:
        v.positive_int(type(self).__name__, "probe_width", self.probe_width)
        super().__post_init__()
