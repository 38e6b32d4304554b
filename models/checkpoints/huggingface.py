"""Hugging Face directories: config.json to our config dataclasses, safetensors names to our parameter names."""

from __future__ import annotations

import json
from pathlib import Path

from artifact.errors import ConfigError, ModelFileError
from models.checkpoints.loading import ImportedCheckpoint, finish_state, load_model, take_tensor
from models.checkpoints.safetensors_reader import read_safetensors
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.tokenizer import TextTokenizer

HF_ARCHITECTURES = ("llama (LlamaForCausalLM)", "gpt2 (GPT2LMHeadModel)")


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
        raise ModelFileError(
            f"{config_path}: model_type {model_type!r} is not supported; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    tensors = read_safetensors(directory)
    state = expected(config, tensors, directory)
    model = load_model(family, config, state, directory)
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
        raise ModelFileError(
            f"{where}: head_dim {hf['head_dim']} != hidden_size/num_attention_heads "
            f"= {width // heads}; decoupled head widths are not supported"
        )
    try:
        return LlamaConfig(
            vocab_size=_get(hf, "vocab_size", where),
            layers=_get(hf, "num_hidden_layers", where),
            width=width,
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
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
        raise ModelFileError(
            f"{where}: activation_function {act!r} is not supported; supported: {', '.join(activations)}"
        )
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ModelFileError(f"{where}: non-standard attention scaling is not supported")
    width = _get(hf, "n_embd", where)
    try:
        return GPTConfig(
            vocab_size=_get(hf, "vocab_size", where),
            width=width,
            heads=_get(hf, "n_head", where),
            ff_width=hf.get("n_inner") or 4 * width,
            context=_get(hf, "n_positions", where),
            layers=_get(hf, "n_layer", where),
            eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            attention_bias=True,
            activation=activations[act],
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    except ConfigError as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def _llama_names(c: LlamaConfig, tensors: dict, where) -> dict:
    d, kv, f = c.width, c.kv_heads * c.head_width, c.ff_width
    state = {"embed_tokens.weight": take_tensor(tensors, "model.embed_tokens.weight", (c.vocab_size, d), where)}
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
            state[ours + dst] = take_tensor(tensors, hf + src, shape, where)
    state["final_norm.weight"] = take_tensor(tensors, "model.norm.weight", (d,), where)
    _take_lm_head(state, tensors, c, where)
    return finish_state(state, tensors, where)


def _gpt2_names(c: GPTConfig, tensors: dict, where) -> dict:
    # Strip the optional "transformer." prefix; GPT-2's Conv1D stores weights as [in, out].
    tensors.update({n.removeprefix("transformer."): tensors.pop(n) for n in list(tensors)})
    d, f = c.width, c.ff_width

    def take(name, shape):
        return take_tensor(tensors, name, shape, where)

    state = {
        "embed_tokens.weight": take("wte.weight", (c.vocab_size, d)),
        "embed_positions.weight": take("wpe.weight", (c.context, d)),
    }
    for i in range(c.layers):
        hf, ours = f"h.{i}.", f"block.{i}."
        state[ours + "attention_norm.weight"] = take(hf + "ln_1.weight", (d,))
        state[ours + "attention_norm.bias"] = take(hf + "ln_1.bias", (d,))
        qkv = take(hf + "attn.c_attn.weight", (d, 3 * d)).T  # (3d, d): rows q, k, v
        qkv_bias = take(hf + "attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            state[ours + f"attention.{name}.weight"] = qkv[j * d : (j + 1) * d].contiguous()
            state[ours + f"attention.{name}.bias"] = qkv_bias[j * d : (j + 1) * d].contiguous()
        state[ours + "attention.o_proj.weight"] = take(hf + "attn.c_proj.weight", (d, d)).T.contiguous()
        state[ours + "attention.o_proj.bias"] = take(hf + "attn.c_proj.bias", (d,))
        state[ours + "feed_forward_norm.weight"] = take(hf + "ln_2.weight", (d,))
        state[ours + "feed_forward_norm.bias"] = take(hf + "ln_2.bias", (d,))
        state[ours + "feed_forward.up_proj.weight"] = take(hf + "mlp.c_fc.weight", (d, f)).T.contiguous()
        state[ours + "feed_forward.up_proj.bias"] = take(hf + "mlp.c_fc.bias", (f,))
        state[ours + "feed_forward.down_proj.weight"] = take(hf + "mlp.c_proj.weight", (f, d)).T.contiguous()
        state[ours + "feed_forward.down_proj.bias"] = take(hf + "mlp.c_proj.bias", (d,))
    state["final_norm.weight"] = take("ln_f.weight", (d,))
    state["final_norm.bias"] = take("ln_f.bias", (d,))
    _take_lm_head(state, tensors, c, where)
    return finish_state(state, tensors, where)


def _take_lm_head(state: dict, tensors: dict, c: LlamaConfig | GPTConfig, where) -> None:
    if c.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints still store the copy
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = take_tensor(tensors, "lm_head.weight", (c.vocab_size, c.width), where)
