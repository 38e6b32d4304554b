"""benchmarks/gguf_shape.py: the random-weight GGUF both engines race on is one model to both of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.checkpoints import import_checkpoint
from tests.optional import LLAMACPP, import_or_skip

gguf = import_or_skip("gguf", "the file is written with the gguf library")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_shape.py"
_spec = importlib.util.spec_from_file_location("gguf_shape", SCRIPT)
gguf_shape = sys.modules["gguf_shape"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(gguf_shape)


@pytest.fixture(scope="module", params=gguf_shape.TYPES)
def written(request, smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / f"tiny.{request.param.upper()}.gguf"
    return path, gguf_shape.write(path, gguf_shape.SHAPES["tiny"], request.param, smollm2)


def test_the_import_is_the_written_blocks_and_shape(written):
    path, blocks = written
    imported = import_checkpoint(path)
    shape, config = gguf_shape.SHAPES["tiny"], imported.model.config
    assert (config.width, config.layers, config.ff_width, config.heads, config.kv_heads, config.vocab_size) == (
        shape.hidden, shape.layers, shape.ffn, shape.heads, shape.kv_heads, 49152,
    )  # fmt: skip
    assert config.tie_embeddings and config.rope_base == shape.rope_base
    state = imported.model.state_dict()
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert (
        state["embed_tokens.weight"].numpy().tobytes()
        == gguf.quants.dequantize(blocks["token_embd.weight"], kinds["token_embd.weight"]).astype(np.float32).tobytes()
    )
    layer = "blk.1.ffn_down.weight"
    want = gguf.quants.dequantize(blocks[layer], kinds[layer]).astype(np.float32)
    assert state["block.1.feed_forward.down_proj.weight"].numpy().tobytes() == want.tobytes()
    assert len(blocks) == 1 + 7 * shape.layers


@torch.no_grad()
def test_llama_cpp_computes_the_same_model(written):
    """llama.cpp reads the same file as the same model: its logits (activations rounded to Q8 blocks, as its
    quantized dot products do) are the import's float32 logits to within a few hundredths."""
    llama_cpp = import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    path, _ = written
    ids = np.random.default_rng(1).integers(0, 49152, 16).tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    ours = import_checkpoint(path).model(torch.tensor([ids]))["logits"][0].numpy()
    scale = np.abs(ours).max()
    assert scale > 0.5  # random weights of std 0.02 still give logits of order one through the tied head
    assert np.abs(ours - theirs).max() < 0.02 * scale, np.abs(ours - theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9
