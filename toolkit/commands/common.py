"""Helpers shared by the CLI commands: npz feeds, backend lists, and the foundation's atomic file writers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from artifact.errors import InputError, ToolkitError
from artifact.npz import read_npz
from artifact.read import max_model_bytes
from artifact.write import save_npz_atomically, write_text_atomically

__all__ = ["SEED_MAX", "load_npz", "save_npz_atomically", "split_backends", "write_text_atomically"]

# Seeds are numpy's and torch's: non-negative and within 64 bits.
SEED_MAX = 2**63 - 1


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Read an --inputs .npz: plain arrays only (never pickles), each member's header checked against
    the member's size before numpy allocates for it, the total bounded by $TOOLKIT_MAX_MODEL_BYTES."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such inputs file")
    limit = max_model_bytes()
    return read_npz(
        path,
        limit=limit,
        error=InputError,
        advice="save inputs with numpy.savez ($TOOLKIT_MAX_MODEL_BYTES bounds them)",
    )


def split_backends(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ToolkitError("--backends is empty; give a comma-separated list, e.g. eager,ort-cpu,onnx-reference")
    return names
