"""Artifact directories: ONNX graph files + `manifest.json`, written atomically, loaded defensively.

Single-graph families write `model.onnx`; the encoder-decoder writes
`encoder.onnx` and `decoder.onnx`. The manifest is also embedded in each ONNX
file's metadata_props (without the file hashes, which cannot hash themselves),
so a lone single-graph .onnx is self-describing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ModelFileError

MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
FORMAT = "onnx-toolkit-artifact"
FORMAT_VERSION = 1
METADATA_KEY = "onnx_toolkit.manifest"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

        return get_family(self.family).config_from_dict(self.manifest["config"])

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

    Everything goes into a sibling temporary directory first; `verify(tmp_dir)`
    may inspect it; only then is it swapped in. A failure at any point leaves
    an existing artifact at out_dir untouched. A non-empty directory that is
    not an artifact is never replaced.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    try:
        for name, data in files.items():
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


def swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` with the finished directory `tmp` (same parent); on failure `target` is restored."""
    if target.exists():
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


def load_artifact(path: str | os.PathLike) -> Artifact:
    """Load an artifact directory (manifest + graphs, hashes checked) or a lone single-graph .onnx file."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory; pass an artifact directory from `toolkit export`")
    if path.is_dir():
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise ModelFileError(f"{path}: missing {MANIFEST_FILE}; is this a `toolkit export` directory?")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"{manifest_path}: not valid JSON ({exc}); re-run `toolkit export`") from None
        _check_manifest(manifest, manifest_path)
        graphs = []
        for entry in manifest["graphs"]:
            model_path = path / entry["file"]
            if Path(entry["file"]).name != entry["file"]:
                raise ModelFileError(f"{manifest_path}: graph file {entry['file']!r} must be a plain file name")
            if not model_path.is_file():
                raise ModelFileError(f"{path}: missing {entry['file']}; re-run `toolkit export`")
            actual = sha256_file(model_path)
            if actual != entry["sha256"]:
                raise ModelFileError(
                    f"{model_path}: sha256 {actual[:12]}… does not match the manifest's {entry['sha256'][:12]}…; "
                    "the model was modified or corrupted, re-run `toolkit export`"
                )
            graphs.append(GraphArtifact(entry["name"], model_path, entry))
        for name, digest in (manifest.get("extra_files") or {}).items():
            extra = path / Path(name).name
            if not extra.is_file() or sha256_file(extra) != digest:
                raise ModelFileError(f"{extra}: missing or modified (sha256 differs from the manifest); re-export")
        return Artifact(directory=path, manifest=manifest, graphs=graphs)
    model = load_onnx(path)
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ModelFileError(f"{path}: ONNX file has no {METADATA_KEY} metadata; it was not written by `toolkit export`")
    try:
        manifest = json.loads(props[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: embedded manifest is not valid JSON ({exc})") from None
    _check_manifest(manifest, path, needs_hash=False)
    if len(manifest["graphs"]) != 1:
        raise ModelFileError(
            f"{path}: is the {manifest.get('graph')!r} graph of a {len(manifest['graphs'])}-graph artifact; "
            "pass the artifact directory instead"
        )
    entry = manifest["graphs"][0]
    return Artifact(directory=None, manifest=manifest, graphs=[GraphArtifact(entry["name"], path, entry)])


def load_onnx(path: Path):
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(path))
    except (DecodeError, ValueError, OSError, RuntimeError) as exc:
        raise ModelFileError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc}); re-export it") from None


def _check_manifest(manifest, where, needs_hash: bool = True) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelFileError(f"{where}: not a toolkit manifest (expected format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ModelFileError(
            f"{where}: manifest format_version {manifest.get('format_version')!r} is not supported "
            f"(this toolkit reads {FORMAT_VERSION}); re-export with this version"
        )
    for key in ("family", "variant", "config", "graphs"):
        if key not in manifest:
            raise ModelFileError(f"{where}: manifest lacks the {key!r} field; re-run `toolkit export`")
    graph_keys = ["name", "file", "inputs", "outputs", "weights"] + (["sha256"] if needs_hash else [])
    if not isinstance(manifest["graphs"], list) or not manifest["graphs"]:
        raise ModelFileError(f"{where}: manifest 'graphs' must be a non-empty list; re-run `toolkit export`")
    for entry in manifest["graphs"]:
        missing = [k for k in graph_keys if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ModelFileError(f"{where}: a graph entry lacks {missing}; re-run `toolkit export`")
        if needs_hash and not (isinstance(entry["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise ModelFileError(
                f"{where}: graph {entry.get('name')!r} sha256 must be 64 hex digits, got {entry['sha256']!r}"
            )
