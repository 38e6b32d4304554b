"""Writing artifacts all-or-nothing: a temporary sibling directory, fsynced, swapped in atomically.

Also the atomic single-file writers the reports and golden files use.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from artifact.errors import ModelFileError, ToolkitError
from artifact.format import MANIFEST_FILE, METADATA_KEY
from artifact.protobuf import serialize_chunks
from artifact.spans import FileSpan, buffers, sha256_chunks, span_of

EXTERNAL_DATA_ENV = "TOOLKIT_EXTERNAL_DATA_BYTES"
# A graph whose initializers exceed this many bytes keeps them in an external data file: the protobuf limit of
# one file is 2 GiB, and runtimes map an external file instead of copying it out of the parsed graph.
DEFAULT_EXTERNAL_DATA_BYTES = 1 << 30
EXTERNAL_MIN_TENSOR_BYTES = 1024  # smaller tensors (scales, shapes) stay inside the graph
EXTERNAL_ALIGNMENT = 4096  # page-aligned offsets, so ONNX Runtime can map each tensor in place
# An initializer whose bytes the exporter holds outside the graph until it writes the artifact (PendingWeights):
# a protobuf message cannot give back the memory of a field it cleared, so weights that pass through one are
# held twice by the time they are written out.
PENDING_LOCATION = "<pending>"


class PendingWeights(dict):
    """{initializer name: its bytes as a flat uint8 array, or the FileSpan of a checkpoint file they are read
    from when written}, for initializers marked pending in a graph."""

    def add(self, tensor, array: np.ndarray) -> None:
        """Mark `tensor` (name, data_type and dims set) pending and hold `array`'s bytes for it (no copy when
        `array` is C-contiguous). An array that views a mapped checkpoint span whole is held as that span, so
        the mapping is let go with the array and the bytes are read from the file only as they are written."""
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=PENDING_LOCATION)
        tensor.data_location = tensor.EXTERNAL
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self[tensor.name] = span_of(flat) or flat

    def array(self, name: str) -> np.ndarray:
        """The bytes of `name` as a flat uint8 array (read into memory if they are still a file span)."""
        held = self[name]
        if isinstance(held, FileSpan):
            held = self[name] = np.frombuffer(b"".join(held.chunks()), dtype=np.uint8)
        return held


def is_pending(tensor) -> bool:
    return tensor.data_location == tensor.EXTERNAL and any(
        e.key == "location" and e.value == PENDING_LOCATION for e in tensor.external_data
    )


def external_data_threshold() -> int:
    """Initializer bytes above which a graph's weights go to an external file ($TOOLKIT_EXTERNAL_DATA_BYTES)."""
    raw = os.environ.get(EXTERNAL_DATA_ENV)
    if raw is None:
        return DEFAULT_EXTERNAL_DATA_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ToolkitError(
            f"${EXTERNAL_DATA_ENV}={raw!r}: expected a number of bytes >= 0, e.g. {DEFAULT_EXTERNAL_DATA_BYTES}"
        )
    return value


def externalize(proto, location: str, pending: PendingWeights | None = None) -> tuple[list, str]:
    """Move the graph's initializers of at least EXTERNAL_MIN_TENSOR_BYTES, and its pending ones, out to the
    external data file `location` (beside the graph file), each at a page-aligned offset. Returns the file's
    contents as chunks (each tensor's bytes and the padding before it, never joined into one copy) and their
    sha256."""
    chunks, size, digest = [], 0, hashlib.sha256()
    for tensor in proto.graph.initializer:
        if is_pending(tensor):
            raw = pending.pop(tensor.name)
        elif not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_TENSOR_BYTES:
            continue
        else:
            raw = tensor.raw_data
            tensor.ClearField("raw_data")
        padding = b"\0" * (-size % EXTERNAL_ALIGNMENT)
        for chunk in (padding, raw):
            chunks.append(chunk)
            for data in buffers(chunk):
                digest.update(data)
        offset, size = size + len(padding), size + len(padding) + len(raw)
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            tensor.external_data.add(key=key, value=value)
        tensor.data_location = tensor.EXTERNAL
    return chunks, digest.hexdigest()


def internalize(proto, pending: PendingWeights | None) -> None:
    """Declare the pending initializers as the graph's own (a graph that keeps its weights inside): their bytes
    stay in `pending` until serialize_chunks(proto, pending) writes them as raw_data, straight from there."""
    for tensor in proto.graph.initializer:
        if is_pending(tensor):
            del tensor.external_data[:]
            tensor.ClearField("data_location")  # absent, as in a tensor that never left the graph


def initializer_bytes(proto, pending: PendingWeights | None = None) -> int:
    return sum(len(pending[t.name]) if is_pending(t) else len(t.raw_data) for t in proto.graph.initializer)


def pack_artifact(
    manifest: dict,
    protos: dict,
    extra_files: dict[str, bytes] | None = None,
    *,
    embedded=None,
    before_serialise=None,
    keep_protos: bool = False,
    external_data: bool | None = None,
    pending: PendingWeights | None = None,
) -> dict[str, bytes]:
    """The files of an artifact, ready for write_artifact: each graph of `manifest["graphs"]` (its ModelProto
    in `protos`, keyed by graph name) with the manifest embedded in its metadata, serialised and hashed into
    its manifest entry; then the extra files; then manifest.json.

    embedded(manifest) -> dict: what each graph embeds (the manifest itself by default); it is taken graph by
    graph, so a later graph's copy records the hashes of the graphs before it. before_serialise(entry,
    proto) may check the finished graph. A graph's proto is dropped once serialised unless keep_protos.

    external_data: True keeps every graph's weights in `{file}.data` beside it, False inside the graph, None
    (the default) beside it above external_data_threshold() bytes of initializers. pending: the bytes of the
    graphs' pending initializers (taken from it as they are placed).
    """
    files = {}
    threshold = external_data_threshold()
    for entry in manifest["graphs"]:
        proto = protos[entry["name"]] if keep_protos else protos.pop(entry["name"])
        del proto.metadata_props[:]
        entry.pop("external_data", None)
        if external_data or (external_data is None and initializer_bytes(proto, pending) > threshold):
            if keep_protos:
                proto = copy.deepcopy(proto)  # the caller's copy keeps its weights (no serialising: 2 GiB cap)
            location = f"{entry['file']}.data"
            files[location], digest = externalize(proto, location, pending)
            entry["external_data"] = {location: digest}
        # On the graph as written, less its weights (the checker and shape inference serialise the graph they
        # are given, and read no external files): moved out, or pending until serialised below.
        if before_serialise is not None:
            before_serialise(entry, proto)
        if "external_data" not in entry:
            internalize(proto, pending)
        # The embedded manifest comes last: it records the external data's hash.
        embed = dict(embedded(manifest) if embedded is not None else manifest, graph=entry["name"])
        proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(embed, sort_keys=True))
        # As chunks, weights not joined into one buffer: a mapped checkpoint's are read from their file as written.
        data = serialize_chunks(proto, pending)
        entry["sha256"] = sha256_chunks(data)
        files[entry["file"]] = data
        del data, proto
    files.update(extra_files or {})
    files[MANIFEST_FILE] = manifest_bytes(manifest)
    return files


def manifest_bytes(manifest: dict) -> bytes:
    """manifest.json as every writer lays it out."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def is_artifact_dir(path: Path) -> bool:
    return (path / MANIFEST_FILE).is_file()


def check_output_dir(out_dir: Path) -> None:
    """Refuse an output path that is a file or a non-empty directory holding no artifact."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelFileError(f"output path {out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_artifact_dir(out_dir):
        raise ModelFileError(
            f"output directory {out_dir} is not empty and holds no {MANIFEST_FILE}; "
            "refusing to overwrite it, choose an empty or new --out"
        )


def write_artifact(
    out_dir: Path,
    files: dict[str, bytes | list[bytes]],
    *,
    verify=None,
    move_from: Path | None = None,
    consume: bool = False,
) -> None:
    """Write files into out_dir all-or-nothing. A file's contents are bytes, or a list of chunks written in
    order and removed from the list as they are written (external data: each tensor's bytes, never joined
    into one copy, freed once on disk). move_from: a finished artifact directory in the same parent whose
    files are moved in first (renamed, not copied), `files` replacing those of the same name. consume: each
    file's bytes are let go (the entry emptied) once on disk, before `verify` reads the files back: an inline
    graph is otherwise held in memory beside the copies its verification reads and parses.

    Everything goes into a sibling temporary directory first (each file fsynced);
    `verify(tmp_dir)` may inspect it; only then is it swapped in, in one atomic
    exchange where the OS offers it. A failure or a kill at any point leaves an
    existing artifact at out_dir untouched and loadable; what a killed writer
    left behind is cleared by the next write. A non-empty directory that is not
    an artifact is never replaced.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with _write_lock(parent):
        _clear_leftovers(parent, out_dir.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        try:
            if move_from is not None:
                for path in Path(move_from).iterdir():
                    os.rename(path, tmp / path.name)
            with naming(out_dir):
                _write_files(tmp, files, consume)
            if verify is not None:
                verify(tmp)
            swap_in(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _write_files(tmp: Path, files: dict[str, bytes | list[bytes]], consume: bool = False) -> None:
    for name, data in files.items():  # replacing a value while iterating is allowed (the keys stay)
        if Path(name).name != name or name in (".", ".."):
            raise ModelFileError(f"artifact file name {name!r} must be a plain file name")
        with open(tmp / name, "wb") as handle:
            if isinstance(data, list):
                # Consumed as written: each tensor's bytes are freed once on disk, not held to the end.
                data.reverse()
                while data:
                    for piece in buffers(data.pop()):
                        handle.write(piece)
            else:
                handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if consume:
            files[name] = b""
        del data


@contextmanager
def naming(target: Path):
    """An OSError of a write that names no file (a full disk, a file too large) names `target`, the path the
    user gave, so the one-line error says where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from None
        raise


@contextmanager
def _write_lock(parent: Path):
    """Serialise writers in one parent directory, so leftovers found under the lock are a dead writer's.

    flock is released by the kernel when its holder dies, even by SIGKILL.
    """
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _clear_leftovers(parent: Path, name: str) -> None:
    """Remove what a killed writer left; if it died between the two renames of a fallback swap, restore."""
    olds = sorted(parent.glob(f".{glob_escape(name)}.old-*"), key=lambda p: p.stat().st_mtime)
    target = parent / name
    if not target.exists() and olds:
        os.rename(olds.pop(), target)  # the previous artifact, moved aside moments before the kill
    for leftover in olds + list(parent.glob(f".{glob_escape(name)}.tmp-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the OS or filesystem can't."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_staged(target: Path, fill):
    """Run fill(staging) on an empty sibling directory of `target`, then swap it in for `target`; return what
    fill returned. A fill that raises leaves `target` as it was. The staging directory is named like
    write_artifact's temporary directories, so the next write to `target` clears one a kill left behind."""
    target = Path(target)
    parent = target.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-staged-", dir=parent))
    try:
        try:
            result = fill(staging)
        except OSError as exc:  # a write inside the staging directory failed: say it of the target
            if exc.errno is not None and str(exc.filename or "").startswith(str(staging)):
                raise OSError(exc.errno, exc.strerror or str(exc), str(target)) from None
            raise
        swap_in(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return result


def swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` with the finished directory `tmp` (same parent); on failure `target` is restored.

    With an atomic exchange `target` always names a complete directory; afterwards `tmp` holds the
    old one and is removed. Without it, `target` is moved aside first; a kill between the two
    renames is repaired by the next write_artifact (_clear_leftovers).
    """
    tmp, target = Path(tmp), Path(target)
    if target.exists():
        if _exchange(tmp, target):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.resolve().parent))
        os.rmdir(old)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


def write_text_atomically(path: str | Path, text: str) -> None:
    path = Path(path)
    if path.is_dir():
        raise ToolkitError(f"{path} is a directory; give a file path for the report")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with naming(path), os.fdopen(fd, "w") as handle:
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
        with naming(path), os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
