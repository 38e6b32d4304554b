"""Helpers shared by the CLI commands: atomic report files, npz feeds, backend lists."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from toolkit.errors import InputError, ToolkitError


def write_text_atomically(path: str | Path, text: str) -> None:
    path = Path(path)
    if path.is_dir():
        raise ToolkitError(f"{path} is a directory; give a file path for the report")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_npz_atomically(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such inputs file") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{path}: not a readable .npz of arrays ({exc}); save inputs with numpy.savez") from None


def split_backends(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ToolkitError("--backends is empty; give a comma-separated list, e.g. eager,ort-cpu,onnx-reference")
    return names
