"""Continuous batching (runners.decoding.batching.BatchEngine) on ONNX Runtime, checked against oracles that
share none of its padding logic: generate() on a CachedLM (one request, no padding) for the tokens,
and the float64 eager model for the logits (the same left-padded feed, and each row's whole history
without any cache).

The artifact is a tiny random LLaMA with a small byte-level BPE tokenizer, exported once per session
(tests/toolkit/serve/test_server.py serves the same artifact through `tiny_lm`).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from artifact.errors import InputError
from runners.decoding.batching import BatchEngine, QueueFull, Request
from runners.decoding.generate import CachedLM, Sampling, generate
from runners.registry import create_runner

pytestmark = pytest.mark.slow
GREEDY = Sampling()

# --------------------------------------------------------------------------- shared artifact

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "language models predict the next token from the ones before it",
    "continuous batching shares every decode step between requests",
    "a cache keeps the keys and values of earlier positions",
    "padding on the left keeps the newest token in the last column",
    "position ids tell each row where its next token sits",
    "the server answers completions and chat completions",
    "streaming sends one delta per token as server sent events",
    "numbers like 1 2 3 42 and 2026 appear in text too",
    "what is the capital of france? paris is the capital of france.",
    "once upon a time there was a small model that could only guess",
]
MAX_POSITIONS = 128
SEED = 2


@dataclass
class TinyLM:
    directory: Path
    tokenizer: object  # models.tokenizer.TextTokenizer
    model: torch.nn.Module  # float32, as exported
    config: object


_CACHE: dict[int, TinyLM] = {}


def tiny_lm(tmp_path_factory, max_positions: int = MAX_POSITIONS) -> TinyLM:
    """The exported serving artifact with its tokenizer; built on first use, then cached for the session
    (one per context length)."""
    if max_positions not in _CACHE:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        from exporters.onnx_export import export_model
        from models.llama import LlamaConfig
        from models.registry import build_model
        from models.tokenizer import TextTokenizer

        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        backend.train_from_iterator(CORPUS * 3, trainer)
        tokenizer = TextTokenizer(
            backend,
            bos_id=None,
            eos_id=backend.token_to_id("<|endoftext|>"),
            add_bos=False,
            chat_template=CHAT_TEMPLATE,
        )
        assert tokenizer.eos_id is not None and tokenizer.vocab_size >= 290
        config = LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            layers=2,
            width=16,
            heads=4,
            kv_heads=2,
            ff_width=32,
            max_positions=max_positions,
            tie_embeddings=False,
        )  # a tied random head just repeats its input token
        model = build_model("llama", config, SEED)
        out = tmp_path_factory.mktemp("tiny-lm") / "artifact"
        export_model(model, "llama", config, out, variant="serving", seed=SEED, extra_files=tokenizer.files())
        _CACHE[max_positions] = TinyLM(out, tokenizer, model, config)
    return _CACHE[max_positions]


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm(tmp_path_factory)


@pytest.fixture(scope="module")
def artifact(lm):
    from models.artifacts import open_artifact

    return open_artifact(lm.directory)


@pytest.fixture(scope="module")
def oracle_lm(artifact):
    """generate()'s own runner: single requests, no padding, IO binding."""
    return CachedLM(create_runner("ort-cpu", artifact), MAX_POSITIONS)


@pytest.fixture(scope="module")
def engine_runner(artifact):
    return create_runner("ort-cpu", artifact)


@pytest.fixture(scope="module")
def model64(lm):
    return copy.deepcopy(lm.model).to(torch.float64).eval()


@pytest.fixture
def make_engine(engine_runner):
    engines = []

    def make(runner=None, **kwargs):
        engine = BatchEngine(runner or engine_runner, MAX_POSITIONS, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        if engine._thread.is_alive():
            for request in list(engine.pending.queue) + [r.request for r in engine.rows]:
                request.cancel()
            engine.stop(10.0)
            assert not engine._thread.is_alive(), "the engine thread did not stop"


def make_request(prompt_ids, max_tokens, sampling=GREEDY, stop_ids=(), on_token=None) -> Request:
    """A Request whose events are recorded; `.done` is set on its "done" or "error" event."""
    events: list[tuple[str, object]] = []
    done = threading.Event()

    def emit(kind, value):
        events.append((kind, value))
        if kind == "token" and on_token is not None:
            on_token(request, value)
        if kind in ("done", "error"):
            done.set()

    request = Request(list(prompt_ids), max_tokens, sampling, tuple(stop_ids), emit)
    request.events, request.done = events, done
    return request


def wait_all(requests, timeout=30.0):
    deadline = time.monotonic() + timeout
    for r in requests:
        assert r.done.wait(max(deadline - time.monotonic(), 0.01)), f"request never finished: {r.events[-3:]}"


def finish(request) -> tuple[list[int], str]:
    """(tokens from the events, the done reason); exactly one terminal event, last."""
    kinds = [k for k, _ in request.events]
    assert kinds.count("done") + kinds.count("error") == 1 and kinds[-1] in ("done", "error"), request.events
    assert kinds[-1] == "done", request.events[-1]
    tokens = [v for k, v in request.events if k == "token"]
    assert tokens == request.tokens
    return tokens, request.events[-1][1]


def oracle(lm, prompt_ids, max_tokens, sampling=GREEDY, stop_ids=()):
    result = generate(lm, list(prompt_ids), max_new_tokens=max_tokens, sampling=sampling, stop_ids=tuple(stop_ids))
    return result.tokens, result.finish_reason


PROMPTS = [
    "hello",
    "the quick brown fox",
    "language models predict the next token from the ones before it, and",
    "a cache keeps",
    "what is the capital of france?",
    "once upon a time there was a small model that could only guess what the quick brown fox",
]


@pytest.fixture(scope="module")
def prompts(lm):
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "the prompts should all have different lengths"
    return ids


class Recorder:
    """A runner wrapper that records every feed and output, and the engine's rows at each call."""

    def __init__(self, runner):
        self.runner = runner
        self.input_specs = runner.input_specs
        self.engine = None
        self.calls = []
        self.trusted = []  # what each call declared as the runner's own cache

    def run(self, feed, trusted=()):
        self.trusted.append(tuple(trusted))
        outputs = self.runner.run(feed, trusted)
        histories = [list(r.request.prompt_ids) + list(r.request.tokens) for r in self.engine.rows]
        self.calls.append(
            ({k: np.array(v) for k, v in feed.items()}, {k: np.array(v) for k, v in outputs.items()}, histories)
        )
        return outputs


# --------------------------------------------------------------------------- tokens against generate()


def test_different_prompt_lengths_submitted_together_match_single_requests(make_engine, oracle_lm, prompts):
    max_tokens = [12, 20, 7, 16, 20, 9]
    expected = [oracle(oracle_lm, p, n) for p, n in zip(prompts, max_tokens, strict=False)]
    engine = make_engine(max_batch=8)
    requests = [make_request(p, n) for p, n in zip(prompts, max_tokens, strict=False)]
    for r in requests:  # all queued before the worker starts: the first batch holds every row
        engine.submit(r)
    assert engine.queue_depth == len(requests)
    engine.start()
    wait_all(requests)
    for r, (tokens, reason), n in zip(requests, expected, max_tokens, strict=False):
        got, why = finish(r)
        assert got == tokens, (r.prompt_ids, got, tokens)
        assert why == reason == "length" and len(got) == n
    assert len({tuple(t) for t, _ in expected}) > 1, "the oracle outputs should differ between prompts"


def test_request_joining_mid_decode_matches_and_leaves_others_unaffected(make_engine, oracle_lm, prompts):
    first, second, late = prompts[1], prompts[5], prompts[2]
    expected = [oracle(oracle_lm, first, 24), oracle(oracle_lm, second, 24), oracle(oracle_lm, late, 10)]
    engine = make_engine()
    joined_at = {}
    late_request = make_request(late, 10, on_token=lambda req, tok: joined_at.setdefault("late", len(a.tokens)))

    def join(request, token):  # runs on the worker thread, between decode steps
        if len(request.tokens) == 5:
            engine.submit(late_request)

    a = make_request(first, 24, on_token=join)
    b = make_request(second, 24)
    engine.submit(a)
    engine.submit(b)
    engine.start()
    wait_all([a, b, late_request])
    assert 5 <= joined_at["late"] < 24, joined_at  # the late request really joined a running batch
    for r, (tokens, reason) in zip([a, b, late_request], expected, strict=False):
        got, why = finish(r)
        assert (got, why) == (tokens, reason), r.prompt_ids


def test_rows_leaving_at_different_times_leave_the_others_unaffected(make_engine, oracle_lm, prompts):
    # The longest prompt leaves first, so the cache columns only it used are trimmed mid-run.
    long_greedy, _ = oracle(oracle_lm, prompts[5], 30)
    k = next(i for i in range(3, 30) if long_greedy[i] not in long_greedy[:i])
    stop = (long_greedy[k],)  # a stop id the greedy output reaches at step k + 1
    plan = [
        (prompts[5], 30, stop),
        (prompts[0], 3, ()),
        (prompts[2], 1, ()),
        (prompts[3], 25, ()),
        (prompts[4], 11, ()),
    ]
    expected = [oracle(oracle_lm, p, n, stop_ids=s) for p, n, s in plan]
    assert expected[0] == (long_greedy[: k + 1], "stop")
    engine = make_engine()
    requests = [make_request(p, n, stop_ids=s) for p, n, s in plan]
    for r in requests:
        engine.submit(r)
    engine.start()
    wait_all(requests)
    for r, (tokens, reason) in zip(requests, expected, strict=False):
        got, why = finish(r)
        assert (got, why) == (tokens, reason), r.prompt_ids
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active == 0 and engine.mask.shape == (0, 0) and engine.cache == {}


def test_cancel_frees_the_row_and_spares_the_others(make_engine, oracle_lm, prompts):
    expected = oracle(oracle_lm, prompts[4], 30)
    engine = make_engine()

    def cancel_after_three(request, token):
        if len(request.tokens) == 3:
            request.cancel()

    doomed = make_request(prompts[5], 60, on_token=cancel_after_three)
    other = make_request(prompts[4], 30)
    engine.submit(doomed)
    engine.submit(other)
    engine.start()
    wait_all([doomed, other])
    tokens, reason = finish(doomed)
    assert reason == "cancelled" and len(tokens) == 3  # retired before the next decode step
    assert finish(other) == expected
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active == 0 and engine.idle()


def test_cancelled_request_in_the_queue_is_skipped(make_engine, prompts):
    engine = make_engine(max_batch=1)
    queued = make_request(prompts[0], 5)
    engine.submit(queued)
    queued.cancel()
    later = make_request(prompts[1], 5)
    engine.submit(later)
    engine.start()
    wait_all([later])
    assert not [k for k, _ in queued.events if k == "token"]  # never prefilled
    assert engine.queue_depth == 0


def test_queue_is_bounded(make_engine, oracle_lm, prompts):
    engine = make_engine(max_batch=2, max_queue=3)
    requests = [make_request(prompts[i], 4) for i in range(3)]
    for r in requests:  # the worker is not running yet, so nothing leaves the queue
        engine.submit(r)
    with pytest.raises(QueueFull):
        engine.submit(make_request(prompts[3], 4))
    assert engine.queue_depth == 3
    engine.start()  # the three accepted requests still complete, two rows at a time
    wait_all(requests)
    for r in requests:
        assert finish(r) == oracle(oracle_lm, r.prompt_ids, 4)
    engine.submit(make_request(prompts[3], 4))  # room again


def test_prompt_plus_max_tokens_beyond_the_context_is_an_input_error(make_engine, prompts):
    engine = make_engine()
    prompt = prompts[2]
    too_many = MAX_POSITIONS - len(prompt) + 1
    with pytest.raises(InputError) as info:
        engine.submit(make_request(prompt, too_many))
    message = str(info.value)
    for number in (len(prompt), too_many, MAX_POSITIONS + 1, MAX_POSITIONS):
        assert str(number) in message, message
    assert engine.queue_depth == 0
    engine.submit(make_request(prompt, too_many - 1))  # exactly the context is fine


def test_seeded_sampling_gives_the_same_tokens_batched_as_alone(make_engine, oracle_lm, prompts):
    samplings = [
        Sampling(temperature=1.0, seed=3),
        Sampling(temperature=0.8, top_p=0.9, seed=5),
        Sampling(temperature=1.3, top_k=20, seed=7),
        Sampling(),
    ]
    chosen = [prompts[0], prompts[3], prompts[5], prompts[1]]
    expected = [oracle(oracle_lm, p, 15, s) for p, s in zip(chosen, samplings, strict=False)]
    assert expected[0] != oracle(oracle_lm, chosen[0], 15, Sampling(temperature=1.0, seed=4))  # seed matters
    engine = make_engine()
    requests = [make_request(p, 15, s) for p, s in zip(chosen, samplings, strict=False)]
    for r in requests:
        engine.submit(r)
    engine.start()
    wait_all(requests)
    for r, want in zip(requests, expected, strict=False):
        assert finish(r) == want, r.sampling


# --------------------------------------------------------------------------- logits against float64 eager


def test_batched_logits_match_float64_eager(make_engine, engine_runner, model64, prompts):
    recorder = Recorder(engine_runner)
    engine = make_engine(runner=recorder)
    recorder.engine = engine
    late = make_request(prompts[3], 6)

    def join(request, token):
        if len(request.tokens) == 4:
            engine.submit(late)

    requests = [make_request(prompts[0], 14, on_token=join), make_request(prompts[5], 5), make_request(prompts[2], 10)]
    for r in requests:
        engine.submit(r)
    engine.start()
    wait_all([*requests, late])

    decode = [(f, o, h) for f, o, h in recorder.calls if f["past_mask"].shape[1] > 0]
    padded = [c for c in decode if c[0]["input_ids"].shape[0] > 1 and (c[0]["past_mask"] == 0).any()]
    assert len(padded) >= 5, "the run should include batched steps with left padding"
    assert {f["input_ids"].shape[0] for f, _, _ in decode} >= {1, 2, 3}  # rows joined and left
    trimmed = any(
        b[0]["past_mask"].shape[1] < a[0]["past_mask"].shape[1] + 1 for a, b in zip(decode, decode[1:], strict=False)
    )
    assert trimmed, "a retiring row should have trimmed padding columns"
    # Prefills (empty cache) are fully scanned; decode steps hand back the engine's own cache as trusted.
    caches = tuple(sorted(k for k in recorder.calls[0][0] if k.startswith("past.")))
    for (feed, _, _), trusted in zip(recorder.calls, recorder.trusted, strict=False):
        assert tuple(sorted(trusted)) == (
            caches if feed["past_mask"].shape[1] > 0 and feed["input_ids"].shape[1] == 1 else ()
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny forwards: thread hand-offs would cost more than the math
    try:
        worst = _check_against_eager(decode, model64)
    finally:
        torch.set_num_threads(threads)
    assert worst < 1e-4


def _check_against_eager(decode, model64) -> float:
    worst = 0.0
    with torch.no_grad():
        for feed, outputs, histories in decode:
            logits = outputs["logits"][:, -1]
            scale = float(np.abs(logits).max())
            # 1. the same left-padded feed through float64 eager
            past = [
                tuple(torch.from_numpy(feed[f"past.{i}.{kind}"]).double() for kind in ("key", "value"))
                for i in range(2)
            ]
            eager = model64(
                torch.from_numpy(feed["input_ids"]),
                past=past,
                past_mask=torch.from_numpy(feed["past_mask"]),
                position_ids=torch.from_numpy(feed["position_ids"]),
            )
            np.testing.assert_allclose(logits, eager["logits"][:, -1].numpy(), rtol=1e-4, atol=1e-4 * scale)
            for i in range(2):  # the returned cache too (its padding slots included)
                for kind in ("key", "value"):
                    np.testing.assert_allclose(
                        outputs[f"present.{i}.{kind}"], eager[f"present.{i}.{kind}"].numpy(), rtol=1e-4, atol=1e-4
                    )
            # 2. each row's whole history, no cache and no padding at all
            assert len(histories) == logits.shape[0]
            for row, history in enumerate(histories):
                assert feed["input_ids"][row, 0] == history[-1]
                assert feed["position_ids"][row, 0] == len(history) - 1
                assert feed["past_mask"][row].sum() == len(history) - 1
                full = model64(torch.tensor([history]))["logits"][0, -1].numpy()
                worst = max(worst, float(np.abs(logits[row] - full).max()) / scale)
                np.testing.assert_allclose(logits[row], full, rtol=1e-4, atol=1e-4 * scale)
    return worst
