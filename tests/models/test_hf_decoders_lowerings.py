"""Lowerings and quantization of the imported architectures (tests/models/test_hf_decoders.py's cases)."""

from __future__ import annotations

import pytest

from tests.models.test_hf_decoders import SEQ, build, tokenizer  # noqa: F401  (tokenizer: a fixture)
from tests.toolkit.test_cli import assert_user_error, invoke


@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_rope_scaling_and_head_dim_through_every_lowering(tokenizer, tmp_path, lowering):  # noqa: F811
    directory = tmp_path / "hf"
    build("llama3", tokenizer, directory)
    out = tmp_path / "artifact"
    result = invoke("export", "--from", directory, "--out", out, "--lowering", lowering)
    assert result.exit_code == 0, result.output
    check = invoke("check", out, "--decode-steps", 2, "--seq-len", SEQ - 2)
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize(
    "name,switch", [("qwen3", "qk_norm='head'"), ("mistral", "sliding_window=5"), ("qwen2", "attention_bias='qkv'")]
)
@pytest.mark.parametrize("lowering", ["standard", "ort"])
def test_lowering_refuses_a_switch_it_does_not_rebuild(tokenizer, tmp_path, name, switch, lowering):  # noqa: F811
    directory = tmp_path / "hf"
    build(name, tokenizer, directory)
    result = invoke("export", "--from", directory, "--out", tmp_path / "artifact", "--lowering", lowering)
    assert_user_error(result, f"lowering '{lowering}' does not rebuild", switch, "--lowering functions")
    assert not (tmp_path / "artifact").exists()


def test_quantize_check_and_generate_a_gemma3_export(tokenizer, tmp_path):  # noqa: F811
    """The rest of the path on the switch-heaviest family: 8-bit weights (block 32, so widths of 64), check of
    the quantized artifact against its own dequantized float64 model, and generation from it."""
    build(
        "gemma3", tokenizer, tmp_path / "hf", hidden_size=64, num_attention_heads=4, intermediate_size=96, head_dim=16
    )
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "float")
    assert result.exit_code == 0, result.output
    result = invoke("quantize", tmp_path / "float", "--bits", 8, "--out", tmp_path / "q8", "--greedy-tokens", 8)
    assert result.exit_code == 0, result.output
    check = invoke("check", tmp_path / "q8", "--backends", "eager,ort-cpu", "--decode-steps", 2)
    assert check.exit_code == 0, check.output
    generated = invoke("generate", tmp_path / "q8", "--prompt", "the quick", "--max-new-tokens", 6)
    assert generated.exit_code == 0 and generated.stdout.strip(), generated.output
