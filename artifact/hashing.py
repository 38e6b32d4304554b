"""sha256 of bytes, files (streamed) and arrays (in place)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path

import numpy as np


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Files this large report their hashing to HASH_PROGRESS's callback (the CLI shows it): minutes at 8B.
PROGRESS_BYTES = 256 << 20
PROGRESS_EVERY = 512 << 20
HASH_PROGRESS: ContextVar[Callable[[str], None] | None] = ContextVar("hash_progress", default=None)


def sha256_file(path: Path) -> str:
    """The file's sha256, read 1 MiB at a time."""
    digest = hashlib.sha256()
    size = Path(path).stat().st_size
    report = hash_progress(path, size)
    done = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            done += len(chunk)
            if report is not None:
                report(done, size)
    return digest.hexdigest()


def hash_progress(path: Path, size: int) -> Callable[[int, int], None] | None:
    """report(done, size) for hashing `path` as its chunks go by (a line each PROGRESS_EVERY bytes and at the end),
    or None when nothing is listening or the file is under PROGRESS_BYTES."""
    callback = HASH_PROGRESS.get()
    if callback is None or size < PROGRESS_BYTES:
        return None
    shown = [0]

    def report(done: int, size: int) -> None:
        if done // PROGRESS_EVERY > shown[0] // PROGRESS_EVERY or (done == size and shown[0] != size):
            callback(f"verifying {Path(path).name}: {done / 2**30:.2f} of {size / 2**30:.2f} GiB hashed")
        shown[0] = done

    return report


DIGEST_CHUNK_BYTES = 4 << 20


def array_digest(array) -> tuple:
    """(dtype, shape, sha256 of the C-order bytes): finds a tensor by its value without holding a second copy.
    A non-contiguous array (a transposed view) is hashed a few rows at a time, so that it is not copied whole."""
    array = np.asarray(array)
    digest = hashlib.sha256()
    if array.dtype.hasobject:  # object arrays have no buffer to read in place
        digest.update(np.ascontiguousarray(array).tobytes())
    elif array.flags.c_contiguous or array.ndim == 0:
        digest.update(np.ascontiguousarray(array))  # hashlib reads a contiguous array's buffer in place
    else:
        row = max(array[0].nbytes if len(array) else 1, 1)
        step = max(DIGEST_CHUNK_BYTES // row, 1)
        for first in range(0, len(array), step):
            digest.update(np.ascontiguousarray(array[first : first + step]))
    return array.dtype.str, array.shape, digest.digest()
