"""The CLI path (tests/models/hf_cli.py) for llama3, llama-linear, llama-yarn, llama-bias-head-dim, mistral, qwen2, qwen2-sliding, qwen2.5-yarn, qwen3."""

from __future__ import annotations

import pytest

from tests.models.hf_cli import export_check_generate
from tests.models.test_hf_decoders import CASES, tokenizer  # noqa: F401  (tokenizer: a fixture)

NAMES = [
    "llama3",
    "llama-linear",
    "llama-yarn",
    "llama-bias-head-dim",
    "mistral",
    "qwen2",
    "qwen2-sliding",
    "qwen2.5-yarn",
    "qwen3",
]


def test_every_case_is_in_one_cli_module():
    from tests.models import test_hf_decoders_cli, test_hf_decoders_cli_more

    assert sorted(test_hf_decoders_cli.NAMES + test_hf_decoders_cli_more.NAMES) == sorted(CASES)


@pytest.mark.parametrize("name", NAMES)
def test_export_check_and_generate_through_the_cli(name, tokenizer, tmp_path):  # noqa: F811
    export_check_generate(name, tokenizer, tmp_path)
