"""Helpers shared by the CLI commands: npz feeds, backend lists, and the foundation's atomic file writers."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from artifact.errors import InputError, ToolkitError
from artifact.read import max_model_bytes
from artifact.write import save_npz_atomically, write_text_atomically

__all__ = ["load_npz", "save_npz_atomically", "split_backends", "write_text_atomically"]


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Read an --inputs .npz: plain arrays only (never pickles), each member's header checked against
    the member's size before numpy allocates for it, the total bounded by $TOOLKIT_MAX_MODEL_BYTES."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such inputs file")
    try:
        _check_npz_members(path, max_model_bytes())
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except InputError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, KeyError) as exc:
        raise InputError(f"{path}: not a readable .npz of arrays ({exc}); save inputs with numpy.savez") from None


def _check_npz_members(path: Path, limit: int) -> None:
    from numpy.lib import format as npy

    with zipfile.ZipFile(path) as archive:
        members = archive.infolist()
        total = sum(info.file_size for info in members)
        if total > limit:
            raise InputError(
                f"{path}: members unpack to {total:,} bytes, above the limit of {limit:,} ($TOOLKIT_MAX_MODEL_BYTES)"
            )
        for info in members:
            where = f"{path}: member {info.filename!r:.80}"
            if not info.filename.endswith(".npy"):
                raise InputError(f"{where} is not a .npy array; save inputs with numpy.savez")
            with archive.open(info) as member:
                version = npy.read_magic(member)
                read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
                if read_header is None:
                    raise InputError(f"{where}: .npy format version {version} is not supported")
                shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise InputError(f"{where}: holds Python objects (dtype {dtype}); only plain arrays are read")
                needed = member.tell() + math.prod(shape) * dtype.itemsize
            if needed != info.file_size:
                raise InputError(
                    f"{where}: header declares shape {shape} of {dtype} ({needed:,} bytes with the "
                    f"header) but the member holds {info.file_size:,}"
                )


def split_backends(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ToolkitError("--backends is empty; give a comma-separated list, e.g. eager,ort-cpu,onnx-reference")
    return names
