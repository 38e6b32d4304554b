"""load_npz (the --inputs file): plain arrays only, headers checked against member sizes before
numpy allocates, every failure an InputError naming the file."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from numpy.lib import format as npy

from artifact import MAX_MODEL_BYTES_ENV
from artifact.errors import InputError
from toolkit.commands.common import load_npz


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    npy.write_array(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def write_zip(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_plain_arrays_round_trip(tmp_path):
    arrays = {"input_ids": np.arange(6).reshape(2, 3), "x": np.ones((1, 2), np.float32)}
    np.savez(tmp_path / "in.npz", **arrays)
    loaded = load_npz(tmp_path / "in.npz")
    assert sorted(loaded) == sorted(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)


def _with_shape(data: bytes, shape) -> bytes:
    """The .npy bytes of `data` (8 bytes of float64 payload) behind a header that declares `shape`."""
    header = {"descr": "<f8", "fortran_order": False, "shape": shape}
    buffer = io.BytesIO()
    npy.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + data[len(data) - 8 :]


CASES = {
    "not a zip": (lambda p: p.write_bytes(b"not a zip at all"), r"not a readable \.npz"),
    "truncated zip": (lambda p: p.write_bytes(np_savez_bytes()[:40]), r"not a readable \.npz"),
    "pickled objects": (
        lambda p: write_zip(p, {"x.npy": npy_bytes(np.array([{"a": 1}], dtype=object))}),
        r"member 'x\.npy': holds Python objects",
    ),
    "header lies about the size": (
        lambda p: write_zip(p, {"x.npy": _with_shape(npy_bytes(np.zeros(1)), (2**40,))}),
        r"header declares shape \(1099511627776,\) of float64 .* holds 136",
    ),
    "not an array member": (lambda p: write_zip(p, {"notes.txt": b"hi"}), r"member 'notes\.txt' is not a \.npy"),
    "unknown npy version": (
        lambda p: write_zip(p, {"x.npy": b"\x93NUMPY\x09\x00junk"}),
        r"\.npy format version \(9, 0\) is not supported",
    ),
}


def np_savez_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.arange(100))
    return buffer.getvalue()


@pytest.mark.parametrize("case", CASES)
def test_bad_inputs_files_are_input_errors(tmp_path, case):
    make, pattern = CASES[case]
    path = tmp_path / "in.npz"
    make(path)
    with pytest.raises(InputError, match=r"in\.npz: .*" + pattern):
        load_npz(path)


def test_missing_inputs_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.npz: no such inputs file"):
        load_npz(tmp_path / "nope.npz")


def test_size_limit_applies_to_unpacked_members(tmp_path, monkeypatch):
    np.savez(tmp_path / "in.npz", x=np.zeros(1000))
    monkeypatch.setenv(MAX_MODEL_BYTES_ENV, "1000")
    with pytest.raises(InputError, match=r"members unpack to 8,128 bytes, above the limit of 1,000"):
        load_npz(tmp_path / "in.npz")
