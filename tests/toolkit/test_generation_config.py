"""generation_config.json's eos_token_id list stops `toolkit generate` on any of its ids.

Llama 3 Instruct lists <|eot_id|> there next to the tokenizer's <|end_of_text|>; a chat model that is
not stopped on it runs on past the end of its turn. The checkpoint is test_cli_lm's tiny Llama with
its tokenizer; the stop id is a token its greedy continuation (transformers, the oracle) emits early,
so generation must end right there, with that token left out of the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.optional import import_or_skip
from tests.toolkit import test_cli_lm
from tests.toolkit.test_cli import invoke
from tests.toolkit.test_cli_lm import PROMPT, generated, hf_greedy

import_or_skip("transformers", reason="transformers (the oracle) is a test extra")

checkpoint = test_cli_lm.checkpoint  # the tiny Llama with its tokenizer, shared
MAX_NEW = 12


@dataclass
class StopCase:
    artifact: Path
    greedy: list[int]  # the oracle's greedy continuation of PROMPT, MAX_NEW tokens
    stop_at: int  # index in `greedy` of the first token generation_config.json stops on
    eos_ids: list[int]  # generation_config.json's eos_token_id
    tok: object  # the tokenizers.Tokenizer


_CACHE: dict[str, StopCase] = {}


def stop_case(checkpoint, tmp_path_factory) -> StopCase:
    """The checkpoint with generation_config.json {"eos_token_id": [a, b]}, exported once per session.

    b is the first token of the greedy continuation from the third on that did not occur before it;
    a is a special token the continuation never reaches before b."""
    if "case" in _CACHE:
        return _CACHE["case"]
    directory, model, tok = checkpoint
    eos = tok.token_to_id("</s>")
    ids = [tok.token_to_id("<s>")] + tok.encode(PROMPT).ids
    greedy = hf_greedy(model, ids, MAX_NEW, eos)
    assert len(greedy) == MAX_NEW and eos not in greedy, "the tokenizer's eos would end generation on its own"
    stop_at = next(k for k in range(2, MAX_NEW - 2) if greedy[k] not in greedy[:k])
    a, b = tok.token_to_id("<|user|>"), greedy[stop_at]
    assert a not in greedy
    copy = tmp_path_factory.mktemp("generation-config") / "hf"
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": [a, b], "transformers_version": "5.0.0"})
    )
    out = copy.parent / "artifact"
    result = invoke("export", "--from", copy, "--out", out)
    assert result.exit_code == 0, (result.output, result.exception)
    _CACHE["case"] = StopCase(out, greedy, stop_at, [a, b], tok)
    return _CACHE["case"]


@pytest.fixture(scope="module")
def case(checkpoint, tmp_path_factory) -> StopCase:
    return stop_case(checkpoint, tmp_path_factory)


def test_the_artifact_carries_the_eos_ids(case):
    config = json.loads((case.artifact / "tokenizer_config.json").read_text())
    assert config["eos_ids"] == case.eos_ids
    assert config["eos_id"] == case.tok.token_to_id("</s>")


@pytest.mark.parametrize("backend", ["ort-cpu", "eager"])
def test_generate_stops_on_a_generation_config_eos_id(case, backend):
    text, summary = generated(
        invoke("generate", case.artifact, "--prompt", PROMPT, "--max-new-tokens", MAX_NEW, "--backend", backend)
    )
    # The tokens before the stop id are the oracle's; the stop id ends the text without being part of it.
    assert text == case.tok.decode(case.greedy[: case.stop_at], skip_special_tokens=True)
    assert summary.startswith(f"[{case.stop_at + 1} tokens, finish: stop, "), summary
    assert case.stop_at + 1 < MAX_NEW  # without the stop id it would have run on to the limit
