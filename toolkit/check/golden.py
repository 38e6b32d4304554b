"""Golden outputs: a check's inputs and every stage output, stored so later checks can be held to them.

`toolkit check` judges today's backends against today's float64 oracle. That
cannot see a change that moves every backend and the oracle together (a
torch/onnx/onnxruntime upgrade, a changed export or model formula in a pull
request). A golden directory freezes one known-good check:

    golden.json         index: format, versions that produced it, the artifact's preset and graph
                        hashes, the stages, and per array its dtype, shape and sha256
    inputs.npz          the check's inputs (reused by `--golden`, so both runs see identical feeds)
    reference.npz       the float64 oracle's output for every stage
    backend.NAME.npz    each backend's outputs (kept for inspection and plots)
    oracle.transformers.npz   with --oracle: the original checkpoint's outputs (transformers, float32) under our
                        stage names, so a later `--golden` check, even where transformers is not installed, still
                        holds the artifact's float64 rebuild to the original

`--golden DIR` compares today's oracle with the stored one (float64 tolerances: only a real change
of the computation moves a float64 result) and every backend with the stored oracle (the usual
calibrated float32 tolerances). The directory is written in one atomic swap.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from artifact import sha256_bytes, sha256_file, write_artifact
from artifact.errors import InputError, ModelFileError
from artifact.jsonfile import read_json
from artifact.npz import read_npz
from artifact.read import max_model_bytes
from artifact.typed import Strict, parse_typed
from artifact.write import write_staged
from models.artifacts import artifact_config
from runners.base import check_feed
from runners.compare import ToleranceConfig, compare

INDEX_FILE = "golden.json"
FORMAT = "onnx-toolkit-golden"
FORMAT_VERSION = 1
ORACLE = "eager-f64"
# The original checkpoint's outputs, by oracle (toolkit.check.oracle, toolkit.check.llamacpp).
ORIGINAL_GROUPS = {"transformers": "oracle.transformers", "llama.cpp": "oracle.llama_cpp"}


class GoldenError(ModelFileError):
    """A golden directory is missing, corrupt, modified or does not fit the artifact."""


RECREATE = "re-create it with --save-golden"
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ArrayEntry(Strict):
    dtype: str
    shape: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=16)]
    sha256: Digest


class GroupEntry(Strict):
    file: str
    sha256: Digest
    arrays: dict[str, ArrayEntry] = {}


class GoldenIndex(Strict):
    """golden.json, typed: what load_golden and the comparisons read."""

    format: str
    format_version: int
    stages: list[str]
    groups: dict[str, GroupEntry]
    versions: dict[str, Any]
    artifact: dict[str, Any]
    created: str | None = None
    oracle: dict[str, Any] | None = None


@dataclass
class Golden:
    directory: Path
    index: dict
    inputs: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]
    backends: dict[str, dict[str, np.ndarray]]
    oracle: dict[str, np.ndarray] | None = None  # the original's outputs, when the saving check ran --oracle

    @property
    def stages(self) -> list[str]:
        return list(self.index["stages"])


def current_versions() -> dict[str, str]:
    import onnx
    import torch

    import toolkit

    versions = {
        "toolkit": toolkit.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    for module in ("onnxruntime", "onnxscript"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = "not installed"
    return versions


def _array_entry(array: np.ndarray) -> dict:
    array = np.ascontiguousarray(array)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "sha256": sha256_bytes(array.tobytes())}


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.ascontiguousarray(a) for name, a in arrays.items()})
    return buffer.getvalue()


def _graph_hashes(artifact) -> dict[str, str]:
    return {g.name: g.entry.sha256 or sha256_file(g.model_path) for g in artifact.graphs}


def save_golden(report, artifact, directory: str | os.PathLike) -> Path:
    """Store `report`'s inputs, oracle outputs and backend outputs in `directory`, atomically."""
    directory = Path(directory)
    _refuse_to_replace(directory)
    if not (report.backends and all(b.passed for b in report.backends)) or (
        report.oracle is not None and not report.oracle.passed
    ):
        raise GoldenError(
            "the check failed, so its outputs are not golden; fix the divergence first "
            "(golden outputs are saved only from a passing check)"
        )
    _write_atomically(directory, golden_files(report, artifact))
    return directory


def _refuse_to_replace(directory: Path) -> None:
    """Refuse a file, or a non-empty directory that holds no golden index (it may be anyone's)."""
    if directory.exists() and not directory.is_dir():
        raise GoldenError(f"--save-golden {directory}: exists and is not a directory; choose another path")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / INDEX_FILE).is_file():
        raise GoldenError(
            f"--save-golden {directory}: not empty and holds no {INDEX_FILE}; refusing to replace it, "
            "choose an empty or new directory"
        )


def golden_files(report, artifact) -> dict[str, bytes]:
    """The golden directory's files: one .npz per group (inputs, reference, backend.NAME) and the index."""
    arrays = report.arrays
    groups = {"inputs": arrays["inputs"], "reference": {s: arrays["reference"][s] for s in report.stages}}
    for name, outputs in arrays["outputs"].items():
        groups[f"backend.{name}"] = {s: outputs[s] for s in report.stages if s in outputs}
    if report.oracle is not None:
        groups[ORIGINAL_GROUPS[report.oracle.name]] = dict(arrays["oracle"]["original"])
    files, entries = {}, {}
    for group, values in groups.items():
        data = _npz_bytes(values)
        files[f"{group}.npz"] = data
        entries[group] = {
            "file": f"{group}.npz",
            "sha256": sha256_bytes(data),
            "arrays": {name: _array_entry(a) for name, a in values.items()},
        }
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": current_versions(),
        "artifact": {
            "preset": artifact.manifest.preset,
            "family": artifact.family,
            "variant": artifact.variant,
            "graph_sha256": _graph_hashes(artifact),
            "export_versions": artifact.manifest.versions,
        },
        "reference": ORACLE,
        "input_source": report.input_source,
        "stages": list(report.stages),
        "calibration": report.calibration,
        "backends": [b.name for b in report.backends],
        "groups": entries,
    }
    if report.oracle is not None:
        source = artifact.manifest.source or {}
        index["oracle"] = {
            **{k: v for k, v in report.oracle_info.items() if k != "first_position"},
            "checkpoint_sha256": dict(source.get("sha256") or {}),
        }
    files[INDEX_FILE] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    return files


def _write_atomically(directory: Path, files: dict[str, bytes]) -> None:
    """Write `files` into a new sibling directory with the foundation's writer (each file fsynced, the whole
    read back by load_golden), then swap it in for `directory` in one step.

    write_artifact replaces only an artifact directory (one holding manifest.json), which a golden
    directory is not; so it fills an empty staging directory and the swap into place is done here.
    """
    # what we wrote must read back before it counts
    write_staged(directory, lambda staging: write_artifact(staging, files, verify=load_golden))


def load_golden(directory: str | os.PathLike) -> Golden:
    """Read and verify a golden directory: index, file hashes, and every array's dtype, shape and hash."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if not directory.is_dir():
        raise GoldenError(
            f"--golden {directory}: no such directory; create it with `toolkit check --save-golden {directory}`"
        )
    if not index_path.is_file():
        raise GoldenError(
            f"--golden {directory}: missing {INDEX_FILE}; not a golden directory (create one with "
            "`toolkit check --save-golden DIR`)"
        )
    index = read_json(index_path, error=GoldenError, what="golden index", advice=RECREATE)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise GoldenError(f"{index_path}: not a golden index (expected format {FORMAT!r})")
    if index.get("format_version") != FORMAT_VERSION:
        raise GoldenError(
            f"{index_path}: format_version {index.get('format_version')!r} is not supported "
            f"(this toolkit reads {FORMAT_VERSION}); re-create it with --save-golden"
        )
    for key in ("stages", "groups", "versions", "artifact"):
        if key not in index:
            raise GoldenError(f"{index_path}: lacks the {key!r} field; re-create it with --save-golden")
    groups = index["groups"]
    if not isinstance(groups, dict) or "inputs" not in groups or "reference" not in groups:
        raise GoldenError(f"{index_path}: 'groups' must list 'inputs' and 'reference'; re-create it with --save-golden")
    for group, entry in groups.items():
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, str) or Path(file).name != file:
            raise GoldenError(f"{index_path}: group {group!r} must name a plain file, got {file!r:.80}")
    typed = parse_typed(GoldenIndex, index, index_path, GoldenError, RECREATE)
    loaded = {}
    for group, entry in typed.groups.items():
        path = directory / entry.file
        if not path.is_file():
            raise GoldenError(f"{path}: missing; the golden directory is incomplete, re-create it with --save-golden")
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise GoldenError(
                f"{path}: sha256 {actual[:12]}… does not match the index's "
                f"{entry.sha256[:12]}…; the golden file was modified or corrupted"
            )
        # Each member's header must declare what the index lists before its data is inflated: the file hash
        # above is of the compressed bytes, which a hostile index simply records.
        arrays = read_npz(
            path,
            limit=max_model_bytes(),
            error=GoldenError,
            advice=RECREATE,
            expected={name: (a.dtype, tuple(a.shape)) for name, a in entry.arrays.items()},
        )
        expected = index["groups"][group].get("arrays") or {}
        for name, array in arrays.items():
            if _array_entry(array) != expected[name]:
                raise GoldenError(
                    f"{path}: array {name!r} ({array.dtype.name} {list(array.shape)}) does not match "
                    f"its index entry {expected[name]}"
                )
        loaded[group] = arrays
    missing = [s for s in index["stages"] if s not in loaded["reference"]]
    if missing:
        raise GoldenError(f"{index_path}: stages {missing} have no stored reference output")
    backends = {g.removeprefix("backend."): a for g, a in loaded.items() if g.startswith("backend.")}
    stored = [name for name, group in ORIGINAL_GROUPS.items() if group in loaded]
    if len(stored) > 1:
        raise GoldenError(f"{index_path}: stores the outputs of two oracles ({', '.join(stored)}); one check runs one")
    oracle = loaded.get(ORIGINAL_GROUPS[stored[0]]) if stored else None
    if oracle is not None and (golden_oracle_name(index) != stored[0]):
        raise GoldenError(f"{index_path}: its oracle entry does not name {stored[0]}, whose outputs it stores")
    if oracle is not None and "input_ids" not in loaded["inputs"]:
        raise GoldenError(f"{index_path}: stores the original's outputs but no input_ids to feed them")
    return Golden(directory, index, loaded["inputs"], loaded["reference"], backends, oracle)


def check_inputs_fit(golden: Golden, artifact) -> None:
    """The stored inputs must be a valid feed for the artifact (names, dtypes, ranks, sizes)."""
    produced = {name for g in artifact.graphs for name in g.output_names}
    for graph in artifact.graphs:
        # Inputs an earlier graph produces are not stored; an omitted KV cache is implied empty.
        specs = [
            s
            for s in graph.input_specs
            if s.name not in produced
            and (s.name in golden.inputs or not (s.name.startswith("past") or s.name == "position_ids"))
        ]
        feed = {s.name: golden.inputs[s.name] for s in specs if s.name in golden.inputs}
        try:
            check_feed(specs, feed, artifact_config(artifact))
        except InputError as exc:
            raise GoldenError(
                f"--golden {golden.directory}: its inputs do not fit {artifact.location} ({exc}); "
                "the golden outputs belong to another model, re-create them with --save-golden"
            ) from None
    extra = sorted(set(golden.inputs) - {s.name for g in artifact.graphs for s in g.input_specs})
    if extra:
        raise GoldenError(
            f"--golden {golden.directory}: inputs {extra} are not inputs of {artifact.location}; "
            "the golden outputs belong to another model"
        )


def compare_with_golden(
    report, golden: Golden, artifact, tolerances: ToleranceConfig | None = None, model64=None
) -> None:
    """Add to `report` today's oracle and every backend compared with the stored oracle outputs, and, when the
    golden directory holds the original's outputs, today's float64 rebuild (`model64`, built from the artifact if
    not given) compared with them at the oracle's tolerance."""
    from toolkit.check.crosscheck import BackendResult

    stages = golden.stages
    today = report.arrays
    oracle = compare(golden.reference, today["reference"], dtype="float64", tolerances=tolerances, order=stages)
    report.golden.append(BackendResult(ORACLE, "today's float64 oracle vs golden", oracle, 0.0))
    for backend in report.backends:
        comparison = compare(
            golden.reference,
            today["outputs"][backend.name],
            dtype=report.dtype,
            tolerances=tolerances,
            calibration=report.calibration,
            order=stages,
            rounding=report.rounding,
        )
        report.golden.append(BackendResult(backend.name, backend.device, comparison, backend.seconds))
    if golden.oracle is not None:
        report.golden.append(_compare_with_stored_original(report, golden, artifact, tolerances, model64))
    then = golden.index["artifact"].get("graph_sha256") or {}
    now = _graph_hashes(artifact)
    report.golden_info = {
        "directory": str(golden.directory),
        "created": golden.index.get("created"),
        "versions_then": golden.index["versions"],
        "versions_now": current_versions(),
        "graphs_changed": sorted(name for name in set(then) | set(now) if then.get(name) != now.get(name)),
        "new_stages": [s for s in report.stages if s not in stages],
    }


def golden_oracle_name(index: dict) -> str:
    """The oracle whose outputs a golden index records (transformers when the entry predates llama.cpp)."""
    info = index.get("oracle")
    return info.get("name", "transformers") if isinstance(info, dict) else "transformers"


def _compare_with_stored_original(report, golden: Golden, artifact, tolerances, model64):
    """Today's float64 rebuild of the artifact against the original's stored outputs (no transformers or
    llama.cpp needed)."""

    from runners.eager import model_from_artifact
    from toolkit.check.crosscheck import BackendResult
    from toolkit.check.llamacpp import TOLERANCES, stored_llama_cpp
    from toolkit.check.oracle import check_input_ids, our_stages

    if model64 is None:
        model64 = model_from_artifact(artifact)  # float32, run in float64 a block at a time
    if golden_oracle_name(golden.index) == "llama.cpp":
        info = golden.index["oracle"]
        precision = info.get("precision")
        if precision not in TOLERANCES:
            raise GoldenError(f"{golden.directory}/{INDEX_FILE}: oracle.precision must be one of {sorted(TOLERANCES)}")
        prompt = check_input_ids(golden.inputs["input_ids"])
        comparison, _ = stored_llama_cpp(golden.oracle, prompt, model64, precision)
        where = f"llama.cpp {info.get('llama_cpp', '')} as stored vs today's eager-f64"
        return BackendResult(ORIGINAL_NAME, where, comparison, 0.0)
    stages = [s for s in (golden.index.get("oracle") or {}).get("stages", golden.oracle) if s in golden.oracle]
    prompt = [s for s in stages if not s.startswith("decode.")]
    ours, calibration = our_stages(model64, check_input_ids(golden.inputs["input_ids"]), prompt)
    for stage in stages:
        if stage.startswith("decode.") and stage in report.arrays["reference"]:  # today's check decoded too
            ours[stage] = report.arrays["reference"][stage]
            calibration[stage] = report.calibration.get(stage, 0.0)
    comparison = compare(
        golden.oracle, ours, dtype=report.dtype, tolerances=tolerances, calibration=calibration, order=stages
    )
    info = golden.index.get("oracle") or {}
    where = f"the original ({info.get('architecture', 'transformers')}) as stored vs today's eager-f64"
    return BackendResult(ORIGINAL_NAME, where, comparison, 0.0)


ORIGINAL_NAME = "original"
