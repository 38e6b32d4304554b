"""Weights that stay in the checkpoint file they came from until an artifact is written.

A checkpoint tensor the export keeps byte for byte (a bfloat16 weight exported as bfloat16) is read as a view of
a private file mapping of its own: its pages are resident only while something reads them. The importer checks
it (finite values) and gives the pages back (map_span, release_pages). The exporter then holds it as a FileSpan
(span_of) and writes it by copying the file range, never holding the weights in memory whole: the export's peak
is the interpreter and one weight instead of every weight.

Mappings are private (copy-on-write): a writer to the tensor gets its own pages and the file is never changed,
and span_of no longer takes a mapping with a written page for the file's bytes. A span remembers its file's
identity and is refused if the file is replaced or rewritten before it is copied. A file truncated in place
while its pages are still read raises SIGBUS, as with any mapped reader.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from artifact.errors import ModelFileError

COPY_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class FileSpan:
    """`length` bytes of the file at `path` from `offset`: a weight written into an artifact straight from the
    checkpoint it was read from. `identity` is the file's (device, inode, size, mtime) when it was mapped: a
    file replaced or rewritten since is refused, not written."""

    path: str
    offset: int
    length: int
    identity: tuple = ()

    def __len__(self) -> int:
        return self.length

    def chunks(self, size: int = COPY_CHUNK_BYTES):
        """The bytes, `size` at a time, read with plain reads (no mapping, so none stays resident)."""
        with open(self.path, "rb") as handle:
            if self.identity and _identity(os.fstat(handle.fileno())) != self.identity:
                raise self._changed()
            done = 0
            while done < self.length:
                count = min(size, self.length - done)
                data = os.pread(handle.fileno(), count, self.offset + done)
                if len(data) != count:  # the file shrank since it was read and checked
                    raise self._changed()
                yield data
                done += count

    def _changed(self) -> ModelFileError:
        return ModelFileError(
            f"{self.path}: the file changed while it was being exported (replaced, rewritten or cut short; "
            f"{self.offset + self.length} bytes expected); leave it unchanged and export again"
        )


def _identity(stat: os.stat_result) -> tuple:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass
class _Mapping:
    mapping: weakref.ref  # the mmap object: a stale entry (its mapping gone, the address reused) is ignored
    nbytes: int
    span: FileSpan


_MAPPED: dict[int, _Mapping] = {}
_LOCK = threading.Lock()


def map_span(span: FileSpan) -> tuple[mmap.mmap, int, FileSpan]:
    """A private mapping of the file pages holding `span`, the span's offset inside it, and the span with the
    file's identity. Registered, so that span_of finds the span from any array that views exactly its bytes
    while the mapping lives and nothing has written to it."""
    try:
        with open(span.path, "rb") as handle:
            identity = _identity(os.fstat(handle.fileno()))
            if identity[2] < span.offset + span.length:  # shrunk since its header was checked
                raise span._changed()
            base = span.offset - span.offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(handle.fileno(), span.offset - base + span.length, offset=base, access=mmap.ACCESS_COPY)
    except ValueError as exc:  # mmap's own refusal of a range past the end
        raise span._changed() from exc
    delta, span = span.offset - base, FileSpan(span.path, span.offset, span.length, identity)
    address = np.frombuffer(mapping, dtype=np.uint8, count=1, offset=delta).ctypes.data
    with _LOCK:
        _MAPPED[address] = _Mapping(weakref.ref(mapping, lambda _, a=address: _forget(a)), span.length, span)
    return mapping, delta, span


def _forget(address: int) -> None:
    with _LOCK:
        entry = _MAPPED.get(address)
        if entry is not None and entry.mapping() is None:
            del _MAPPED[address]


def _entry(array) -> tuple[_Mapping, mmap.mmap] | None:
    """The live mapping whose span `array` (a numpy array or a torch tensor, C-contiguous) views whole."""
    if hasattr(array, "data_ptr"):  # a torch tensor (torch is not imported here)
        if not array.is_contiguous() or array.device.type != "cpu":
            return None
        address, nbytes = array.data_ptr(), array.numel() * array.element_size()
    else:
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            return None
        address, nbytes = array.__array_interface__["data"][0], array.nbytes
    with _LOCK:
        entry = _MAPPED.get(address)
    mapping = entry.mapping() if entry is not None else None
    if mapping is None or entry.nbytes != nbytes or _written(mapping):
        return None
    return entry, mapping


def _written(mapping: mmap.mmap) -> bool:
    """Whether any page of the private mapping was written (copied on write, so no longer the file's): from
    /proc/self/pagemap, whose flags say of each page whether it is present, swapped and file-backed. Where it
    cannot be read, every mapping counts as written, so its bytes are taken from memory."""
    page = mmap.PAGESIZE
    first = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data // page
    pages = -(-len(mapping) // page)
    try:
        with open("/proc/self/pagemap", "rb") as handle:
            raw = os.pread(handle.fileno(), pages * 8, first * 8)
    except OSError:
        return True
    if len(raw) != pages * 8:
        return True
    flags = np.frombuffer(raw, dtype="<u8")
    present, swapped, file_page = (flags >> 63) & 1, (flags >> 62) & 1, (flags >> 61) & 1
    return bool(np.any(swapped | (present & (1 - file_page))))


def span_of(array) -> FileSpan | None:
    """The file span whose bytes `array` views whole, if it is a live mapping of map_span's."""
    found = _entry(array)
    return found[0].span if found is not None else None


def release_pages(array) -> None:
    """Give back the resident pages of a mapped span's view (read again from the file if touched later). Not once
    anything has written to it: a private mapping's written pages would be dropped too, back to the file's
    bytes."""
    found = _entry(array)
    if found is not None:
        found[1].madvise(mmap.MADV_DONTNEED)


def buffers(chunk):
    """A file's chunk as buffers in order: itself, or a FileSpan's bytes read from its file."""
    return chunk.chunks() if isinstance(chunk, FileSpan) else (chunk,)


def sha256_chunks(chunks) -> str:
    """sha256 of a file's chunks: bytes-like objects and FileSpans (read from their file)."""
    digest = hashlib.sha256()
    for chunk in chunks:
        for data in buffers(chunk):
            digest.update(data)
    return digest.hexdigest()
