"""The text side of streaming: token ids in, text that is safe to show out.

Shared by `toolkit serve` and `toolkit generate`; nothing here knows about HTTP or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# What the tokenizer decodes an incomplete UTF-8 sequence to.
REPLACEMENT = "\ufffd"


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string in `text` begins, or -1 when none occurs."""
    return min((text.find(s) for s in stops if s and s in text), default=-1)


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could still grow into a stop string (the longest such tail)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class TextStream:
    """Incremental detokenizer: each token in, the newly settled text out.

    A token can end inside a multi-byte character, so the text is decoded whole each time and held back
    while it ends in U+FFFD. Text already handed out cannot be taken back, so a decode that rewrites it
    waits for one that extends it. With stop strings, the end that could still become one is held back
    too, and text from the first stop string on is never handed out. `flush` returns what is left.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self.text = ""  # everything handed out so far
        self.stopped = False  # a stop string appeared; push no more tokens

    def push(self, token: int) -> str:
        """The text `token` settles, possibly ""; once a stop string appears, the text up to it."""
        self.tokens.append(token)
        full = self.decode(self.tokens)
        settled = full.startswith(self.text)
        # The handed-out text holds no stop string, so only its last longest-1 characters can begin one:
        # each token searches a window of about the longest stop, not the whole answer.
        start = max(0, len(self.text) - self.longest + 1) if settled else 0
        cut = find_stop(full[start:], self.stops)
        if cut >= 0:
            self.stopped = True
            return self._advance(full, start + cut)
        if full.endswith(REPLACEMENT) or not settled:
            return ""
        return self._advance(full, len(full) - stop_prefix_length(full[-self.longest :], self.stops))

    def flush(self) -> str:
        """The rest of the text once no more tokens come, held-back characters included."""
        rest = self.decode(self.tokens)[len(self.text) :]
        self.text += rest
        return rest

    def _advance(self, full: str, end: int) -> str:
        if end <= len(self.text):
            return ""
        delta, self.text = full[len(self.text) : end], full[:end]
        return delta
