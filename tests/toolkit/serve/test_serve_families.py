"""`toolkit serve` on architectures beyond Llama: a Gemma 2 export (sandwich norms, GeGLU, soft-capping,
alternating sliding windows) answers concurrent completions with transformers' own greedy tokens."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from tests.models.test_hf_decoders import build, tokenizer  # noqa: F401  (tokenizer: a fixture)
from tests.toolkit.serve.test_server import Server
from tests.toolkit.test_cli import invoke

pytestmark = pytest.mark.slow
PROMPTS = ["the quick brown fox jumps", "hello world hello world hello", "the lazy dog jumps over the quick brown"]
MAX_TOKENS = 10


def test_gemma2_served_greedy_equals_transformers(tokenizer, tmp_path):  # noqa: F811
    hf = build("gemma2", tokenizer, tmp_path / "hf")
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "gemma2")
    assert result.exit_code == 0, result.output
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    expected = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = [bos, *tokenizer.encode(prompt).ids]
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos)
            expected[prompt] = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    server = Server(tmp_path / "gemma2", tmp_path / "server.log")
    try:
        server.wait_ready()

        def complete(prompt):
            payload = {"model": "gemma2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = httpx.post(server.url + "/v1/completions", json=payload, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together by the engine
            answers = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
    finally:
        server.stop()
    assert answers == expected
