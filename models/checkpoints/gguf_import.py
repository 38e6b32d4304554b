"""GGUF checkpoints: metadata to a LlamaConfig, tensors dequantized by the `gguf` library, llama.cpp names to ours.

The file is walked and checked by gguf_reader.py first; the tokenizer metadata is type- and
range-checked here before TextTokenizer.from_gguf builds a tokenizer from it. Every metadata key is
implemented, known not to change the computation, or refused (config_keys.KeyPolicy, gguf_key_policy).

    llama, qwen2, qwen3   metadata read straight into a LlamaConfig
    gemma2, gemma3, phi3  metadata restated as the config.json of the same architecture and mapped by
                          hf_decoders.decoder_config, with llama.cpp's defaults and rules where the file is
                          silent (Gemma 2's soft caps and window, the sliding-layer patterns, Gemma's query scale);
                          Phi-3's window as transformers applies it (llama.cpp ignores it), LongRoPE refused

The file's computation is llama.cpp's (src/models/<arch>.cpp): Gemma files store the (1 + w) RMSNorm gains
already summed (convert_hf_to_gguf.py adds 1), which is what our norms multiply by; Phi-3 files hold fused
attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from artifact.errors import ConfigError, ModelFileError
from models.checkpoints.config_keys import KeyPolicy, Only, is_int
from models.checkpoints.gguf_reader import GGUF_PLAIN_TYPES, GGUFTensor, check_gguf_header
from models.checkpoints.hf_decoders import decoder_config
from models.checkpoints.loading import ImportedCheckpoint, OpenedCheckpoint, finish_state, load_model, take_tensor
from models.llama import LlamaConfig
from models.tokenizer import TextTokenizer

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# llama.cpp's converter permutes a llama file's Q/K rows so that interleaved pairs (2i, 2i+1) rotate together;
# Qwen2/3 files keep Hugging Face's rows, which llama.cpp rotates as NEOX pairs (i, i + head_width/2).
GGUF_ROPE_PAIRING = {"llama": "interleaved", "qwen2": "half", "qwen3": "half"}
# GGUF architectures mapped through hf_decoders (which rotates NEOX pairs, as llama.cpp does for these):
# the Hugging Face model type whose switches they share.
GGUF_HF_TYPES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
GEMMA = ("gemma2", "gemma3")
# llama.cpp's values where a Gemma 2 file omits the key (llama_model_gemma2::load_arch_hparams, llama_hparams).
GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# load_swa_pattern's default n: layer i slides unless i % n == n - 1 (every n-th layer sees the whole context).
GGUF_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}
# A GGUF file stores no query_pre_attn_scalar: llama.cpp scales Gemma's queries by 1/sqrt(head width), except for
# the 27B sizes, which it knows by their layer count, whose scalar is width / heads (gemma_pytorch's configs).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# The sliding layers' RoPE base when a Gemma 3 file gives none (llama_hparams.rope_freq_base_train_swa).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Phi-3's LongRoPE: per-frequency factors that llama.cpp switches between by the context size it is run at.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Every type gguf.quants dequantizes that llama.cpp's converters and quantizer write for these models: plain floats,
# 32-value blocks and the 256-value K-quant super-blocks (Q8_K is only llama.cpp's activation type, never stored).
GGUF_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
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

    def same_as(key: str, default):
        # A sliding-layer variant of `key`: implemented where it repeats `key`'s value.
        return Only(
            lambda v, raw, ours: v == raw.get(f"{arch}.{key}", default),
            lambda raw, ours: f"{arch}.{key} = {raw.get(f'{arch}.{key}', default)} (one value for every layer)",
        )

    policy = _base_key_policy(arch, at_head_width, head_width)
    implemented, only = set(policy.implemented), dict(policy.only)
    if arch in GGUF_HF_TYPES:
        implemented.add(f"{arch}.attention.sliding_window")
        only.pop(f"{arch}.attention.sliding_window")
        # Per-layer head and rotary widths for the sliding layers, which llama.cpp reads for every architecture.
        only[f"{arch}.attention.key_length_swa"] = Only(at_head_width, head_width)
        only[f"{arch}.attention.value_length_swa"] = Only(at_head_width, head_width)
        only[f"{arch}.rope.dimension_count_swa"] = Only(
            lambda v, raw, ours: v == (ours.rotary_dim or ours.head_width),
            lambda raw, ours: f"rope.dimension_count = {ours.rotary_dim or ours.head_width}",
        )
    if arch in GEMMA:
        implemented.add(f"{arch}.attention.sliding_window_pattern")
    if arch == "gemma2":
        implemented |= {f"{arch}.attn_logit_softcapping", f"{arch}.final_logit_softcapping"}
        # llama.cpp scales a Gemma 2 file's sliding layers' RoPE as its full layers' (freq_scale_swa = freq_scale),
        # which our local_rope_base (unscaled) does not express: one base for every layer.
        only[f"{arch}.rope.freq_base_swa"] = same_as("rope.freq_base", 10000.0)
    if arch == "gemma3":
        implemented |= {f"{arch}.final_logit_softcapping", f"{arch}.rope.freq_base_swa"}
        # llama.cpp's Gemma 3 graph has no attention soft cap (Gemma 3 dropped it); a file that asks for one
        # would compute differently in transformers.
        only[f"{arch}.attn_logit_softcapping"] = Only(
            lambda v, raw, ours: v in (None, 0), "0 (Gemma 3 has no attention soft cap; llama.cpp reads none)"
        )
    if arch == "phi3":
        implemented.add(f"{arch}.rope.dimension_count")  # partial rotary: RoPE on the first n dims of each head
        only.pop(f"{arch}.rope.dimension_count")
    return KeyPolicy(
        policy.importer,
        frozenset(implemented),
        only,
        policy.inert,
        policy.inert_prefixes,
        policy.subject,
    )


def _base_key_policy(arch: str, at_head_width, head_width) -> KeyPolicy:
    """The keys every architecture's file shares."""
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
                # SentencePiece ("llama") vocabularies: merge priorities, the leading space, the unknown piece;
                # the padding id is checked as a token id (generation never emits it).
                "tokenizer.ggml.scores",
                "tokenizer.ggml.add_space_prefix",
                "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id",
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
            # SentencePiece normalization that llama.cpp applies to Unigram (T5) vocabularies only: a file that
            # asks for it describes a tokenizer whose text is not what llama.cpp's BPE splits.
            "tokenizer.ggml.remove_extra_whitespaces": Only(
                lambda v, raw, ours: v is False, "false (whitespace is kept as typed)"
            ),
            "tokenizer.ggml.precompiled_charsmap": Only(
                lambda v, raw, ours: v in (None, []), "absent (no SentencePiece character normalization)"
            ),
        },
        inert=frozenset(
            {
                # YaRN's parameters: they only act with a scaling type, which is refused unless "none" or "linear";
                # Phi-3's converter writes the original context, which only chooses between LongRoPE factor
                # tensors (refused by name).
                f"{arch}.rope.scaling.original_context_length",
                f"{arch}.rope.scaling.finetuned",
            }
        ),
        inert_prefixes=(
            "GGUF.",  # the reader's own: version and counts
            "general.",  # names, licences, file type, quantization version, base models, tags
            # Tokenizer bookkeeping: further special ids (separator, mask, fill-in-the-middle), named chat
            # templates, the same tokenizer in Hugging Face's format; the keys above are what is read.
            "tokenizer.",
            "quantize.imatrix.",  # which calibration data chose the quantization, not how to dequantize it
        ),
        subject="GGUF metadata ",
    )


def import_gguf(path: Path) -> ImportedCheckpoint:
    return open_gguf(path).load()


def open_gguf(path: Path) -> OpenedCheckpoint:
    """The file's config, tokenizer and tensor names and shapes, checked; read_model() dequantizes its tensors
    into the model."""
    header = check_gguf_header(path)
    fields, tensors_by_name = header.fields, header.tensors
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            f"{path}: GGUF architecture {arch!r:.60} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    longrope = [name for name in LONGROPE_TENSORS if name in tensors_by_name]
    if longrope:
        raise ModelFileError(
            f"{path}: tensor {longrope[0]!r} is LongRoPE scaling (short/long per-frequency factors that llama.cpp "
            f"switches between by context size), which the GGUF {arch} import does not implement; supported: "
            "unscaled or linear RoPE (e.g. a 4k-context Phi-3 or Phi-4 file)"
        )
    if arch in GGUF_HF_TYPES:
        config = _decoder_config(fields, arch, tensors_by_name.keys(), path)
    else:
        factors = None
        if "rope_freqs.weight" in tensors_by_name:
            factors = _dequantize(tensors_by_name["rope_freqs.weight"], path).reshape(-1).tolist()
        config = _llama_config(fields, arch, tensors_by_name.keys(), path, factors)
    gguf_key_policy(arch).check(fields, config, path)
    tensors = {name: (lambda t=t: _dequantize(t, path)) for name, t in tensors_by_name.items()}
    if arch not in GGUF_HF_TYPES:
        tensors.pop("rope_freqs.weight", None)  # read into the config above
    state = _gguf_names(config, tensors, path, arch)
    tokenizer = _gguf_tokenizer(fields, config.vocab_size, path) if "tokenizer.ggml.tokens" in fields else None
    source = {"format": "gguf", "path": str(path), "architecture": arch}

    def read_model():
        return load_model("llama", config, state, path, assign=True)  # the dequantized tensors are ours

    return OpenedCheckpoint("llama", config, tokenizer, source, read_model)


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


def _meta(fields: dict, arch: str, path: Path, key: str, default=None, kind=int):
    """Metadata `{arch}.{key}` (or `default` where the file omits it), an integer or a finite number."""
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


def _llama_config(fields: dict, arch: str, tensor_names, path: Path, rope_factors=None) -> LlamaConfig:
    """The config from `{arch}.*` metadata; the tensor names tell tied embeddings and biases."""

    def meta(key, default=None, kind=int):
        return _meta(fields, arch, path, key, default, kind)

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


def _decoder_config(fields: dict, arch: str, tensor_names, path: Path) -> LlamaConfig:
    """Gemma 2/3 and Phi-3: the metadata restated as the config.json hf_decoders.decoder_config maps onto the
    llama family's switches, with llama.cpp's values where the file is silent."""

    def meta(key, default=None, kind=int):
        return _meta(fields, arch, path, key, default, kind)

    layers, width, heads = meta("block_count"), meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", 0) or None
    tokens = fields.get("tokenizer.ggml.tokens", [])
    rope = {"rope_type": "default", "rope_theta": meta("rope.freq_base", 10000.0, float)}
    scaling = _rope_scaling(fields, arch, None)
    if scaling is not None:
        rope.update(scaling)
    hf = {
        "vocab_size": fields.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0),
        "num_hidden_layers": layers,
        "hidden_size": width,
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "intermediate_size": meta("feed_forward_length"),
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", kind=float),
        "head_dim": head_dim,
        "rope_parameters": rope,
    }
    if arch in GEMMA:
        window = meta(
            "attention.sliding_window", GEMMA2_DEFAULTS["attention.sliding_window"] if arch == "gemma2" else 0
        )
        # Gemma 3 without a window (or with 0) is llama.cpp's non-sliding graph: every layer full.
        sliding = _gguf_sliding_layers(fields, arch, layers, path) if window or arch == "gemma2" else [False] * layers
        if any(sliding) and window <= 0:
            raise ModelFileError(
                f"{path}: GGUF metadata {arch}.attention.sliding_window is {window}; expected a positive window for "
                "the sliding layers (llama.cpp masks every key with 0)"
            )
        hf["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        hf["sliding_window"] = window if any(sliding) else None
        hf["query_pre_attn_scalar"] = width // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim or width // heads
        hf["attention_bias"] = False
        if arch == "gemma2":
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                hf[key] = _positive(fields, arch, path, key, GEMMA2_DEFAULTS[key])
        else:
            hf["final_logit_softcapping"] = _positive(fields, arch, path, "final_logit_softcapping", 0.0) or None
            if any(sliding):
                local = {
                    "rope_type": "default",
                    "rope_theta": meta("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE, float),
                }
                hf["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        # Phi-3: one window for every layer, as transformers applies it; 0 means none (Phi-4). llama.cpp reads the
        # window but computes without it ("Phi SWA is currently disabled"), so past the window its logits are
        # not the model's, and `toolkit check --oracle llama.cpp` agrees only on prompts no longer than it.
        hf["sliding_window"] = meta("attention.sliding_window", 0) or None
    # Gemma 2 files have no output.weight: llama.cpp always reads the output from token_embd.
    tie = arch == "gemma2" or "output.weight" not in tensor_names
    config = decoder_config(hf, path, GGUF_HF_TYPES[arch], tie)
    rotary = meta("rope.dimension_count", 0) if arch == "phi3" else 0
    if rotary and rotary != config.head_width:
        try:
            config = dataclasses.replace(config, rotary_dim=rotary)
        except ConfigError:
            raise ModelFileError(
                f"{path}: GGUF metadata {arch}.rope.dimension_count is {rotary}; expected an even number of "
                f"dimensions up to the head width {config.head_width}"
            ) from None
    return config


def _positive(fields: dict, arch: str, path: Path, key: str, default: float) -> float:
    """A soft cap: positive (llama.cpp divides by it), or `default` where the file omits it."""
    value = _meta(fields, arch, path, key, default, float)
    if value < 0 or (value == 0 and default != 0):
        raise ModelFileError(f"{path}: GGUF metadata {arch}.{key} is {value}; expected a positive number")
    return value


def _gguf_sliding_layers(fields: dict, arch: str, layers: int, path: Path) -> list[bool]:
    """Which layers slide (llama_model_base::load_swa_pattern): a per-layer array, or a period n where every
    n-th layer attends to the whole context (0: every layer slides)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = fields.get(key, GGUF_SWA_PATTERNS[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, (bool, int)) and p in (0, 1) for p in pattern):
            raise ModelFileError(
                f"{path}: GGUF metadata {key} is {pattern!r:.60}; expected {layers} flags (one per layer) or a period"
            )
        return [bool(p) for p in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ModelFileError(
            f"{path}: GGUF metadata {key} is {pattern!r:.60}; expected a period >= 0 or per-layer flags"
        )
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _gguf_tokenizer(fields: dict, vocab_size: int, path: Path) -> TextTokenizer:
    """TextTokenizer.from_gguf on metadata whose types and ranges are checked first."""
    tokens, merges = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.merges", [])
    types = fields.get("tokenizer.ggml.token_type", [])
    scores = fields.get("tokenizer.ggml.scores")
    problems = []
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        problems.append("tokenizer.ggml.tokens is not a list of strings")
    elif len(tokens) != vocab_size:
        problems.append(f"tokenizer.ggml.tokens has {len(tokens)} entries but the vocabulary has {vocab_size}")
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        problems.append("tokenizer.ggml.merges is not a list of 'a b' strings")
    if not isinstance(types, list) or not all(isinstance(t, int) for t in types) or len(types) > vocab_size:
        problems.append("tokenizer.ggml.token_type is not a list of integers, one per token")
    if scores is not None and (
        not isinstance(scores, list)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in scores)
        or len(scores) != vocab_size
    ):
        problems.append("tokenizer.ggml.scores is not a list of finite numbers, one per token")
    prefix = fields.get("tokenizer.ggml.add_space_prefix")
    if prefix is not None and not isinstance(prefix, bool):
        problems.append(f"tokenizer.ggml.add_space_prefix {prefix!r:.40} is not true or false")
    for key in (
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
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
        # BF16 arrives as bytes (a block of one value, 2 bytes) like the quantized types. A block's values do not
        # depend on where rows end, so rows of whole blocks up to
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


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """Where one of our weights lives in a GGUF file: a llama.cpp tensor (its whole torch shape), or a range of
    its rows where the file fuses several of ours (Phi-3's attn_qkv and ffn_up)."""

    tensor: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None


def gguf_sources(c: LlamaConfig, tensor_names, arch: str = "llama") -> dict[str, GGUFSource]:
    """{our state-dict name: its GGUFSource} for a file holding `tensor_names`: llama.cpp's names to ours, the one
    table the import and `toolkit quantize --recipe gguf` (which takes the tensors' blocks as they are) share.
    A tied head's source is token_embd."""
    d, f, hd = c.width, c.ff_width, c.head_width
    q, kv = c.heads * hd, c.kv_heads * hd
    sources = {"embed_tokens.weight": GGUFSource("token_embd.weight", (c.vocab_size, d))}

    def fused(name, parts):
        """A fused tensor's rows, in order, as our `parts` ({our name: row count})."""
        shape, start = (sum(parts.values()), d), 0
        for ours, count in parts.items():
            sources[ours] = GGUFSource(name, shape, (start, start + count))
            start += count

    for i in range(c.layers):
        g, ours = f"blk.{i}.", f"block.{i}."
        names = [
            ("attn_norm.weight", "attention_norm.weight", (d,)),
            ("attn_output.weight", "attention.o_proj.weight", (d, q)),
            ("ffn_norm.weight", "feed_forward_norm.weight", (d,)),
            ("ffn_down.weight", "feed_forward.down_proj.weight", (d, f)),
        ]
        rows = dict(zip("qkv", (q, kv, kv), strict=True))
        if (
            arch in GGUF_HF_TYPES and g + "attn_qkv.weight" in tensor_names
        ):  # llama.cpp's create_tensor_qkv reads either
            fused(g + "attn_qkv.weight", {f"{ours}attention.{p}_proj.weight": n for p, n in rows.items()})
        else:
            names += [(f"attn_{p}.weight", f"attention.{p}_proj.weight", (n, d)) for p, n in rows.items()]
        if arch == "phi3":  # ffn_up holds [gate; up] rows: llama.cpp's swiglu is silu(first half) * second half
            fused(
                g + "ffn_up.weight",
                {f"{ours}feed_forward.gate_proj.weight": f, f"{ours}feed_forward.up_proj.weight": f},
            )
        else:
            names += [
                ("ffn_gate.weight", "feed_forward.gate_proj.weight", (f, d)),
                ("ffn_up.weight", "feed_forward.up_proj.weight", (f, d)),
            ]
        if c.norm_placement == "sandwich":  # Gemma: a norm after each branch too
            names += [
                ("post_attention_norm.weight", "attention_post_norm.weight", (d,)),
                ("post_ffw_norm.weight", "feed_forward_post_norm.weight", (d,)),
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
        sources.update({ours + dst: GGUFSource(g + src, shape) for src, dst, shape in names})
    sources["final_norm.weight"] = GGUFSource("output_norm.weight", (d,))
    head = "token_embd.weight" if c.tie_embeddings else "output.weight"
    sources["lm_head.weight"] = GGUFSource(head, (c.vocab_size, d))
    return sources


def _gguf_names(c: LlamaConfig, lazy: dict, where, arch: str = "llama") -> dict:
    """Our state dict from llama.cpp's names; `lazy` maps each name to a function that dequantizes it."""
    tensors, taken, state = {}, {}, {}
    for ours, source in gguf_sources(c, lazy.keys(), arch).items():
        if source.tensor not in taken:  # a fused tensor, or a tied head's token_embd, is read once
            if source.tensor not in lazy:
                raise ModelFileError(f"{where}: missing tensor {source.tensor!r} (expected shape {source.shape})")
            tensors[source.tensor] = lazy.pop(source.tensor)()
            taken[source.tensor] = take_tensor(tensors, source.tensor, source.shape, where)
        whole = taken[source.tensor]
        if source.rows is None:
            state[ours] = whole
            continue
        state[ours] = whole[source.rows[0] : source.rows[1]].clone()
        if source.rows[1] == source.shape[0]:  # its last part: the fused tensor is let go
            del taken[source.tensor]
    return finish_state(state, lazy, where)
