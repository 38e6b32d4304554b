"""`toolkit serve` as a real process, driven with the official `openai` client and raw httpx.

Oracles: generate() on a CachedLM with the same tokenizer (what `toolkit generate` prints), the
tokenizer's own token counts, the server's own answers to one request at a time (batched ==
unbatched), and Prometheus counters read before and after. The artifact is the tiny random LLaMA
with a byte-level BPE tokenizer from tests/runners/test_batching.py (exported once per session).
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from models.artifacts import open_artifact
from runners.decoding.generate import CachedLM, Sampling, generate
from runners.registry import create_runner
from tests.optional import import_or_skip
from tests.runners.decoding.test_batching import MAX_POSITIONS, tiny_lm
from toolkit.cli import main

pytestmark = pytest.mark.slow

openai = import_or_skip("openai", reason="the OpenAI client is the test extra that talks to the server")

GREEDY = Sampling()
SERVER_MAX_TOKENS = 120  # --max-tokens of every server here
LONG_POSITIONS = 4096  # long_lm's context
LONG_TOKENS = LONG_POSITIONS - 96  # an answer this long outlasts any delay in noticing a close or a shutdown
SMALL = ("--max-batch", "1", "--max-queue", "1")
REPO = Path(__file__).resolve().parents[3]
PROMPTS = [
    "hello",
    "the quick brown fox",
    "a cache keeps",
    "what is the capital of france?",
    "language models predict the next token from the ones before it, and",
    "once upon a time there was a small model",
    "numbers like 1 2 3",
    "streaming sends one delta per token",
    "position ids tell each row",
    "the server answers",
]


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, directory: Path, log: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from toolkit.cli import main; main()",
                    "serve",
                    str(directory),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it was ready:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()
            if state["active"] == 0 and state["queued"] == 0 or time.monotonic() > deadline:
                return state
            time.sleep(0.02)

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm(tmp_path_factory)


@pytest.fixture(scope="module")
def long_lm(tmp_path_factory):
    """The same recipe with LONG_POSITIONS of context: for tests that race the server against a request that
    must still be decoding (a close, a shutdown), since the 128-position model's answers end within a second."""
    return tiny_lm(tmp_path_factory, max_positions=LONG_POSITIONS)


@pytest.fixture(scope="module")
def servers(lm, tmp_path_factory):
    """Two servers started together: main (batch 8) and small (batch 1, queue 1; SIGTERMed at the end)."""
    logs = tmp_path_factory.mktemp("server-logs")
    limit = ("--max-tokens", str(SERVER_MAX_TOKENS))
    started = {}
    try:
        for name, args in (("main", ()), ("small", SMALL)):
            started[name] = Server(lm.directory, logs / f"{name}.log", *limit, *args)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture
def small(servers, lm, tmp_path):
    """The batch-1, queue-1 server; restarted if the SIGTERM test already ran (any test order works)."""
    if servers["small"].proc.poll() is not None:
        servers["small"] = Server(lm.directory, tmp_path / "small.log", "--max-tokens", str(SERVER_MAX_TOKENS), *SMALL)
        servers["small"].wait_ready()
    return servers["small"]


@pytest.fixture(scope="module")
def client(server):
    # max_retries=0: a 429 must reach the test, not be retried away
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(lm):
    return lm.directory.name  # exported without a preset, so the model is named after its directory


@pytest.fixture(scope="module")
def oracle_lm(lm):
    return CachedLM(create_runner("ort-cpu", open_artifact(lm.directory)), MAX_POSITIONS)


def expected(oracle_lm, tokenizer, prompt: str | list[int], max_tokens: int, sampling: Sampling = GREEDY):
    """(text, prompt ids, Generation) of generate() with the server's stop rule (the eos token); the prompt is
    text or token ids (a chat's, from encode_chat)."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    result = generate(oracle_lm, ids, max_new_tokens=max_tokens, sampling=sampling, stop_ids=(tokenizer.eos_id,))
    return tokenizer.decode(result.tokens), ids, result


def clean_prompts(oracle_lm, tokenizer, max_tokens, count, sampling=GREEDY):
    """Prompts whose text does not end inside a UTF-8 sequence (see the xfail below)."""
    chosen = [p for p in PROMPTS if not expected(oracle_lm, tokenizer, p, max_tokens, sampling)[0].endswith("\ufffd")]
    if len(chosen) < count:
        pytest.fail(f"only {len(chosen)} usable prompts for max_tokens={max_tokens}")
    return chosen[:count]


def post(server, path, payload=None, **kwargs):
    return httpx.post(server.url + path, json=payload, timeout=30, **kwargs)


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


# --------------------------------------------------------------------------- OpenAI API through the client


def test_models_list_returns_the_model_id(client, model_id):
    assert [m.id for m in client.models.list().data] == [model_id]


def test_completion_greedy_equals_generate(client, model_id, lm, oracle_lm):
    tokenizer = lm.tokenizer
    for prompt in clean_prompts(oracle_lm, tokenizer, 24, 3):
        text, ids, result = expected(oracle_lm, tokenizer, prompt, 24)
        response = client.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0)
        choice = response.choices[0]
        assert choice.text == text, prompt
        assert choice.finish_reason == result.finish_reason
        assert response.usage.prompt_tokens == len(ids) == len(tokenizer.encode(prompt))
        assert response.usage.completion_tokens == len(result.tokens)
        assert response.usage.total_tokens == len(ids) + len(result.tokens)
        assert response.model == model_id and response.object == "text_completion"


def test_completion_equals_toolkit_generate_output(client, model_id, lm, oracle_lm):
    prompt = clean_prompts(oracle_lm, lm.tokenizer, 20, 1, Sampling(0.7, 0, 1.0, 9))[0]
    cli = CliRunner().invoke(
        main,
        [
            "generate",
            str(lm.directory),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "20",
            "--temperature",
            "0.7",
            "--seed",
            "9",
        ],
    )
    assert cli.exit_code == 0, cli.output
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0.7, seed=9)
    assert cli.stdout == response.choices[0].text + "\n"
    assert response.choices[0].text == expected(oracle_lm, lm.tokenizer, prompt, 20, Sampling(0.7, 0, 1.0, 9))[0]


def test_completion_stream_equals_non_stream(client, model_id, lm, oracle_lm):
    prompt = clean_prompts(oracle_lm, lm.tokenizer, 30, 2, Sampling(1.1, 0, 0.95, 4))[1]
    settings = dict(model=model_id, prompt=prompt, max_tokens=30, temperature=1.1, top_p=0.95, seed=4)
    whole = client.completions.create(**settings)
    chunks = list(client.completions.create(stream=True, **settings))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_non_streaming_and_streaming_agree_with_generate(client, model_id, lm, oracle_lm):
    tokenizer = lm.tokenizer
    messages = [
        {"role": "system", "content": "you are a tiny model"},
        {"role": "user", "content": "what is the capital of france?"},
    ]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    sampling = Sampling(0.9, 0, 1.0, 5)
    text, ids, result = expected(oracle_lm, tokenizer, tokenizer.encode_chat(messages), 30, sampling)
    settings = dict(model=model_id, messages=messages, max_tokens=30, temperature=0.9, seed=5)
    whole = client.chat.completions.create(**settings)
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert not text.endswith("\ufffd"), "pick settings whose text ends on a whole character (see the xfail below)"
    assert message.content == text
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(result.tokens)
    assert whole.choices[0].finish_reason == result.finish_reason
    assert whole.object == "chat.completion"

    chunks = list(client.chat.completions.create(stream=True, **settings))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    other = client.chat.completions.create(**dict(settings, seed=6))
    assert other.choices[0].message.content != message.content  # the seed is used


def _stop_case(oracle_lm, tokenizer):
    """(prompt, greedy text of 30 tokens, index k > 0 of a char that first occurs at k)."""
    for prompt in PROMPTS:
        text, _, result = expected(oracle_lm, tokenizer, prompt, 30)
        if result.finish_reason != "length":
            continue
        for k in range(len(text) // 3, len(text) - 1):
            if text[k].isalnum() and text.find(text[k]) == k:
                return prompt, text, k
    pytest.fail("no prompt with a usable stop character")


def test_finish_reason_length_versus_stop(client, model_id, lm, oracle_lm):
    prompt, text, k = _stop_case(oracle_lm, lm.tokenizer)
    settings = dict(model=model_id, prompt=prompt, max_tokens=30, temperature=0)
    full = client.completions.create(**settings)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 30
    stopped = client.completions.create(stop=["never appears ~~~", text[k]], **settings)
    assert stopped.choices[0].text == text[:k]
    assert stopped.choices[0].finish_reason == "stop"
    assert 0 < stopped.usage.completion_tokens < 30
    streamed = list(client.completions.create(stop=text[k], stream=True, **settings))
    assert "".join(c.choices[0].text for c in streamed) == text[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_string_spanning_two_tokens_is_cut_exactly(client, model_id, lm, oracle_lm):
    tokenizer = lm.tokenizer
    for prompt in PROMPTS:
        text, _, result = expected(oracle_lm, tokenizer, prompt, 30)
        # decoded-text length after each token: a boundary b has text[b - 1] and text[b] in different tokens
        bounds = [len(tokenizer.decode(result.tokens[:i])) for i in range(1, len(result.tokens))]
        spans = [
            b - 1
            for b in bounds
            if 0 < b - 1
            and b < len(text)
            and "\ufffd" not in text[: b + 1]
            and text[b - 1 : b + 1].isprintable()
            and text.find(text[b - 1 : b + 1]) == b - 1
            and not tokenizer.decode(result.tokens[: bounds.index(b) + 1]).endswith("\ufffd")
        ]
        if spans:
            k = spans[0]
            break
    else:
        pytest.fail("no greedy text with a two-character stop string across a token boundary")
    stop = text[k : k + 2]
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == text[:k], (stop, response.choices[0].text, text[:k])


def test_completion_text_ending_inside_a_utf8_sequence_is_not_dropped(client, model_id, lm, oracle_lm):
    tokenizer = lm.tokenizer
    for prompt in PROMPTS:
        _, _, result = expected(oracle_lm, tokenizer, prompt, 60)
        ends = [
            n
            for n in range(2, len(result.tokens) + 1)
            if tokenizer.decode(result.tokens[:n]).endswith("\ufffd") and tokenizer.eos_id not in result.tokens[:n]
        ]
        if ends:
            n = ends[0]
            break
    else:
        pytest.fail("no greedy output ending inside a UTF-8 sequence")
    text, _, result = expected(oracle_lm, tokenizer, prompt, n)
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0)
    assert response.usage.completion_tokens == n
    assert response.choices[0].text == text, (response.choices[0].text, text)


def test_concurrent_requests_get_the_same_text_as_alone(client, model_id, server):
    jobs = [dict(prompt=p, max_tokens=40, temperature=0 if i % 2 else 0.8, seed=i) for i, p in enumerate(PROMPTS[:8])]

    def ask(job):
        r = client.completions.create(model=model_id, **job)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    alone = [ask(job) for job in jobs]
    assert len(set(alone)) == len(jobs)
    server.wait_idle()
    before = server.metrics()
    barrier = threading.Barrier(len(jobs), timeout=30)

    def together(job):
        barrier.wait()
        return ask(job)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        batched = list(pool.map(together, jobs, timeout=60))
    assert batched == alone
    after = server.metrics()
    steps = after[("toolkit_batch_size_count", ())] - before[("toolkit_batch_size_count", ())]
    single = (
        after[("toolkit_batch_size_bucket", (("le", "1.0"),))] - before[("toolkit_batch_size_bucket", (("le", "1.0"),))]
    )
    rows = after[("toolkit_batch_size_sum", ())] - before[("toolkit_batch_size_sum", ())]
    assert steps > single and rows > steps, "no decode step ran more than one row: nothing was batched"


# --------------------------------------------------------------------------- raw HTTP errors


def test_invalid_json_is_422_naming_the_body(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "hi", "max_tokens": ',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 422
    error = error_of(r)
    assert error["param"] == "body" and error["message"].startswith("body: invalid JSON"), error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, payload, param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_invalid_fields_are_422_naming_the_field(server, path, payload, param):
    r = post(server, path, payload)
    assert r.status_code == 422, r.text
    error = error_of(r)
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_prompt_longer_than_the_context_is_400_with_the_numbers(server, lm):
    prompt = "the quick brown fox jumps over the lazy dog " * 20
    n = len(lm.tokenizer.encode(prompt))
    assert n > MAX_POSITIONS
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
    assert r.status_code == 400
    error = error_of(r)
    assert error["param"] == "prompt"
    for number in (n, 5, n + 5, MAX_POSITIONS):
        assert str(number) in error["message"], error
    # fits on its own, but not with the answer it asks for
    prompt = "hello " * 10
    n = len(lm.tokenizer.encode(prompt))
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_POSITIONS - n + 1})
    assert r.status_code == 400 and str(MAX_POSITIONS + 1) in error_of(r)["message"]
    assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_POSITIONS - n}).status_code == 200


def test_max_tokens_above_the_server_limit_is_400(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": SERVER_MAX_TOKENS + 1})
    assert r.status_code == 400
    error = error_of(r)
    assert error["param"] == "max_tokens"
    assert str(SERVER_MAX_TOKENS + 1) in error["message"] and str(SERVER_MAX_TOKENS) in error["message"]
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": SERVER_MAX_TOKENS}).status_code == 200


def test_empty_prompt_is_400(server):
    r = post(server, "/v1/completions", {"prompt": ""})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"


def test_empty_prompt_400_is_counted_in_the_metrics(server):
    key = ("toolkit_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    before = server.metrics().get(key, 0.0)
    assert post(server, "/v1/completions", {"prompt": ""}).status_code == 400
    assert server.metrics().get(key, 0.0) - before == 1


# --------------------------------------------------------------------------- load, disconnects, metrics


def test_full_queue_is_429_with_retry_after_and_spares_the_others(small, lm):
    short = [p for p in PROMPTS if len(lm.tokenizer.encode(p)) <= MAX_POSITIONS - 100][:8]
    valid = [{"prompt": p, "max_tokens": 100, "temperature": 0} for p in short]
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=32)) as http:
        alone = []
        for payload in valid:
            r = http.post(small.url + "/v1/completions", json=payload)
            assert r.status_code == 200, r.text
            alone.append(r.json()["choices"][0]["text"])
        invalid = [{"prompt": "hi", "max_tokens": 0}, {"prompt": "hello " * 200, "max_tokens": 4}]
        jobs = [(i, p) for i, p in enumerate(valid)]
        jobs[3:3] = [(None, invalid[0])]  # bad requests amid the good ones
        jobs[7:7] = [(None, invalid[1])]
        refused = []
        for _ in range(3):  # bounded: one round almost always overflows a queue of one
            barrier = threading.Barrier(len(jobs), timeout=30)

            def send(job, barrier=barrier):
                barrier.wait()
                return job[0], http.post(small.url + "/v1/completions", json=job[1])

            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                results = list(pool.map(send, jobs, timeout=90))
            statuses = [r.status_code for _, r in results]
            for index, r in results:
                if index is None:  # the invalid ones fail on their own merits, never with a 500
                    assert r.status_code in (422, 400), r.text
                elif r.status_code == 429:
                    refused.append(r)
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == alone[index]
            assert statuses.count(200) >= 1
            if refused:
                break
    assert refused, "a queue of one never overflowed"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert "queue full" in error_of(r)["message"]
    assert small.wait_idle() == {"status": "ok", "active": 0, "queued": 0}


@pytest.fixture
def long_small(long_lm, tmp_path):
    """A batch-1, queue-1 server whose model and --max-tokens allow a LONG_TOKENS answer, so a disconnected
    stream cannot finish its decode before the server sees the close."""
    server = Server(long_lm.directory, tmp_path / "long.log", "--max-tokens", str(LONG_TOKENS), *SMALL)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_client_disconnect_mid_stream_frees_the_slot(long_small):
    small, max_tokens = long_small, LONG_TOKENS
    assert small.wait_idle()["active"] == 0
    steps_before = small.metrics()[("toolkit_batch_size_count", ())]
    payload = {"prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", small.url + "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            json.loads(first[len("data: ") :])
        # leaving the block closed the connection after one chunk
    state = small.wait_idle(timeout=10)
    assert state["active"] == 0 and state["queued"] == 0, state
    steps = small.metrics()[("toolkit_batch_size_count", ())] - steps_before
    assert steps < max_tokens - 1, f"the disconnected request decoded all {steps} steps"
    assert small.metrics()[("toolkit_requests_cancelled_total", (("reason", "disconnect"),))] == 1
    # the one slot is free: a new request is served at once (greedy: a sampled answer may end at an EOS first)
    r = post(small, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_metrics_expose_counters_gauges_and_histograms(server):
    server.wait_idle()
    before = server.metrics()
    r = post(server, "/v1/completions", {"prompt": "a cache keeps", "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200
    k = r.json()["usage"]["completion_tokens"]
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 0}).status_code == 422
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}).status_code == 400
    after = server.metrics()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        assert key in after, (key, sorted(k for k in after if k[0].startswith(name[:12])))
        return after[key] - before.get(key, 0.0)

    assert delta("toolkit_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("toolkit_requests_total", endpoint="/v1/completions", status="422") == 1
    assert delta("toolkit_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("toolkit_tokens_generated_total") == k
    assert delta("toolkit_time_to_first_token_seconds_count") == 1
    assert delta("toolkit_time_to_first_token_seconds_sum") > 0
    assert delta("toolkit_token_latency_seconds_count") == k - 1  # one decode step per token after the first
    assert delta("toolkit_batch_size_count") == k - 1
    assert delta("toolkit_batch_size_sum") == k - 1  # alone: one row per step
    assert after[("toolkit_queue_depth", ())] == 0
    assert after[("toolkit_active_requests", ())] == 0


# --------------------------------------------------------------------------- shutdown and start-up errors


@pytest.fixture(scope="module")
def sigterm_run(servers, lm):
    """SIGTERM the small server (batch 1, queue 1) while two streams are in flight (one decoding, one queued)."""
    term = servers["small"]
    assert term.proc.poll() is None and term.wait_idle()["active"] == 0
    payloads = [{"prompt": p, "max_tokens": 100, "temperature": 0, "stream": True} for p in PROMPTS[:2]]
    with httpx.Client(timeout=30) as http:
        alone = []
        for p in payloads:
            r = http.post(term.url + "/v1/completions", json=dict(p, stream=False))
            assert r.status_code == 200
            alone.append(r.json()["choices"][0]["text"])
    assert term.wait_idle()["active"] == 0
    # The barrier outlasts the wait for the engine below, so a first stream that finishes before the poll sees
    # it decoding cannot break the barrier.
    opened = threading.Barrier(len(payloads) + 1, timeout=60)

    def stream(payload):
        with httpx.Client(timeout=60) as http, http.stream("POST", term.url + "/v1/completions", json=payload) as r:
            opened.wait()  # headers arrive at once, even for a queued request
            return r.status_code, [line for line in r.iter_lines() if line]

    with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
        # The queue holds one request: the second stream goes in only once the engine has taken the
        # first out of the queue, or it is refused with 429 (a race seen once in CI).
        futures = [pool.submit(stream, payloads[0])]
        deadline = time.monotonic() + 10
        while term.health()["active"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        futures.append(pool.submit(stream, payloads[1]))
        opened.wait()
        signalled = time.monotonic()
        term.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=60) for f in futures]
    try:
        code = term.proc.wait(timeout=40)  # the grace period is 30 s
    except subprocess.TimeoutExpired:
        code = None
    return {
        "alone": alone,
        "results": results,
        "code": code,
        "seconds": time.monotonic() - signalled,
        "output": term.output(),
    }


def test_sigterm_lets_in_flight_streams_finish(sigterm_run):
    for (status, lines), text in zip(sigterm_run["results"], sigterm_run["alone"], strict=True):
        assert status == 200
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sigterm_run["code"] is not None, "the server did not exit within the grace period"
    assert sigterm_run["seconds"] < 30
    assert "Traceback" not in sigterm_run["output"]


def test_sigterm_exit_status_is_zero(sigterm_run):
    assert sigterm_run["code"] == 0, sigterm_run["code"]


def _without_tokenizer(lm, tmp_path) -> Path:
    """The artifact as an export without --from would write it: no tokenizer files, none in the manifest."""
    out = tmp_path / "no-tokenizer"
    shutil.copytree(lm.directory, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["extra_files"] = {}
    (out / "manifest.json").write_text(json.dumps(manifest))
    open_artifact(out)  # a valid artifact otherwise
    return out


@pytest.mark.parametrize("which", ["directory", "onnx-file"])
def test_serve_without_a_tokenizer_exits_2_with_one_line(lm, tmp_path, which):
    target = _without_tokenizer(lm, tmp_path) if which == "directory" else lm.directory / "model.onnx"
    result = CliRunner().invoke(main, ["serve", str(target), "--port", str(free_port())])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "no tokenizer" in lines[0] and str(target) in lines[0]
    assert "serving" not in result.stdout
