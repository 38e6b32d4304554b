"""artifact.spans: a checkpoint weight mapped from its file, found again from any view of it whole, its pages
given back, and written into an artifact by copying its file range."""

from __future__ import annotations

import gc
import hashlib

import numpy as np
import pytest
import torch

from artifact.errors import ModelFileError
from artifact.spans import FileSpan, map_span, release_pages, sha256_chunks, span_of


def rss_file_bytes() -> int:
    """This process's resident pages that map files (/proc/self/status RssFile)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture
def data_file(tmp_path):
    payload = np.random.default_rng(0).integers(0, 256, (40 << 20) + 12345, dtype=np.uint8).tobytes()
    path = tmp_path / "weights.bin"
    path.write_bytes(payload)
    return path, payload


def test_a_span_reads_its_bytes_and_hashes_them(data_file):
    path, payload = data_file
    span = FileSpan(str(path), 777, 9 << 20)
    assert len(span) == 9 << 20
    assert b"".join(span.chunks(1 << 20)) == payload[777 : 777 + (9 << 20)]
    expected = hashlib.sha256(b"ab" + payload[777 : 777 + (9 << 20)] + b"c").hexdigest()
    assert sha256_chunks([b"ab", span, memoryview(b"c")]) == expected


def test_a_span_of_a_file_that_shrank_is_refused_naming_the_file(data_file):
    path, payload = data_file
    span = FileSpan(str(path), 1000, 4 << 20)
    path.write_bytes(payload[: 2 << 20])
    with pytest.raises(ModelFileError, match=r"weights.bin: the file changed while it was being exported .*4195304"):
        b"".join(span.chunks())


def test_a_mapped_span_is_found_from_a_whole_view_only(data_file):
    """An unaligned offset inside the file: the view starts at the span's first byte, not the page's."""
    path, payload = data_file
    span = FileSpan(str(path), 4096 * 3 + 10, 8 << 20)
    mapping, delta, mapped = map_span(span)
    view = np.frombuffer(mapping, dtype=np.uint8, count=span.length, offset=delta)
    assert view.tobytes() == payload[span.offset : span.offset + span.length]
    assert span_of(view) == mapped and (mapped.path, mapped.offset, mapped.length) == (
        str(path),
        span.offset,
        span.length,
    )
    assert span_of(view.view(np.uint16)) == mapped  # another dtype of the same bytes
    assert span_of(view[1:]) is None and span_of(view[:-1]) is None  # part of it: not the span's bytes
    assert span_of(view[::2]) is None
    assert span_of(np.array(view)) is None  # a copy
    tensor = torch.frombuffer(mapping, dtype=torch.bfloat16, count=span.length // 2, offset=delta)
    assert span_of(tensor) == mapped and span_of(tensor.reshape(64, -1)) == mapped
    assert span_of(tensor.reshape(64, -1).T) is None


def test_a_span_whose_mapping_is_gone_is_not_found(data_file):
    path, _ = data_file
    span = FileSpan(str(path), 0, 4 << 20)
    mapping, delta, _ = map_span(span)
    address = np.frombuffer(mapping, dtype=np.uint8, count=1, offset=delta).ctypes.data
    del mapping
    gc.collect()
    # Memory at the same address (a new mapping reusing it) is not the span any more.
    from artifact import spans

    assert address not in spans._MAPPED


def test_released_pages_leave_the_resident_set_and_read_back_the_same(data_file):
    path, payload = data_file
    span = FileSpan(str(path), 5, 32 << 20)
    mapping, delta, _ = map_span(span)
    view = np.frombuffer(mapping, dtype=np.uint8, count=span.length, offset=delta)
    before = rss_file_bytes()
    total = int(view.sum(dtype=np.uint64))  # touches every page
    touched = rss_file_bytes()
    release_pages(view)
    released = rss_file_bytes()
    assert touched - before > 24 << 20, (before, touched)
    assert touched - released > 24 << 20, (touched, released)
    assert int(view.sum(dtype=np.uint64)) == total  # paged in again from the file
    assert view.tobytes() == payload[5 : 5 + (32 << 20)]


def test_a_write_to_a_mapped_view_never_reaches_the_file(data_file):
    path, payload = data_file
    mapping, delta, _ = map_span(FileSpan(str(path), 0, 2 << 20))
    view = np.frombuffer(mapping, dtype=np.uint8, count=2 << 20, offset=delta)
    view[:] = 0
    assert not view.any()
    del view, mapping
    assert path.read_bytes() == payload


def test_a_mapping_written_to_is_no_longer_its_files_and_keeps_its_pages(data_file):
    """A private mapping written in place (by torch, numpy or anything else) holds its own copy of the pages
    written: span_of no longer finds the file's span for it, and release_pages leaves it alone."""
    path, payload = data_file
    mapping, delta, span = map_span(FileSpan(str(path), 100, 16 << 20))
    tensor = torch.frombuffer(mapping, dtype=torch.float32, count=4 << 20, offset=delta)
    assert span_of(tensor) == span
    with torch.no_grad():
        tensor[123456] = 42.0  # one page written
    assert span_of(tensor) is None
    release_pages(tensor)
    assert float(tensor[123456]) == 42.0  # not reverted to the file's bytes
    assert path.read_bytes() == payload


def test_a_file_replaced_after_it_was_mapped_is_refused(data_file, tmp_path):
    """Swapped by a rename (a re-download), or rewritten in place: the span's file is not the one mapped."""
    path, payload = data_file
    _, _, span = map_span(FileSpan(str(path), 0, 1 << 20))
    other = tmp_path / "other.bin"
    other.write_bytes(payload[::-1])
    other.replace(path)
    with pytest.raises(ModelFileError, match="the file changed while it was being exported"):
        b"".join(span.chunks())


def test_mapping_a_span_past_the_end_of_the_file_is_refused(data_file):
    path, payload = data_file
    with pytest.raises(ModelFileError, match="the file changed while it was being exported"):
        map_span(FileSpan(str(path), len(payload) - 10, 1 << 20))
