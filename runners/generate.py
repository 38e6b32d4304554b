"""Text generation on any runner that serves a KV-cache graph (eager, ONNX Runtime, reference).

One graph does both phases: the prefill feeds the prompt with an empty cache
(T_past = 0), each decode step feeds one token with the cache it got back.
On ONNX Runtime the cache stays in OrtValues bound with IO binding, on the
provider's device (the GPU for ort-cuda), so no step copies it through numpy.

Graphs whose manifest says kv_cache "shared-buffer" (the ort lowering's
GroupQueryAttention) also take a past buffer longer than the history: rows
past seqlens_k are ignored and the new keys are written in place. There the
cache is one pre-allocated buffer per past.* input, bound as both the past
input and the present output, so a step neither allocates nor copies it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from models.registry import lm_defaults
from runners.base import Runner, check_feed
from exporters.lowerings import SHARED_KV_CACHE
from toolkit.errors import ConfigError, InputError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
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
            raise InputError(f"logits: the model produced {int((~np.isfinite(logits)).sum())} non-finite value(s), "
                             f"first at token {bad}; check the artifact with `toolkit check` (the cache or weights "
                             "may overflow its dtype)")
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
    """Feeds tokens to a KV-cache graph through a runner and keeps the cache between calls."""

    def __init__(self, runner: Runner, max_positions: int):
        self.runner = runner
        self.max_positions = max_positions
        self.cache_names = [s["name"] for s in runner.input_specs if s["name"].startswith("past.")]
        if not self.cache_names:
            raise InputError(
                "this artifact has no KV cache inputs; export it with `--variant serving` to generate text"
            )
        self.specs = {s["name"]: s for s in runner.input_specs}
        self.session = getattr(runner, "session", None)  # ONNX Runtime: use IO binding
        self.shared = self.session is not None and getattr(runner, "kv_cache", None) == SHARED_KV_CACHE
        self.buffers: dict = {}  # shared mode: name -> OrtValue [B, kv_heads, capacity, head_width]
        self.planned = 0
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.length = 0  # the shared buffers stay allocated; rows past `length` are ignored

    def reserve(self, positions: int) -> None:
        """Say how many positions the next generation will hold, so a shared buffer is allocated once."""
        self.planned = min(int(positions), self.max_positions)

    @property
    def capacity(self) -> int:
        """Positions the shared buffers hold (0 when the cache is concatenated each step)."""
        return next(iter(self.buffers.values())).shape()[2] if self.buffers else 0

    def _empty_cache(self, batch: int) -> dict:
        ids = np.zeros((batch, 1), dtype=np.int64)
        return {k: v for k, v in lm_defaults(self.runner.input_specs, ids).items() if k.startswith("past.")}

    def _extras(self, ids: np.ndarray) -> dict:
        """position_ids / past_mask for a single history of self.length tokens."""
        out = lm_defaults(self.runner.input_specs, ids, self.length)
        return {k: v for k, v in out.items() if not k.startswith("past.")}

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Feed ids [B, T] after everything fed so far; returns logits [B, T, V]."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self.length + ids.shape[1] > self.max_positions:
            raise InputError(f"input 'input_ids': {self.length} cached + {ids.shape[1]} new positions exceed "
                             f"max_positions={self.max_positions}; shorten the prompt or --max-new-tokens")
        if self.cache is None:
            self.cache = self._empty_cache(ids.shape[0])
            self.rows = ids.shape[0]
        elif ids.ndim != 2 or ids.shape[0] != self.rows:
            raise InputError(f"input 'input_ids': expected shape ({self.rows}, new tokens) after {self.length} "
                             f"cached positions of {self.rows} row(s), got {tuple(ids.shape)}; reset() to start over")
        if self.session is not None:
            logits = self._step_bound(ids)
        else:
            trusted = tuple(self.cache_names) if self.length else ()  # our own cache from the last step
            outputs = self.runner.run({"input_ids": ids, **self._extras(ids), **self.cache}, trusted=trusted)
            self.cache = {name: outputs[name.replace("past.", "present.")] for name in self.cache_names}
            logits = outputs["logits"]
        self.length += ids.shape[1]
        return logits

    def _step_bound(self, ids: np.ndarray) -> np.ndarray:
        from runners.ort import from_ortvalue, to_ortvalue

        extras = self._extras(ids)
        if self.length == 0:  # validate the first feed fully; later ones only add our own cache
            check_feed(self.runner.input_specs, {"input_ids": ids, **extras, **self.cache}, self.runner.config)
        elif ids.min() < 0 or ids.max() >= self.runner.config.vocab_size:
            blank = np.zeros((ids.shape[0], 1), dtype=np.int64)
            check_feed(self.runner.input_specs, {"input_ids": ids, **lm_defaults(self.runner.input_specs, blank)},
                       self.runner.config)
        # The cache lives where the provider computes (the GPU for ort-cuda) and never visits the host;
        # only the new ids go in and the logits come out each step.
        device = getattr(self.runner, "binding_device", "cpu")
        device_id = getattr(self.runner, "device_id", 0)
        binding = self.session.io_binding()
        for name, value in {"input_ids": ids, **extras}.items():
            binding.bind_ortvalue_input(name, to_ortvalue(value, device, device_id))
        if self.shared:
            self._grow(ids.shape[0], self.length + ids.shape[1], device, device_id)
        for name in self.cache_names:
            value = self.buffers[name] if self.shared else self.cache[name]
            if isinstance(value, np.ndarray):
                value = to_ortvalue(value, device, device_id)
            binding.bind_ortvalue_input(name, value)
        outputs = self.runner.output_names
        for name in outputs:
            past = name.replace("present.", "past.")
            if name == "logits":
                binding.bind_output(name, "cpu")  # the sampler needs them on the host
            elif self.shared and past in self.buffers:
                binding.bind_ortvalue_output(name, self.buffers[past])  # written in place
            else:
                binding.bind_output(name, device, device_id)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.runner.last_inference_time = time.perf_counter() - start
        values = dict(zip(outputs, binding.get_outputs()))
        self.cache = {name: values[name.replace("past.", "present.")] for name in self.cache_names}
        return from_ortvalue(values["logits"])

    def _grow(self, batch: int, needed: int, device: str, device_id: int) -> None:
        """Make the shared buffers hold `needed` positions for `batch` rows, keeping the history."""
        from runners.ort import from_ortvalue, to_ortvalue

        same_rows = bool(self.buffers) and self.buffers[self.cache_names[0]].shape()[0] == batch
        if same_rows and self.capacity >= needed:
            return
        # Double on overflow, so a generation that did not reserve still grows O(log n) times.
        capacity = min(max(needed, self.planned, 2 * self.capacity if same_rows else 0), self.max_positions)
        keep = self.length if same_rows else 0
        for name in self.cache_names:
            spec = self.specs[name]
            shape = [batch if d == "batch" else capacity if d == "past_sequence" else d for d in spec["shape"]]
            array = np.zeros(shape, dtype=spec["dtype"])
            if keep:
                array[:, :, :keep] = from_ortvalue(self.buffers[name])[:, :, :keep]
            self.buffers[name] = to_ortvalue(array, device, device_id)


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


def generate(lm: CachedLM, prompt_ids: list[int], *, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_ids: tuple[int, ...] = (), on_token: Callable[[int], None] | None = None,
             keep_logits: bool = False) -> Generation:
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
