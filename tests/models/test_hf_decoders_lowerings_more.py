"""The other half of the architectures through both lowerings, and the packed GroupQueryAttention cases
(tests/models/test_hf_decoders_lowerings.py says what each checks)."""

from __future__ import annotations

import pytest

from tests.models.test_hf_decoders import CASES, build, tokenizer  # noqa: F401  (tokenizer: a fixture)
from tests.models.test_hf_decoders_lowerings import FIRST_HALF, GQA, PACKED, export_and_check, through_both_lowerings


@pytest.mark.parametrize("name", [name for name in CASES if name not in FIRST_HALF])
def test_every_architecture_through_both_lowerings(tokenizer, tmp_path, name):  # noqa: F811
    through_both_lowerings(tokenizer, tmp_path, name)


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_group_query_attention_rebuilds_the_switches_inside_the_kernel(tokenizer, tmp_path, name):  # noqa: F811
    build(name, tokenizer, tmp_path / "hf", **PACKED[name])
    entry = export_and_check(tmp_path / "hf", tmp_path / "ort", "ort")
    assert (entry["attention_op"], entry["rotary_op"]) == (GQA, "inside GroupQueryAttention (do_rotary)")


def test_longrope_exports_checks_and_is_refused_by_the_cache_lowerings(tokenizer, tmp_path):  # noqa: F811
    """LongRoPE chooses its factors per call (max position + 1 past the original context of 16): the default
    lowering traces that choice, and check's two decode steps cross the switch against transformers (a prefill of
    15 positions takes the short factors, the step at position 16 the long ones); the
    standard and ort lowerings precompute cos/sin caches and refuse it in one line."""
    from tests.models.test_hf_decoders import COMMON, LENGTH_ROPE, randomize, transformers
    from tests.toolkit.test_cli import assert_user_error, invoke

    cls, keys = LENGTH_ROPE["phi3-longrope"]
    config = getattr(transformers, cls)(vocab_size=tokenizer.get_vocab_size(), **{**COMMON, **keys})
    randomize(transformers.AutoModelForCausalLM.from_config(config), 5).save_pretrained(tmp_path / "hf")
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "out")
    assert result.exit_code == 0 and "verified against the original" in result.output, result.output
    check = invoke("check", tmp_path / "out", "--decode-steps", 2, "--seq-len", 15, "--oracle", "transformers")
    assert check.exit_code == 0 and "oracle transformers: PASS" in check.output, check.output
    for lowering in ("standard", "ort"):
        refused = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / lowering, "--lowering", lowering)
        assert_user_error(refused, f"lowering '{lowering}' precomputes cos/sin caches", "'longrope'")
