"""The GGUF header walk: metadata values and tensor views of a GGUF file, every field checked against the file.

A lying count could make a naive reader spin or grow lists without bound, so every count and length
is checked against the bytes that remain before it sizes a loop or an allocation, every tensor's
byte span (dims x type) against the data section, and spans against each other; only then are the
tensors mapped (numpy views of the file, nothing read yet). The walk follows gguf.GGUFReader's
layout, one method per section of the file, and gives values as its `contents()` does; the
library's reader itself is not used, as it builds numpy objects for every token of a vocabulary
(tens of thousands of entries per import). Little-endian GGUF v2/v3 only.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple, NoReturn

import numpy as np

from artifact.errors import ModelFileError

GGUF_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS in ggml.h
# GGUF metadata value types -> bytes per scalar (gguf.GGUFValueType; 8 = string, 9 = array).
GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_UINT32, GGUF_STRING, GGUF_ARRAY = 4, 8, 9
# The numpy dtypes gguf.GGUFReader reads those scalars as (little-endian files only).
GGUF_SCALAR_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
# Tensor types gguf.GGUFReader views as typed arrays; every other type is viewed as bytes per row.
GGUF_PLAIN_TYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
GGUF_FIXED_HEADER = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count
# Lower bounds in bytes on one metadata entry (8-byte key length, 4-byte type, 1-byte value) and one
# tensor-info entry (a rank-1 entry's fixed fields take 32): a count of more entries than fit is a lie.
GGUF_MIN_FIELD_BYTES, GGUF_MIN_TENSOR_INFO_BYTES = 13, 24


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its type, its shape in torch order and a read-only view of its bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF lists the fastest-varying axis first; this is reversed to torch's order
    data: np.ndarray  # as gguf.GGUFReader lays it out: typed for plain types, (..., bytes per row) for blocks


@dataclass
class GGUFHeader:
    """What check_gguf_header read: metadata values and tensor views, in file order."""

    fields: dict  # key -> value as gguf's ReaderField.contents() gives it; values that are not UTF-8 left out
    tensors: dict[str, GGUFTensor]


class TensorInfo(NamedTuple):
    """One tensor-info entry; ordered by data offset first, so sorting lays the entries out as their bytes."""

    start: int  # relative to the data section
    end: int
    label: str  # how messages name the tensor
    shape: tuple[int, ...]  # torch order
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType


def check_gguf_header(path: Path) -> GGUFHeader:
    """Walk a GGUF header against the file size, then read its metadata and map its tensors."""
    return GGUFHeaderReader(path).read()


class GGUFHeaderReader:
    """One walk over one GGUF file, section by section:

    _read_preamble (magic, version, counts) -> _read_metadata (key-value section) -> _read_tensor_infos
    -> _check_data_section (alignment, spans) -> _map_tensors (views of the data). The first three read
    through an mmap of the file; the primitives below them take an offset and return the one after.
    """

    def __init__(self, path: Path):
        self.path = path
        self.size = 0
        self.data: mmap.mmap | None = None  # the file, while the header sections are read
        self.offset = 0  # where the next section entry starts
        self.alignment = 0
        self.fields: dict = {}
        self.infos: list[TensorInfo] = []  # in file order
        self.data_start = 0

    def read(self) -> GGUFHeader:
        self.size = self.path.stat().st_size
        if self.size < GGUF_FIXED_HEADER:
            raise ModelFileError(
                f"{self.path}: not a readable GGUF file (truncated: {self.size} bytes, the header "
                f"alone takes {GGUF_FIXED_HEADER})"
            )
        with open(self.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            self.data = data
            try:
                n_tensors, n_fields = self._read_preamble()
                self._read_metadata(n_fields)
                self._read_tensor_infos(n_tensors)
            finally:
                self.data = None
        self._check_data_section()
        return GGUFHeader(self.fields, self._map_tensors())

    # ----------------------------------------------------------------------- sections

    def _read_preamble(self) -> tuple[int, int]:
        """Magic and version; (tensor count, metadata count) once both could fit in the file."""
        import gguf

        magic = bytes(self.data[:4])
        if magic != b"GGUF":
            self._fail(f"magic is {magic!r}, expected b'GGUF'")
        version = self._scalar("<I", 4, "version")
        if version not in GGUF_VERSIONS:
            self._fail(
                f"version {version} (or a big-endian file); supported: little-endian versions "
                f"{', '.join(map(str, GGUF_VERSIONS))}"
            )
        n_tensors, n_fields = self._scalar("<Q", 8, "tensor count"), self._scalar("<Q", 16, "metadata count")
        self.offset, self.alignment = GGUF_FIXED_HEADER, gguf.GGUF_DEFAULT_ALIGNMENT
        if n_fields * GGUF_MIN_FIELD_BYTES > self.size or n_tensors * GGUF_MIN_TENSOR_INFO_BYTES > self.size:
            self._fail(
                f"header counts ({n_tensors:,} tensors, {n_fields:,} metadata entries) cannot fit in "
                f"{self.size:,} bytes"
            )
        # gguf.GGUFReader lists the header's own fields under these names; a metadata key may not reuse them.
        self.fields = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_fields}
        return n_tensors, n_fields

    def _read_metadata(self, count: int) -> None:
        """The key-value section: keys unique and UTF-8; values that are not UTF-8 left out, as contents() fails."""
        keys = set(self.fields)
        for i in range(count):
            self.offset, raw_key = self._string(self.offset, f"metadata key #{i}")
            key = _utf8(raw_key)
            if key is None:
                self._fail(f"metadata key #{i} {raw_key!r:.60} is not UTF-8")
            if key in keys:
                self._fail(f"metadata key {key!r:.60} appears twice")
            keys.add(key)
            kind = self._scalar("<I", self.offset, f"metadata {key!r:.60} type")
            if key == "general.alignment":
                self._read_alignment(kind)
            self.offset, decoded = self._value(self.offset + 4, kind, f"metadata {key!r:.60}")
            if decoded is not None:
                self.fields[key] = decoded

    def _read_alignment(self, kind: int) -> None:
        """general.alignment, which places the data section and every tensor in it."""
        if kind != GGUF_UINT32:
            self._fail("general.alignment is not a uint32")
        alignment = self._scalar("<I", self.offset + 4, "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            self._fail(f"general.alignment {alignment} is not a power of two")
        self.alignment = alignment

    def _read_tensor_infos(self, count: int) -> None:
        names = set()
        for i in range(count):
            info = self._read_tensor_info(i, names)
            names.add(info.name)
            self.infos.append(info)

    def _read_tensor_info(self, i: int, names: set[str]) -> TensorInfo:
        """Entry i of the tensor-info section: name, rank, dims, type and data offset."""
        import gguf

        self.offset, raw_name = self._string(self.offset, f"tensor #{i} name")
        name = _utf8(raw_name)
        if name is None:
            self._fail(f"tensor #{i} name {raw_name!r:.60} is not UTF-8")
        label = f"tensor {name!r:.80}"
        if name in names:
            self._fail(f"{label} appears twice")
        n_dims = self._scalar("<I", self.offset, f"{label} rank")
        if not 1 <= n_dims <= GGUF_MAX_DIMS:
            self._fail(f"{label} has rank {n_dims}; GGUF allows 1..{GGUF_MAX_DIMS}")
        dims = [self._scalar("<Q", self.offset + 4 + 8 * j, f"{label} dims") for j in range(n_dims)]
        self.offset += 4 + 8 * n_dims
        kind = self._scalar("<I", self.offset, f"{label} type")
        start = self._scalar("<Q", self.offset + 4, f"{label} offset")
        self.offset += 12
        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            self._fail(f"{label} has unknown tensor type {kind}")
        elements = math.prod(dims)
        if elements % block or (dims[0] % block):
            self._fail(f"{label} shape {tuple(reversed(dims))} is not a whole number of {block}-value blocks")
        return TensorInfo(start, start + elements // block * type_size, label, tuple(reversed(dims)), name, tensor_type)

    def _check_data_section(self) -> None:
        """The data section starts at the next alignment; every span is aligned, inside it and apart from the rest."""
        self.data_start = -(-self.offset // self.alignment) * self.alignment
        data_size = self.size - self.data_start
        spans = sorted(self.infos)
        for info in spans:
            if info.start % self.alignment:
                self._fail(f"{info.label} data offset {info.start} is not a multiple of the alignment {self.alignment}")
            if info.end > data_size:
                self._fail(
                    f"truncated or lying header: {info.label} {info.shape} needs bytes [{info.start:,}, "
                    f"{info.end:,}) of a {max(data_size, 0):,}-byte data section"
                )
        for a, b in pairwise(spans):
            if b.start < a.end:
                self._fail(f"{a.label} and {b.label} overlap (data bytes {b.start:,} to {a.end:,})")

    def _map_tensors(self) -> dict[str, GGUFTensor]:
        """Views of the tensors: every span is inside the file (_check_data_section), so the file is mapped once
        and each tensor is a view of it (nothing read yet)."""
        import gguf

        tensors = {}
        if not self.infos:
            return tensors
        try:
            mapped = np.memmap(self.path, mode="r")
        except (OSError, ValueError) as exc:
            self._fail(f"cannot map the tensor data: {exc}")
        if mapped.size != self.size:
            self._fail(f"the file changed size while it was read ({self.size:,} then {mapped.size:,} bytes)")
        for info in self.infos:
            view = mapped[self.data_start + info.start : self.data_start + info.end]
            plain = GGUF_PLAIN_TYPES.get(info.tensor_type.name)
            if plain is not None:
                view = view.view(plain).reshape(info.shape)
            else:
                view = view.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, info.tensor_type))
            tensors[info.name] = GGUFTensor(info.name, info.tensor_type, info.shape, view)
        return tensors

    # ----------------------------------------------------------------------- primitives

    def _fail(self, what: str) -> NoReturn:
        raise ModelFileError(f"{self.path}: not a readable GGUF file ({what})")

    def _scalar(self, fmt: str, offset: int, what: str):
        if offset + struct.calcsize(fmt) > self.size:
            self._fail(f"truncated: {what} at byte {offset} runs past the end of the {self.size:,}-byte file")
        return struct.unpack_from(fmt, self.data, offset)[0]

    def _string(self, offset: int, what: str) -> tuple[int, bytes]:
        length = self._scalar("<Q", offset, f"{what} length")
        if offset + 8 + length > self.size:
            self._fail(f"truncated: {what} of {length:,} bytes at byte {offset} runs past the end of the file")
        return offset + 8 + length, self.data[offset + 8 : offset + 8 + length]

    def _strings(self, offset: int, count: int, what: str) -> tuple[int, list[bytes]]:
        # The tokenizer's vocabulary and merges: ~10^5 strings, so the lengths are unpacked inline.
        data, size, unpack, items = self.data, self.size, struct.Struct("<Q").unpack_from, []
        for i in range(count):
            if offset + 8 > size:
                self._scalar("<Q", offset, f"{what}[{i}] length")
            (length,) = unpack(data, offset)
            start, offset = offset + 8, offset + 8 + length
            if offset > size:
                self._fail(
                    f"truncated: {what}[{i}] of {length:,} bytes at byte {start - 8} runs past the end of the file"
                )
            items.append(data[start:offset])
        return offset, items

    def _scalars(self, offset: int, kind: int, count: int) -> list:
        raw = self.data[offset : offset + count * GGUF_SCALAR_SIZES[kind]]
        return np.frombuffer(raw, dtype=GGUF_SCALAR_DTYPES[kind], count=count).tolist()

    def _value(self, offset: int, kind: int, what: str) -> tuple[int, object]:
        """(offset after the value, the value or None where gguf's contents() would fail: not UTF-8)."""
        if kind in GGUF_SCALAR_SIZES:
            if offset + GGUF_SCALAR_SIZES[kind] > self.size:
                self._fail(f"truncated: {what} at byte {offset}")
            return offset + GGUF_SCALAR_SIZES[kind], self._scalars(offset, kind, 1)[0]
        if kind == GGUF_STRING:
            offset, raw = self._string(offset, what)
            return offset, _utf8(raw)
        if kind == GGUF_ARRAY:
            return self._array(offset, what)
        self._fail(f"{what}: value type {kind} is not supported")

    def _array(self, offset: int, what: str) -> tuple[int, list | None]:
        """An array value: item type, count, then the items (scalars or strings; nested arrays are refused)."""
        item, count = self._scalar("<I", offset, f"{what} item type"), self._scalar("<Q", offset + 4, f"{what} count")
        offset += 12
        if item in GGUF_SCALAR_SIZES:
            if offset + count * GGUF_SCALAR_SIZES[item] > self.size:
                self._fail(f"{what}: {count:,} items of {GGUF_SCALAR_SIZES[item]} bytes run past the end of the file")
            return offset + count * GGUF_SCALAR_SIZES[item], self._scalars(offset, item, count)
        if item != GGUF_STRING:
            self._fail(f"{what}: array item type {item} is not supported")
        if offset + count * 8 > self.size:  # every string takes at least its 8-byte length
            self._fail(f"{what}: {count:,} strings cannot fit in the rest of the file")
        offset, items = self._strings(offset, count, what)
        try:
            return offset, [raw.decode("utf-8") for raw in items]
        except UnicodeDecodeError:
            return offset, None


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
