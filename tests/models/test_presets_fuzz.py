"""Fuzzing config files: load_config_file on drawn JSON (valid configs with drawn field values, unknown
keys, wrong types, mutated text). The outcome is a config that satisfies its family's invariants
(checked here independently) or a ConfigError; nothing else escapes. 2,000 cases, count printed."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artifact.errors import ConfigError
from models.presets import PRESETS, load_config_file
from models.registry import FAMILIES

pytestmark = pytest.mark.slow


CASES = 2000
BASES = [{"family": p.family, "seed": p.seed, "config": p.config.to_dict()} for p in PRESETS.values()]
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 4, 64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["pre", "post", "half", "interleaved", "rmsnorm", "relu", "rope"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def config_texts(draw) -> str:
    base = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from(["config", "config", "config", "top"]))
        where = base["config"] if target == "config" and isinstance(base.get("config"), dict) else base
        key = draw(st.sampled_from(sorted(where) + ["unknown", "family", "seed", "config"]))
        if draw(st.integers(0, 5)) == 0:
            where.pop(key, None)
        else:
            where[key] = draw(JSON_VALUES)
    text = json.dumps(base, allow_nan=True)
    if draw(st.integers(0, 9)) == 0:  # text-level damage: a cut or a deep nest
        text = draw(st.sampled_from([text[: draw(st.integers(0, len(text)))], "[" * 5000 + "]" * 5000, ""]))
    return text


def invariants_hold(preset) -> None:
    """Independent checks of an accepted config: positive sizes, divisibility, finite numbers."""
    config = preset.config
    assert preset.family in FAMILIES and isinstance(preset.seed, int) and preset.seed >= 0
    fields = config.to_dict()
    for name in ("width", "heads", "layers", "vocab_size", "ff_width", "max_positions"):
        if name in fields:
            assert isinstance(fields[name], int) and not isinstance(fields[name], bool) and fields[name] > 0, name
    if "width" in fields and "heads" in fields:
        assert fields["width"] % fields["heads"] == 0
    for name, value in fields.items():
        if isinstance(value, float):
            assert math.isfinite(value), name


def test_fuzz_load_config_file(tmp_path, fuzz_summary):
    path = tmp_path / "config.json"
    counts = {"cases": 0, "accepted": 0, "refused": 0}

    @settings(
        max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(config_texts())
    def run(text):
        counts["cases"] += 1
        path.write_text(text)
        try:
            preset = load_config_file(path)
        except ConfigError as exc:
            assert "\n" not in str(exc) and str(exc)
            counts["refused"] += 1
            return
        invariants_hold(preset)
        counts["accepted"] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of models.presets.load_config_file "
        f"({counts['accepted']} accepted, {counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES and counts["accepted"] > 0
