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
