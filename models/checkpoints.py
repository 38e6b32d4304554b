"""Import real checkpoints: Hugging Face directories (safetensors) and GGUF files.

Only local paths; no code from the checkpoint runs (safetensors and GGUF are
plain data; chat templates render in a sandbox). Every import is validated
against the config: the first missing, unexpected or mis-shaped tensor is named.

Files are hostile until checked: the safetensors header and the GGUF header are
walked here against the file size (lengths, counts, shapes x dtypes vs byte
spans, offsets, overlaps) before the `safetensors` library parses the one or
any GGUF tensor is mapped, so no allocation or loop is sized by an unchecked
header field; library exceptions become ModelFileError naming the file. The
GGUF walk also reads the metadata (values as gguf.GGUFReader gives them) and
the `gguf` library dequantizes the tensors.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.registry import build_model
from models.tokenizer import TextTokenizer
from artifact.errors import ConfigError, ModelFileError

HF_ARCHITECTURES = ("llama (LlamaForCausalLM)", "gpt2 (GPT2LMHeadModel)")
GGUF_ARCHITECTURES = ("llama",)
GGUF_TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
# Buffers some checkpoints carry that are not weights (recomputed from the config here).
IGNORED_TENSORS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# safetensors dtypes read here (bytes per element); others (F8, complex, ...) are refused by name.
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own header-size limit
GGUF_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS in ggml.h
# GGUF metadata value types -> bytes per scalar (gguf.GGUFValueType; 8 = string, 9 = array).
GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9
# The numpy dtypes gguf.GGUFReader reads those scalars as (little-endian files only).
GGUF_SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                      11: "<i8", 12: "<f8"}
# Tensor types gguf.GGUFReader views as typed arrays; every other type is viewed as bytes per row.
GGUF_PLAIN_TYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
# Row length handed to gguf's dequantizer (16 rows per numpy call): SmolLM2's rows are a few hundred
# bytes, so calls are mostly overhead; much longer rows measured slower again (their temporaries are
# fresh memory on every call).
GGUF_DEQUANTIZE_ROW_BYTES = 2048


@dataclass
class ImportedCheckpoint:
    family: str
    config: object
    model: torch.nn.Module
    tokenizer: TextTokenizer | None
    source: dict  # format, path, architecture


def import_checkpoint(path: str | Path) -> ImportedCheckpoint:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such checkpoint; give a Hugging Face directory or a .gguf file")
    if path.is_dir():
        return import_huggingface(path)
    if path.suffix.lower() == ".gguf":
        return import_gguf(path)
    raise ModelFileError(f"{path}: not a checkpoint; expected a Hugging Face directory (config.json + *.safetensors) "
                         "or a .gguf file")


# --------------------------------------------------------------------------- Hugging Face


def import_huggingface(directory: Path) -> ImportedCheckpoint:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"{directory}: missing config.json; is this a Hugging Face model directory?")
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{config_path}: invalid JSON ({exc})") from None
    model_type = hf.get("model_type")
    if model_type == "llama":
        family, config, expected = "llama", _llama_config(hf, config_path), _llama_names
    elif model_type == "gpt2":
        family, config, expected = "gpt", _gpt2_config(hf, config_path), _gpt2_names
    else:
        raise ModelFileError(f"{config_path}: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(HF_ARCHITECTURES)}")
    tensors = _read_safetensors(directory)
    state = expected(config, tensors, directory)
    model = _load(family, config, state, directory)
    source = {"format": "huggingface", "path": str(directory), "architecture": model_type}
    return ImportedCheckpoint(family, config, model, TextTokenizer.from_hf_dir(directory), source)


def _get(hf: dict, key: str, where: Path, default=None, required=True):
    if key in hf and hf[key] is not None:
        return hf[key]
    if required and default is None:
        raise ModelFileError(f"{where}: missing {key!r}")
    return default


def _llama_config(hf: dict, where: Path) -> LlamaConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported; supported: 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ModelFileError(f"{where}: {flag}=true is not supported (the LLaMA family is bias-free)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source in (rope, scaling):  # either key may carry the scaling; transformers honours both
        rope_type = source.get("rope_type", source.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ModelFileError(f"{where}: rope scaling {rope_type!r} is not supported; supported: default")
    heads = _get(hf, "num_attention_heads", where)
    width = _get(hf, "hidden_size", where)
    if hf.get("head_dim") not in (None, width // heads):
        raise ModelFileError(f"{where}: head_dim {hf['head_dim']} != hidden_size/num_attention_heads "
                             f"= {width // heads}; decoupled head widths are not supported")
    try:
        return LlamaConfig(
            vocab_size=_get(hf, "vocab_size", where), layers=_get(hf, "num_hidden_layers", where),
            width=width, heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
            ff_width=_get(hf, "intermediate_size", where),
            max_positions=_get(hf, "max_position_embeddings", where, 2048),
            rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            eps=float(_get(hf, "rms_norm_eps", where, 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_pairing="half",  # Hugging Face rotates (i, i + head_width/2)
        )
    except ConfigError as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def _gpt2_config(hf: dict, where: Path) -> GPTConfig:
    activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    act = hf.get("activation_function", "gelu_new")
    if act not in activations:
        raise ModelFileError(f"{where}: activation_function {act!r} is not supported; supported: {', '.join(activations)}")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ModelFileError(f"{where}: non-standard attention scaling is not supported")
    width = _get(hf, "n_embd", where)
    try:
        return GPTConfig(
            vocab_size=_get(hf, "vocab_size", where), width=width, heads=_get(hf, "n_head", where),
            ff_width=hf.get("n_inner") or 4 * width, context=_get(hf, "n_positions", where),
            layers=_get(hf, "n_layer", where), eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            attention_bias=True, activation=activations[act],
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    except ConfigError as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ModelFileError(f"{index}: invalid shard index ({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ModelFileError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = sorted({directory / Path(name).name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileError(f"{index}: shard {missing[0]!r} is listed but not in {directory}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory}: no *.safetensors files; only safetensors checkpoints are read")
    tensors = {}
    for file in files:
        check_safetensors_header(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as exc:
            raise ModelFileError(f"{file}: unreadable safetensors file ({exc})") from None
    return tensors


def check_safetensors_header(file: Path) -> dict:
    """Validate a safetensors header against the file before the library reads it; returns the header.

    Layout: u64 little-endian N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
    then the data; offsets are relative to the data and must tile it without overlaps.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFileError(f"{file}: unreadable safetensors file (truncated: {size} bytes, the header "
                                     "length alone takes 8)")
            length = int.from_bytes(prefix, "little")
            if length > SAFETENSORS_MAX_HEADER:
                raise ModelFileError(f"{file}: unreadable safetensors file (header length {length:,} is above the "
                                     f"{SAFETENSORS_MAX_HEADER:,}-byte limit)")
            if 8 + length > size:
                raise ModelFileError(f"{file}: unreadable safetensors file (truncated: header length {length:,} "
                                     f"runs past the end of the {size:,}-byte file)")
            raw = handle.read(length)
    except OSError as exc:
        raise ModelFileError(f"{file}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelFileError(f"{file}: unreadable safetensors file (header is not JSON: "
                             f"{type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: unreadable safetensors file (header is not a JSON object)")
    data_size, spans = size - 8 - length, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ModelFileError(f"{file}: unreadable safetensors file (__metadata__ must map strings to strings)")
            continue
        where = f"{file}: unreadable safetensors file: tensor {name!r:.80}"
        if not isinstance(info, dict):
            raise ModelFileError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelFileError(f"{where}: dtype {dtype!r:.40} is not supported; supported: "
                                 f"{', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ModelFileError(f"{where}: shape {shape!r:.60} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise ModelFileError(f"{where}: data_offsets {offsets!r:.60} are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        if end > data_size:
            raise ModelFileError(f"{where}: data_offsets [{begin}, {end}) run past the end of the data "
                                 f"({data_size:,} bytes); the file is truncated or the header lies")
        needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if end - begin != needed:
            raise ModelFileError(f"{where}: shape {tuple(shape)} of {dtype} needs {needed:,} bytes but data_offsets "
                                 f"[{begin}, {end}) hold {end - begin:,}")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise ModelFileError(f"{file}: unreadable safetensors file: tensors {a!r:.80} and {b!r:.80} overlap (bytes from {begin_b} to {end_a}); "
                                 "the header lies")
    return header


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _take(tensors: dict, name: str, shape: tuple, where) -> torch.Tensor:
    if name not in tensors:
        raise ModelFileError(f"{where}: missing tensor {name!r} (expected shape {shape})")
    tensor = tensors.pop(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ModelFileError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor


def _finish(state: dict, leftovers: dict, where) -> dict:
    extra = [n for n in leftovers if not n.endswith(IGNORED_TENSORS)]
    if extra:
        raise ModelFileError(f"{where}: unexpected tensor {sorted(extra)[0]!r} (not in this architecture)")
    return state


def _llama_names(c: LlamaConfig, tensors: dict, where) -> dict:
    d, kv, f = c.width, c.kv_heads * c.head_width, c.ff_width
    state = {"embed_tokens.weight": _take(tensors, "model.embed_tokens.weight", (c.vocab_size, d), where)}
    for i in range(c.layers):
        hf, ours = f"model.layers.{i}.", f"block.{i}."
        for src, dst, shape in (
            ("input_layernorm.weight", "attention_norm.weight", (d,)),
            ("self_attn.q_proj.weight", "attention.q_proj.weight", (d, d)),
            ("self_attn.k_proj.weight", "attention.k_proj.weight", (kv, d)),
            ("self_attn.v_proj.weight", "attention.v_proj.weight", (kv, d)),
            ("self_attn.o_proj.weight", "attention.o_proj.weight", (d, d)),
            ("post_attention_layernorm.weight", "feed_forward_norm.weight", (d,)),
            ("mlp.gate_proj.weight", "feed_forward.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", "feed_forward.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", "feed_forward.down_proj.weight", (d, f)),
        ):
            state[ours + dst] = _take(tensors, hf + src, shape, where)
    state["final_norm.weight"] = _take(tensors, "model.norm.weight", (d,), where)
    if c.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints still store the copy
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = _take(tensors, "lm_head.weight", (c.vocab_size, d), where)
    return _finish(state, tensors, where)


def _gpt2_names(c: GPTConfig, tensors: dict, where) -> dict:
    # Strip the optional "transformer." prefix; GPT-2's Conv1D stores weights as [in, out].
    tensors.update({n.removeprefix("transformer."): tensors.pop(n) for n in list(tensors)})
    d, f = c.width, c.ff_width
    state = {"embed_tokens.weight": _take(tensors, "wte.weight", (c.vocab_size, d), where),
             "embed_positions.weight": _take(tensors, "wpe.weight", (c.context, d), where)}
    for i in range(c.layers):
        hf, ours = f"h.{i}.", f"block.{i}."
        state[ours + "attention_norm.weight"] = _take(tensors, hf + "ln_1.weight", (d,), where)
        state[ours + "attention_norm.bias"] = _take(tensors, hf + "ln_1.bias", (d,), where)
        qkv = _take(tensors, hf + "attn.c_attn.weight", (d, 3 * d), where).T  # (3d, d): rows q, k, v
        qkv_bias = _take(tensors, hf + "attn.c_attn.bias", (3 * d,), where)
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state[ours + f"attention.{name}.weight"] = qkv[j * d:(j + 1) * d].contiguous()
            state[ours + f"attention.{name}.bias"] = qkv_bias[j * d:(j + 1) * d].contiguous()
        state[ours + "attention.o_proj.weight"] = _take(tensors, hf + "attn.c_proj.weight", (d, d), where).T.contiguous()
        state[ours + "attention.o_proj.bias"] = _take(tensors, hf + "attn.c_proj.bias", (d,), where)
        state[ours + "feed_forward_norm.weight"] = _take(tensors, hf + "ln_2.weight", (d,), where)
        state[ours + "feed_forward_norm.bias"] = _take(tensors, hf + "ln_2.bias", (d,), where)
        state[ours + "feed_forward.up_proj.weight"] = _take(tensors, hf + "mlp.c_fc.weight", (d, f), where).T.contiguous()
        state[ours + "feed_forward.up_proj.bias"] = _take(tensors, hf + "mlp.c_fc.bias", (f,), where)
        state[ours + "feed_forward.down_proj.weight"] = _take(tensors, hf + "mlp.c_proj.weight", (f, d), where).T.contiguous()
        state[ours + "feed_forward.down_proj.bias"] = _take(tensors, hf + "mlp.c_proj.bias", (d,), where)
    state["final_norm.weight"] = _take(tensors, "ln_f.weight", (d,), where)
    state["final_norm.bias"] = _take(tensors, "ln_f.bias", (d,), where)
    if c.tie_embeddings:
        tensors.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = _take(tensors, "lm_head.weight", (c.vocab_size, d), where)
    return _finish(state, tensors, where)


def _load(family: str, config, state: dict, where, *, assign: bool = False) -> torch.nn.Module:
    """The model with `state` loaded (every entry checked for name and shape by load_state_dict).

    assign=True makes the state's tensors the parameters instead of copying them (the caller owns
    them: fresh, writable float32 memory); tied parameters stay one Parameter.
    """
    model = build_model(family, config, init=False)  # every weight is loaded next
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ModelFileError(f"{where}: no source tensor for {missing[0]!r}")
    for name in sorted(expected):
        value = state[name]
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ModelFileError(f"{where}: weight {name!r} holds {bad} non-finite value(s) (NaN/Inf); the checkpoint "
                                 "is corrupt or was saved from a diverged model, re-download or re-convert it")
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    model.load_state_dict({name: state[name] for name in expected}, assign=assign)
    if assign:  # load_state_dict(assign=True) wraps each name's tensor in a Parameter of its own
        for first, *others in tied.values():
            for other in others:
                owner, _, attr = other.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model.eval()


# --------------------------------------------------------------------------- GGUF


def import_gguf(path: Path) -> ImportedCheckpoint:
    header = check_gguf_header(path)
    fields, tensors_by_name = header.fields, header.tensors
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"{path}: GGUF architecture {arch!r:.60} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

    def meta(key, default=None, kind=int):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: missing GGUF metadata {arch}.{key}")
        number = (int, float) if kind is float else int
        if isinstance(value, bool) or not isinstance(value, number) or (kind is float and not math.isfinite(value)):
            raise ModelFileError(f"{path}: GGUF metadata {arch}.{key} is {value!r:.60}; expected "
                                 f"{'a finite number' if kind is float else 'an integer'}")
        return kind(value)

    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = fields.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling not in ("none", None) or factor not in (0, 1, 1.0) or "rope_freqs.weight" in tensors_by_name:
        raise ModelFileError(f"{path}: RoPE scaling (type {scaling!r:.40}, factor {factor!r:.40}, rope_freqs "
                             f"{'present' if 'rope_freqs.weight' in tensors_by_name else 'absent'}) is not supported; "
                             "supported: unscaled RoPE")
    heads = meta("attention.head_count")
    tokens = fields.get("tokenizer.ggml.tokens", [])
    vocab = fields.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    try:
        config = LlamaConfig(
            vocab_size=vocab, layers=meta("block_count"), width=meta("embedding_length"), heads=heads,
            kv_heads=meta("attention.head_count_kv", heads), ff_width=meta("feed_forward_length"),
            max_positions=meta("context_length", 2048), rope_base=meta("rope.freq_base", 10000.0, float),
            eps=meta("attention.layer_norm_rms_epsilon", kind=float),
            tie_embeddings="output.weight" not in tensors_by_name,
            # llama.cpp's converter permutes Q/K rows so that interleaved pairs (2i, 2i+1) rotate together.
            rope_pairing="interleaved",
        )
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    tensors = {name: (lambda t=t: _dequantize(t, path)) for name, t in tensors_by_name.items()}
    state = _gguf_names(config, tensors, path)
    model = _load("llama", config, state, path, assign=True)  # the dequantized tensors are ours
    tokenizer = _gguf_tokenizer(fields, config.vocab_size, path) if "tokenizer.ggml.tokens" in fields else None
    source = {"format": "gguf", "path": str(path), "architecture": arch}
    return ImportedCheckpoint("llama", config, model, tokenizer, source)


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
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
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


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its type, its shape in torch order and a read-only view of its bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF lists the fastest-varying axis first; this is reversed to torch's order
    data: np.ndarray  # as gguf.GGUFReader lays it out: typed for plain types, (..., bytes per row) for blocks


@dataclass
class GGUFHeader:
    """What check_gguf_header read: metadata values and tensor views, in file order."""

    fields: dict  # key -> value as gguf's ReaderField.contents() gives it; values that are not UTF-8 left out
    tensors: dict[str, GGUFTensor]


def check_gguf_header(path: Path) -> GGUFHeader:
    """Walk a GGUF header against the file size, then read its metadata and map its tensors.

    A lying count could make a naive reader spin or grow lists without bound, so every count and
    length is checked against the bytes that remain before it sizes a loop or an allocation,
    every tensor's byte span (dims x type) against the data section, and spans against each other;
    only then are the tensors mapped (numpy views of the file, nothing read yet).
    Values come out as gguf.GGUFReader's `contents()` gives them; this walk replaces the reader,
    which builds numpy objects for every token of a 49k-entry vocabulary (seconds per import).
    Little-endian GGUF v2/v3 only.
    """
    import gguf

    size = path.stat().st_size
    fixed = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count
    if size < fixed:
        raise ModelFileError(f"{path}: not a readable GGUF file (truncated: {size} bytes, the header alone takes {fixed})")
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        def fail(what):
            raise ModelFileError(f"{path}: not a readable GGUF file ({what})")

        def read(fmt, offset, what):
            if offset + struct.calcsize(fmt) > size:
                fail(f"truncated: {what} at byte {offset} runs past the end of the {size:,}-byte file")
            return struct.unpack_from(fmt, data, offset)[0]

        def string(offset, what):
            length = read("<Q", offset, f"{what} length")
            if offset + 8 + length > size:
                fail(f"truncated: {what} of {length:,} bytes at byte {offset} runs past the end of the file")
            return offset + 8 + length, data[offset + 8:offset + 8 + length]

        def strings(offset, count, what):
            # The tokenizer's vocabulary and merges: ~10^5 strings, so the lengths are unpacked inline.
            unpack, items = struct.Struct("<Q").unpack_from, []
            for i in range(count):
                if offset + 8 > size:
                    read("<Q", offset, f"{what}[{i}] length")
                (length,) = unpack(data, offset)
                start, offset = offset + 8, offset + 8 + length
                if offset > size:
                    fail(f"truncated: {what}[{i}] of {length:,} bytes at byte {start - 8} runs past the end of the file")
                items.append(data[start:offset])
            return offset, items

        def scalars(offset, kind, count):
            raw = data[offset:offset + count * GGUF_SCALAR_SIZES[kind]]
            return np.frombuffer(raw, dtype=GGUF_SCALAR_DTYPES[kind], count=count).tolist()

        def value(offset, kind, what):
            """(offset after the value, the value or None where gguf's contents() would fail: not UTF-8)."""
            if kind in GGUF_SCALAR_SIZES:
                if offset + GGUF_SCALAR_SIZES[kind] > size:
                    fail(f"truncated: {what} at byte {offset}")
                return offset + GGUF_SCALAR_SIZES[kind], scalars(offset, kind, 1)[0]
            if kind == GGUF_STRING:
                offset, raw = string(offset, what)
                return offset, _utf8(raw)
            if kind == GGUF_ARRAY:
                item, count = read("<I", offset, f"{what} item type"), read("<Q", offset + 4, f"{what} count")
                offset += 12
                if item in GGUF_SCALAR_SIZES:
                    if offset + count * GGUF_SCALAR_SIZES[item] > size:
                        fail(f"{what}: {count:,} items of {GGUF_SCALAR_SIZES[item]} bytes run past the end of the file")
                    return offset + count * GGUF_SCALAR_SIZES[item], scalars(offset, item, count)
                if item != GGUF_STRING:
                    fail(f"{what}: array item type {item} is not supported")
                if offset + count * 8 > size:  # every string takes at least its 8-byte length
                    fail(f"{what}: {count:,} strings cannot fit in the rest of the file")
                offset, items = strings(offset, count, what)
                try:
                    return offset, [raw.decode("utf-8") for raw in items]
                except UnicodeDecodeError:
                    return offset, None
            fail(f"{what}: value type {kind} is not supported")

        if bytes(data[:4]) != b"GGUF":
            fail(f"magic is {bytes(data[:4])!r}, expected b'GGUF'")
        version = read("<I", 4, "version")
        if version not in GGUF_VERSIONS:
            fail(f"version {version} (or a big-endian file); supported: little-endian versions "
                 f"{', '.join(map(str, GGUF_VERSIONS))}")
        n_tensors, n_fields = read("<Q", 8, "tensor count"), read("<Q", 16, "metadata count")
        offset, alignment = fixed, gguf.GGUF_DEFAULT_ALIGNMENT
        if n_fields * 13 > size or n_tensors * 24 > size:  # smallest metadata entry / tensor entry in bytes
            fail(f"header counts ({n_tensors:,} tensors, {n_fields:,} metadata entries) cannot fit in {size:,} bytes")
        # gguf.GGUFReader lists the header's own fields under these names; a metadata key may not reuse them.
        fields = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_fields}
        keys = set(fields)
        for i in range(n_fields):
            offset, raw_key = string(offset, f"metadata key #{i}")
            key = _utf8(raw_key)
            if key is None:
                fail(f"metadata key #{i} {raw_key!r:.60} is not UTF-8")
            if key in keys:
                fail(f"metadata key {key!r:.60} appears twice")
            keys.add(key)
            kind = read("<I", offset, f"metadata {key!r:.60} type")
            if key == "general.alignment":
                if kind != 4:
                    fail("general.alignment is not a uint32")
                alignment = read("<I", offset + 4, "general.alignment")
                if alignment == 0 or alignment & (alignment - 1):
                    fail(f"general.alignment {alignment} is not a power of two")
            offset, decoded = value(offset + 4, kind, f"metadata {key!r:.60}")
            if decoded is not None:
                fields[key] = decoded
        infos, names = [], set()
        for i in range(n_tensors):
            offset, raw_name = string(offset, f"tensor #{i} name")
            name = _utf8(raw_name)
            if name is None:
                fail(f"tensor #{i} name {raw_name!r:.60} is not UTF-8")
            label = f"tensor {name!r:.80}"
            if name in names:
                fail(f"{label} appears twice")
            names.add(name)
            n_dims = read("<I", offset, f"{label} rank")
            if not 1 <= n_dims <= GGUF_MAX_DIMS:
                fail(f"{label} has rank {n_dims}; GGUF allows 1..{GGUF_MAX_DIMS}")
            dims = [read("<Q", offset + 4 + 8 * j, f"{label} dims") for j in range(n_dims)]
            offset += 4 + 8 * n_dims
            kind, start = read("<I", offset, f"{label} type"), read("<Q", offset + 4, f"{label} offset")
            offset += 12
            try:
                tensor_type = gguf.GGMLQuantizationType(kind)
                block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
            except (ValueError, KeyError):
                fail(f"{label} has unknown tensor type {kind}")
            elements = math.prod(dims)
            if elements % block or (dims[0] % block):
                fail(f"{label} shape {tuple(reversed(dims))} is not a whole number of {block}-value blocks")
            infos.append((start, start + elements // block * type_size, label, tuple(reversed(dims)), name, tensor_type))
    data_start = -(-offset // alignment) * alignment
    data_size = size - data_start
    for start, end, label, shape, _, _ in sorted(infos):
        if start % alignment:
            fail(f"{label} data offset {start} is not a multiple of the alignment {alignment}")
        if end > data_size:
            fail(f"truncated or lying header: {label} {shape} needs bytes [{start:,}, {end:,}) of a "
                 f"{max(data_size, 0):,}-byte data section")
    spans = sorted(infos)
    for (_, end_a, a, *_), (start_b, _, b, *_) in zip(spans, spans[1:]):
        if start_b < end_a:
            fail(f"{a} and {b} overlap (data bytes {start_b:,} to {end_a:,})")
    tensors = {}
    if infos:
        # Every span is now inside the file: map it once, views per tensor (nothing is read until used).
        try:
            mapped = np.memmap(path, mode="r")
        except (OSError, ValueError) as exc:
            fail(f"cannot map the tensor data: {exc}")
        if mapped.size != size:
            fail(f"the file changed size while it was read ({size:,} then {mapped.size:,} bytes)")
        for start, end, _, shape, name, tensor_type in infos:
            view = mapped[data_start + start:data_start + end]
            plain = GGUF_PLAIN_TYPES.get(tensor_type.name)
            if plain is not None:
                view = view.view(plain).reshape(shape)
            else:
                view = view.reshape(gguf.quants.quant_shape_to_byte_shape(shape, tensor_type))
            tensors[name] = GGUFTensor(name, tensor_type, shape, view)
    return GGUFHeader(fields, tensors)


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _dequantize(tensor: GGUFTensor, path: Path) -> torch.Tensor:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in GGUF_TENSOR_TYPES:
        raise ModelFileError(f"{path}: tensor {tensor.name!r} has type {kind}; supported: {', '.join(GGUF_TENSOR_TYPES)}")
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
        with np.errstate(invalid="ignore", over="ignore"):  # a corrupt scale: refused by _load, not warned
            values = gguf.quants.dequantize(data, tensor.tensor_type)
        array = np.asarray(values, dtype=np.float32).reshape(tensor.shape)
    except (ValueError, IndexError) as exc:
        raise ModelFileError(f"{path}: tensor {tensor.name!r} data does not match its shape {tensor.shape} ({exc})") from None
    if not array.flags.writeable:  # a view of the file (F32): torch needs memory of its own
        array = array.copy()
    return torch.from_numpy(array)


def _gguf_names(c: LlamaConfig, lazy: dict, where) -> dict:
    tensors = {}

    def take(name, shape):
        if name not in lazy:
            raise ModelFileError(f"{where}: missing tensor {name!r} (expected shape {shape})")
        tensors[name] = lazy.pop(name)()
        return _take(tensors, name, shape, where)

    d, kv, f = c.width, c.kv_heads * c.head_width, c.ff_width
    state = {"embed_tokens.weight": take("token_embd.weight", (c.vocab_size, d))}
    for i in range(c.layers):
        g, ours = f"blk.{i}.", f"block.{i}."
        for src, dst, shape in (
            ("attn_norm.weight", "attention_norm.weight", (d,)),
            ("attn_q.weight", "attention.q_proj.weight", (d, d)),
            ("attn_k.weight", "attention.k_proj.weight", (kv, d)),
            ("attn_v.weight", "attention.v_proj.weight", (kv, d)),
            ("attn_output.weight", "attention.o_proj.weight", (d, d)),
            ("ffn_norm.weight", "feed_forward_norm.weight", (d,)),
            ("ffn_gate.weight", "feed_forward.gate_proj.weight", (f, d)),
            ("ffn_up.weight", "feed_forward.up_proj.weight", (f, d)),
            ("ffn_down.weight", "feed_forward.down_proj.weight", (d, f)),
        ):
            state[ours + dst] = take(g + src, shape)
    state["final_norm.weight"] = take("output_norm.weight", (d,))
    state["lm_head.weight"] = state["embed_tokens.weight"] if c.tie_embeddings else take("output.weight", (c.vocab_size, d))
    return _finish(state, lazy, where)
