"""Text generation on any runner that serves a KV-cache graph (eager, ONNX Runtime, reference).

One graph does both phases: the prefill feeds the prompt with an empty cache
(T_past = 0), each decode step feeds one token with the cache it got back.
The step itself is the runner's (Runner.decode_step): ONNX Runtime keeps the
cache in OrtValues on the provider's device, so no step copies it through numpy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from artifact.errors import ConfigError, InputError
from artifact.format import is_cache_input
from models.registry import lm_defaults
from runners.base import Runner


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ConfigError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k: expected an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")


class Sampler:
    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)

    def __call__(self, logits: np.ndarray) -> int:
        s = self.sampling
        logits = np.asarray(logits, dtype=np.float64)
        if not np.isfinite(logits).all():  # arg-max would silently pick the first NaN
            bad = int(np.flatnonzero(~np.isfinite(logits))[0])
            raise InputError(
                f"logits: the model produced {int((~np.isfinite(logits)).sum())} non-finite value(s), "
                f"first at token {bad}; check the artifact with `toolkit check` (the cache or weights "
                "may overflow its dtype)"
            )
        if s.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits / s.temperature
        if s.top_k and s.top_k < scaled.size:
            cutoff = np.partition(scaled, -s.top_k)[-s.top_k]
            scaled = np.where(scaled >= cutoff, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if s.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, s.top_p)) + 1]  # smallest set reaching top_p
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))


class CachedLM:
    """Feeds tokens to a KV-cache graph through a runner and keeps the runner's cache between calls."""

    def __init__(self, runner: Runner, max_positions: int):
        self.runner = runner
        self.max_positions = max_positions
        self.kv = runner.new_cache(max_positions)
        self.rows = 0

    # The cache's state, read by tests and benchmarks.
    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def reset(self) -> None:
        self.kv.reset()  # a shared buffer stays allocated; rows past the length are ignored

    def reserve(self, positions: int) -> None:
        """Say how many positions the next generation will hold, so a shared buffer is allocated once."""
        self.kv.reserve(positions)

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Feed ids [B, T] after everything fed so far; returns logits [B, T, V]."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.length + ids.shape[1] > self.max_positions:
            raise InputError(
                f"input 'input_ids': {self.length} cached + {ids.shape[1]} new positions exceed "
                f"max_positions={self.max_positions}; shorten the prompt or --max-new-tokens"
            )
        if self.length == 0:
            self.rows = ids.shape[0]
        elif ids.ndim != 2 or ids.shape[0] != self.rows:
            raise InputError(
                f"input 'input_ids': expected shape ({self.rows}, new tokens) after {self.length} "
                f"cached positions of {self.rows} row(s), got {tuple(ids.shape)}; reset() to start over"
            )
        extras = lm_defaults(self.runner.input_specs, ids, self.length)
        feed = {"input_ids": ids, **{k: v for k, v in extras.items() if not is_cache_input(k)}}
        logits = self.runner.decode_step(feed, self.kv)
        self.kv.length += ids.shape[1]
        return logits


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" when a stop token ended it
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_logits: list[np.ndarray] = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def generate(
    lm: CachedLM,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] = (),
    on_token: Callable[[int], None] | None = None,
    keep_logits: bool = False,
) -> Generation:
    """Prefill the prompt, then sample one token per step until a stop token or max_new_tokens."""
    if not prompt_ids:
        raise InputError("prompt: empty; give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    sampler = Sampler(sampling)
    result = Generation(prompt_ids=list(prompt_ids))
    lm.reset()
    lm.reserve(len(prompt_ids) + max_new_tokens)
    start = time.perf_counter()
    logits = lm.step(np.asarray([prompt_ids], dtype=np.int64))[0, -1]
    result.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while True:
        if keep_logits:
            result.step_logits.append(np.array(logits, copy=True))
        token = sampler(logits)
        result.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop_ids:
            result.finish_reason = "stop"
            break
        if len(result.tokens) >= max_new_tokens:
            break
        logits = lm.step(np.asarray([[token]], dtype=np.int64))[0, -1]
    result.decode_seconds = time.perf_counter() - start
    return result
