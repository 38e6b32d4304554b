"""Sliding-window attention under continuous batching: left padding must take no place in the window.

A tiny random Mistral (window 5) and a Gemma 2 (alternating sliding and global layers) are imported from
Hugging Face directories and exported with `toolkit export --from`; prompts of different lengths, all longer
than the window, are decoded together by BatchEngine on ONNX Runtime. The oracle is transformers' own greedy
generate on each prompt alone (no padding, no shared batch). The window counts the keys the cache keeps
(models.ops.attention); left padding shifts a row's query and key slots alike, so this also holds a window
counted in slots, and the test pins the batched path end to end rather than that choice.
"""

from __future__ import annotations

import pytest
import torch

from models.artifacts import open_artifact
from runners.decoding.batching import BatchEngine
from runners.registry import create_runner
from tests.models.test_hf_decoders import build, tokenizer  # noqa: F401  (tokenizer: a fixture)
from tests.runners.decoding.test_batching import finish, make_request, wait_all
from tests.toolkit.test_cli import invoke

pytestmark = pytest.mark.slow
PROMPTS = [
    "the quick brown fox jumps",
    "hello world hello world hello",
    "the lazy dog jumps over the quick brown fox again",
]
MAX_TOKENS = 12


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_batched_windowed_decoding_matches_transformers(tokenizer, tmp_path, name):  # noqa: F811
    hf = build(name, tokenizer, tmp_path / "hf")
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "artifact")
    assert result.exit_code == 0, result.output
    artifact = open_artifact(tmp_path / "artifact")
    bos = tokenizer.token_to_id("<s>")
    prompts = [[bos, *tokenizer.encode(p).ids] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts) and min(map(len, prompts)) > 5  # past the window
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None)
            expected.append(out[0, len(ids) :].tolist())
    engine = BatchEngine(create_runner("ort-cpu", artifact), artifact.manifest.data["config"]["max_positions"])
    requests = [make_request(p, MAX_TOKENS) for p in prompts]
    for request in requests:  # queued before the worker starts: one batch, left-padded to the longest prompt
        engine.submit(request)
    engine.start()
    try:
        wait_all(requests, timeout=60.0)
    finally:
        engine.stop(10.0)
    for request, want in zip(requests, expected, strict=True):
        got, _ = finish(request)
        assert got == want, (request.prompt_ids, got, want)
