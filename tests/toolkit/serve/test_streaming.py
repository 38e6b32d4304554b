"""The streaming text rules on their own: UTF-8 hold-back, stop-string hold-back, flushing.

Tokens here are byte strings decoded as UTF-8 with replacement, as a byte-level BPE decoder does,
so every expected value is worked out by hand from the bytes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from artifact.errors import ModelFileError
from models.tokenizer import load_tokenizer
from toolkit.serve.streaming import TextStream, find_stop, stop_prefix_length

EURO = "\u20ac"  # E2 82 AC in UTF-8


def byte_stream(pieces: list[bytes], stops=()) -> tuple[TextStream, list[int]]:
    """A TextStream over tokens 0..n-1, token i decoding to pieces[i]."""
    stream = TextStream(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"), stops)
    return stream, list(range(len(pieces)))


def push_all(stream: TextStream, tokens: list[int]) -> list[str]:
    return [stream.push(t) for t in tokens]


# --------------------------------------------------------------------------- UTF-8 hold-back


def test_a_character_split_across_tokens_is_held_until_complete():
    stream, tokens = byte_stream([b"a", b"\xe2", b"\x82", b"\xacb"])
    assert push_all(stream, tokens) == ["a", "", "", EURO + "b"]
    assert stream.flush() == ""


def test_a_character_split_after_text_holds_the_text_with_it():
    stream, tokens = byte_stream([b"x\xe2\x82", b"\xac"])
    assert push_all(stream, tokens) == ["", "x" + EURO]


def test_an_incomplete_character_at_the_end_comes_out_in_flush():
    stream, tokens = byte_stream([b"hi", b"\xe2\x82"])
    assert push_all(stream, tokens) == ["hi", ""]
    assert stream.flush() == "\ufffd"  # the decoder's one replacement for the truncated sequence


def test_text_already_handed_out_is_never_contradicted():
    decoded = {(0,): "it '", (0, 1): "it's", (0, 1, 2): "it's fine"}  # a decoder that rewrites " ' " to "'"
    stream = TextStream(lambda ids: decoded[tuple(ids)])
    assert push_all(stream, [0, 1, 2]) == ["it '", "", ""]


# --------------------------------------------------------------------------- stop strings


def test_a_stop_string_split_across_tokens_is_never_emitted():
    stream, tokens = byte_stream([b"ab", b"cE", b"N", b"Dxyz"], stops=["END"])
    assert push_all(stream, tokens) == ["ab", "c", "", ""]
    assert stream.stopped


def test_text_before_a_stop_string_in_the_same_token_is_emitted():
    stream, tokens = byte_stream([b"ab", b"cdENDef"], stops=["END"])
    assert push_all(stream, tokens) == ["ab", "cd"]
    assert stream.stopped


def test_a_held_back_prefix_that_does_not_become_a_stop_is_released():
    stream, tokens = byte_stream([b"ab", b"E", b"N", b"x"], stops=["END"])
    assert push_all(stream, tokens) == ["ab", "", "", "ENx"]
    assert not stream.stopped


def test_the_earliest_stop_string_wins():
    stream, tokens = byte_stream([b"abcxyz"], stops=["xyz", "b"])
    assert push_all(stream, tokens) == ["a"]
    assert stream.stopped


def test_held_back_text_comes_out_in_flush_when_generation_ends():
    stream, tokens = byte_stream([b"ab", b"cE"], stops=["END"])
    assert push_all(stream, tokens) == ["ab", "c"]
    assert stream.flush() == "E"
    assert not stream.stopped


def test_an_empty_stop_string_stops_nothing():
    stream, tokens = byte_stream([b"ab", b"c"], stops=[""])
    assert push_all(stream, tokens) == ["ab", "c"]
    assert not stream.stopped


@pytest.mark.parametrize(
    "text, stops, hold",
    [
        ("abcEN", ["END"], 2),
        ("abcE", ["END"], 1),
        ("abc", ["END"], 0),
        ("abcEND", ["END"], 0),  # a whole stop string is found, not held
        ("xx", ["xxy", "x"], 2),  # the longest tail over all stop strings
        ("ab", [""], 0),
    ],
)
def test_stop_prefix_length(text, stops, hold):
    assert stop_prefix_length(text, stops) == hold


@pytest.mark.parametrize(
    "text, stops, cut",
    [
        ("abcEND", ["END"], 3),
        ("abcxyz", ["xyz", "b"], 1),
        ("abc", ["END", ""], -1),
    ],
)
def test_find_stop(text, stops, cut):
    assert find_stop(text, stops) == cut


# --------------------------------------------------------------------------- the tokenizer check


@pytest.mark.parametrize("directory", [None, "empty"])
def test_an_artifact_without_a_tokenizer_is_named_in_the_error(tmp_path, directory):
    artifact = SimpleNamespace(directory=None if directory is None else tmp_path)
    with pytest.raises(ModelFileError, match=r"^given/path: no tokenizer in the artifact; export a checkpoint"):
        load_tokenizer(artifact, "given/path")
