"""The KV cache a runner carries between decode steps.

The cache's names are the artifact format's (artifact.format: past.{layer}.key/value inputs, each
carried forward by the present.* output of the same name); its shapes come from the graph's input
specs: [batch, kv_heads, past_sequence, head_width].
"""

from __future__ import annotations

import numpy as np

from artifact.errors import InputError
from artifact.format import is_cache_input, tensor_specs


class KVCache:
    """The KV cache a runner carries between decode steps: the past.* values as that runner returns them
    (numpy arrays here; OrtValues on ONNX Runtime) and how many positions of history they hold."""

    shared = False  # one pre-allocated buffer per input, written in place (ONNX Runtime's GroupQueryAttention)

    def __init__(self, specs, max_positions: int):
        self.specs = {s.name: s for s in tensor_specs(specs) if is_cache_input(s.name)}
        if not self.specs:
            raise InputError(
                "this artifact has no KV cache inputs; export it with `--variant serving` to generate text"
            )
        self.max_positions = max_positions
        self.planned = 0
        self.reset()

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def capacity(self) -> int:
        """Positions a pre-allocated buffer holds (0 when the cache is concatenated each step)."""
        return 0

    def reset(self) -> None:
        self.values: dict = {}
        self.length = 0

    def reserve(self, positions: int) -> None:
        """Say how many positions the next generation will hold, so a shared buffer is allocated once."""
        self.planned = min(int(positions), self.max_positions)

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        """An empty history (past_sequence 0) of `batch` rows, as numpy arrays."""
        out = {}
        for name, spec in self.specs.items():
            shape = [batch if d == "batch" else 0 if d == "past_sequence" else d for d in spec.shape]
            out[name] = np.zeros(shape, dtype=spec.dtype)
        return out
