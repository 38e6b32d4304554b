"""Typed parsing of what a bounded reader (artifact.jsonfile) returned: pydantic models, strict (no "4" for 4,
no 1.0 for true), with a ValidationError turned into the caller's one-line error naming the file and the field.
"""

from __future__ import annotations

import json
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from artifact.errors import ToolkitError

SHOWN_CHARS = 80
Model = TypeVar("Model", bound=BaseModel)

# JSON integers that are ids, counts and sizes (the bounded reader already caps them at 20 digits).
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class Strict(BaseModel):
    """A typed file section: strict types, unknown keys kept (each reader says whether it refuses them)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


def shown(value: object) -> str:
    """`value` as JSON, cut to SHOWN_CHARS characters (never fails: a value too odd for JSON shows its type)."""
    try:
        text = json.dumps(value, default=lambda v: f"<{type(v).__name__}>")
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def field_name(loc: tuple) -> str:
    """A pydantic error location as the file spells it: rope_parameters.factor, eos_ids[2]."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in ("int", "float", "str", "bool", "list", "dict", "none") or "[" in str(part):
            continue  # the branch of a union pydantic tried, not a key of the file
        else:
            text = str(part)
            text = text if text.isprintable() and text else json.dumps(text)  # a key may hold a newline
            out += f".{text}" if out else text
    return out or "the top level"


def parse_typed(model: type[Model], data: object, where, error: type[ToolkitError], advice: str = "") -> Model:
    """`data` as `model`; the first problem raises `error`: "{where}: {field}: {what is wrong}, got {value}"."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        tail = f"; {advice}" if advice else ""
        if not first["loc"] and first["type"] == "model_type":  # the file is not an object at all
            raise error(f"{where}: expected a JSON object, got {type(data).__name__}{tail}") from None
        message = first["msg"][:1].lower() + first["msg"][1:]
        raise error(f"{where}: {field_name(first['loc'])}: {message}, got {shown(first.get('input'))}{tail}") from None
