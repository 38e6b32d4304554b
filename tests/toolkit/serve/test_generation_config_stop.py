"""`toolkit serve` stops on every id of generation_config.json's eos_token_id, as `toolkit generate` does.

The app runs in-process (FastAPI's TestClient runs its lifespan, so the batch engine thread is real);
the oracle is the greedy continuation from tests/toolkit/test_generation_config.py.
"""

from __future__ import annotations

import json

import pytest

from tests.optional import import_or_skip
from tests.toolkit import test_cli_lm
from tests.toolkit.test_cli_lm import PROMPT
from tests.toolkit.test_generation_config import MAX_NEW, StopCase, stop_case

import_or_skip("transformers", reason="transformers (the oracle) is a test extra")
testclient = import_or_skip("fastapi.testclient", reason="the in-process client needs httpx")

checkpoint = test_cli_lm.checkpoint  # the tiny Llama with its tokenizer, shared


@pytest.fixture(scope="module")
def case(checkpoint, tmp_path_factory) -> StopCase:
    return stop_case(checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def client(case):
    from toolkit.serve.app import create_app

    with testclient.TestClient(create_app(case.artifact, max_tokens=MAX_NEW)) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_serve_stops_on_a_generation_config_eos_id(client, case, stream):
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "stream": stream}
    want = case.tok.decode(case.greedy[: case.stop_at], skip_special_tokens=True)
    if not stream:
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["text"] == want
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == case.stop_at + 1  # the stop id is generated, not shown
        return
    with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
