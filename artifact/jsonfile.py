"""The one bounded reader of the JSON (and TOML) files the toolkit reads: manifests, configs, tokenizer
configs, tolerance files, golden indexes.

Before a parser sees a file it must be a regular file (a FIFO or a device would block or never end) of at
most `max_bytes`; before a value is built, the text must nest no deeper than MAX_DEPTH and hold no integer
longer than MAX_INT_DIGITS digits (Python refuses to convert integers past 4,300 digits with a ValueError,
and arithmetic on huge ones is slow). Every refusal is one line, raised as the caller's error class and
naming the file. What the values mean is each caller's typed parse (artifact.typed, pydantic models).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from artifact.errors import ModelFileError, ToolkitError

# A manifest is a few kilobytes (one weight-map line per tensor), a config or a tokenizer config less; this
# bound only stops a hostile file from being read into memory and parsed into Python objects at many times
# its size. tokenizer.json files are read by the tokenizers library, not here.
MAX_JSON_BYTES = 16 << 20
# The toolkit's own files nest a handful of levels (a manifest's weight places: 5); Hugging Face configs
# a few more (rope parameters per layer type).
MAX_DEPTH = 64
# Sizes, offsets, ids and seeds fit in 64 bits (20 digits); transformers writes "no limit" in a tokenizer's
# model_max_length as int(1e30), 31 digits, into most tokenizer_config.json files. 40 admits both and stays far
# below the sizes whose conversion is slow.
MAX_INT_DIGITS = 40

# A JSON string, escapes included ("unrolled" so that long strings are matched in linear time).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
# TOML strings: basic and literal, one-line and multi-line.
_TOML_STRING = re.compile(r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'', re.S)
_TOML_COMMENT = re.compile(r"#[^\n]*")
# A run of more than MAX_INT_DIGITS digits (underscores allowed between them) that starts a number.
_TOML_LONG_NUMBER = re.compile(r"(?<![\w.])\d(?:_?\d){%d,}" % MAX_INT_DIGITS)


class _Bound(ValueError):
    """A bound a value broke while the text was decoded (raised from json's hooks)."""


def read_regular_file(
    path: str | os.PathLike, *, max_bytes: int, error: type[ToolkitError], what: str, advice: str = ""
) -> bytes:
    """The bytes of `path`, refused unless it is a regular file of at most `max_bytes`. Opened without
    blocking, so a FIFO is refused instead of waiting for a writer."""
    path = Path(path)
    tail = f"; {advice}" if advice else ""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc}){tail}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file ({_kind(info.st_mode)}); the {what} must be a plain file{tail}")
        if info.st_size > max_bytes:
            raise error(
                f"{path}: {info.st_size:,} bytes, above the {max_bytes:,} a {what} may have; "
                f"this is not a {what} the toolkit reads"
            )
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc}){tail}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew since fstat
        raise error(f"{path}: more than the {max_bytes:,} bytes a {what} may have")
    return data


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _text(data: bytes | str, where, error: type[ToolkitError], advice: str, language: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{where}: invalid {language} (not UTF-8 text: byte {exc.start} is {data[exc.start]:#04x}){advice}"
        ) from None


def nesting_depth(text: str, strings: re.Pattern | None = _JSON_STRING) -> int:
    """The deepest nesting of [ and { outside strings (a scan, no recursion); strings=None: `text` holds none."""
    if "[" not in text and "{" not in text:
        return 0
    stripped = (strings.sub("", text) if strings is not None else text).encode("utf-8", "surrogatepass")
    b = np.frombuffer(stripped, dtype=np.uint8)
    step = (b == ord("[")).astype(np.int32) + (b == ord("{")) - (b == ord("]")) - (b == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _Bound(f"an integer of {digits:,} digits, more than the {MAX_INT_DIGITS} allowed")
    return int(text)


def _check_depth(text: str, where, error, advice: str, language: str, strings: re.Pattern | None) -> None:
    depth = nesting_depth(text, strings)
    if depth > MAX_DEPTH:
        raise error(
            f"{where}: invalid {language} (nested {depth:,} levels deep, above the {MAX_DEPTH} allowed){advice}"
        )


def parse_json(data: bytes | str, where, *, error: type[ToolkitError] = ModelFileError, advice: str = "") -> Any:
    """The JSON value of `data`, within MAX_DEPTH and MAX_INT_DIGITS; anything else raises `error` naming
    `where`. `advice` (what to do) ends the message."""
    advice = f"; {advice}" if advice else ""
    text = _text(data, where, error, advice, "JSON")
    _check_depth(text, where, error, advice, "JSON", _JSON_STRING)
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: invalid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}){advice}") from None
    except _Bound as exc:
        raise error(f"{where}: invalid JSON ({exc}){advice}") from None
    except (ValueError, RecursionError) as exc:  # no other cause is known; the bounds above should prevent these
        raise error(f"{where}: invalid JSON ({type(exc).__name__}: {str(exc)[:120]}){advice}") from None


def read_json(
    path: str | os.PathLike,
    *,
    error: type[ToolkitError] = ModelFileError,
    what: str = "JSON file",
    max_bytes: int = MAX_JSON_BYTES,
    advice: str = "",
) -> Any:
    """read_regular_file + parse_json."""
    data = read_regular_file(path, max_bytes=max_bytes, error=error, what=what, advice=advice)
    return parse_json(data, path, error=error, advice=advice)


def read_toml_or_json(
    path: str | os.PathLike,
    *,
    error: type[ToolkitError] = ModelFileError,
    what: str = "config file",
    max_bytes: int = MAX_JSON_BYTES,
    advice: str = "",
) -> Any:
    """A .json file through parse_json, anything else as TOML with the same bounds."""
    path = Path(path)
    data = read_regular_file(path, max_bytes=max_bytes, error=error, what=what, advice=advice)
    if path.suffix.lower() == ".json":
        return parse_json(data, path, error=error, advice=advice)
    suffix = f"; {advice}" if advice else ""
    text = _text(data, path, error, suffix, "TOML")
    bare = _TOML_COMMENT.sub("", _TOML_STRING.sub("", text))  # strings first: a '#' inside one is no comment
    _check_depth(bare, path, error, suffix, "TOML", None)
    long_number = _TOML_LONG_NUMBER.search(bare)
    if long_number:
        digits = sum(c.isdigit() for c in long_number.group())
        raise error(
            f"{path}: invalid TOML (a number of {digits:,} digits, more than the {MAX_INT_DIGITS} allowed){suffix}"
        )
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no TOML reader in the standard library
        raise error(
            f"{path}: reading TOML needs Python >= 3.11 (tomllib); write the same tables as a .json file"
        ) from None
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise error(f"{path}: invalid TOML ({str(exc)[:160]}){suffix}") from None
