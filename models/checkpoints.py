"""Import real checkpoints: Hugging Face directories (safetensors) and GGUF files.

Only local paths; no code from the checkpoint runs (safetensors and GGUF are
plain data; chat templates render in a sandbox). Every import is validated
against the config: the first missing, unexpected or mis-shaped tensor is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.gpt import GPTConfig
from models.llama import DecoderConfig
from models.registry import build_model
from models.tokenizer import TextTokenizer
from toolkit.errors import ConfigError, ModelFileError

HF_ARCHITECTURES = ("llama (LlamaForCausalLM)", "gpt2 (GPT2LMHeadModel)")
GGUF_ARCHITECTURES = ("llama",)
GGUF_TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
# Buffers some checkpoints carry that are not weights (recomputed from the config here).
IGNORED_TENSORS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


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
    except ValueError as exc:
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


def _llama_config(hf: dict, where: Path) -> DecoderConfig:
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
        return DecoderConfig(
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
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{index}: invalid shard index ({exc})") from None
        files = sorted({directory / Path(name).name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory}: no *.safetensors files; only safetensors checkpoints are read")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelFileError(f"{file}: unreadable safetensors file ({exc})") from None
    return tensors


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


def _llama_names(c: DecoderConfig, tensors: dict, where) -> dict:
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


def _load(family: str, config, state: dict, where) -> torch.nn.Module:
    model = build_model(family, config, init=False)  # every weight is loaded next
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ModelFileError(f"{where}: no source tensor for {missing[0]!r}")
    model.load_state_dict({name: state[name] for name in expected})
    return model.eval()


# --------------------------------------------------------------------------- GGUF


def import_gguf(path: Path) -> ImportedCheckpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = field.contents()
        except (ValueError, IndexError, TypeError):
            continue
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

    def meta(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    tensors_by_name = {t.name: t for t in reader.tensors}
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = fields.get(f"{arch}.rope.scaling.factor", 1.0)
    if scaling not in ("none", None) or factor not in (0, 1, 1.0) or "rope_freqs.weight" in tensors_by_name:
        raise ModelFileError(f"{path}: RoPE scaling (type {scaling!r}, factor {factor}, rope_freqs "
                             f"{'present' if 'rope_freqs.weight' in tensors_by_name else 'absent'}) is not supported; "
                             "supported: unscaled RoPE")
    heads = int(meta("attention.head_count"))
    vocab = int(fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", [])))
    try:
        config = DecoderConfig(
            vocab_size=vocab, layers=int(meta("block_count")), width=int(meta("embedding_length")), heads=heads,
            kv_heads=int(meta("attention.head_count_kv", heads)), ff_width=int(meta("feed_forward_length")),
            max_positions=int(meta("context_length", 2048)), rope_base=float(meta("rope.freq_base", 10000.0)),
            eps=float(meta("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in tensors_by_name,
            # llama.cpp's converter permutes Q/K rows so that interleaved pairs (2i, 2i+1) rotate together.
            rope_pairing="interleaved",
        )
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    tensors = {name: (lambda t=t: _dequantize(t, path)) for name, t in tensors_by_name.items()}
    state = _gguf_names(config, tensors, path)
    model = _load("llama", config, state, path)
    tokenizer = TextTokenizer.from_gguf(fields) if "tokenizer.ggml.tokens" in fields else None
    source = {"format": "gguf", "path": str(path), "architecture": arch}
    return ImportedCheckpoint("llama", config, model, tokenizer, source)


def _dequantize(tensor, path: Path) -> torch.Tensor:
    import gguf

    kind = tensor.tensor_type.name
    if kind not in GGUF_TENSOR_TYPES:
        raise ModelFileError(f"{path}: tensor {tensor.name!r} has type {kind}; supported: {', '.join(GGUF_TENSOR_TYPES)}")
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest-varying axis first
    try:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        array = np.asarray(values, dtype=np.float32).reshape(shape)
    except (ValueError, IndexError) as exc:
        raise ModelFileError(f"{path}: tensor {tensor.name!r} data does not match its shape {shape} ({exc})") from None
    return torch.from_numpy(array.copy())


def _gguf_names(c: DecoderConfig, lazy: dict, where) -> dict:
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
