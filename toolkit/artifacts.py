"""Artifact directories: ONNX graph files + `manifest.json`, written atomically, loaded defensively.

Single-graph families write `model.onnx`; the encoder-decoder writes
`encoder.onnx` and `decoder.onnx`. The manifest is also embedded in each ONNX
file's metadata_props (without the file hashes, which cannot hash themselves),
so a lone single-graph .onnx is self-describing.

Loading treats every file as hostile: sizes are checked before anything is
read, hashes before anything is parsed, and the parsed graph (IR version,
opsets, external-data locations, ONNX checker) before any runtime is handed
the file. Each refusal is its own ModelFileError subclass below.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

import onnx

from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from toolkit.errors import ConfigError, ModelFileError

MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
FORMAT = "onnx-toolkit-artifact"
FORMAT_VERSION = 1
METADATA_KEY = "onnx_toolkit.manifest"

# The one allow-list of operator sets a loaded graph may import: {domain: newest version accepted}.
# The default domain goes up to the newest opset the installed onnx knows (exports use
# exporters.functions.OPSET; a "standard" lowering uses 23); "com.microsoft" is ONNX Runtime's
# contrib domain (the "ort" lowering). Anything else, or anything newer, is refused.
ALLOWED_OPSETS: dict[str, int] = {
    "": onnx.defs.onnx_opset_version(),
    "ai.onnx": onnx.defs.onnx_opset_version(),
    CUSTOM_DOMAIN: CUSTOM_DOMAIN_VERSION,
    "com.microsoft": 1,
}
MAX_MODEL_BYTES_ENV = "TOOLKIT_MAX_MODEL_BYTES"
DEFAULT_MAX_MODEL_BYTES = 4 << 30  # 4 GiB: twice the 2 GiB protobuf limit of a graph file, room for external data
# A manifest is a few kilobytes (one weight-map line per tensor); this bound only stops a hostile
# file from being read into memory and parsed into Python objects at many times its size.
MAX_MANIFEST_BYTES = 16 << 20
# Input/output dtypes a manifest may declare (what the exporters and runners handle).
WEIGHTLESS_BYTES = 1 << 16  # initializers above this size are checked by type and shape only
# Packed types whose elements are narrower than a byte (numpy's stand-in dtype is wider).
_SUB_BYTE_TYPES = {getattr(onnx.TensorProto, name): bits for name, bits in
                   (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)) if hasattr(onnx.TensorProto, name)}
SPEC_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")


class CorruptModelError(ModelFileError):
    """An ONNX file that does not parse, or parses into something the ONNX checker rejects."""


class HashMismatchError(ModelFileError):
    """A file whose sha256 differs from the one its manifest records."""


class ExternalDataError(ModelFileError):
    """An external-data reference that is absolute, climbs out of the model directory or is missing."""


class UnsupportedOpsetError(ModelFileError):
    """An IR version, operator-set domain or domain version this toolkit does not know."""


class ModelTooLargeError(ModelFileError):
    """A model (graph file plus its external data) above the configured size limit."""


def max_model_bytes(override: int | None = None) -> int:
    """The size limit: `override` if given, else $TOOLKIT_MAX_MODEL_BYTES, else 4 GiB."""
    if override is not None:
        value, source = override, "max_bytes"
    else:
        raw = os.environ.get(MAX_MODEL_BYTES_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_MAX_MODEL_BYTES
        source = f"${MAX_MODEL_BYTES_ENV}"
        try:
            value = int(raw.strip())
        except ValueError:
            raise ConfigError(f"{source}={raw!r}: expected a positive number of bytes, e.g. {DEFAULT_MAX_MODEL_BYTES}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}={value!r}: expected a positive number of bytes")
    return value


def _check_size(path: Path, size: int, limit: int, what: str = "model") -> None:
    if size > limit:
        raise ModelTooLargeError(
            f"{path}: {what} is {size:,} bytes, above the limit of {limit:,}; "
            f"raise it with ${MAX_MODEL_BYTES_ENV} or max_bytes= if you trust this file"
        )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def array_digest(array) -> tuple:
    """(dtype, shape, sha256 of the C-order bytes): finds a tensor by its value without holding a second copy."""
    import numpy as np

    data = np.ascontiguousarray(array)
    # hashlib reads a contiguous array's buffer in place (no copy); object arrays have no such buffer.
    return array.dtype.str, array.shape, hashlib.sha256(data.tobytes() if data.dtype.hasobject else data).digest()


def serialize_model(model: onnx.ModelProto) -> bytearray:
    """The bytes of model.SerializeToString(), assembled from parts into one buffer.

    protobuf (upb) serialises a model holding hundreds of MB of initializers in seconds, several
    times slower than the same bytes serialised one initializer at a time. Fields go out in
    field-number order, as protobuf writes them, so the bytes are the same (unknown fields of the
    model and graph messages themselves, which no export of ours carries, would be left out).
    """
    graph_field = model.DESCRIPTOR.fields_by_name["graph"]
    init_field = model.graph.DESCRIPTOR.fields_by_name["initializer"]
    head, tail = onnx.ModelProto(), onnx.ModelProto()
    for field, value in model.ListFields():
        if field is not graph_field:
            _copy_field(head if field.number < graph_field.number else tail, field, value)
    graph_head, graph_tail = onnx.GraphProto(), onnx.GraphProto()
    for field, value in model.graph.ListFields():
        if field is not init_field:
            _copy_field(graph_head if field.number < init_field.number else graph_tail, field, value)
    out = bytearray(head.SerializeToString())
    if model.HasField("graph"):
        # The graph's length prefix comes first: sum the initializers' sizes without serialising them.
        sizes = [tensor.ByteSize() for tensor in model.graph.initializer]
        init_tag = _varint(init_field.number << 3 | 2)  # wire type 2: length-delimited
        graph_head_bytes, graph_tail_bytes = graph_head.SerializeToString(), graph_tail.SerializeToString()
        graph_size = len(graph_head_bytes) + len(graph_tail_bytes) + sum(
            len(init_tag) + len(_varint(size)) + size for size in sizes)
        out += _varint(graph_field.number << 3 | 2) + _varint(graph_size) + graph_head_bytes
        for tensor, size in zip(model.graph.initializer, sizes):
            # One initializer at a time (a few MB), appended to the one buffer (grown in place).
            out += init_tag + _varint(size)
            out += tensor.SerializeToString()
        out += graph_tail_bytes
    out += tail.SerializeToString()
    return out


def _copy_field(target, field, value) -> None:
    # protobuf 7 dropped FieldDescriptor.label; older releases may lack is_repeated.
    if field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED:
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class GraphArtifact:
    """One ONNX graph of an artifact and its manifest entry."""

    name: str
    model_path: Path
    entry: dict

    @property
    def input_specs(self) -> list[dict]:
        return self.entry["inputs"]

    @property
    def output_names(self) -> list[str]:
        return [o["name"] for o in self.entry["outputs"]]

    @property
    def weights(self) -> dict:
        return self.entry["weights"]


@dataclass
class Artifact:
    """A loaded, hash-verified artifact: where it is, its manifest, and its graphs in order."""

    directory: Path | None
    manifest: dict
    graphs: list[GraphArtifact]

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def variant(self) -> str:
        return self.manifest["variant"]

    def config(self):
        from models.registry import get_family

        try:
            return get_family(self.family).config_from_dict(self.manifest["config"])
        except ConfigError as exc:
            raise ModelFileError(f"{self.location}: the manifest's config is invalid ({exc}); re-export") from None
        except TypeError as exc:  # the dataclass constructor's own complaints, e.g. a missing required field
            raise ModelFileError(f"{self.location}: the manifest's config is invalid ({exc}); re-export") from None

    def graph(self, name: str | None = None) -> GraphArtifact:
        """The named graph; without a name, the only graph of a single-graph artifact."""
        if name is None:
            if len(self.graphs) != 1:
                raise ModelFileError(
                    f"{self.location}: has graphs {[g.name for g in self.graphs]}; name the one you mean"
                )
            return self.graphs[0]
        for graph in self.graphs:
            if graph.name == name:
                return graph
        raise ModelFileError(f"{self.location}: no graph {name!r}; graphs are {[g.name for g in self.graphs]}")

    @property
    def location(self) -> str:
        return str(self.directory if self.directory is not None else self.graphs[0].model_path)

    # Single-graph conveniences.
    @property
    def model_path(self) -> Path:
        return self.graph().model_path

    @property
    def input_specs(self) -> list[dict]:
        return self.graph().input_specs

    @property
    def output_names(self) -> list[str]:
        return [name for graph in self.graphs for name in graph.output_names]


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


def write_artifact(out_dir: Path, files: dict[str, bytes], *, verify=None) -> None:
    """Write files into out_dir all-or-nothing.

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
            for name, data in files.items():
                if Path(name).name != name or name in (".", ".."):
                    raise ModelFileError(f"artifact file name {name!r} must be a plain file name")
                with open(tmp / name, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
            if verify is not None:
                verify(tmp)
            swap_in(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def write_and_load(out_dir: Path, files: dict[str, bytes]) -> Artifact:
    """write_artifact verified by load_artifact (every check, hashes included) on the temporary
    directory; returns that artifact at out_dir. The swap renames the very files that were loaded,
    so they are not read and checked a second time."""
    loaded = []
    write_artifact(out_dir, files, verify=lambda tmp: loaded.append(load_artifact(tmp)))
    (artifact,) = loaded
    directory = Path(out_dir)
    graphs = [GraphArtifact(g.name, directory / g.entry["file"], g.entry) for g in artifact.graphs]
    return Artifact(directory=directory, manifest=artifact.manifest, graphs=graphs)


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


def load_artifact(path: str | os.PathLike, *, max_bytes: int | None = None) -> Artifact:
    """Load an artifact directory (manifest + graphs, hashes checked) or a lone single-graph .onnx file.

    Every graph file is size-checked, hash-checked and validated (validate_onnx) here, so a runtime
    that later opens `model_path` only ever sees a file that passed. max_bytes overrides
    $TOOLKIT_MAX_MODEL_BYTES.
    """
    limit = max_model_bytes(max_bytes)
    path = Path(path)
    if not path.exists():
        aside = sorted(path.parent.glob(f".{glob_escape(path.name)}.old-*")) if path.name else []
        if aside:
            raise ModelFileError(f"{path}: missing; an interrupted write left the previous artifact at {aside[-1]}; "
                                 "the next export to this path restores it (or rename it back)")
        raise ModelFileError(f"{path}: no such file or directory; pass an artifact directory from `toolkit export`")
    if not path.is_dir():
        return _load_lone_onnx(path, limit)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ModelFileError(f"{path}: missing {MANIFEST_FILE}; is this a `toolkit export` directory?")
    _check_inside(manifest_path, path)
    manifest_size = manifest_path.stat().st_size
    if manifest_size > MAX_MANIFEST_BYTES:
        raise ModelFileError(f"{manifest_path}: {manifest_size:,} bytes, above the {MAX_MANIFEST_BYTES:,} a manifest "
                             "may have; this is not a manifest `toolkit export` wrote")
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ModelFileError(f"{manifest_path}: not valid JSON ({reason}); re-run `toolkit export`") from None
    _check_manifest(manifest, manifest_path)
    graphs = []
    for entry in manifest["graphs"]:
        model_path = path / entry["file"]
        if not model_path.is_file():
            raise ModelFileError(f"{path}: missing {entry['file']}; re-run `toolkit export`")
        _check_inside(model_path, path)
        _check_size(model_path, model_path.stat().st_size, limit)
        # The hash is checked on the bytes validate_onnx reads, before it parses them (one read, not two).
        validate_onnx(model_path, max_bytes=limit, sha256=entry["sha256"])
        graphs.append(GraphArtifact(entry["name"], model_path, entry))
    for name, digest in manifest["extra_files"].items():
        extra = path / name
        if not extra.is_file():
            raise ModelFileError(f"{extra}: missing (the manifest lists it); re-export")
        _check_inside(extra, path)
        _check_size(extra, extra.stat().st_size, limit, "file")
        _check_hash(extra, digest, "re-export")
    artifact = Artifact(directory=path, manifest=manifest, graphs=graphs)
    artifact.config()  # a manifest config the family refuses is refused here, not in a runner
    return artifact


def _load_lone_onnx(path: Path, limit: int) -> Artifact:
    model = validate_onnx(path, max_bytes=limit)
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ModelFileError(f"{path}: ONNX file has no {METADATA_KEY} metadata; it was not written by `toolkit export`")
    try:
        manifest = json.loads(props[METADATA_KEY])
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ModelFileError(f"{path}: embedded manifest is not valid JSON ({exc})") from None
    _check_manifest(manifest, path, needs_hash=False)
    if len(manifest["graphs"]) != 1:
        raise ModelFileError(
            f"{path}: is the {manifest.get('graph')!r} graph of a {len(manifest['graphs'])}-graph artifact; "
            "pass the artifact directory instead"
        )
    entry = manifest["graphs"][0]
    artifact = Artifact(directory=None, manifest=manifest, graphs=[GraphArtifact(entry["name"], path, entry)])
    artifact.config()
    return artifact


def _check_hash(path: Path, expected: str, advice: str, data: bytes | None = None) -> None:
    actual = sha256_file(path) if data is None else sha256_bytes(data)
    if actual != expected:
        raise HashMismatchError(
            f"{path}: sha256 {actual[:12]}… does not match the manifest's {expected[:12]}…; {advice}"
        )


def _check_inside(path: Path, directory: Path) -> None:
    """Refuse a file that is (or, through symlinks, resolves to) something outside `directory`."""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(directory))
    if real != root and root not in real.parents:
        raise ExternalDataError(f"{path}: resolves to {real}, outside {root}; refusing to read it")


def load_onnx(path: Path, *, max_bytes: int | None = None):
    """Read and validate an ONNX file (validate_onnx), then attach its external data, if any."""
    model = validate_onnx(path, max_bytes=max_bytes)
    if any(_is_external(t) for t in _all_tensors(model)):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, str(Path(path).parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ExternalDataError(f"{path}: cannot read its external data ({exc})") from None
    return model


def validate_onnx(path: Path, *, max_bytes: int | None = None, sha256: str | None = None):
    """The checks every ONNX file passes before a runtime sees it; returns the parsed model without its
    external data. Order: size (from stat), the sha256 of the bytes read (when the manifest gives
    one), parse, IR version and opsets, external-data locations (and their sizes), the ONNX checker.
    """
    from google.protobuf.message import DecodeError

    limit = max_model_bytes(max_bytes)
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            _check_size(path, size, limit)
            data = handle.read(size + 1)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model ({exc.strerror or exc})") from None
    if sha256 is not None:
        _check_hash(path, sha256, "the model was modified or corrupted, re-run `toolkit export`", data)
    try:
        model = onnx.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CorruptModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc}); re-export it") from None
    del data
    try:
        _decode_strings(model)
    except UnicodeDecodeError as exc:
        raise CorruptModelError(f"{path}: not a readable ONNX model (a text field is not UTF-8: {exc.reason}); "
                                "re-export it") from None
    except _NotText as exc:
        raise CorruptModelError(f"{path}: not a readable ONNX model (text field {exc} is not UTF-8); "
                                "re-export it") from None
    if not model.HasField("graph") or model.ir_version < 1:
        raise CorruptModelError(f"{path}: not a readable ONNX model (no graph or no IR version: truncated or not "
                                "an ONNX file); re-export it")
    _check_opsets(model, path)
    external = _check_external_data(model, path)
    _check_size(path, size + external, limit, "model with its external data")
    raw_sizes = _check_initializer_sizes(model, path)
    try:
        # With external data the checker must know the model's directory to find (and confine) the files.
        onnx.checker.check_model(str(path) if external else weightless(model, raw_sizes=raw_sizes))
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptModelError(f"{path}: not a readable ONNX model (the ONNX checker says: {first}); "
                                "re-export it") from None
    return model


def weightless(model: onnx.ModelProto, threshold: int | None = None, raw_sizes: list[int] | None = None) -> onnx.ModelProto:
    """A copy of `model` whose initializers over `threshold` bytes are graph inputs of the same type and shape.

    The ONNX checker and shape inference serialise the model they are given, which for a real
    checkpoint is hundreds of MB each time; neither reads weight values, only small shape constants,
    which stay initializers. (_check_initializer_sizes covers what the checker would see of the data.)
    raw_sizes: len(raw_data) of each initializer, in order, when known (reading it from a parsed
    model copies the bytes).
    """
    threshold = WEIGHTLESS_BYTES if threshold is None else threshold
    skeleton = onnx.ModelProto()
    for name in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(skeleton, name, getattr(model, name))
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    skeleton.metadata_props.extend(model.metadata_props)
    graph = skeleton.graph
    graph.name = model.graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(model.graph, field))
    if raw_sizes is None:
        raw_sizes = [len(tensor.raw_data) for tensor in model.graph.initializer]
    for tensor, raw_size in zip(model.graph.initializer, raw_sizes, strict=True):
        if raw_size > threshold:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
        else:
            graph.initializer.append(tensor)
    return skeleton


def _check_initializer_sizes(model: onnx.ModelProto, path: Path) -> list[int]:
    """Raw initializer bytes must be exactly what their dims and dtype say (a header lie otherwise).
    Returns len(raw_data) of each initializer, in order."""
    raw_sizes = []
    for tensor in model.graph.initializer:
        raw_size = len(tensor.raw_data)
        raw_sizes.append(raw_size)
        if not raw_size or tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            continue
        try:
            bits = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize * 8
        except (KeyError, TypeError, ValueError):
            continue  # the checker judges dtypes
        if tensor.data_type in _SUB_BYTE_TYPES:
            bits = _SUB_BYTE_TYPES[tensor.data_type]
        count = 1
        for dim in tensor.dims:
            if dim < 0:
                raise CorruptModelError(f"{path}: initializer {tensor.name!r} has a negative dimension {dim}; "
                                        "re-export it")
            count *= dim
        expected = (count * bits + 7) // 8
        if raw_size != expected:
            raise CorruptModelError(
                f"{path}: initializer {tensor.name!r} holds {raw_size} bytes, its shape "
                f"{list(tensor.dims)} and dtype need {expected}; re-export it")
    return raw_sizes


class _NotText(ValueError):
    pass


def _decode_strings(message) -> None:
    """Touch every string field once: protobuf decodes UTF-8 lazily (and may hand proto2 strings back
    as bytes), so an invalid one would otherwise surface wherever a name is first read (a runner, a
    report). Bytes fields (raw tensor data) and numeric arrays are not walked."""
    for field, value in _set_fields(message):
        # protobuf 7 dropped FieldDescriptor.label; older releases may lack is_repeated.
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if field.type == field.TYPE_MESSAGE:
            for item in (value if repeated else (value,)):
                _decode_strings(item)
        elif field.type == field.TYPE_STRING:
            if not all(isinstance(v, str) for v in (value if repeated else (value,))):
                raise _NotText(field.full_name)


_TENSOR_TEXT_FIELDS = [f for f in onnx.TensorProto.DESCRIPTOR.fields if f.type in (f.TYPE_STRING, f.TYPE_MESSAGE)]


def _set_fields(message):
    """message.ListFields(), except that a tensor's numeric and bytes fields are left out unread:
    ListFields() would copy every initializer's bytes out of a parsed model (hundreds of MB).
    A tensor's unset text fields read as their defaults ("" and empty messages), which pass."""
    if not isinstance(message, onnx.TensorProto):
        return message.ListFields()
    return [(field, getattr(message, field.name)) for field in _TENSOR_TEXT_FIELDS]


def _check_opsets(model, path: Path) -> None:
    if model.ir_version > onnx.IR_VERSION:
        raise UnsupportedOpsetError(f"{path}: ONNX IR version {model.ir_version} is newer than this toolkit's "
                                    f"onnx reads ({onnx.IR_VERSION}); upgrade onnx or re-export")
    imports = [("model", o) for o in model.opset_import]
    imports += [(f"function {f.domain}::{f.name}", o) for f in model.functions for o in f.opset_import]
    for owner, opset in imports:
        known = ALLOWED_OPSETS.get(opset.domain)
        if known is None:
            raise UnsupportedOpsetError(
                f"{path}: {owner} imports operator domain {opset.domain!r} (version {opset.version}), which this "
                f"toolkit does not know; known domains: {_known_opsets()}"
            )
        if not 1 <= opset.version <= known:
            raise UnsupportedOpsetError(
                f"{path}: {owner} imports {opset.domain or 'the default domain'!s} version {opset.version}; "
                f"this toolkit reads versions 1..{known}; known: {_known_opsets()}"
            )


def _known_opsets() -> str:
    return ", ".join(f"{domain or 'default'}<={version}" for domain, version in ALLOWED_OPSETS.items())


def _all_tensors(model):
    """Every TensorProto of the model: initializers, sparse initializers and attributes, in the main
    graph, its subgraphs and the model-local functions."""

    def from_graph(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from from_nodes(graph.node)

    def from_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                for sparse in attr.sparse_tensors:
                    yield sparse.values
                    yield sparse.indices
                if attr.HasField("g"):
                    yield from from_graph(attr.g)
                for sub in attr.graphs:
                    yield from from_graph(sub)

    yield from from_graph(model.graph)
    for function in model.functions:
        yield from from_nodes(function.node)


def _is_external(tensor) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _check_external_data(model, path: Path) -> int:
    """Refuse external-data references that could read outside the model's directory; return their total size."""
    root = Path(os.path.realpath(path.parent))
    sizes: dict[Path, int] = {}
    for tensor in _all_tensors(model):
        if not _is_external(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        where = f"{path}: tensor {tensor.name!r} external data location {location!r}"
        if not location or "\0" in location:
            raise ExternalDataError(f"{where}: empty or invalid; re-export the model")
        pure = Path(location)
        if pure.is_absolute() or location.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", location):
            raise ExternalDataError(f"{where} is an absolute path; external data must sit in the model's directory")
        if ".." in re.split(r"[\\/]", location):
            raise ExternalDataError(f"{where} climbs out with '..'; external data must sit in the model's directory")
        real = Path(os.path.realpath(root / location))
        if root not in real.parents:
            raise ExternalDataError(f"{where} resolves to {real}, outside {root} (a symlink?); refusing to read it")
        if not real.is_file():
            raise ExternalDataError(f"{where}: no such file next to the model")
        size = sizes.setdefault(real, real.stat().st_size)
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", size))
        except ValueError:
            raise ExternalDataError(f"{where}: offset/length are not integers") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise ExternalDataError(f"{where}: bytes [{offset}, {offset + length}) lie outside the {size}-byte file")
    return sum(sizes.values())


def _is_hex_digest(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _check_manifest(manifest, where, needs_hash: bool = True) -> None:
    """The manifest's schema, every field the loaders and runners read, with its type."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelFileError(f"{where}: not a toolkit manifest (expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION or isinstance(manifest.get("format_version"), bool):
        raise ModelFileError(
            f"{where}: manifest format_version {manifest.get('format_version')!r} is not supported "
            f"(this toolkit reads {FORMAT_VERSION}); re-export with this version"
        )
    for key in ("family", "variant", "config", "graphs"):
        if key not in manifest:
            raise ModelFileError(f"{where}: manifest lacks the {key!r} field; re-run `toolkit export`")
    for key, kind in (("family", str), ("variant", str), ("config", dict)):
        if not isinstance(manifest[key], kind):
            raise ModelFileError(f"{where}: manifest {key!r} must be a {kind.__name__}, got {manifest[key]!r:.60}")
    extra = manifest.setdefault("extra_files", {}) if manifest.get("extra_files") is None else manifest["extra_files"]
    if not isinstance(extra, dict) or not all(
        isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") and _is_hex_digest(d)
        for n, d in extra.items()
    ):
        raise ModelFileError(f"{where}: manifest 'extra_files' must map plain file names to sha256 hex digests")
    graph_keys = ["name", "file", "inputs", "outputs", "weights"] + (["sha256"] if needs_hash else [])
    if not isinstance(manifest["graphs"], list) or not manifest["graphs"]:
        raise ModelFileError(f"{where}: manifest 'graphs' must be a non-empty list; re-run `toolkit export`")
    for entry in manifest["graphs"]:
        missing = [k for k in graph_keys if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ModelFileError(f"{where}: a graph entry lacks {missing}; re-run `toolkit export`")
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise ModelFileError(f"{where}: a graph 'name' must be a non-empty string, got {name!r:.60}")
        file = entry["file"]
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise ModelFileError(f"{where}: graph file {file!r:.80} must be a plain file name")
        if needs_hash and not _is_hex_digest(entry["sha256"]):
            raise ModelFileError(
                f"{where}: graph {name!r} sha256 must be 64 hex digits, got {entry['sha256']!r:.80}"
            )
        if not isinstance(entry["weights"], dict):
            raise ModelFileError(f"{where}: graph {name!r} 'weights' must be an object")
        outputs = entry["outputs"]
        if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                    for o in outputs):
            raise ModelFileError(f"{where}: graph {name!r} 'outputs' must be a list of {{\"name\": ...}} objects")
        inputs = entry["inputs"]
        if not isinstance(inputs, list):
            raise ModelFileError(f"{where}: graph {name!r} 'inputs' must be a list of input specs")
        for spec in inputs:
            _check_input_spec(spec, f"{where}: graph {name!r}")


def _check_input_spec(spec, where: str) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ModelFileError(f"{where}: an input spec must be an object with a 'name', got {spec!r:.80}")
    if spec.get("dtype") not in SPEC_DTYPES:
        raise ModelFileError(f"{where}: input {spec['name']!r} dtype {spec.get('dtype')!r:.40} is not one of "
                             f"{', '.join(SPEC_DTYPES)}")
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(
        (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d) for d in shape
    ):
        raise ModelFileError(f"{where}: input {spec['name']!r} shape must be a list of sizes and axis names, "
                             f"got {shape!r:.80}")
