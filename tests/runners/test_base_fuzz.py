"""Fuzzing check_feed: whatever a caller passes, the outcome is an InputError or a feed that really
matches the declared specs (checked here independently: dtype, rank, fixed dims, finite floats,
token ids and positions in range, the context window). 2,000 generated feeds, count printed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artifact.errors import InputError
from models.llama import LlamaConfig
from runners.base import check_feed

# The generator's own casts (complex -> real, huge -> small ints) warn; they are the point of the mutation.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning", "ignore::RuntimeWarning"),
]
CASES = 2000
CONFIG = LlamaConfig(vocab_size=10, layers=1, width=4, heads=2, ff_width=4, max_positions=6)
SPECS = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "position_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "past_mask", "dtype": "int64", "shape": ["batch", "past_sequence"]},
    {"name": "past.0.key", "dtype": "float32", "shape": ["batch", 2, "past_sequence", 2]},
]
DTYPES = ["int64", "int32", "uint8", "float32", "float64", "float16", "bool", "complex64", "object", "<U2"]
MUTATIONS = (
    "dtype",
    "shape",
    "rank",
    "nan",
    "inf",
    "id",
    "position",
    "mask",
    "drop",
    "extra",
    "not-array",
    "empty",
    "long",
)


@st.composite
def feeds(draw):
    """A valid feed built from drawn sizes and a seed, then 0-3 drawn mutations (some harmless)."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    past = draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    feed = {
        "input_ids": rng.integers(0, CONFIG.vocab_size, (batch, seq)),
        "position_ids": rng.integers(0, CONFIG.max_positions, (batch, seq)),
        "past_mask": rng.integers(0, 2, (batch, past)),
        "past.0.key": rng.standard_normal((batch, 2, past, 2)).astype(np.float32),
    }
    for _ in range(draw(st.integers(0, 3))):
        kind, name = draw(st.sampled_from(MUTATIONS)), draw(st.sampled_from([s["name"] for s in SPECS]))
        value = feed.get(name)
        if kind == "drop":
            feed.pop(name, None)
        elif kind == "extra":
            feed[draw(st.one_of(st.text(max_size=4), st.integers(), st.none()))] = np.zeros(1)
        elif kind == "not-array":
            feed[name] = draw(st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=3)))
        elif not isinstance(value, np.ndarray):
            continue
        elif kind == "dtype":
            feed[name] = value.astype(draw(st.sampled_from(DTYPES)))
        elif kind == "shape":
            axis = draw(st.integers(0, value.ndim - 1))
            feed[name] = np.repeat(value, draw(st.integers(0, 3)), axis=axis)
        elif kind == "rank":
            feed[name] = value.reshape(-1) if draw(st.booleans()) else value[None]
        elif kind in ("nan", "inf") and value.size:
            value = value.astype(np.float32) if draw(st.booleans()) else value.copy()
            if value.dtype.kind == "f":
                value.flat[draw(st.integers(0, value.size - 1))] = np.nan if kind == "nan" else -np.inf
            feed[name] = value
        elif kind in ("id", "position", "mask") and value.size:
            value = value.copy()
            bad = np.array([draw(st.integers(-(2**62), 2**62))], np.int64).astype(value.dtype)  # wraps, never raises
            value.flat[draw(st.integers(0, value.size - 1))] = bad[0]
            feed[name] = value
        elif kind == "empty":
            feed[name] = value[:, :0] if value.ndim >= 2 else value[:0]
        elif kind == "long":
            feed[name] = np.concatenate([value] * 4, axis=1) if value.ndim >= 2 else value
    return feed


def independently_valid(feed: dict) -> None:
    """What a returned feed must satisfy, checked without the code under test."""
    assert [s["name"] for s in SPECS] == list(feed)
    sizes = {}
    for spec in SPECS:
        array = feed[spec["name"]]
        assert array.dtype == np.dtype(spec["dtype"]) and array.ndim == len(spec["shape"])
        for want, got in zip(spec["shape"], array.shape, strict=False):
            assert got == want if isinstance(want, int) else sizes.setdefault(want, got) == got
        if array.dtype.kind == "f":
            assert np.isfinite(array).all()
    assert sizes["sequence"] >= 1 and sizes["past_sequence"] + sizes["sequence"] <= CONFIG.max_positions
    assert 0 <= feed["input_ids"].min() and feed["input_ids"].max() < CONFIG.vocab_size
    assert 0 <= feed["position_ids"].min() and feed["position_ids"].max() < CONFIG.max_positions
    assert set(np.unique(feed["past_mask"])) <= {0, 1}


def test_fuzz_check_feed(fuzz_summary):
    counts = {"cases": 0, "accepted": 0, "refused": 0}

    @settings(
        max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(feeds())
    def run(feed):
        counts["cases"] += 1
        try:
            checked = check_feed(SPECS, feed, CONFIG)
        except InputError as exc:
            assert "\n" not in str(exc) and str(exc)
            counts["refused"] += 1
            return
        independently_valid(checked)
        counts["accepted"] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of runners.base.check_feed "
        f"({counts['accepted']} accepted, {counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES
    assert counts["accepted"] > 0  # the generator reaches the valid side too
