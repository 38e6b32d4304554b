""".npz files read with bounds: plain arrays only (never pickles), each member's .npy header checked against the
member's unpacked size, and the unpacked total bounded, all from the zip directory and the headers, before a
member's data is inflated (a few hundred kilobytes of zeros can inflate to gigabytes)."""

from __future__ import annotations

import math
import os
import stat
import zipfile
from pathlib import Path

import numpy as np

from artifact.errors import ToolkitError


def read_npz(
    path: str | os.PathLike,
    *,
    limit: int,
    error: type[ToolkitError],
    advice: str,
    expected: dict[str, tuple[str, tuple]] | None = None,
) -> dict[str, np.ndarray]:
    """The arrays of `path`. `limit` bounds the unpacked total; `expected` ({member: (dtype name, shape)}), when
    given, is what each member's header must declare (checked before its data is read)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc}); {advice}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file; {advice}")
    try:
        _check_members(path, limit, error, advice, expected)
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except ToolkitError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, KeyError) as exc:
        raise error(f"{path}: not a readable .npz of arrays ({str(exc)[:200]}); {advice}") from None


def _check_members(path: Path, limit: int, error, advice: str, expected) -> None:
    from numpy.lib import format as npy

    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        total = sum(info.file_size for info in members)
        if total > limit:
            raise error(f"{path}: members unpack to {total:,} bytes, above the limit of {limit:,}; {advice}")
        names = [info.filename.removesuffix(".npy") for info in members]
        if expected is not None and sorted(names) != sorted(expected):
            raise error(
                f"{path}: holds arrays {sorted(names)[:20]} but {sorted(expected)[:20]} were expected; {advice}"
            )
        for info, name in zip(members, names, strict=True):
            where = f"{path}: member {info.filename!r:.80}"
            if not info.filename.endswith(".npy"):
                raise error(f"{where} is not a .npy array; {advice}")
            with archive.open(info) as member:
                version = npy.read_magic(member)
                read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise error(f"{where}: .npy format version {version} is not supported; {advice}")
                shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise error(f"{where}: holds Python objects (dtype {dtype}); only plain arrays are read")
                needed = member.tell() + math.prod(shape) * dtype.itemsize
            if needed != info.file_size:
                raise error(
                    f"{where}: header declares shape {shape} of {dtype} ({needed:,} bytes with the header) but the "
                    f"member holds {info.file_size:,}; {advice}"
                )
            if expected is not None and (dtype.name, tuple(shape)) != (expected[name][0], tuple(expected[name][1])):
                want_dtype, want_shape = expected[name]
                raise error(
                    f"{where}: declares {dtype.name} {list(shape)} but {want_dtype} {list(want_shape)} was expected; "
                    f"{advice}"
                )
