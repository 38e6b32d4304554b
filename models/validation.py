"""Field checks shared by the model config dataclasses.

Each check raises ConfigError naming the field, the expected value and the
actual one, so a config is rejected before any tensor is allocated.
"""

import dataclasses
import math
from typing import Any

from artifact.errors import ConfigError


def fail(owner: str, field: str, expected: str, actual: Any) -> None:
    raise ConfigError(f"{owner}.{field}: expected {expected}, got {actual!r}; fix the config")


def positive_int(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(owner, field, "a positive integer", value)
    if value <= 0:
        fail(owner, field, "a positive integer", value)


def finite_float(owner: str, field: str, value: Any, *, minimum: float, inclusive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        fail(owner, field, "a finite number", value)
    if value < minimum or (not inclusive and value == minimum):
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        fail(owner, field, f"a number {bound}", value)


def one_of(owner: str, field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        fail(owner, field, "one of " + ", ".join(repr(c) for c in choices), value)


def from_dict(cls, data: Any, owner: str):
    """Build a config dataclass from JSON-like data, naming unknown or derived keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{owner}: expected a JSON object of config fields, got {type(data).__name__}")
    settable = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in settable:
            raise ConfigError(f"{owner}: unknown field {key!r}; valid fields are " + ", ".join(sorted(settable)))
    return cls(**data)


class ConfigFields:
    """to_dict/from_dict for the config dataclasses: settable fields only (derived ones are recomputed)."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, data):
        return from_dict(cls, data, cls.__name__)
