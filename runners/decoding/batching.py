"""Continuous batching over a KV-cache graph, at step granularity.

Requests join and leave the running batch between decode steps. A joining
request is prefilled on its own (B=1, empty cache) and its cache is merged into
the batch by left-padding: every row keeps its own history length, padding
slots are hidden by `past_mask`, and each row's new token gets its own
`position_ids`. Finished or cancelled rows are sliced out, and cache columns
that are padding in every remaining row are trimmed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from artifact.errors import InputError
from artifact.format import present_name
from runners.decoding.cache import KVCache
from runners.decoding.generate import Sampler, Sampling


class QueueFull(Exception):
    """The request queue is at its limit; the caller should retry later."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]
    emit: Callable[[str, object], None]  # emit("token", id) | emit("done", reason) | emit("error", message)
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Row:
    request: Request
    sampler: Sampler
    length: int  # real tokens in the cache (prompt + generated, minus the pending one)
    next_token: int


class BatchEngine:
    """One worker thread owns the runner; HTTP handlers only enqueue requests and read events."""

    def __init__(
        self,
        runner,
        max_positions: int,
        *,
        max_batch: int = 8,
        max_queue: int = 32,
        on_step: Callable[[int, float], None] | None = None,
    ):
        self.runner = runner
        self.max_positions = max_positions
        self.max_batch = max_batch
        self.pending: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.on_step = on_step
        self.kv = KVCache(runner.input_specs, max_positions)  # the cache's specs; its values live in self.cache
        self.cache_names = self.kv.names
        self.rows: list[_Row] = []
        self.cache: dict[str, np.ndarray] = {}
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-engine", daemon=True)

    # ------------------------------------------------------------------ public API (any thread)
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_positions:
            raise InputError(
                f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.max_tokens} = "
                f"{total} exceeds the context of {self.max_positions} tokens"
            )
        try:
            self.pending.put_nowait(request)
        except queue.Full:
            raise QueueFull() from None
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return self.pending.qsize()

    @property
    def active(self) -> int:
        return len(self.rows)

    def idle(self) -> bool:
        return not self.rows and self.pending.empty()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker thread
    def _loop(self) -> None:
        while not self._stop.is_set() or not self.idle():
            self._admit()
            if not self.rows:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as exc:  # a backend failure ends the batch's requests, never the server
                for row in self.rows:
                    row.request.emit("error", f"{type(exc).__name__}: {exc}")
                self.rows, self.cache, self.mask = [], {}, np.zeros((0, 0), dtype=np.int64)

    def _admit(self) -> None:
        while len(self.rows) < self.max_batch:
            try:
                request = self.pending.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                request.emit("done", "cancelled")
                continue
            try:
                self._prefill(request)
            except Exception as exc:
                request.emit("error", f"{type(exc).__name__}: {exc}")

    def _prefill(self, request: Request) -> None:
        ids = np.asarray([request.prompt_ids], dtype=np.int64)
        feed = {
            "input_ids": ids,
            "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
            "past_mask": np.zeros((1, 0), dtype=np.int64),
            **self.kv.empty(1),
        }
        outputs = self.runner.run(feed)
        sampler = Sampler(request.sampling)
        row = _Row(request, sampler, length=ids.shape[1], next_token=-1)
        cache = {name: outputs[present_name(name)] for name in self.cache_names}
        self._merge(row, cache)
        self._accept(row, outputs["logits"][0, -1])

    def _merge(self, row: _Row, cache: dict[str, np.ndarray]) -> None:
        """Left-pad the batch or the newcomer so both caches have the same length, then stack."""
        new_len = row.length
        old_len = self.mask.shape[1] if self.rows else 0
        width = max(old_len, new_len)
        row_mask = np.zeros((1, width), dtype=np.int64)
        row_mask[0, width - new_len :] = 1
        if self.rows:
            self.mask = np.concatenate([np.pad(self.mask, ((0, 0), (width - old_len, 0))), row_mask])
            for name in self.cache_names:
                old = np.pad(self.cache[name], ((0, 0), (0, 0), (width - old_len, 0), (0, 0)))
                new = np.pad(cache[name], ((0, 0), (0, 0), (width - new_len, 0), (0, 0)))
                self.cache[name] = np.concatenate([old, new])
        else:
            self.mask = row_mask
            self.cache = dict(cache)
        self.rows.append(row)

    def _accept(self, row: _Row, logits: np.ndarray) -> None:
        """Sample the row's next token and report it; mark the row finished when it is done."""
        request = row.request
        token = row.sampler(logits)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.tokens.append(token)
        row.next_token = token
        request.emit("token", token)

    def _finished(self, row: _Row) -> str | None:
        request = row.request
        if request.cancelled:
            return "cancelled"
        if request.tokens and request.tokens[-1] in request.stop_ids:
            return "stop"
        if len(request.tokens) >= request.max_tokens:
            return "length"
        return None

    def _step(self) -> None:
        self._retire()
        if not self.rows:
            return
        batch = len(self.rows)
        feed = {
            "input_ids": np.asarray([[r.next_token] for r in self.rows], dtype=np.int64),
            "position_ids": np.asarray([[r.length] for r in self.rows], dtype=np.int64),
            "past_mask": self.mask,
            **self.cache,
        }
        start = time.perf_counter()
        outputs = self.runner.run(feed, trusted=tuple(self.cache_names))
        elapsed = time.perf_counter() - start
        self.cache = {name: outputs[present_name(name)] for name in self.cache_names}
        self.mask = np.concatenate([self.mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        for i, row in enumerate(self.rows):
            row.length += 1
            self._accept(row, outputs["logits"][i, -1])
        if self.on_step is not None:
            self.on_step(batch, elapsed)

    def _retire(self) -> None:
        keep = []
        for i, row in enumerate(self.rows):
            reason = self._finished(row)
            if reason is None:
                keep.append(i)
            else:
                row.request.emit("done", reason)
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self.mask = {}, np.zeros((0, 0), dtype=np.int64)
            return
        self.mask = self.mask[keep]
        self.cache = {name: value[keep] for name, value in self.cache.items()}
        used = np.flatnonzero(self.mask.any(axis=0))
        start = int(used[0]) if used.size else self.mask.shape[1]
        if start:  # columns that are padding in every remaining row
            self.mask = self.mask[:, start:]
            self.cache = {name: value[:, :, start:] for name, value in self.cache.items()}
