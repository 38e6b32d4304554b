"""Artifact directories: `model.onnx` + `manifest.json`, written atomically, loaded defensively.

The manifest is also embedded in the ONNX file's metadata_props (without the
file hash, which cannot hash itself), so a lone .onnx is self-describing.
"""

from __future__ import annotations

import hashlib
import json
import os
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
class Artifact:
    """A loaded, hash-verified artifact: where it is and what its manifest says."""

    directory: Path | None
    model_path: Path
    manifest: dict

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def variant(self) -> str:
        return self.manifest["variant"]

    @property
    def output_names(self) -> list[str]:
        return [o["name"] for o in self.manifest["outputs"]]

    @property
    def input_specs(self) -> list[dict]:
        return self.manifest["inputs"]

    def config(self):
        from models.registry import get_family

        return get_family(self.family).config_from_dict(self.manifest["config"])


def is_artifact_dir(path: Path) -> bool:
    return (path / MANIFEST_FILE).is_file()


def write_artifact(out_dir: Path, files: dict[str, bytes], *, verify=None) -> None:
    """Write files into out_dir all-or-nothing.

    Everything goes into a sibling temporary directory first; `verify(tmp_dir)`
    may inspect it; only then is it swapped in. A failure at any point leaves
    an existing artifact at out_dir untouched. A non-empty directory that is
    not an artifact is never replaced.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelFileError(f"output path {out_dir} exists and is not a directory; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_artifact_dir(out_dir):
        raise ModelFileError(
            f"output directory {out_dir} is not empty and holds no {MANIFEST_FILE}; "
            "refusing to overwrite it, choose an empty or new --out"
        )
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
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.rmdir(old)
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except BaseException:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_artifact(path: str | os.PathLike) -> Artifact:
    """Load an artifact directory (manifest + model, hash checked) or a lone .onnx file."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory; pass an artifact directory from `toolkit export`")
    if path.is_dir():
        manifest_path, model_path = path / MANIFEST_FILE, path / MODEL_FILE
        if not manifest_path.is_file():
            raise ModelFileError(f"{path}: missing {MANIFEST_FILE}; is this a `toolkit export` directory?")
        if not model_path.is_file():
            raise ModelFileError(f"{path}: missing {MODEL_FILE}; re-run `toolkit export`")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"{manifest_path}: not valid JSON ({exc}); re-run `toolkit export`") from None
        _check_manifest(manifest, manifest_path)
        actual = sha256_file(model_path)
        if actual != manifest["model_sha256"]:
            raise ModelFileError(
                f"{model_path}: sha256 {actual[:12]}… does not match the manifest's "
                f"{manifest['model_sha256'][:12]}…; the model was modified or corrupted, re-run `toolkit export`"
            )
        return Artifact(directory=path, model_path=model_path, manifest=manifest)
    model = load_onnx(path)
    props = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in props:
        raise ModelFileError(f"{path}: ONNX file has no {METADATA_KEY} metadata; it was not written by `toolkit export`")
    try:
        manifest = json.loads(props[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: embedded manifest is not valid JSON ({exc})") from None
    _check_manifest(manifest, path, needs_hash=False)
    return Artifact(directory=None, model_path=path, manifest=manifest)


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
    required = ["family", "variant", "config", "inputs", "outputs", "weights"]
    if needs_hash:
        required.append("model_sha256")
    for key in required:
        if key not in manifest:
            raise ModelFileError(f"{where}: manifest lacks the {key!r} field; re-run `toolkit export`")
