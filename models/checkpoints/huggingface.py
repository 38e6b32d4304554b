"""Hugging Face directories: config.json to our config dataclasses, safetensors names to our parameter names.

Every key of config.json is implemented, known not to change the computation, or refused
(config_keys.KeyPolicy): the lists below are per architecture, and each group of inert keys says why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from artifact.errors import ConfigError, ModelFileError
from models.checkpoints.config_keys import KeyPolicy, Only, refusal
from models.checkpoints.hf_config import read_hf_config
from models.checkpoints.hf_decoders import ARCHITECTURES, decoder_config, decoder_key_policy, decoder_names
from models.checkpoints.loading import ImportedCheckpoint, OpenedCheckpoint, finish_state, load_model, take_tensor
from models.checkpoints.safetensors_reader import header_tensors, read_safetensors
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.presets_limits import check_footprint
from models.tokenizer import TextTokenizer

HF_ARCHITECTURES = (*(f"{t} ({cls})" for t, cls in ARCHITECTURES.items()), "gpt2 (GPT2LMHeadModel)")

# PretrainedConfig's own keys and transformers' bookkeeping; none changes what LlamaForCausalLM or
# GPT2LMHeadModel compute from input ids.
HF_INERT = frozenset(
    {
        # Provenance: which class, library version, path and revision wrote the file.
        "architectures",
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation_autoset",
        # The storage dtype: tensors are read as stored and computed in float32 (the export dtype is an option).
        "dtype",
        "torch_dtype",
        # What the forward returns and whether it keeps a KV cache, not the values it computes.
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        # Token ids the tokenizer and generation use (generation_config.json's eos_token_id is read with the
        # tokenizer), never the forward.
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        # Training only: initialisation and dropout (inference runs in eval mode, where dropout is the identity).
        "initializer_range",
        "attention_dropout",
        # Sequence-classification heads and fine-tuning tasks, which a causal LM does not have.
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "finetuning_task",
        # Encoder-decoder wiring, which neither causal-LM class reads.
        "is_encoder_decoder",
        "is_decoder",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        # Chunks the feed-forward over positions: the same function computed in pieces.
        "chunk_size_feed_forward",
        # Defaults for transformers' generate() and pipelines: decoding policy, not the model's function;
        # `toolkit generate` and `toolkit serve` take theirs from their options and requests.
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "task_specific_params",
        # Tokenizer bookkeeping: the tokenizer is read from tokenizer.json.
        "tokenizer_class",
        "prefix",
        # TensorFlow-only flags.
        "use_bfloat16",
        "tf_legacy_loss",
    }
)
# Keys of PretrainedConfig that change the model unless they are at their neutral value.
HF_ONLY = {
    # Pruned heads remove rows of the attention projections.
    "pruned_heads": Only(lambda v, raw, ours: not v, "{} (no pruned heads)"),
    # Cross-attention blocks attend to an encoder this import has no input for.
    "add_cross_attention": Only(lambda v, raw, ours: v is None or v is False, "false"),
}


DECODER_KEYS = {t: decoder_key_policy(t, HF_INERT, HF_ONLY) for t in ARCHITECTURES}
LLAMA_KEYS = DECODER_KEYS["llama"]


GPT2_KEYS = KeyPolicy(
    "gpt2",
    implemented=frozenset(
        {
            "model_type",
            "vocab_size",
            "n_embd",
            "n_head",
            "n_inner",
            "n_positions",
            "n_layer",
            "layer_norm_epsilon",
            "activation_function",
            "tie_word_embeddings",
        }
    ),
    only={
        **HF_ONLY,
        "scale_attn_weights": Only(
            lambda v, raw, ours: v is None or v is True, "true (scores scaled by 1/sqrt(head width))"
        ),
        "scale_attn_by_inverse_layer_idx": Only(lambda v, raw, ours: v is None or v is False, "false"),
        # transformers no longer reads n_ctx; one that is not the context contradicts n_positions.
        "n_ctx": Only(
            lambda v, raw, ours: v is None or v == ours.context,
            lambda raw, ours: f"null or n_positions = {ours.context}",
        ),
    },
    inert=HF_INERT
    | {
        # Dropout: the identity at inference.
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        # GPT2DoubleHeadsModel's multiple-choice head, which GPT2LMHeadModel does not have.
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        # The same attention with the scale applied before the matmul in float32: only float16/bfloat16
        # rounding differs, never the function.
        "reorder_and_upcast_attn",
    },
)


def import_huggingface(directory: Path, *, keep_dtype: bool = False) -> ImportedCheckpoint:
    return open_huggingface(directory, keep_dtype=keep_dtype).load()


def open_huggingface(directory: Path, *, keep_dtype: bool = False) -> OpenedCheckpoint:
    """The directory's config, tokenizer and tensor names and shapes, checked; its weights are read by
    read_model() (float32, or with keep_dtype float16/bfloat16 as stored)."""
    family, config, model_type, expected = hf_model_config(directory)
    stored = {}
    expected(config, header_tensors(directory, stored), directory)  # names and shapes, before any data is read
    source = {"format": "huggingface", "path": str(directory), "architecture": model_type}
    if stored:  # the dtype most of the weights are stored in: what `toolkit export` keeps by default
        source["dtype"] = max(stored, key=stored.get)

    def read_model():
        state = expected(config, read_safetensors(directory, keep_dtype=keep_dtype), directory)
        return load_model(family, config, state, directory, assign=True)  # the tensors read are ours

    return OpenedCheckpoint(family, config, TextTokenizer.from_hf_dir(directory), source, read_model)


def hf_model_config(directory: Path):
    """(family, our config, model_type, the tensor-name mapping) from a directory's config.json alone: typed,
    every key implemented, inert or refused, the size the weights will take checked; no tensor is read."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ModelFileError(f"{directory}: missing config.json; is this a Hugging Face model directory?")
    hf = read_hf_config(config_path)
    model_type = hf.get("model_type")
    if model_type in ARCHITECTURES:
        config = decoder_config(hf, config_path, model_type, _tie(hf, False, config_path, model_type))
        family, keys = "llama", DECODER_KEYS[model_type]

        def expected(c, tensors, where):
            return _decoder_names(c, tensors, where, model_type)

    elif model_type == "gpt2":
        family, config, expected, keys = "gpt", _gpt2_config(hf, config_path), _gpt2_names, GPT2_KEYS
    else:
        raise ModelFileError(
            f"{config_path}: model_type {model_type!r:.60} is not supported; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    keys.check(hf, config, config_path)
    check_footprint(family, config, config_path, ModelFileError)  # before a module is built for it
    return family, config, model_type, expected


def _get(hf: dict, key: str, where: Path, default=None, required=True):
    if key in hf and hf[key] is not None:
        return hf[key]
    if required and default is None:
        raise ModelFileError(f"{where}: missing {key!r}")
    return default


def _tie(hf: dict, default: bool, where: Path, importer: str) -> bool:
    value = hf.get("tie_word_embeddings")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refusal(where, "tie_word_embeddings", value, importer, "true or false")
    return value


GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gpt2_config(hf: dict, where: Path) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in GPT2_ACTIVATIONS:
        raise refusal(where, "activation_function", act, "gpt2", ", ".join(GPT2_ACTIVATIONS))
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
            activation=GPT2_ACTIVATIONS[act],
            tie_embeddings=_tie(hf, True, where, "gpt2"),
        )
    except (ConfigError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: {exc}") from None


def _decoder_names(c: LlamaConfig, tensors: dict, where, model_type: str) -> dict:
    state = decoder_names(c, tensors, where, model_type)
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
    """The output projection as tie_word_embeddings says, refusing weights that contradict it."""
    shape = (c.vocab_size, c.width)
    if c.tie_embeddings:
        # Some tied checkpoints still store the copy; a copy that differs is a head transformers would drop.
        # (Its values are compared when they are read: the headers' meta tensors have none.)
        stored = tensors.pop("lm_head.weight", None)
        embedding = state["embed_tokens.weight"]
        differs = stored is not None and not stored.is_meta and not torch.equal(stored, embedding)
        if stored is not None and (stored.shape != embedding.shape or differs):
            raise ModelFileError(
                f"{where}: tie_word_embeddings=true but the stored 'lm_head.weight' differs from the token "
                "embedding; supported: tied (no lm_head.weight, or a copy of the embedding) or "
                "tie_word_embeddings=false with its own lm_head.weight"
            )
        state["lm_head.weight"] = embedding
    elif "lm_head.weight" not in tensors:
        raise ModelFileError(
            f"{where}: tie_word_embeddings=false but there is no tensor 'lm_head.weight' (expected shape {shape}); "
            "supported: an untied checkpoint with its lm_head.weight, or tie_word_embeddings=true"
        )
    else:
        state["lm_head.weight"] = take_tensor(tensors, "lm_head.weight", shape, where)
