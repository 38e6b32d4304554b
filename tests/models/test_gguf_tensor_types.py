"""GGUF files whose matrices are BF16, Q5_0/Q5_1 or K-quants (Q2_K to Q6_K), held to the gguf library's dequantizer
and to llama.cpp on the same file.

Each file is a random transformers Llama written as llama.cpp's converter writes it (tests/models/test_checkpoints.py's
writer) with every matrix of one type: gguf.quants quantizes BF16, Q5_0 and Q5_1; the K-quants are random valid
blocks (tests/models/test_checkpoints_gguf.py's `quantized`). Widths are 256 so every row is whole super-blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoints import import_checkpoint
from tests.models import test_checkpoints as checkpoints
from tests.models.test_checkpoints import hf_llama, write_gguf
from tests.models.test_checkpoints_gguf import K_QUANT_SCALES, quantized
from tests.optional import LLAMACPP, import_or_skip

gguf = import_or_skip("gguf", "GGUF test files are written with the gguf library")
import_or_skip("transformers", "the tiny GGUF files are written from a random transformers Llama")

bpe = checkpoints.bpe  # the fixture: a small byte-level BPE vocabulary
Q = gguf.GGMLQuantizationType
TYPES = [Q.BF16, Q.Q5_0, Q.Q5_1, *K_QUANT_SCALES]
SEQ, STEPS = 12, 4
# Our names of llama.cpp's (the llama import keeps llama.cpp's Q/K row order: its RoPE pairs are interleaved).
OURS = {
    "token_embd.weight": "embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "final_norm.weight",
    **{
        f"blk.{{}}.{theirs}.weight": f"block.{{}}.{ours}.weight"
        for theirs, ours in (
            ("attn_norm", "attention_norm"),
            ("attn_q", "attention.q_proj"),
            ("attn_k", "attention.k_proj"),
            ("attn_v", "attention.v_proj"),
            ("attn_output", "attention.o_proj"),
            ("ffn_norm", "feed_forward_norm"),
            ("ffn_gate", "feed_forward.gate_proj"),
            ("ffn_up", "feed_forward.up_proj"),
            ("ffn_down", "feed_forward.down_proj"),
        )
    },
}


def our_name(name: str) -> str:
    if name.startswith("blk."):
        layer = name.split(".")[1]
        return OURS[name.replace(f"blk.{layer}.", "blk.{}.", 1)].format(layer)
    return OURS[name]


@pytest.fixture(scope="module", params=TYPES, ids=[t.name for t in TYPES])
def typed_file(request, bpe, tmp_path_factory):
    """(type, GGUF path, the bytes written by tensor name)."""
    kind = request.param
    rng = np.random.default_rng(int(kind))
    hf = hf_llama(vocab=len(bpe[1]), width=256, heads=4, kv_heads=2, ff=256, seed=int(kind))
    path = tmp_path_factory.mktemp(kind.name) / f"{kind.name}.gguf"
    # "default": llama.cpp's plain byte-level BPE, so llama.cpp loads the file's vocabulary.
    written = write_gguf(path, hf, bpe, qtype=kind, pre="default", quantize=lambda a, k: quantized(a, k, rng))
    return kind, path, written


def test_weights_are_the_library_s_dequantization(typed_file):
    """Every imported weight is, bit for bit, gguf.quants.dequantize of the bytes the test wrote."""
    kind, path, written = typed_file
    state = import_checkpoint(path).model.state_dict()
    assert sum(data.dtype == np.uint8 for data in written.values()) == 2 * 7 + 2  # every matrix is `kind`
    for name, data in written.items():
        want = gguf.quants.dequantize(data, kind) if data.dtype == np.uint8 else data
        got = state[our_name(name)].numpy()
        assert got.dtype == np.float32 and got.tobytes() == want.astype(np.float32).tobytes(), name


@torch.no_grad()
def test_logits_match_llama_cpp(typed_file):
    """Our float64 model on the dequantized weights against llama.cpp's kernels on the same file, within the
    `toolkit check --oracle llama.cpp` bound of the file's precision (bfloat16 3e-2, quantized 5e-2 relative RMS);
    llama.cpp rounds the activations to bfloat16 or 8-bit blocks, so the values are not float32 noise."""
    import_or_skip("llama_cpp", "the llama.cpp oracle is the [llamacpp] extra", LLAMACPP)
    from toolkit.check.llamacpp import TOLERANCES, gguf_precision, judge_llama_cpp, rebuild_logits, run_llama_cpp

    kind, path, _ = typed_file
    precision = gguf_precision(path)
    assert precision == ("bfloat16" if kind == Q.BF16 else "quantized")
    model = import_checkpoint(path).model.to(torch.float64)
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, (1, SEQ))
    run = run_llama_cpp(path, prompt, STEPS)
    ours = rebuild_logits(model, np.concatenate([run.prompt, run.tokens], axis=1))
    comparison, extra = judge_llama_cpp(run, ours, precision)
    values = [(row.name, row.value) for row in comparison.outputs]
    assert all(0 < row.value < TOLERANCES[precision] for row in comparison.outputs), values
    assert extra["greedy_agreement"] >= 0.75, extra
