"""GGUF checkpoints: metadata to a LlamaConfig, tensors dequantized by the `gguf` library, llama.cpp names to ours.

The file is walked and checked by gguf_reader.py first; the tokenizer metadata is type- and
range-checked here before TextTokenizer.from_gguf builds a tokenizer from it. Every metadata key is
implemented, known not to change the computation, or refused (config_keys.KeyPolicy, gguf_key_policy).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from artifact.errors import ConfigError, ModelFileError
from models.checkpoints.config_keys import KeyPolicy, Only, is_int
from models.checkpoints.gguf_reader import GGUF_PLAIN_TYPES, GGUFTensor, check_gguf_header
from models.checkpoints.loading import ImportedCheckpoint, finish_state, load_model, take_tensor
from models.llama import LlamaConfig
from models.tokenizer import TextTokenizer

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# llama.cpp's converter permutes a llama file's Q/K rows so that interleaved pairs (2i, 2i+1) rotate together;
# Qwen2/3 files keep Hugging Face's rows, which llama.cpp rotates as NEOX pairs (i, i + head_width/2).
GGUF_ROPE_PAIRING = {"llama": "interleaved", "qwen2": "half", "qwen3": "half"}
GGUF_TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
# Row length handed to gguf's dequantizer (16 rows per numpy call): SmolLM2's rows are a few hundred
# bytes, so calls are mostly overhead; much longer rows are slower again (their temporaries are
# fresh memory on every call).
GGUF_DEQUANTIZE_ROW_BYTES = 2048


def gguf_key_policy(arch: str) -> KeyPolicy:
    """The metadata keys of a GGUF `arch` file: implemented, implemented at a neutral value only, or inert."""

    def at_head_width(value, raw, ours) -> bool:
        return value is None or value == ours.head_width

    def head_width(raw, ours) -> str:
        return f"attention.key_length (or embedding_length/head_count) = {ours.head_width}"

    return KeyPolicy(
        f"GGUF {arch}",
        implemented=frozenset(
            {
                "general.architecture",
                *(
                    f"{arch}.{key}"
                    for key in (
                        "block_count",
                        "context_length",
                        "embedding_length",
                        "feed_forward_length",
                        "attention.head_count",
                        "attention.head_count_kv",
                        "rope.freq_base",
                        "attention.layer_norm_rms_epsilon",
                        "vocab_size",
                        "attention.key_length",
                    )
                ),
                # What TextTokenizer.from_gguf builds the tokenizer and its stop ids from.
                "tokenizer.ggml.model",
                "tokenizer.ggml.pre",
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
                "tokenizer.ggml.add_bos_token",
                "tokenizer.chat_template",
            }
        ),
        only={
            f"{arch}.rope.dimension_count": Only(at_head_width, head_width),
            f"{arch}.attention.value_length": Only(at_head_width, head_width),
            f"{arch}.rope.scaling.type": Only(
                lambda v, raw, ours: v in ("none", "linear", None), '"none" or "linear" (llama.cpp\'s freq_scale)'
            ),
            f"{arch}.rope.scaling.factor": Only(
                lambda v, raw, ours: v in (0, 1) or raw.get(f"{arch}.rope.scaling.type") == "linear",
                '0 or 1, or any factor with rope.scaling.type "linear"',
            ),
            f"{arch}.attention.sliding_window": Only(
                lambda v, raw, ours: v == 0 or (is_int(v) and v >= ours.max_positions),
                lambda raw, ours: f"0 or >= context_length = {ours.max_positions} (no window)",
            ),
            f"{arch}.attention.causal": Only(lambda v, raw, ours: v is True, "true"),
            f"{arch}.expert_count": Only(lambda v, raw, ours: v == 0, "0 (a dense model)"),
            f"{arch}.expert_used_count": Only(lambda v, raw, ours: v == 0, "0 (a dense model)"),
            # Appending EOS to every prompt changes what generation sees.
            "tokenizer.ggml.add_eos_token": Only(lambda v, raw, ours: v is False, "false"),
        },
        inert=frozenset(
            {
                # YaRN's parameters: they only act with a scaling type, which is refused unless "none".
                f"{arch}.rope.scaling.original_context_length",
                f"{arch}.rope.scaling.finetuned",
            }
        ),
        inert_prefixes=(
            "GGUF.",  # the reader's own: version and counts
            "general.",  # names, licences, file type, quantization version, base models, tags
            # Tokenizer bookkeeping: SentencePiece scores and prefix-space flag (a byte-level BPE vocabulary
            # merges by rank), further special ids, named chat templates, the same tokenizer in Hugging Face's
            # format; the tokens and merges above are what is read.
            "tokenizer.",
            "quantize.imatrix.",  # which calibration data chose the quantization, not how to dequantize it
        ),
        subject="GGUF metadata ",
    )


def import_gguf(path: Path) -> ImportedCheckpoint:
    header = check_gguf_header(path)
    fields, tensors_by_name = header.fields, header.tensors
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            f"{path}: GGUF architecture {arch!r:.60} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    factors = None
    if "rope_freqs.weight" in tensors_by_name:
        factors = _dequantize(tensors_by_name["rope_freqs.weight"], path).reshape(-1).tolist()
    config = _llama_config(fields, arch, tensors_by_name.keys(), path, factors)
    gguf_key_policy(arch).check(fields, config, path)
    tensors = {name: (lambda t=t: _dequantize(t, path)) for name, t in tensors_by_name.items()}
    tensors.pop("rope_freqs.weight", None)  # read into the config above
    state = _gguf_names(config, tensors, path)
    model = load_model("llama", config, state, path, assign=True)  # the dequantized tensors are ours
    tokenizer = _gguf_tokenizer(fields, config.vocab_size, path) if "tokenizer.ggml.tokens" in fields else None
    source = {"format": "gguf", "path": str(path), "architecture": arch}
    return ImportedCheckpoint("llama", config, model, tokenizer, source)


def _rope_scaling(fields: dict, arch: str, factors) -> dict | None:
    """llama.cpp's RoPE scaling: a linear freq_scale, or per-frequency divisors (the rope_freqs tensor of Llama 3.1
    files, which llama.cpp divides every angle by)."""
    if factors is not None:
        return {"rope_type": "factors", "factors": [float(f) for f in factors]}
    if fields.get(f"{arch}.rope.scaling.type") == "linear" and fields.get(f"{arch}.rope.scaling.factor") not in (
        None,
        0,
        1,
    ):
        return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    return None


def _llama_config(fields: dict, arch: str, tensor_names, path: Path, rope_factors=None) -> LlamaConfig:
    """The config from `{arch}.*` metadata; the tensor names tell tied embeddings and biases."""

    def meta(key, default=None, kind=int):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: missing GGUF metadata {arch}.{key}")
        number = (int, float) if kind is float else int
        if isinstance(value, bool) or not isinstance(value, number) or (kind is float and not math.isfinite(value)):
            raise ModelFileError(
                f"{path}: GGUF metadata {arch}.{key} is {value!r:.60}; expected "
                f"{'a finite number' if kind is float else 'an integer'}"
            )
        return kind(value)

    heads = meta("attention.head_count")
    tokens = fields.get("tokenizer.ggml.tokens", [])
    vocab = fields.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    try:
        return LlamaConfig(
            vocab_size=vocab,
            layers=meta("block_count"),
            width=meta("embedding_length"),
            heads=heads,
            kv_heads=meta("attention.head_count_kv", heads),
            ff_width=meta("feed_forward_length"),
            max_positions=meta("context_length", 2048),
            rope_base=meta("rope.freq_base", 10000.0, float),
            eps=meta("attention.layer_norm_rms_epsilon", kind=float),
            tie_embeddings="output.weight" not in tensor_names,
            rope_pairing=GGUF_ROPE_PAIRING[arch],
            head_dim=meta("attention.key_length", 0) or None,
            rope_scaling=_rope_scaling(fields, arch, rope_factors),
            # llama.cpp loads q/k/v biases (and o's) where the file has them; Qwen2's always does.
            attention_bias="all"
            if "blk.0.attn_output.bias" in tensor_names
            else "qkv"
            if "blk.0.attn_q.bias" in tensor_names
            else "none",
            qk_norm="head" if arch == "qwen3" else "none",
        )
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from None


def _gguf_tokenizer(fields: dict, vocab_size: int, path: Path) -> TextTokenizer:
    """TextTokenizer.from_gguf on metadata whose types and ranges are checked first."""
    tokens, merges = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.merges", [])
    types = fields.get("tokenizer.ggml.token_type", [])
    problems = []
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        problems.append("tokenizer.ggml.tokens is not a list of strings")
    elif len(tokens) != vocab_size:
        problems.append(f"tokenizer.ggml.tokens has {len(tokens)} entries but the vocabulary has {vocab_size}")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        problems.append("tokenizer.ggml.merges is not a list of 'a b' strings")
    if not isinstance(types, list) or not all(isinstance(t, int) for t in types) or len(types) > vocab_size:
        problems.append("tokenizer.ggml.token_type is not a list of integers, one per token")
    for key in (
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size):
            problems.append(f"{key} {value!r:.40} is not a token id in [0, {vocab_size})")
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        problems.append("tokenizer.chat_template is not a string")
    if problems:
        raise ModelFileError(f"{path}: malformed GGUF tokenizer metadata: {problems[0]}")
    try:
        return TextTokenizer.from_gguf(fields)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    except Exception as exc:  # the tokenizers library raises plain Exception
        raise ModelFileError(f"{path}: the GGUF tokenizer metadata does not build a tokenizer ({exc})") from None


def _dequantize(tensor: GGUFTensor, path: Path) -> torch.Tensor:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in GGUF_TENSOR_TYPES:
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} has type {kind}; supported: {', '.join(GGUF_TENSOR_TYPES)}"
        )
    data = tensor.data
    if kind not in GGUF_PLAIN_TYPES:
        # A block's values do not depend on where rows end, so rows of whole blocks up to
        # GGUF_DEQUANTIZE_ROW_BYTES give the same values in fewer numpy calls.
        _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = data.size // type_size
        per_row = max(1, min(blocks, GGUF_DEQUANTIZE_ROW_BYTES // type_size))
        while blocks % per_row:  # the largest whole number of blocks per row up to that size
            per_row -= 1
        data = data.reshape(blocks // per_row, per_row * type_size)
    try:
        with np.errstate(invalid="ignore", over="ignore"):  # a corrupt scale: refused by load_model, not warned
            values = gguf.quants.dequantize(data, tensor.tensor_type)
        array = np.asarray(values, dtype=np.float32).reshape(tensor.shape)
    except (ValueError, IndexError) as exc:
        raise ModelFileError(
            f"{path}: tensor {tensor.name!r} data does not match its shape {tensor.shape} ({exc})"
        ) from None
    if not array.flags.writeable:  # a view of the file (F32): torch needs memory of its own
        array = array.copy()
    return torch.from_numpy(array)


def _gguf_names(c: LlamaConfig, lazy: dict, where) -> dict:
    """Our state dict from llama.cpp's names; `lazy` maps each name to a function that dequantizes it."""
    tensors = {}

    def take(name, shape):
        if name not in lazy:
            raise ModelFileError(f"{where}: missing tensor {name!r} (expected shape {shape})")
        tensors[name] = lazy.pop(name)()
        return take_tensor(tensors, name, shape, where)

    d, f, hd = c.width, c.ff_width, c.head_width
    q, kv = c.heads * hd, c.kv_heads * hd
    state = {"embed_tokens.weight": take("token_embd.weight", (c.vocab_size, d))}
    for i in range(c.layers):
        g, ours = f"blk.{i}.", f"block.{i}."
        names = [
            ("attn_norm.weight", "attention_norm.weight", (d,)),
            ("attn_q.weight", "attention.q_proj.weight", (q, d)),
            ("attn_k.weight", "attention.k_proj.weight", (kv, d)),
            ("attn_v.weight", "attention.v_proj.weight", (kv, d)),
            ("attn_output.weight", "attention.o_proj.weight", (d, q)),
            ("ffn_norm.weight", "feed_forward_norm.weight", (d,)),
            ("ffn_gate.weight", "feed_forward.gate_proj.weight", (f, d)),
            ("ffn_up.weight", "feed_forward.up_proj.weight", (f, d)),
            ("ffn_down.weight", "feed_forward.down_proj.weight", (d, f)),
        ]
        if c.attention_bias != "none":
            names += [
                (f"attn_{p}.bias", f"attention.{p}_proj.bias", (w,)) for p, w in zip("qkv", (q, kv, kv), strict=True)
            ]
        if c.attention_bias == "all":
            names.append(("attn_output.bias", "attention.o_proj.bias", (d,)))
        if c.qk_norm == "head":
            names += [("attn_q_norm.weight", "attention.q_norm.weight", (hd,))]
            names += [("attn_k_norm.weight", "attention.k_norm.weight", (hd,))]
        for src, dst, shape in names:
            state[ours + dst] = take(g + src, shape)
    state["final_norm.weight"] = take("output_norm.weight", (d,))
    if c.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = take("output.weight", (c.vocab_size, d))
    return finish_state(state, lazy, where)
