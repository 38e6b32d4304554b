"""The one interface every backend implements, and the feed check they share.

A runner has a name, the device/provider it really ran on, and
run(inputs) -> {output name: numpy array}; it records the last run's time.
Feeds are checked against the model's declared inputs before any backend sees
them, so a bad feed is an InputError naming the input, never a backend crash.

Decoding: `new_cache()` makes the KV cache a runner carries between steps, and
`decode_step(feed, cache)` runs one step of a KV-cache graph, feeding the cache
and keeping the `present.*` outputs as the next step's `past.*`. The base class
does it through `run` with numpy arrays; ONNX Runtime overrides both to keep the
cache in OrtValues bound with IO binding (runners/ort.py).
"""

from __future__ import annotations

import time

import numpy as np

from artifact.errors import InputError, ModelFileError
from artifact.format import TensorSpec, present_name, tensor_specs
from runners.decoding.cache import KVCache


class Runner:
    name: str = "runner"
    device: str = "unknown"

    def __init__(self, input_specs, output_names: list[str], config=None):
        self.input_specs = tensor_specs(input_specs)
        self.output_names = list(output_names)
        self.config = config
        self.last_inference_time: float | None = None

    def run(self, inputs: dict[str, np.ndarray], trusted: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """trusted: inputs this runner produced itself on the previous step (the KV cache handed back);
        they are still checked for name, dtype and shape, but not scanned value by value."""
        feed = check_feed(self.input_specs, inputs, self.config, trusted)
        start = time.perf_counter()
        outputs = self._infer(feed)
        self.last_inference_time = time.perf_counter() - start
        return outputs

    def _infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def placement_audit(self, feed: dict[str, np.ndarray]):
        """Where the nodes of one run of `feed` ran, for a runner that may place them on other devices than it
        asked for (a PlacementAudit, runners/ort.py); None for runners that compute where they say."""
        return None

    def new_cache(self, max_positions: int) -> KVCache:
        return KVCache(self.input_specs, max_positions)

    def decode_step(self, feed: dict[str, np.ndarray], cache: KVCache) -> np.ndarray:
        """One step of a KV-cache graph: `feed` holds the new tokens' inputs (input_ids, position_ids,
        past_mask), `cache` the history; returns the logits and keeps the present.* outputs in `cache`.
        The caller advances cache.length."""
        past = cache.values or cache.empty(feed["input_ids"].shape[0])  # kept only once a step succeeds
        trusted = tuple(cache.names) if cache.length else ()  # our own cache from the last step
        outputs = self.run({**feed, **past}, trusted=trusted)
        cache.values = {name: outputs[present_name(name)] for name in cache.names}
        return outputs["logits"]


def check_kind(spec, array) -> None:
    """One input's type, dtype and rank: what anything deriving other inputs from it (an implied empty KV
    cache and positions) relies on, checked before it does."""
    spec = TensorSpec.of(spec)
    name = spec.name
    if not isinstance(array, np.ndarray):
        raise InputError(f"input {name!r}: expected a numpy array, got {type(array).__name__}")
    try:
        want_dtype = np.dtype(spec.dtype)
    except TypeError:
        raise ModelFileError(
            f"input {name!r}: the model declares dtype {spec.dtype!r}, which numpy does not know; re-export the model"
        ) from None
    if array.dtype != want_dtype:
        raise InputError(f"input {name!r}: expected dtype {spec.dtype}, got {array.dtype}; cast it first")
    if array.ndim != len(spec.shape):
        raise InputError(
            f"input {name!r}: expected rank {len(spec.shape)} {_fmt(spec.shape)}, got rank {array.ndim} "
            f"{tuple(array.shape)}"
        )


def check_feed(specs, inputs: dict, config=None, trusted=()) -> dict[str, np.ndarray]:
    """Validate names, dtypes, ranks, fixed and symbolic dims, sizes and values of a feed.

    Inputs named in `trusted` skip the NaN/Inf scan: a decode loop's cache is the runner's own output,
    and scanning it every step would read the whole cache once more per token."""
    if not isinstance(inputs, dict):
        raise InputError(f"inputs: expected a mapping of input name to array, got {type(inputs).__name__}")
    specs = tensor_specs(specs)
    expected = [s.name for s in specs]
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in expected]
    if missing or extra:
        raise InputError(
            f"inputs: expected names {expected}, got {sorted(inputs, key=repr)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    symbols: dict[str, tuple[int, str]] = {}
    feed = {}
    for spec in specs:
        name, array = spec.name, inputs[spec.name]
        check_kind(spec, array)
        shape = spec.shape
        for axis, (want, got) in enumerate(zip(shape, array.shape, strict=False)):
            if got < 1 and want != "past_sequence":  # only the cache may be empty (a prefill)
                raise InputError(f"input {name!r}: axis {axis} ({want}) is empty; every axis needs at least 1 element")
            if isinstance(want, int) and want > 0 and got != want:
                raise InputError(
                    f"input {name!r}: axis {axis} expected size {want}, got {got} (shape {tuple(array.shape)})"
                )
            if isinstance(want, str):
                seen = symbols.setdefault(want, (got, name))
                if seen[0] != got:
                    raise InputError(
                        f"input {name!r}: axis {axis} ({want}) is {got} but input {seen[1]!r} has {want}={seen[0]}"
                    )
        if (
            name not in trusted
            and np.issubdtype(array.dtype, np.floating)
            and array.size
            and not np.isfinite(array).all()
        ):
            bad = np.argwhere(~np.isfinite(array))
            raise InputError(
                f"input {name!r}: {len(bad)} non-finite value(s) (NaN/Inf), first at index {tuple(int(i) for i in bad[0])}"
            )
        feed[name] = array
    if config is not None:
        _check_against_config(feed, symbols, config)
    return feed


def _check_against_config(feed, symbols, config) -> None:
    for symbol, (length, name) in symbols.items():
        if symbol.endswith("sequence") and length > config.max_positions:
            raise InputError(
                f"input {name!r}: sequence length {length} exceeds max_positions={config.max_positions}; "
                "shorten the input"
            )
    if "past_sequence" in symbols and "sequence" in symbols:
        total = symbols["past_sequence"][0] + symbols["sequence"][0]
        if total > config.max_positions:
            raise InputError(
                f"input {symbols['sequence'][1]!r}: cached {symbols['past_sequence'][0]} + new "
                f"{symbols['sequence'][0]} positions exceed max_positions={config.max_positions}"
            )
    positions = feed.get("position_ids")
    if positions is not None and positions.size and (positions.min() < 0 or positions.max() >= config.max_positions):
        bad = int(positions.min()) if positions.min() < 0 else int(positions.max())
        raise InputError(f"input 'position_ids': position {bad} is outside [0, {config.max_positions})")
    mask = feed.get("past_mask")
    if mask is not None and mask.size and not np.isin(mask, (0, 1)).all():
        raise InputError("input 'past_mask': expected only 0 (padding) and 1 (real token) values")
    for name, ids in feed.items():
        if not name.endswith("_ids") or name == "position_ids" or not hasattr(config, "vocab_size"):
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= config.vocab_size:
            bad = lo if lo < 0 else hi
            where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
            raise InputError(f"input {name!r}: token id {bad} at index {where} is outside [0, {config.vocab_size})")


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
