"""Shared fixtures: exports are the slow part, so each preset/variant is exported once per session."""

from __future__ import annotations

import pytest

from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.presets import get_preset


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(preset_name, variant="stages") -> Artifact, cached for the session."""
    cache = {}

    def get(preset: str, variant: str = "stages"):
        key = (preset, variant)
        if key not in cache:
            spec = get_preset(preset)
            out = tmp_path_factory.mktemp(f"{preset}-{variant}") / "artifact"
            export_model(spec.build(), spec.family, spec.config, out, variant=variant, preset=spec.name, seed=spec.seed)
            cache[key] = open_artifact(out)
        return cache[key]

    return get


def pytest_collection_modifyitems(config, items):
    # The real-model module is by far the longest (a 30-layer export); start it first so that, with
    # `-n 2 --dist loadscope`, the other worker runs everything else meanwhile.
    items.sort(key=lambda item: 0 if "test_smollm2" in item.nodeid else 1)


# Fuzz tests report how many cases each parser ran; the lines reach the terminal summary even from
# xdist workers (user_properties travel with the test reports), so CI logs show the counts.
_FUZZ_LINES: list[str] = []


@pytest.fixture
def fuzz_summary(record_property):
    def report(line: str) -> None:
        print(line)
        record_property("fuzzed", line)

    return report


def pytest_runtest_logreport(report):
    if report.when == "call":
        _FUZZ_LINES.extend(value for key, value in report.user_properties if key == "fuzzed")


def pytest_terminal_summary(terminalreporter):
    if _FUZZ_LINES:
        terminalreporter.section("fuzzing")
        for line in sorted(_FUZZ_LINES):
            terminalreporter.write_line(line)
