"""KV cache: decoding through the cache computes the same function as the cache-free forward.

The oracle is the model's own no-cache forward over the whole sequence (float64), which
never touches the cache code. Eager: prefill with an empty cache (T_past = 0), then
chunks and single tokens. Exported serving graphs (ONNX Runtime, ONNX reference
evaluator): the same schedule through each backend's own cache, and a left-padded batch
of rows with different histories (past_mask, position_ids). Bad caches (too long, wrong
head count or width, bad positions or mask values) are InputErrors raised before any
backend runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from artifact.errors import InputError
from exporters.onnx_export import export_model
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.presets import get_preset
from models.registry import build_model
from runners.decoding.generate import CachedLM
from runners.registry import create_runner

# Every attention/norm/RoPE leg: MHA and GQA/MQA, pre and post norm, interleaved and half RoPE, GPT.
EAGER_CASES = {
    "mha-interleaved-pre": (
        "llama",
        LlamaConfig(vocab_size=40, layers=2, width=16, heads=4, ff_width=24, max_positions=16, rope_base=50.0),
    ),
    "gqa-interleaved-untied": (
        "llama",
        LlamaConfig(
            vocab_size=40, layers=2, width=16, heads=4, kv_heads=2, ff_width=24, max_positions=16, tie_embeddings=False
        ),
    ),
    "mqa-half-pre": (
        "llama",
        LlamaConfig(
            vocab_size=40,
            layers=3,
            width=24,
            heads=3,
            kv_heads=1,
            ff_width=24,
            max_positions=16,
            rope_pairing="half",
            rope_base=30.0,
        ),
    ),
    "gqa-half-post": (
        "llama",
        LlamaConfig(
            vocab_size=40,
            layers=2,
            width=16,
            heads=4,
            kv_heads=2,
            ff_width=24,
            max_positions=16,
            rope_pairing="half",
            norm_placement="post",
        ),
    ),
    "mha-interleaved-post": (
        "llama",
        LlamaConfig(vocab_size=40, layers=2, width=16, heads=2, ff_width=24, max_positions=16, norm_placement="post"),
    ),
    "gpt": (
        "gpt",
        GPTConfig(
            vocab_size=40,
            width=16,
            heads=4,
            ff_width=32,
            context=16,
            layers=2,
            attention_bias=True,
            activation="gelu_tanh",
        ),
    ),
}
# Prefill, then a chunk of several tokens on a non-empty cache, then single tokens.
SCHEDULE = (5, 3, 1, 1, 1)


def empty_past(config, batch: int, dtype=torch.float64):
    kv_heads = getattr(config, "kv_heads", config.heads)
    return [(torch.zeros(batch, kv_heads, 0, config.head_width, dtype=dtype),) * 2 for _ in range(config.layers)]


def full_logits(model, ids: np.ndarray) -> np.ndarray:
    """The oracle: one cache-free float64 forward over the whole sequence."""
    with torch.no_grad():
        return model(torch.from_numpy(ids))["logits"].numpy()


def random_ids(config, batch, seq, seed):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq)).astype(np.int64)


@pytest.mark.parametrize("case", list(EAGER_CASES))
def test_eager_cache_path_equals_full_forward(case):
    family, config = EAGER_CASES[case]
    model = build_model(family, config, seed=len(case)).double()
    ids = random_ids(config, 2, sum(SCHEDULE), seed=1)
    want = full_logits(model, ids)
    past, start, got = empty_past(config, 2), 0, []
    with torch.no_grad():
        for n in SCHEDULE:
            stages = model(torch.from_numpy(ids[:, start : start + n]), past=past)
            past = [(stages[f"present.{i}.key"], stages[f"present.{i}.value"]) for i in range(config.layers)]
            got.append(stages["logits"].numpy())
            start += n
        whole = model(torch.from_numpy(ids), past=empty_past(config, 2))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=0, atol=1e-10)
    # The incrementally built cache is the cache of the whole sequence at once.
    kv_heads = getattr(config, "kv_heads", config.heads)
    for i, (k, v) in enumerate(past):
        assert tuple(k.shape) == (2, kv_heads, sum(SCHEDULE), config.head_width)
        np.testing.assert_allclose(k.numpy(), whole[f"present.{i}.key"].numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(v.numpy(), whole[f"present.{i}.value"].numpy(), rtol=0, atol=1e-12)


def test_eager_cache_differs_from_restarting_positions():
    """Sanity of the oracle: a decode step that ignored the cache would not match it."""
    family, config = EAGER_CASES["mha-interleaved-pre"]
    model = build_model(family, config, seed=3).double()
    ids = random_ids(config, 1, 6, seed=2)
    with torch.no_grad():
        alone = model(torch.from_numpy(ids[:, -1:]), past=empty_past(config, 1))["logits"].numpy()[:, 0]
    assert np.abs(alone - full_logits(model, ids)[:, -1]).max() > 1e-3


def test_eager_cache_overflow_is_refused():
    family, config = EAGER_CASES["gqa-half-post"]
    model = build_model(family, config, seed=0)
    past = [(torch.zeros(1, 2, 14, 4), torch.zeros(1, 2, 14, 4)) for _ in range(config.layers)]
    with pytest.raises(InputError, match=r"sequence length 3 \(\+ offset 14\) exceeds max_positions=16"):
        model(torch.zeros(1, 3, dtype=torch.int64), past=past)


# --------------------------------------------------------------------------- exported serving graphs

# One layer keeps the export cheap; the multi-layer cache plumbing is covered by decoder-small.
CUSTOM = LlamaConfig(
    vocab_size=40,
    layers=1,
    width=16,
    heads=4,
    kv_heads=2,
    ff_width=24,
    max_positions=12,
    rope_pairing="half",
    norm_placement="post",
    tie_embeddings=False,
    rope_base=50.0,
)


@pytest.fixture(scope="module")
def gqa_half_post(tmp_path_factory):
    """The legs the serving presets lack (GQA + half RoPE + post-norm + untied), exported once."""
    out = tmp_path_factory.mktemp("kv") / "artifact"
    return export_model(build_model("llama", CUSTOM, 21), "llama", CUSTOM, out, variant="serving", seed=21)


@pytest.fixture(params=["decoder-small", "gpt-tiny", "gqa-half-post"])
def serving(request, exported, gqa_half_post):
    """(artifact, config, float64 oracle model rebuilt from the seed, not from the artifact)."""
    if request.param == "gqa-half-post":
        return gqa_half_post, CUSTOM, build_model("llama", CUSTOM, 21).double()
    spec = get_preset(request.param)
    return exported(spec.name, "serving"), spec.config, spec.build().double()


def kv_shape(config, batch, length):
    return (batch, getattr(config, "kv_heads", config.heads), length, config.head_width)


@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference"])
def test_serving_graph_decodes_like_the_full_forward(serving, backend):
    artifact, config, oracle = serving
    schedule = (4, 3, 1, 1, 1, 1)
    ids = random_ids(config, 3, sum(schedule), seed=5)
    want = full_logits(oracle, ids)
    lm = CachedLM(create_runner(backend, artifact), config.max_positions)
    got, start = [], 0
    for n in schedule:
        got.append(lm.step(ids[:, start : start + n]))
        start += n
    assert lm.length == sum(schedule)
    got = np.concatenate(got, axis=1)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-5 * scale)
    for name in lm.kv.names:
        value = lm.kv.values[name]  # numpy, or an OrtValue on the IO-binding path
        shape = value.shape if isinstance(value, np.ndarray) else value.shape()
        assert tuple(shape) == kv_shape(config, 3, sum(schedule)), name


def serving_feed(ids, past: dict, past_len: int) -> dict:
    """A single-history feed written out by hand: positions continue after the cache, every
    cached slot is a real token."""
    batch, new = ids.shape
    return {
        "input_ids": ids,
        "position_ids": np.tile(np.arange(past_len, past_len + new, dtype=np.int64), (batch, 1)),
        "past_mask": np.ones((batch, past_len), np.int64),
        **past,
    }


def zero_past(config, batch, length, *, kv_heads=None, head_width=None, fill=0.0):
    kv = getattr(config, "kv_heads", config.heads) if kv_heads is None else kv_heads
    hw = config.head_width if head_width is None else head_width
    return {
        f"past.{i}.{kind}": np.full((batch, kv, length, hw), fill, np.float32)
        for i in range(config.layers)
        for kind in ("key", "value")
    }


@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference", "eager"])
def test_empty_past_is_a_prefill(serving, backend):
    artifact, config, oracle = serving
    ids = random_ids(config, 2, 5, seed=6)
    out = create_runner(backend, artifact).run(serving_feed(ids, zero_past(config, 2, 0), 0))
    want = full_logits(oracle, ids)
    np.testing.assert_allclose(out["logits"], want, rtol=0, atol=5e-5 * max(1.0, np.abs(want).max()))
    for i in range(config.layers):
        assert out[f"present.{i}.key"].shape == kv_shape(config, 2, 5)


def cache_feed(config, batch, past_len, new_len, **kwargs):
    return serving_feed(np.zeros((batch, new_len), np.int64), zero_past(config, batch, past_len, **kwargs), past_len)


def never_infer(feed):
    pytest.fail("the feed reached the backend; it should have been refused first")


@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference"])
def test_cache_overflow_is_refused_before_the_backend(serving, backend, monkeypatch):
    artifact, config, _ = serving
    runner = create_runner(backend, artifact)
    monkeypatch.setattr(runner, "_infer", never_infer)
    m = config.max_positions
    with pytest.raises(InputError, match=rf"cached {m - 2} \+ new 3 positions exceed max_positions={m}"):
        runner.run(cache_feed(config, 1, m - 2, 3))
    # Through CachedLM (and, on ONNX Runtime, its IO-binding path) the check comes first too.
    lm = CachedLM(create_runner(backend, artifact), m)
    lm.step(np.zeros((1, m - 1), np.int64))
    lm.runner._infer = never_infer
    if hasattr(lm.runner, "session"):
        lm.runner.session = object()  # any use of the session would fail
    with pytest.raises(InputError, match=rf"{m - 1} cached \+ 2 new positions exceed max_positions={m}"):
        lm.step(np.zeros((1, 2), np.int64))


@pytest.mark.parametrize("axis,field", [(1, "kv_heads"), (3, "head_width")])
def test_past_with_wrong_heads_or_width_is_refused(serving, axis, field, monkeypatch):
    artifact, config, _ = serving
    runner = create_runner("ort-cpu", artifact)
    monkeypatch.setattr(runner, "_infer", never_infer)
    right = getattr(config, "kv_heads", config.heads) if field == "kv_heads" else config.head_width
    wrong = right + 1
    with pytest.raises(InputError, match=rf"input 'past\.0\.key': axis {axis} expected size {right}, got {wrong}"):
        runner.run(cache_feed(config, 1, 2, 1, **{field: wrong}))


def test_past_lengths_and_batch_must_agree(serving, monkeypatch):
    artifact, config, _ = serving
    runner = create_runner("ort-cpu", artifact)
    monkeypatch.setattr(runner, "_infer", never_infer)
    feed = cache_feed(config, 2, 3, 1)
    feed["past.0.value"] = feed["past.0.value"][:, :, :2]
    with pytest.raises(
        InputError,
        match=r"input 'past\.0\.value': axis 2 \(past_sequence\) is 2 but input "
        r"'past_mask' has past_sequence=3",
    ):
        runner.run(feed)
    feed = cache_feed(config, 2, 3, 1)
    feed["input_ids"] = np.zeros((1, 1), np.int64)
    with pytest.raises(InputError, match=r"axis 0 \(batch\) is 2 but input 'input_ids' has batch=1"):
        runner.run(feed)


@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference"])
def test_left_padded_batch_decodes_each_row_like_its_own_forward(serving, backend):
    """Rows with different histories share one cache: shorter rows are left-padded, past_mask hides the
    padding slots (filled with large values here, so attending to them would show), and position_ids
    continue each row's own history."""
    artifact, config, oracle = serving
    runner = create_runner(backend, artifact)
    lengths, steps = (3, 6), 3
    seqs = [random_ids(config, 1, n + steps, seed=30 + n)[0] for n in lengths]
    width = max(lengths)
    cache = {name: [] for name in zero_past(config, 1, 0)}
    for seq, n in zip(seqs, lengths, strict=False):
        out = runner.run(serving_feed(seq[None, :n], zero_past(config, 1, 0), 0))
        for name in cache:
            pad = zero_past(config, 1, width - n, fill=100.0)[name]
            cache[name].append(np.concatenate([pad, out[name.replace("past.", "present.")]], axis=2))
    cache = {name: np.concatenate(parts) for name, parts in cache.items()}
    mask = np.array([[0] * (width - n) + [1] * n for n in lengths], np.int64)
    got = []
    for k in range(steps):
        feed = {
            "input_ids": np.array([[seq[n + k]] for seq, n in zip(seqs, lengths, strict=False)], np.int64),
            "position_ids": np.array([[n + k] for n in lengths], np.int64),
            "past_mask": mask,
            **cache,
        }
        out = runner.run(feed)
        got.append(out["logits"][:, 0])
        cache = {name: out[name.replace("past.", "present.")] for name in cache}
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    for row, (seq, n) in enumerate(zip(seqs, lengths, strict=False)):
        want = full_logits(oracle, seq[None])[0, n : n + steps]
        have = np.stack([g[row] for g in got])
        np.testing.assert_allclose(have, want, rtol=0, atol=5e-5 * max(1.0, np.abs(want).max()), err_msg=f"row {row}")


@pytest.mark.parametrize(
    "change,pattern",
    [
        (
            lambda f, m: f["position_ids"].__setitem__((0, 0), m),
            r"input 'position_ids': position {m} is outside \[0, {m}\)",
        ),
        (
            lambda f, m: f["position_ids"].__setitem__((0, 0), -1),
            r"input 'position_ids': position -1 is outside \[0, {m}\)",
        ),
        (lambda f, m: f["past_mask"].__setitem__((0, 1), 2), r"input 'past_mask': expected only 0 \(padding\) and 1"),
    ],
    ids=["position too large", "negative position", "mask value"],
)
def test_bad_positions_and_masks_are_refused(serving, change, pattern, monkeypatch):
    artifact, config, _ = serving
    runner = create_runner("ort-cpu", artifact)
    monkeypatch.setattr(runner, "_infer", never_infer)
    feed = cache_feed(config, 2, 3, 1)
    change(feed, config.max_positions)
    with pytest.raises(InputError, match=pattern.format(m=config.max_positions)):
        runner.run(feed)
