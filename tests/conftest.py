"""Shared fixtures: exports are the slow part, so each preset/variant is exported once per session."""

from __future__ import annotations

import collections
import os

import pytest
import torch

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


def pytest_configure(config):
    # The controller schedules the modules in the order the workers collected them (pytest_collection_modifyitems
    # below), not xdist's by number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # Each xdist worker's torch takes every core by default, so `-n 2` on two cores runs four busy threads
    # and loses about a sixth of the suite's time to their hand-offs. A worker gets its share of the cores,
    # and so do the commands it starts (OMP_NUM_THREADS), unless the caller chose a count.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# The longest modules (`--durations=0` of the whole suite under `-n 2 --dist loadscope`, about 40-150 s each),
# handed out first: xdist's default order, by number of tests, leaves the single-test memory modules to the end,
# where one worker runs them alone while the other has finished. Order only balances the workers.
LONGEST_FIRST = (
    "tests/exporters/test_export_memory.py",
    "tests/toolkit/quantize/test_quantize_memory.py",
    "tests/models/test_hf_decoders_lowerings_more.py",
    "tests/models/test_hf_decoders_lowerings.py",
    "tests/toolkit/check/test_tightness.py",
    "tests/exporters/test_lowering_switches.py",
    "tests/toolkit/serve/test_server_hardening.py",
    "tests/toolkit/serve/test_ray_serve.py",
    "tests/exporters/test_replicate.py",
    "tests/toolkit/test_hostile_cli.py",
    "tests/toolkit/test_smollm2.py",
)


def pytest_collection_modifyitems(config, items):
    # The rest follow by number of tests, as xdist orders them (its own reordering is off: pytest_configure).
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def rank(item):
        module = item.nodeid.split("::")[0]
        return (LONGEST_FIRST.index(module), 0) if module in LONGEST_FIRST else (len(LONGEST_FIRST), -counts[module])

    items.sort(key=rank)


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
