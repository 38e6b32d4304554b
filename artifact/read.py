"""Loading artifacts and ONNX files defensively: every file is treated as hostile.

Sizes are checked before anything is read, hashes before anything is parsed, and
the parsed graph (IR version, opsets, external-data locations, the ONNX checker)
before any runtime is handed the file. Each refusal is its own ModelFileError
subclass (artifact.errors).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import onnx

from artifact.errors import (
    ConfigError,
    CorruptModelError,
    ExternalDataError,
    HashMismatchError,
    ModelFileError,
    ModelTooLargeError,
    UnsupportedOpsetError,
)
from artifact.format import (
    CUSTOM_DOMAIN,
    CUSTOM_DOMAIN_VERSION,
    MANIFEST_FILE,
    METADATA_KEY,
    Artifact,
    GraphArtifact,
    parse_manifest,
)
from artifact.hashing import hash_progress, sha256_bytes, sha256_file
from artifact.jsonfile import parse_json, read_json
from artifact.protobuf import Malformed, NotText, all_tensors, decode_strings, is_external, read_skeleton, weightless
from artifact.write import glob_escape, write_artifact

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
# The floor of the default limit, and the limit where the machine does not say how much memory it has: twice the
# 2 GiB protobuf limit of a graph file, room for external data.
DEFAULT_MAX_MODEL_BYTES = 4 << 30
# A manifest is a few kilobytes (one weight-map line per tensor); this bound only stops a hostile
# file from being read into memory and parsed into Python objects at many times its size.
MAX_MANIFEST_BYTES = 16 << 20
# Packed types whose elements are narrower than a byte (numpy's stand-in dtype is wider).
_SUB_BYTE_TYPES = {
    getattr(onnx.TensorProto, name): bits
    for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if hasattr(onnx.TensorProto, name)
}


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where it does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_max_model_bytes() -> int:
    """The default size limit: this machine's memory (a model the machine cannot hold is refused up front, not
    killed halfway), and never below DEFAULT_MAX_MODEL_BYTES."""
    return max(machine_memory() or 0, DEFAULT_MAX_MODEL_BYTES)


def max_model_bytes(override: int | None = None) -> int:
    """The size limit: `override` if given, else $TOOLKIT_MAX_MODEL_BYTES, else default_max_model_bytes()."""
    if override is not None:
        value, source = override, "max_bytes"
    else:
        raw = os.environ.get(MAX_MODEL_BYTES_ENV)
        if raw is None or not raw.strip():
            return default_max_model_bytes()
        source = f"${MAX_MODEL_BYTES_ENV}"
        try:
            value = int(raw.strip())
        except ValueError:
            raise ConfigError(
                f"{source}={raw!r}: expected a positive number of bytes, e.g. {DEFAULT_MAX_MODEL_BYTES}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}={value!r}: expected a positive number of bytes")
    return value


def _check_size(path: Path, size: int, limit: int, what: str = "model") -> None:
    if size > limit:
        memory = machine_memory()
        whose = (
            f" (this machine's memory, {memory / 2**30:.1f} GiB)"
            if memory and limit == default_max_model_bytes() and MAX_MODEL_BYTES_ENV not in os.environ
            else ""
        )
        raise ModelTooLargeError(
            f"{path}: {what} is {size:,} bytes, above the limit of {limit:,}{whose}; "
            f"raise it with ${MAX_MODEL_BYTES_ENV} or max_bytes= if you trust this file"
        )


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
            raise ModelFileError(
                f"{path}: missing; an interrupted write left the previous artifact at {aside[-1]}; "
                "the next export to this path restores it (or rename it back)"
            )
        raise ModelFileError(f"{path}: no such file or directory; pass an artifact directory from `toolkit export`")
    if not path.is_dir():
        return _load_lone_onnx(path, limit)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ModelFileError(f"{path}: missing {MANIFEST_FILE}; is this a `toolkit export` directory?")
    _check_inside(manifest_path, path)
    manifest = read_json(manifest_path, what="manifest", max_bytes=MAX_MANIFEST_BYTES, advice="re-run `toolkit export`")
    typed = parse_manifest(manifest, manifest_path)
    graphs = []
    for entry in typed.graphs:
        model_path = path / entry.file
        if not model_path.is_file():
            raise ModelFileError(f"{path}: missing {entry.file}; re-run `toolkit export`")
        _check_inside(model_path, path)
        _check_size(model_path, model_path.stat().st_size, limit)
        for name, digest in entry.external_data.items():
            data_path = path / name
            if not data_path.is_file():
                raise ModelFileError(f"{data_path}: missing (graph {entry.name!r} keeps its weights there); re-export")
            _check_inside(data_path, path)
            _check_size(data_path, data_path.stat().st_size, limit, "external data file")
            _check_hash(data_path, digest, "the weights beside the graph changed or were truncated; re-export")
        # The hash is checked on the bytes validate_onnx reads, before it parses them (one read, not two).
        # The graph is read without its weights: nothing here reads them, and a runner maps or reads them itself.
        model = validate_onnx(model_path, max_bytes=limit, sha256=entry.sha256, weights=False)
        check_graph_matches_entry(model, entry, model_path)
        stray = sorted(external_locations(model) - set(entry.external_data))
        if stray:
            raise ExternalDataError(
                f"{model_path}: reads external data from {stray}, which the manifest does not list (and hash); "
                "re-export"
            )
        graphs.append(GraphArtifact(entry.name, model_path, entry))
    for name, digest in typed.extra_files.items():
        extra = path / name
        if not extra.is_file():
            raise ModelFileError(f"{extra}: missing (the manifest lists it); re-export")
        _check_inside(extra, path)
        _check_size(extra, extra.stat().st_size, limit, "file")
        _check_hash(extra, digest, "re-export")
    return Artifact(directory=path, manifest=typed, graphs=graphs)


def _load_lone_onnx(path: Path, limit: int) -> Artifact:
    model = validate_onnx(path, max_bytes=limit, weights=False)
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ModelFileError(
            f"{path}: ONNX file has no {METADATA_KEY} metadata; it was not written by `toolkit export`"
        )
    manifest = parse_json(props[METADATA_KEY], f"{path}: embedded manifest", advice="re-run `toolkit export`")
    typed = parse_manifest(manifest, f"{path}: embedded manifest", needs_hash=False)
    if len(typed.graphs) != 1:
        raise ModelFileError(
            f"{path}: is the {manifest.get('graph')!r} graph of a {len(manifest['graphs'])}-graph artifact; "
            "pass the artifact directory instead"
        )
    entry = typed.graphs[0]
    check_graph_matches_entry(model, entry, path)
    return Artifact(directory=None, manifest=typed, graphs=[GraphArtifact(entry.name, path, entry)])


def _dtype_name(elem_type: int) -> str | None:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except (KeyError, TypeError, ValueError):
        return None


def check_graph_matches_entry(model, entry, path: Path) -> None:
    """The graph's inputs are the manifest's (names, dtypes, ranks, and every size the graph fixes) and each
    output the manifest lists is the graph's (name, dtype): feeds are checked against the manifest, so a graph
    that disagrees would fail inside a runtime instead."""
    initialized = {t.name for t in model.graph.initializer}
    graph_inputs = {v.name: v for v in model.graph.input if v.name not in initialized}
    declared = {spec.name: spec for spec in entry.inputs}
    where = f"{path}: graph {entry.name!r}"
    for name in graph_inputs.keys() - declared.keys():
        raise ModelFileError(f"{where} has input {name!r}, which the manifest does not list; re-export")
    for name, spec in declared.items():
        value = graph_inputs.get(name)
        if value is None:
            raise ModelFileError(f"{where} has no input {name!r}, which the manifest lists; re-export")
        tensor = value.type.tensor_type
        dtype = _dtype_name(tensor.elem_type) if tensor.elem_type else None
        if dtype is not None and dtype != spec.dtype:
            raise ModelFileError(
                f"{where}: input {name!r} is {dtype} in the graph, {spec.dtype} in the manifest; re-export"
            )
        if not tensor.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if len(dims) != len(spec.shape) or any(
            fixed is not None and fixed != size for fixed, size in zip(dims, spec.shape, strict=False)
        ):
            shown = [d if d is not None else "?" for d in dims]
            raise ModelFileError(
                f"{where}: input {name!r} has shape {shown} in the graph but {list(spec.shape)} in the manifest; "
                "re-export"
            )
    graph_outputs = {v.name: v for v in model.graph.output}
    for spec in entry.outputs:
        value = graph_outputs.get(spec.name)
        if value is None:
            raise ModelFileError(f"{where} has no output {spec.name!r}, which the manifest lists; re-export")
        elem = value.type.tensor_type.elem_type
        dtype = _dtype_name(elem) if elem else None
        if dtype is not None and dtype != spec.dtype:
            raise ModelFileError(
                f"{where}: output {spec.name!r} has dtype {dtype} in the graph, {spec.dtype} in the manifest "
                "(float32 where it names none); re-export"
            )


def _check_hash(path: Path, expected: str, advice: str, data: bytes | None = None, actual: str | None = None) -> None:
    """The file's sha256 (of `data`, its bytes already read, or `actual`, already computed) must be `expected`."""
    if actual is None:
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
    if any(is_external(t) for t in all_tensors(model)):
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, str(Path(path).parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ExternalDataError(f"{path}: cannot read its external data ({exc})") from None
    return model


def validate_onnx(path: Path, *, max_bytes: int | None = None, sha256: str | None = None, weights: bool = True):
    """The checks every ONNX file passes before a runtime sees it; returns the parsed model without its
    external data. Order: size (from stat), the sha256 of the bytes read (when the manifest gives
    one), parse, IR version and opsets, external-data locations (and their sizes), the ONNX checker.

    weights=False: the model is read without the raw_data of its initializers over WEIGHTLESS_BYTES
    (artifact.protobuf.read_skeleton; their lengths are still checked against their shapes), for a caller that
    reads the graph, not the weights: parsing a graph that holds its weights costs two copies of them.
    """
    from google.protobuf.message import DecodeError

    limit = max_model_bytes(max_bytes)
    path = Path(path)
    advice = "the model was modified or corrupted, re-run `toolkit export`"
    left_out: dict[int, int] = {}
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            _check_size(path, size, limit)
            if weights:
                data = handle.read(size + 1)
            else:
                data, left_out = _read_skeleton(path, handle, size, sha256, advice)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model ({exc.strerror or exc})") from None
    if sha256 is not None and weights:
        _check_hash(path, sha256, advice, data)
    try:
        model = onnx.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CorruptModelError(
            f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc}); re-export it"
        ) from None
    del data
    try:
        decode_strings(model)
    except UnicodeDecodeError as exc:
        raise CorruptModelError(
            f"{path}: not a readable ONNX model (a text field is not UTF-8: {exc.reason}); re-export it"
        ) from None
    except NotText as exc:
        raise CorruptModelError(
            f"{path}: not a readable ONNX model (text field {exc} is not UTF-8); re-export it"
        ) from None
    if not model.HasField("graph") or model.ir_version < 1:
        raise CorruptModelError(
            f"{path}: not a readable ONNX model (no graph or no IR version: truncated or not "
            "an ONNX file); re-export it"
        )
    _check_opsets(model, path)
    external = _check_external_data(model, path)
    _check_size(path, size + external, limit, "model with its external data")
    raw_sizes = check_initializer_sizes(model, path, left_out)
    try:
        # With external data the checker must know the model's directory to find (and confine) the files.
        onnx.checker.check_model(str(path) if external else weightless(model, raw_sizes=raw_sizes))
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptModelError(
            f"{path}: not a readable ONNX model (the ONNX checker says: {first}); re-export it"
        ) from None
    return model


def _read_skeleton(path: Path, handle, size: int, sha256: str | None, advice: str) -> tuple[bytes, dict[int, int]]:
    """read_skeleton of the open file, hashed as it is read: a broken framing is reported once the whole file is
    hashed, so a file that is not the one the manifest names gets the hash's error, as a full read would."""
    report = hash_progress(path, size)
    digest = hashlib.sha256()
    try:
        return_value, error = read_skeleton(handle, size, digest, report=report), None
    except Malformed as exc:
        return_value, error = None, exc
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if sha256 is not None:
        _check_hash(path, sha256, advice, actual=digest.hexdigest())
    if error is not None:
        raise CorruptModelError(f"{path}: not a readable ONNX model (Malformed: {error}); re-export it") from None
    return return_value


def check_initializer_sizes(model: onnx.ModelProto, path: Path, left_out: dict[int, int] | None = None) -> list[int]:
    """Raw initializer bytes must be exactly what their dims and dtype say (a header lie otherwise).
    Returns len(raw_data) of each initializer, in order. left_out: {initializer index: raw_data length} of those
    read without it (artifact.protobuf.read_skeleton)."""
    raw_sizes, left_out = [], left_out or {}
    for index, tensor in enumerate(model.graph.initializer):
        raw_size = left_out[index] if index in left_out else len(tensor.raw_data)
        raw_sizes.append(raw_size)
        if not raw_size:
            continue
        expected = tensor_bytes(tensor, path)
        if expected is not None and raw_size != expected:
            raise CorruptModelError(
                f"{path}: initializer {tensor.name!r} holds {raw_size} bytes, its shape "
                f"{list(tensor.dims)} and dtype need {expected}; re-export it"
            )
    return raw_sizes


def tensor_bytes(tensor, path: Path) -> int | None:
    """The bytes a tensor's dims and dtype need (None for strings and dtypes the checker judges)."""
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        bits = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize * 8
    except (KeyError, TypeError, ValueError):
        return None
    bits = _SUB_BYTE_TYPES.get(tensor.data_type, bits)
    count = 1
    for dim in tensor.dims:
        if dim < 0:
            raise CorruptModelError(f"{path}: tensor {tensor.name!r} has a negative dimension {dim}; re-export it")
        count *= dim
    return (count * bits + 7) // 8


def _check_opsets(model, path: Path) -> None:
    if model.ir_version > onnx.IR_VERSION:
        raise UnsupportedOpsetError(
            f"{path}: ONNX IR version {model.ir_version} is newer than this toolkit's "
            f"onnx reads ({onnx.IR_VERSION}); upgrade onnx or re-export"
        )
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


def external_locations(model) -> set[str]:
    """The external data files a model's tensors name."""
    return {
        entry.value
        for tensor in all_tensors(model)
        if is_external(tensor)
        for entry in tensor.external_data
        if entry.key == "location"
    }


def _check_external_data(model, path: Path) -> int:
    """Refuse external-data references that could read outside the model's directory; return their total size."""
    root = Path(os.path.realpath(path.parent))
    sizes: dict[Path, int] = {}
    for tensor in all_tensors(model):
        if not is_external(tensor):
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
        offset_text, length_text = info.get("offset", "0"), info.get("length")
        if not re.fullmatch(r"\d{1,20}", offset_text) or not re.fullmatch(r"\d{1,20}", length_text or "0"):
            raise ExternalDataError(
                f"{where}: offset/length are not integers of at most 20 digits; re-export the model"
            )
        offset = int(offset_text)
        length = size - offset if length_text is None else int(length_text)
        if offset < 0 or length < 0 or offset + length > size:
            raise ExternalDataError(f"{where}: bytes [{offset}, {offset + length}) lie outside the {size}-byte file")
        expected = tensor_bytes(tensor, path)
        if expected is not None and length != expected:
            raise CorruptModelError(
                f"{where}: length {length} bytes, but its shape {list(tensor.dims)} and dtype need {expected}; "
                "re-export the model"
            )
    return sum(sizes.values())


def write_and_load(out_dir: Path, files: dict[str, bytes]) -> Artifact:
    """write_artifact verified by load_artifact (every check, hashes included) on the temporary
    directory; returns that artifact at out_dir. The swap renames the very files that were loaded,
    so they are not read and checked a second time. `files` is consumed: each file's bytes are let go
    once on disk, before the verification reads them back."""
    loaded = []
    write_artifact(out_dir, files, verify=lambda tmp: loaded.append(load_artifact(tmp)), consume=True)
    (artifact,) = loaded
    directory = Path(out_dir)
    graphs = [GraphArtifact(g.name, directory / g.entry.file, g.entry) for g in artifact.graphs]
    return Artifact(directory=directory, manifest=artifact.manifest, graphs=graphs)
