"""benchmarks/llamacpp_offgrid.py: the float32 GGUF it writes from a Hugging Face Llama is that model to llama.cpp."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.optional import LLAMACPP, import_or_skip

transformers = import_or_skip("transformers", "the checkpoint is a transformers Llama")
import_or_skip("gguf", "the file is written with the gguf library")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("llamacpp_offgrid", BENCHMARKS / "llamacpp_offgrid.py")
offgrid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(offgrid)


@torch.no_grad()
def test_llama_cpp_reads_the_written_file_as_the_checkpoint(smollm2, tmp_path):
    """Random weights large enough that attention is far from uniform, so q/k rows in the wrong order (the
    rotate-half to interleaved permutation left out) move the logits well past the tolerance."""
    llama_cpp = import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.15,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:  # gains away from one, so a norm read as another tensor shows
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    out = tmp_path / "model.F32.gguf"
    offgrid.write_float_gguf(hf, out, smollm2)
    ids = np.random.default_rng(1).integers(0, 49152, 24).tolist()
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    ours = model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(ours).max()
    assert scale > 1.0
    # llama.cpp keeps its KV cache in float16: about 2e-3 of the largest logit here
    assert np.abs(ours - theirs).max() < 5e-3 * scale, np.abs(ours - theirs).max() / scale


def test_a_checkpoint_with_more_than_a_plain_llama_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "attention_bias": true}')
    with pytest.raises(SystemExit, match="attention_bias"):
        offgrid.write_float_gguf(tmp_path, tmp_path / "x.gguf", tmp_path / "unused.gguf")


def test_permute_interleaves_each_heads_halves():
    rows = np.arange(8, dtype=np.float32)[:, None]  # one head of 8 rows: halves [0..3] and [4..7]
    assert offgrid.permute(rows, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    two = np.arange(8, dtype=np.float32)[:, None]  # two heads of 4 rows each
    assert offgrid.permute(two, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
