"""Every key of an imported config is implemented, known not to change the computation, or refused.

A key an import drops can change the function without a word (a sliding window, scaled RoPE, a bias),
so each import lists the keys it understands in three groups: keys its reader maps onto our config,
keys it implements at one value only (the neutral one: a window no shorter than the context, no
scaling, no bias), and keys that do not change what the model computes. Everything else, unknown
keys included, is refused in one line naming the key, its value and what is supported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from artifact.errors import ModelFileError

SHOWN_VALUE_CHARS = 80


def shown(value: object) -> str:
    """`value` as JSON (what the config file says), cut to SHOWN_VALUE_CHARS characters."""
    try:
        text = json.dumps(value, default=repr)
    except (ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 3] + "..."


def refusal(where, key: str, value: object, importer: str, supported: str) -> ModelFileError:
    """One line: the key, its value, which import refuses it and what that import supports."""
    return ModelFileError(
        f"{where}: {key}={shown(value)} is not supported by the {importer} import; supported: {supported}"
    )


class Only(NamedTuple):
    """A key implemented at some values only: `accepts(value, raw config, our config)`, and those values in words."""

    accepts: Callable[[object, Mapping, object], bool]
    supported: str | Callable[[Mapping, object], str]


@dataclass(frozen=True)
class KeyPolicy:
    importer: str  # as the messages name it: "llama", "gpt2", "GGUF llama"
    implemented: frozenset[str]  # read by the importer, which checks their values
    only: Mapping[str, Only]  # implemented at the values `accepts` allows; any other value is refused
    inert: frozenset[str]  # do not change what the model computes (each list says why)
    inert_prefixes: tuple[str, ...] = field(default=())
    subject: str = ""  # what a message calls the keys, before the key: "GGUF metadata "

    def known(self) -> frozenset[str]:
        return self.implemented | frozenset(self.only) | self.inert

    def classify(self, key: str) -> str | None:
        """'implemented', 'only', 'inert' or None (unknown, refused)."""
        if key in self.implemented:
            return "implemented"
        if key in self.only:
            return "only"
        if key in self.inert or key.startswith(self.inert_prefixes):
            return "inert"
        return None

    def check(self, raw: Mapping, ours: object, where, keys: Iterable[str] | None = None) -> None:
        """Refuse the first key of `raw` (in file order) that is unknown or has a value not implemented."""
        for key in raw if keys is None else keys:
            kind, value = self.classify(key), raw[key]
            if kind == "only":
                rule = self.only[key]
                if not rule.accepts(value, raw, ours):
                    supported = rule.supported if isinstance(rule.supported, str) else rule.supported(raw, ours)
                    raise refusal(where, self.subject + key, value, self.importer, supported)
            elif kind is None:
                raise refusal(
                    where,
                    self.subject + key,
                    value,
                    self.importer,
                    f"the keys it implements ({', '.join(sorted(self.implemented | frozenset(self.only)))}) and "
                    "bookkeeping that does not change the computation; an unknown key is refused, not ignored",
                )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
