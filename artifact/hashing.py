"""sha256 of bytes, files (streamed) and arrays (in place)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def array_digest(array) -> tuple:
    """(dtype, shape, sha256 of the C-order bytes): finds a tensor by its value without holding a second copy."""
    data = np.ascontiguousarray(array)
    # hashlib reads a contiguous array's buffer in place (no copy); object arrays have no such buffer.
    return array.dtype.str, array.shape, hashlib.sha256(data.tobytes() if data.dtype.hasobject else data).digest()
