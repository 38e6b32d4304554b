"""Lowerings and quantization of the imported architectures (tests/models/test_hf_decoders.py's cases).

Every architecture goes through the standard and ort lowerings: `toolkit export --from --lowering`, then
`toolkit check` with two cached decode steps (the KV-cache graph with past_mask and position_ids; on
GroupQueryAttention graphs through ONNX Runtime's shared cache buffer) against float64 eager and against
transformers, over SEQ positions: past the sliding window of 5 and past the scaled RoPE's original context.
"""

from __future__ import annotations

import json

import pytest

from exporters.lowerings import lowering_support
from models.checkpoints import import_checkpoint
from tests.models.test_hf_decoders import CASES, SEQ, build, tokenizer, transformers  # noqa: F401  (tokenizer: a fixture)
from tests.toolkit.test_cli import invoke

# Head widths of 16 (rotated widths of 16) send GroupQueryAttention the packed QKV and let it rotate: the
# switches that must then happen inside the kernel or in the packed projection.
PACKED = {
    "gemma2": dict(head_dim=16),  # local_window_size on alternate layers, softcap and query_pre_attn_scalar
    "qwen2": dict(hidden_size=96),  # the q/k/v biases in the packed QKV
    "smollm3": dict(hidden_size=96),  # a layer without RoPE: do_rotary off for that layer only
    "phi3": dict(hidden_size=192),  # 16 of 32 dims rotated, and a window on every layer
}
GQA = "com.microsoft::GroupQueryAttention"
# The cases whose head width is a multiple of 8, which GroupQueryAttention takes (the others run Attention).
GQA_CASES = ("llama3", "qwen3", "gemma2", "gemma3", "phi3", "pythia", "gpt-neox-sequential")


def export_and_check(directory, out, lowering) -> dict:
    """export --from with the lowering, check against float64 eager and transformers; the graph's manifest entry.
    (The check's oracle compares with transformers layer by layer, so the export's own verification is skipped.)"""
    result = invoke("export", "--from", directory, "--out", out, "--lowering", lowering, "--no-verify")
    assert result.exit_code == 0, result.output
    check = invoke("check", out, "--decode-steps", 2, "--seq-len", SEQ - 2, "--oracle", "transformers")
    assert check.exit_code == 0, check.output
    assert "oracle transformers: PASS" in check.output and "decode.1.logits" in check.output, check.output
    return json.loads((out / "manifest.json").read_text())["graphs"][0]


# Half of the cases here, half in test_hf_decoders_lowerings_more.py: CI's --dist loadscope runs a module on one
# worker, so the two halves run side by side.
FIRST_HALF = list(CASES)[: len(CASES) // 2]


@pytest.mark.parametrize("name", FIRST_HALF)
def test_every_architecture_through_both_lowerings(tokenizer, tmp_path, name):  # noqa: F811
    through_both_lowerings(tokenizer, tmp_path, name)


def through_both_lowerings(tokenizer, tmp_path, name):  # noqa: F811
    directory = tmp_path / "hf"
    build(name, tokenizer, directory)
    support = lowering_support("llama", import_checkpoint(directory).config)
    assert support == {"functions": None, "standard": None, "ort": None}, support
    assert export_and_check(directory, tmp_path / "standard", "standard")["attention_op"] == "Attention (opset 23)"
    attention = export_and_check(directory, tmp_path / "ort", "ort")["attention_op"]
    assert attention == (GQA if name in GQA_CASES else "Attention (opset 23)")


@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_gpt2_through_both_lowerings(tokenizer, tmp_path, lowering):  # noqa: F811
    """GPT-2 imports as the gpt family (learned positions, so attention without RoPE; biases on every projection):
    export --from with the lowering, verified against transformers; check with the transformers oracle, three cached
    decode steps, the standard lowering's on the ONNX reference evaluator too; greedy generation of 20 tokens
    token-identical to transformers' generate. Head width 8: the ort lowering's GroupQueryAttention."""
    from tests.models.hf_cli import check_and_generate
    from tests.models.test_checkpoints import hf_gpt2
    from tests.models.test_hf_decoders import MAX_POS, save_with_tokenizer

    directory = tmp_path / "hf"
    hf = save_with_tokenizer(hf_gpt2(seed=9, vocab=tokenizer.get_vocab_size(), positions=MAX_POS), tokenizer, directory)
    imported = import_checkpoint(directory)
    assert imported.family == "gpt" and imported.config.attention_bias
    assert lowering_support("gpt", imported.config) == {"functions": None, "standard": None, "ort": None}
    out = tmp_path / lowering
    check = check_and_generate("gpt2", hf, tokenizer, directory, out, "--lowering", lowering)
    assert "decode.2.logits" in check
    reference = [line.split()[:2] for line in check.splitlines() if line.startswith("onnx-reference")]
    assert reference == ([["onnx-reference", "PASS"]] if lowering == "standard" else []), check
    entry = json.loads((out / "manifest.json").read_text())["graphs"][0]
    want = {"standard": "Attention (opset 23)", "ort": GQA}[lowering]
    assert (entry["attention_op"], entry["rotary_op"]) == (want, None)


def test_quantize_check_and_generate_a_gemma3_export(tokenizer, tmp_path):  # noqa: F811
    """The rest of the path on the switch-heaviest family: 8-bit weights (block 32, so widths of 64), check of
    the quantized artifact against its own dequantized float64 model, and generation from it."""
    build(
        "gemma3", tokenizer, tmp_path / "hf", hidden_size=64, num_attention_heads=4, intermediate_size=96, head_dim=16
    )
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "float")
    assert result.exit_code == 0, result.output
    # GeGLU is one node that takes its weights in the stored [out, in] layout, as SwiGLU does: the export writes
    # them as the checkpoint holds them (copied from the file), not transposed copies made in memory.
    entry = json.loads((tmp_path / "float" / "manifest.json").read_text())["graphs"][0]
    assert entry["custom_ops"] == ["GeGLU", "RMSNorm"]
    ffn = {k: v["transpose"] for k, v in entry["weights"].items() if ".feed_forward." in k}
    assert len(ffn) == 3 * import_checkpoint(tmp_path / "hf").config.layers and not any(ffn.values()), ffn
    q8 = ("--bits", 8, "--accuracy-level", 0, "--out", tmp_path / "q8", "--greedy-tokens", 8)  # checkable exactly
    result = invoke("quantize", tmp_path / "float", *q8)
    assert result.exit_code == 0, result.output
    check = invoke("check", tmp_path / "q8", "--backends", "eager,ort-cpu", "--decode-steps", 2)
    assert check.exit_code == 0, check.output
    generated = invoke("generate", tmp_path / "q8", "--prompt", "the quick", "--max-new-tokens", 6)
    assert generated.exit_code == 0 and generated.stdout.strip(), generated.output
