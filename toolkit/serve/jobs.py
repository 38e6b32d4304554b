"""One HTTP request inside the server: its engine requests (one per choice), the events they send back, and
the text side of its choices (detokenizing and stop strings), which a worker thread works."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from runners.decoding.batching import Request as EngineRequest
from runners.decoding.generate import Sampling
from toolkit.serve.streaming import TextStream

# (choice index, text delta, finish reason or None)
Piece = tuple[int, str, str | None]


class Aborted(Exception):
    """A request ended by the server before its answer was complete (deadline, shutdown, disconnect)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Group:
    """One HTTP request's engine requests (one per choice) and the queue their events cross from the
    engine thread into the event loop, tagged with the choice's index."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.requests: list[EngineRequest] = []
        self.aborted: Aborted | None = None
        self.deadline: asyncio.TimerHandle | None = None

    def add(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling, stop_ids: tuple[int, ...]) -> None:
        index = len(self.requests)

        def emit(kind, value):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, kind, value))

        self.requests.append(EngineRequest(prompt_ids, max_tokens, sampling, stop_ids, emit=emit))

    def cancel(self) -> None:
        for request in self.requests:
            request.cancel()

    def abort(self, status: int, message: str) -> bool:
        """End every choice now; False when the request had already been aborted."""
        if self.aborted is not None:
            return False
        self.aborted = Aborted(status, message)
        self.cancel()
        self.events.put_nowait((None, "abort", None))
        return True


class Choices:
    """The text side of a request's choices, worked in a thread: detokenizing and stop strings."""

    def __init__(
        self, group: Group, decode: Callable, stops: list[str], stop_ids: tuple[int, ...], observe_token: Callable
    ):
        self.group, self.stop_ids, self.observe_token = group, stop_ids, observe_token
        self.texts = [TextStream(decode, stops) for _ in group.requests]
        self.tokens = [0] * len(group.requests)
        self.finished = [False] * len(group.requests)

    @property
    def done(self) -> bool:
        return all(self.finished)

    def settle(self, events: list[tuple]) -> list[Piece]:
        pieces = []
        for index, kind, value in events:
            if kind == "abort":  # the loop raises the request's Aborted before settling its events
                continue
            if kind == "error":
                raise RuntimeError(value)
            if self.finished[index]:
                continue
            if kind == "done":
                self.finished[index] = True
                pieces.append((index, self.texts[index].flush(), "stop" if value == "stop" else "length"))
                continue
            self.tokens[index] += 1
            self.observe_token(self.group.requests[index], self.tokens[index])
            if value in self.stop_ids:
                continue
            text = self.texts[index]
            delta = text.push(value)
            if text.stopped:
                self.group.requests[index].cancel()
                self.finished[index] = True
                pieces.append((index, delta, "stop"))
            elif delta:
                pieces.append((index, delta, None))
        return pieces
