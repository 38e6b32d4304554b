"""Sampling and generation: the Sampler against hand values and softmax statistics, and
generate() on eager and ONNX Runtime against a cache-free float64 greedy oracle."""

from __future__ import annotations

import types

import numpy as np
import onnxruntime as ort
import pytest
import torch

from artifact.errors import ConfigError, InputError
from exporters.onnx_export import export_model
from models.llama import LlamaConfig
from models.presets import get_preset
from models.registry import build_model
from runners.base import Runner
from runners.decoding.cache import KVCache
from runners.decoding.generate import CachedLM, Sampler, Sampling, generate
from runners.ort import BoundKVCache
from runners.registry import create_runner

PRESET = "decoder-small"  # random tiny LLaMA (V=96, 2 layers, max_positions=32), exported once per session


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def draws(sampling: Sampling, logits: np.ndarray, n: int) -> np.ndarray:
    sampler = Sampler(sampling)
    return np.array([sampler(logits) for _ in range(n)])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square 0.999 quantiles (scipy.stats.chi2.ppf(0.999, df)): the draws are seeded, so these are
# fixed outcomes, not flaky ones; a wrong distribution lands orders of magnitude above them.
CHI2_999 = {2: 13.816, 5: 20.515}


# --------------------------------------------------------------------------- Sampler


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    sampler = Sampler(Sampling())
    for _ in range(50):
        logits = rng.standard_normal(97).astype(np.float32) * 3
        assert sampler(logits) == int(np.argmax(logits))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = np.random.default_rng(1).standard_normal(50)
    a = draws(Sampling(temperature=1.0, seed=7), logits, 100)
    b = draws(Sampling(temperature=1.0, seed=7), logits, 100)
    c = draws(Sampling(temperature=1.0, seed=8), logits, 100)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert len(set(a.tolist())) > 5  # really sampling, not greedy


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.5, top_k=1, seed=3),
        Sampling(temperature=2.0, top_p=1e-6, seed=4),
        Sampling(temperature=1.0, top_k=5, top_p=1e-9, seed=5),
    ],
    ids=["top_k=1", "tiny top_p", "both"],
)
def test_degenerate_filters_are_greedy(sampling):
    rng = np.random.default_rng(2)
    sampler = Sampler(sampling)
    for _ in range(50):
        logits = rng.standard_normal(40)
        assert sampler(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_frequencies_match_softmax_of_scaled_logits(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = np.bincount(draws(Sampling(temperature=temperature, seed=11), logits, 10000), minlength=6)
    assert chi_square(counts, softmax(logits / temperature)) < CHI2_999[5]
    # The statistic separates temperatures: the unscaled softmax is rejected (T != 1).
    if temperature != 1.0:
        assert chi_square(counts, softmax(logits)) > 10 * CHI2_999[5]


def test_top_k_renormalises_over_the_k_largest():
    logits = np.array([0.1, 3.0, -2.0, 2.5, 2.0, 0.0])
    counts = np.bincount(draws(Sampling(temperature=1.0, top_k=3, seed=12), logits, 10000), minlength=6)
    assert set(np.flatnonzero(counts)) == {1, 3, 4}
    probs = np.zeros(6)
    probs[[1, 3, 4]] = softmax(logits[[1, 3, 4]])
    assert chi_square(counts, probs) < CHI2_999[2]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(probs)
    # sorted: 0.5, 0.3 (0.8 >= 0.75) -> {1, 3}; 0.15 and 0.05 are cut
    counts = np.bincount(draws(Sampling(temperature=1.0, top_p=0.75, seed=13), logits, 10000), minlength=4)
    assert set(np.flatnonzero(counts)) == {1, 3}
    assert chi_square(counts, np.array([0, 0.5, 0, 0.3]) / 0.8) < CHI2_999[2]
    # p just above 0.8 needs the third token too
    counts = np.bincount(draws(Sampling(temperature=1.0, top_p=0.81, seed=14), logits, 5000), minlength=4)
    assert set(np.flatnonzero(counts)) == {1, 2, 3}


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"temperature": -1.0}, r"temperature: expected a finite number >= 0, got -1\.0"),
        ({"temperature": float("nan")}, r"temperature: expected a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, r"temperature: expected a finite number >= 0, got inf"),
        ({"temperature": "0.7"}, r"temperature: expected a finite number >= 0, got '0\.7'"),
        ({"top_k": -1}, r"top_k: expected an integer >= 0, got -1"),
        ({"top_k": 2.5}, r"top_k: expected an integer >= 0, got 2\.5"),
        ({"top_k": True}, r"top_k: expected an integer >= 0, got True"),
        ({"top_p": 0.0}, r"top_p: expected a number in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p: expected a number in \(0, 1\], got 1\.5"),
        ({"top_p": float("nan")}, r"top_p: expected a number in \(0, 1\], got nan"),
    ],
)
def test_invalid_sampling_parameters(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Sampling(**kwargs)


# --------------------------------------------------------------------------- generate()


@pytest.fixture(scope="module")
def artifact(exported):
    return exported(PRESET, "serving")


@pytest.fixture(scope="module")
def config():
    return get_preset(PRESET).config


@pytest.fixture(scope="module")
def prompt(config):
    return np.random.default_rng(5).integers(0, config.vocab_size, 5).tolist()


def lm_for(backend, artifact, config):
    return CachedLM(create_runner(backend, artifact), config.max_positions)


@pytest.fixture(scope="module")
def oracle_greedy(config, prompt):
    """20 greedy tokens from repeated cache-free float64 forwards of the model rebuilt from its seed,
    and the logits each choice was made from."""
    model = get_preset(PRESET).build().double()
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(20):
            step = model(torch.tensor([ids]))["logits"][0, -1].numpy()
            logits.append(step)
            ids.append(int(step.argmax()))
    margins = [np.sort(s)[-1] - np.sort(s)[-2] for s in logits]
    assert min(margins) > 1e-3, "a near-tie would make greedy decoding precision-dependent"
    return ids[len(prompt) :], np.stack(logits)


@pytest.mark.parametrize("backend", ["eager", "ort-cpu"])
def test_greedy_generation_matches_the_cache_free_oracle(artifact, config, prompt, oracle_greedy, backend):
    tokens, logits = oracle_greedy
    result = generate(lm_for(backend, artifact, config), prompt, max_new_tokens=20, keep_logits=True)
    assert result.tokens == tokens
    assert result.finish_reason == "length" and result.prompt_ids == prompt
    got = np.stack([s[0] if s.ndim == 2 else s for s in result.step_logits])
    np.testing.assert_allclose(got, logits, rtol=0, atol=5e-5 * max(1.0, np.abs(logits).max()))


def test_generation_stops_on_a_stop_id(artifact, config, prompt, oracle_greedy):
    tokens = oracle_greedy[0]
    k = 3
    stop = tokens[k]
    first = tokens.index(stop)  # an earlier occurrence stops it earlier
    result = generate(lm_for("ort-cpu", artifact, config), prompt, max_new_tokens=20, stop_ids=(stop, 10**6))
    assert result.finish_reason == "stop"
    assert result.tokens == tokens[: first + 1]


def test_tokens_stream_in_order_before_the_next_step(artifact, config, prompt):
    lm = lm_for("ort-cpu", artifact, config)
    seen = []
    result = generate(lm, prompt, max_new_tokens=8, on_token=lambda t: seen.append((t, lm.length)))
    assert [t for t, _ in seen] == result.tokens
    # token j is streamed when the prompt and j earlier tokens have been fed, before it is fed itself
    assert [n for _, n in seen] == [len(prompt) + j for j in range(8)]


@pytest.mark.parametrize("n", [1, 7])
def test_max_new_tokens_is_respected(artifact, config, prompt, oracle_greedy, n):
    result = generate(lm_for("ort-cpu", artifact, config), prompt, max_new_tokens=n)
    assert result.tokens == oracle_greedy[0][:n] and result.finish_reason == "length"


def test_io_binding_path_equals_the_numpy_path(artifact, config, prompt):
    bound = lm_for("ort-cpu", artifact, config)
    plain = lm_for("ort-cpu", artifact, config)
    assert isinstance(bound.kv, BoundKVCache)
    # The plain runner.run path through numpy: the base class's decode step and cache.
    plain.runner.decode_step = types.MethodType(Runner.decode_step, plain.runner)
    plain.kv = KVCache(plain.runner.input_specs, plain.max_positions)
    sampling = Sampling(temperature=0.9, top_k=20, seed=3)
    a = generate(bound, prompt, max_new_tokens=20, sampling=sampling, keep_logits=True)
    b = generate(plain, prompt, max_new_tokens=20, sampling=sampling, keep_logits=True)
    assert all(isinstance(v, ort.OrtValue) for v in bound.kv.values.values())  # the cache stayed in ORT
    assert all(isinstance(v, np.ndarray) for v in plain.kv.values.values())
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.stack(a.step_logits), np.stack(b.step_logits), rtol=0, atol=1e-6)


def test_sampled_generation_is_reproducible_and_reset_between_calls(artifact, config, prompt):
    lm = lm_for("ort-cpu", artifact, config)
    a = generate(lm, prompt, max_new_tokens=15, sampling=Sampling(temperature=1.5, seed=1))
    b = generate(lm, prompt, max_new_tokens=15, sampling=Sampling(temperature=1.5, seed=1))  # same lm: reset
    c = generate(lm, prompt, max_new_tokens=15, sampling=Sampling(temperature=1.5, seed=2))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_generation_may_fill_the_context_exactly(artifact, config):
    m = config.max_positions
    prompt = list(range(m - 3))
    # The last token is sampled, never fed: prompt + 4 new tokens feeds m - 3 + 3 = m positions.
    assert len(generate(lm_for("ort-cpu", artifact, config), prompt, max_new_tokens=4).tokens) == 4
    with pytest.raises(InputError, match=rf"{m} cached \+ 1 new positions exceed max_positions={m}"):
        generate(lm_for("ort-cpu", artifact, config), prompt, max_new_tokens=5)


def test_generate_argument_errors(artifact, config, exported):
    lm = lm_for("ort-cpu", artifact, config)
    with pytest.raises(InputError, match=r"prompt: empty"):
        generate(lm, [], max_new_tokens=3)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ConfigError, match=r"max_new_tokens: expected an integer >= 1"):
            generate(lm, [1, 2], max_new_tokens=bad)
    with pytest.raises(InputError, match=r"token id 96 at index \(0, 1\) is outside \[0, 96\)"):
        generate(lm, [1, 96], max_new_tokens=2)
    with pytest.raises(InputError, match=r"no KV cache inputs; export it with `--variant serving`"):
        CachedLM(create_runner("ort-cpu", exported("block-small")), config.max_positions)


# --------------------------------------------------------------------------- shared KV buffers

# head_width 16: the ort lowering's GroupQueryAttention, whose past may be a longer buffer updated in place.
SHARED_CONFIG = LlamaConfig(vocab_size=64, layers=2, width=64, heads=4, kv_heads=2, ff_width=48, max_positions=32)


@pytest.fixture(scope="module")
def shared_artifact(tmp_path_factory):
    model = build_model("llama", SHARED_CONFIG, seed=11)
    return export_model(
        model, "llama", SHARED_CONFIG, tmp_path_factory.mktemp("shared") / "a", variant="serving", lowering="ort"
    )


def feed_both(lms: dict, ids: np.ndarray) -> dict:
    return {name: lm.step(ids) for name, lm in lms.items()}


def test_shared_buffers_grow_in_place_and_match_the_float64_oracle(shared_artifact):
    ours = CachedLM(create_runner("ort-cpu", shared_artifact), SHARED_CONFIG.max_positions)
    oracle = CachedLM(create_runner("eager-f64", shared_artifact), SHARED_CONFIG.max_positions)
    assert ours.kv.shared and not oracle.kv.shared
    prompt = np.random.default_rng(2).integers(0, SHARED_CONFIG.vocab_size, (2, 5))
    out = feed_both({"ours": ours, "oracle": oracle}, prompt)
    capacities = [ours.capacity]
    np.testing.assert_allclose(out["ours"], out["oracle"], rtol=0, atol=1e-4)
    for _ in range(SHARED_CONFIG.max_positions - prompt.shape[1]):  # to the last position
        before = {name: value.data_ptr() for name, value in ours.kv.buffers.items()}
        grows = ours.length + 1 > ours.capacity
        token = out["oracle"][:, -1:].argmax(-1).astype(np.int64)
        out = feed_both({"ours": ours, "oracle": oracle}, token)
        np.testing.assert_allclose(out["ours"], out["oracle"], rtol=0, atol=1e-4, err_msg=f"position {ours.length}")
        # The present outputs are the past buffers themselves; between growths they never move.
        assert all(ours.kv.values[name].data_ptr() == value.data_ptr() for name, value in ours.kv.buffers.items())
        if not grows:
            assert {name: value.data_ptr() for name, value in ours.kv.buffers.items()} == before
        capacities.append(ours.capacity)
    # No reservation: 5 positions, then doubled when full, capped at max_positions.
    assert sorted(set(capacities)) == [5, 10, 20, SHARED_CONFIG.max_positions]


def test_a_reservation_allocates_once_and_a_new_batch_size_reallocates(shared_artifact):
    ours = CachedLM(create_runner("ort-cpu", shared_artifact), SHARED_CONFIG.max_positions)
    oracle = CachedLM(create_runner("eager-f64", shared_artifact), SHARED_CONFIG.max_positions)
    rng = np.random.default_rng(3)
    for batch in (1, 3):
        for lm in (ours, oracle):
            lm.reset()
        ours.reserve(4 + 6)
        out = feed_both({"ours": ours, "oracle": oracle}, rng.integers(0, SHARED_CONFIG.vocab_size, (batch, 4)))
        first = {name: value.data_ptr() for name, value in ours.kv.buffers.items()}
        for _ in range(6):
            token = out["oracle"][:, -1:].argmax(-1).astype(np.int64)
            out = feed_both({"ours": ours, "oracle": oracle}, token)
            np.testing.assert_allclose(out["ours"], out["oracle"], rtol=0, atol=1e-4)
        assert ours.capacity == 10 and ours.kv.buffers[ours.kv.names[0]].shape()[0] == batch
        assert {name: value.data_ptr() for name, value in ours.kv.buffers.items()} == first


def test_generate_reserves_the_whole_generation(shared_artifact):
    lm = CachedLM(create_runner("ort-cpu", shared_artifact), SHARED_CONFIG.max_positions)
    generate(lm, [1, 2, 3], max_new_tokens=10)
    # Growing unreserved would have doubled 3 -> 6 -> 12 for the 12 positions fed; the reservation is 13.
    assert lm.capacity == 3 + 10


@pytest.mark.parametrize("lowering", ["functions", "standard"])
def test_concatenating_graphs_keep_a_per_step_cache(tmp_path, lowering):
    config = SHARED_CONFIG
    artifact = export_model(
        build_model("llama", config, seed=11), "llama", config, tmp_path / "a", variant="serving", lowering=lowering
    )
    assert artifact.graphs[0].entry.kv_cache is None
    lm = CachedLM(create_runner("ort-cpu", artifact), config.max_positions)
    lm.step(np.zeros((1, 3), dtype=np.int64))
    assert not lm.kv.shared and lm.capacity == 0
    assert [v.shape()[2] for v in lm.kv.values.values()] == [3] * len(lm.kv.names)


@pytest.mark.parametrize("backend", ["ort-cpu", "eager"])
def test_a_step_with_another_batch_size_is_refused_until_reset(shared_artifact, backend):
    lm = CachedLM(create_runner(backend, shared_artifact), SHARED_CONFIG.max_positions)
    lm.step(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(
        InputError,
        match=r"expected shape \(2, new tokens\) after 3 cached positions of 2 row\(s\), "
        r"got \(1, 1\); reset\(\) to start over",
    ):
        lm.step(np.zeros((1, 1), dtype=np.int64))
    lm.reset()
    assert lm.step(np.zeros((1, 1), dtype=np.int64)).shape == (1, 1, SHARED_CONFIG.vocab_size)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=0)])
def test_non_finite_logits_are_an_error_not_token_zero(sampling):
    logits = np.array([0.5, 2.0, np.nan, 1.0])
    with pytest.raises(InputError, match=r"logits: the model produced 1 non-finite value\(s\), first at token 2"):
        Sampler(sampling)(logits)


def test_decode_steps_hand_back_the_cache_as_trusted(shared_artifact):
    """The per-step cache (the runner's own output) is not rescanned for NaN on every token."""
    runner = create_runner("eager", shared_artifact)
    seen = []
    original = runner.run

    def spy(inputs, trusted=()):
        seen.append(tuple(trusted))
        return original(inputs, trusted)

    runner.run = spy
    lm = CachedLM(runner, SHARED_CONFIG.max_positions)
    generate(lm, [1, 2, 3], max_new_tokens=3)
    assert seen[0] == () and all(t == tuple(lm.kv.names) for t in seen[1:]) and len(seen) == 3
