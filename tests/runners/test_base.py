"""runners.base: the shared feed check and the Runner contract (check first, then infer, then time)."""

from __future__ import annotations

import numpy as np
import pytest

from artifact.errors import InputError
from models.llama import LlamaConfig, ProbedBlockConfig
from runners.base import Runner, check_feed

HIDDEN = [{"name": "hidden_states", "dtype": "float32", "shape": ["batch", "sequence", 4]}]
IDS = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}]
TWO = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "memory", "dtype": "float32", "shape": ["batch", "source", 4]},
]
TWO_SOURCE = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    {"name": "source_ids", "dtype": "int64", "shape": ["batch", "source_sequence"]},
]
BLOCK = ProbedBlockConfig(width=4, heads=2, ff_width=4, max_positions=8, probe_width=2)
DECODER = LlamaConfig(vocab_size=10, layers=1, width=4, heads=2, ff_width=4, max_positions=8)


def hidden(shape=(2, 3, 4), dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


class SpyRunner(Runner):
    name = "spy"

    def __init__(self, specs, config=None):
        super().__init__(specs, ["out"], config)
        self.calls = []

    def _infer(self, feed):
        self.calls.append(feed)
        return {"out": next(iter(feed.values()))}


def test_valid_feed_passes_through_unchanged():
    x = hidden()
    feed = check_feed(HIDDEN, {"hidden_states": x}, BLOCK)
    assert list(feed) == ["hidden_states"] and feed["hidden_states"] is x


def test_two_inputs_may_have_different_symbolic_axes():
    feed = {"input_ids": np.zeros((2, 3), np.int64), "memory": hidden((2, 5, 4))}
    assert set(check_feed(TWO, feed, DECODER)) == {"input_ids", "memory"}


# Each case: (specs, feed, config, pattern naming the input and expected vs actual).
BAD_FEEDS = {
    "wrong dtype": (HIDDEN, {"hidden_states": hidden(dtype=np.float64)}, None, r"'hidden_states'.*float32.*float64"),
    "wrong integer dtype": (IDS, {"input_ids": np.zeros((1, 2), np.int32)}, None, r"'input_ids'.*int64.*int32"),
    "rank too low": (HIDDEN, {"hidden_states": hidden((3, 4))}, None, r"'hidden_states'.*rank 3.*rank 2"),
    "rank too high": (HIDDEN, {"hidden_states": hidden((1, 2, 3, 4))}, None, r"'hidden_states'.*rank 3.*rank 4"),
    "wrong fixed dim": (HIDDEN, {"hidden_states": hidden((2, 3, 5))}, None, r"'hidden_states'.*axis 2.*4.*got 5"),
    "inconsistent symbolic dim": (
        TWO,
        {"input_ids": np.zeros((2, 3), np.int64), "memory": hidden((3, 5, 4))},
        None,
        r"'memory'.*batch.*3.*'input_ids'.*2",
    ),
    "missing input": (TWO, {"input_ids": np.zeros((2, 3), np.int64)}, None, r"missing \['memory'\]"),
    "extra input": (HIDDEN, {"hidden_states": hidden(), "mask": hidden()}, None, r"unexpected \['mask'\]"),
    "misspelt input": (
        IDS,
        {"input_id": np.zeros((1, 2), np.int64)},
        None,
        r"expected names \['input_ids'\].*missing \['input_ids'\].*unexpected \['input_id'\]",
    ),
    "empty batch": (HIDDEN, {"hidden_states": hidden((0, 3, 4))}, None, r"'hidden_states'.*axis 0.*batch.*empty"),
    "empty sequence": (IDS, {"input_ids": np.zeros((2, 0), np.int64)}, None, r"'input_ids'.*axis 1.*sequence.*empty"),
    "NaN": (
        HIDDEN,
        {"hidden_states": np.where(np.arange(24).reshape(2, 3, 4) == 13, np.nan, 1.0).astype(np.float32)},
        None,
        r"'hidden_states'.*non-finite.*\(1, 0, 1\)",
    ),
    "Inf": (HIDDEN, {"hidden_states": np.full((1, 1, 4), np.inf, np.float32)}, None, r"'hidden_states'.*non-finite"),
    "token id too large": (
        IDS,
        {"input_ids": np.array([[0, 10, 3]])},
        DECODER,
        r"'input_ids'.*token id 10.*\(0, 1\).*\[0, 10\)",
    ),
    "negative token id": (IDS, {"input_ids": np.array([[1], [-1]])}, DECODER, r"'input_ids'.*token id -1.*\[0, 10\)"),
    "sequence too long (ids)": (
        IDS,
        {"input_ids": np.zeros((1, 9), np.int64)},
        DECODER,
        r"'input_ids'.*sequence length 9.*max_positions=8",
    ),
    "sequence too long (hidden)": (
        HIDDEN,
        {"hidden_states": hidden((1, 9, 4))},
        BLOCK,
        r"'hidden_states'.*sequence length 9.*max_positions=8",
    ),
    "source too long": (
        TWO_SOURCE,
        {"input_ids": np.zeros((1, 2), np.int64), "source_ids": np.zeros((1, 9), np.int64)},
        DECODER,
        r"'source_ids'.*sequence length 9.*max_positions=8",
    ),
    "source id too large": (
        TWO_SOURCE,
        {"input_ids": np.zeros((1, 2), np.int64), "source_ids": np.array([[0, 12]], np.int64)},
        DECODER,
        r"'source_ids'.*token id 12.*\[0, 10\)",
    ),
    "not an array": (HIDDEN, {"hidden_states": hidden().tolist()}, None, r"'hidden_states'.*numpy array.*list"),
    "not a mapping": (HIDDEN, [hidden()], None, r"inputs: expected a mapping.*list"),
}


@pytest.mark.parametrize("case", BAD_FEEDS)
def test_check_feed_rejects(case):
    specs, feed, config, pattern = BAD_FEEDS[case]
    with pytest.raises(InputError, match=pattern):
        check_feed(specs, feed, config)


@pytest.mark.parametrize("case", BAD_FEEDS)
def test_runner_checks_the_feed_before_inferring(case):
    specs, feed, config, pattern = BAD_FEEDS[case]
    runner = SpyRunner(specs, config)
    with pytest.raises(InputError, match=pattern):
        runner.run(feed)
    assert runner.calls == []
    assert runner.last_inference_time is None


def test_sequence_at_max_positions_and_largest_token_id_are_accepted():
    ids = np.full((1, 8), 9, np.int64)
    assert check_feed(IDS, {"input_ids": ids}, DECODER)["input_ids"] is ids


def test_config_limits_are_not_applied_without_a_config():
    # Without a config the check cannot know the vocabulary or the window: only structure is checked.
    ids = np.full((1, 50), 99, np.int64)
    assert check_feed(IDS, {"input_ids": ids})["input_ids"] is ids


def test_runner_records_inference_time_after_a_run():
    runner = SpyRunner(HIDDEN, BLOCK)
    assert runner.last_inference_time is None
    x = hidden()
    out = runner.run({"hidden_states": x})
    assert out["out"] is x and len(runner.calls) == 1
    assert isinstance(runner.last_inference_time, float) and runner.last_inference_time >= 0.0


def test_base_runner_has_no_inference():
    with pytest.raises(NotImplementedError):
        Runner(HIDDEN, ["out"]).run({"hidden_states": hidden()})


def test_feed_with_non_string_keys_is_an_input_error_not_a_sort_crash():
    with pytest.raises(InputError, match=r"expected names \['hidden_states'\].*unexpected \[1\]"):
        check_feed(HIDDEN, {"hidden_states": hidden(), 1: hidden()})


def test_a_spec_dtype_numpy_does_not_know_is_a_model_file_error():
    from artifact.errors import ModelFileError

    specs = [{"name": "x", "dtype": "no-such-dtype", "shape": [1]}]
    with pytest.raises(ModelFileError, match=r"input 'x': the model declares dtype 'no-such-dtype'"):
        check_feed(specs, {"x": np.zeros(1, np.float32)})


def test_non_finite_report_counts_every_bad_value_and_names_the_first():
    x = np.zeros((1, 2, 4), np.float32)
    x[0, 1, 2], x[0, 1, 3], x[0, 0, 1] = np.nan, np.inf, -np.inf  # first in C order: (0, 0, 1)
    with pytest.raises(
        InputError, match=r"'hidden_states': 3 non-finite value\(s\) \(NaN/Inf\), first at index \(0, 0, 1\)"
    ):
        check_feed(HIDDEN, {"hidden_states": x})


def test_trusted_inputs_skip_only_the_value_scan():
    """A decode loop's own cache is not rescanned each step, but its name, dtype and shape still are."""
    x = hidden()
    x[0, 0, 0] = np.nan
    assert check_feed(HIDDEN, {"hidden_states": x}, trusted=("hidden_states",))["hidden_states"] is x
    with pytest.raises(InputError, match="non-finite"):
        check_feed(HIDDEN, {"hidden_states": x}, trusted=("other",))
    with pytest.raises(InputError, match="expected dtype float32, got float64"):
        check_feed(HIDDEN, {"hidden_states": x.astype(np.float64)}, trusted=("hidden_states",))
    with pytest.raises(InputError, match="expected rank 3"):
        check_feed(HIDDEN, {"hidden_states": x[0]}, trusted=("hidden_states",))
    spy = SpyRunner(HIDDEN)
    spy.run({"hidden_states": x}, trusted=("hidden_states",))
    assert spy.calls[0]["hidden_states"] is x
