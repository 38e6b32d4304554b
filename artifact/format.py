"""The artifact format: file names, the typed manifest, and the loaded artifact.

An artifact is a directory of ONNX graph files plus `manifest.json`. Single-graph
families write `model.onnx`; the encoder-decoder writes `encoder.onnx` and
`decoder.onnx`. The manifest is also embedded in each ONNX file's metadata_props
(without the file hashes, which cannot hash themselves), so a lone single-graph
.onnx is self-describing.

The manifest is read in one place, `parse_manifest`, into frozen dataclasses;
the defaults of optional fields are stated here once. `Manifest.data` keeps the
JSON object as read, for writers that derive a new artifact from this one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from artifact.errors import ModelFileError

TOOLKIT_VERSION = "0.1.0"  # recorded in every manifest's "versions"
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
FORMAT = "onnx-toolkit-artifact"
FORMAT_VERSION = 1
METADATA_KEY = "onnx_toolkit.manifest"
# The operator domain of the toolkit's own functions (RMSNorm, SwiGLU, GeGLU), with their bodies in each file.
CUSTOM_DOMAIN = "onnx_toolkit"
CUSTOM_DOMAIN_VERSION = 1
# Input/output dtypes a manifest may declare (what the exporters and runners handle).
SPEC_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
DEFAULT_DTYPE = "float32"  # an artifact, or an output spec, that names no dtype
DEFAULT_LOWERING = "functions"

# The KV-cache contract of a serving graph: inputs past.{layer}.key/value [batch, kv_heads,
# past_sequence, head_width] and outputs present.* with the new positions appended.
PAST_PREFIX = "past."
PRESENT_PREFIX = "present."
# A graph entry's "kv_cache" when its past buffers may be longer than the history and are written in place.
SHARED_KV_CACHE = "shared-buffer"


def past_name(layer: int, kind: str) -> str:
    return f"{PAST_PREFIX}{layer}.{kind}"


def present_name(past: str) -> str:
    """past.{i}.key -> present.{i}.key: the output that carries an input's cache forward."""
    return PRESENT_PREFIX + past.removeprefix(PAST_PREFIX)


def is_cache_input(name: str) -> bool:
    return name.startswith(PAST_PREFIX)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, numpy dtype name, and shape (ints for fixed axes, strings for named ones)."""

    name: str
    dtype: str = DEFAULT_DTYPE
    shape: tuple = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, spec: TensorSpec | Mapping) -> TensorSpec:
        """A TensorSpec from itself or from a manifest-style mapping ({"name", "dtype", "shape"})."""
        if isinstance(spec, TensorSpec):
            return spec
        return cls(spec["name"], spec.get("dtype") or DEFAULT_DTYPE, tuple(spec.get("shape") or ()))


def tensor_specs(specs) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec.of(spec) for spec in specs)


@dataclass(frozen=True)
class WeightPlace:
    """Where a model parameter lives in a graph: an initializer, possibly transposed, a slice of a fused
    one ([axis, start, stop]), or quantized (the spec `exporters.quantize` writes)."""

    initializer: str | None
    transpose: bool = False
    slice: tuple | None = None
    quantized: Mapping | None = None

    @classmethod
    def of(cls, entry: Mapping) -> WeightPlace:
        return cls(
            entry.get("initializer"),
            bool(entry.get("transpose")),
            tuple(entry["slice"]) if entry.get("slice") else None,
            entry.get("quantized") or None,
        )

    def to_dict(self) -> dict:
        out = {"initializer": self.initializer, "transpose": self.transpose}
        if self.slice is not None:
            out["slice"] = list(self.slice)
        if self.quantized is not None:
            out["quantized"] = dict(self.quantized)
        return out


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the manifest: its file, inputs and outputs, and where each parameter's weights are."""

    name: str
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: Mapping[str, WeightPlace]
    sha256: str | None = None
    stages: tuple[str, ...] = ()
    custom_ops: tuple[str, ...] = ()
    attention_op: str | None = None
    kv_cache: str | None = None
    # The graph's external data files (weights beside the .onnx, artifact/write.externalize): name -> sha256.
    external_data: Mapping[str, str] = field(default_factory=dict)
    data: Mapping = field(default_factory=dict, repr=False, compare=False)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]


@dataclass(frozen=True)
class Manifest:
    """manifest.json, typed. Optional fields default here: an artifact without `dtype` is float32,
    without `lowering` it uses the custom functions."""

    family: str
    variant: str
    config: Mapping
    graphs: tuple[GraphEntry, ...]
    preset: str | None = None
    seed: int | None = None
    lowering: str = DEFAULT_LOWERING
    dtype: str = DEFAULT_DTYPE
    quantization: Mapping | None = None
    source: Mapping | None = None
    extra_files: Mapping[str, str] = field(default_factory=dict)
    versions: Mapping | None = None
    custom_domains: Mapping = field(default_factory=dict)
    # {lowering: None where the model admits it, else why not}, recorded at export (exporters.lowerings).
    lowerings: Mapping[str, str | None] | None = None
    data: Mapping = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        """The JSON object this manifest was read from."""
        return dict(self.data)


@dataclass
class GraphArtifact:
    """One ONNX graph of an artifact and its manifest entry."""

    name: str
    model_path: Path
    entry: GraphEntry

    @property
    def input_specs(self) -> tuple[TensorSpec, ...]:
        return self.entry.inputs

    @property
    def output_names(self) -> list[str]:
        return self.entry.output_names

    @property
    def weights(self) -> Mapping[str, WeightPlace]:
        return self.entry.weights


@dataclass
class Artifact:
    """A loaded, hash-verified artifact: where it is, its manifest, and its graphs in order."""

    directory: Path | None
    manifest: Manifest
    graphs: list[GraphArtifact]

    @property
    def family(self) -> str:
        return self.manifest.family

    @property
    def variant(self) -> str:
        return self.manifest.variant

    @property
    def dtype(self) -> str:
        return self.manifest.dtype

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
    def input_specs(self) -> tuple[TensorSpec, ...]:
        return self.graph().input_specs

    @property
    def output_names(self) -> list[str]:
        return [name for graph in self.graphs for name in graph.output_names]


def _is_hex_digest(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def parse_manifest(manifest, where, needs_hash: bool = True) -> Manifest:
    """Check the manifest's schema (every field the loaders and runners read, with its type) and type it."""
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
    if not isinstance(manifest["graphs"], list) or not manifest["graphs"]:
        raise ModelFileError(f"{where}: manifest 'graphs' must be a non-empty list; re-run `toolkit export`")
    graphs = tuple(_parse_graph(entry, where, needs_hash) for entry in manifest["graphs"])
    _check_optional(
        manifest,
        where,
        "manifest",
        {
            "quantization": dict,
            "custom_domains": dict,
            "source": dict,
            "versions": dict,
            "lowering": str,
            "preset": str,
        },
    )
    lowerings = manifest.get("lowerings")
    if lowerings is not None and not (
        isinstance(lowerings, dict)
        and all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in lowerings.items())
    ):
        raise ModelFileError(f"{where}: manifest 'lowerings' must map lowering names to null or a reason string")
    if manifest.get("dtype") is not None and manifest["dtype"] not in SPEC_DTYPES:
        raise ModelFileError(
            f"{where}: manifest 'dtype' {manifest['dtype']!r:.40} is not one of {', '.join(SPEC_DTYPES)}"
        )
    return Manifest(
        family=manifest["family"],
        variant=manifest["variant"],
        config=manifest["config"],
        graphs=graphs,
        preset=manifest.get("preset"),
        seed=manifest.get("seed"),
        lowering=manifest.get("lowering") or DEFAULT_LOWERING,
        dtype=manifest.get("dtype") or DEFAULT_DTYPE,
        quantization=manifest.get("quantization") or None,
        source=manifest.get("source"),
        extra_files=MappingProxyType(extra),
        versions=manifest.get("versions"),
        custom_domains=manifest.get("custom_domains") or {},
        lowerings=lowerings,
        data=manifest,
    )


def _parse_graph(entry, where, needs_hash: bool) -> GraphEntry:
    graph_keys = ["name", "file", "inputs", "outputs", "weights"] + (["sha256"] if needs_hash else [])
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
        raise ModelFileError(f"{where}: graph {name!r} sha256 must be 64 hex digits, got {entry['sha256']!r:.80}")
    if not isinstance(entry["weights"], dict):
        raise ModelFileError(f"{where}: graph {name!r} 'weights' must be an object")
    outputs = entry["outputs"]
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise ModelFileError(f"{where}: graph {name!r} 'outputs' must be a list of {{\"name\": ...}} objects")
    inputs = entry["inputs"]
    if not isinstance(inputs, list):
        raise ModelFileError(f"{where}: graph {name!r} 'inputs' must be a list of input specs")
    for spec in inputs:
        _check_input_spec(spec, f"{where}: graph {name!r}")
    for spec in outputs:
        _check_output_spec(spec, f"{where}: graph {name!r}")
    _check_optional(entry, where, f"graph {name!r}", {"attention_op": str, "kv_cache": str})
    for key in ("stages", "custom_ops"):
        if entry.get(key) is not None and not (
            isinstance(entry[key], list) and all(isinstance(v, str) for v in entry[key])
        ):
            raise ModelFileError(f"{where}: graph {name!r} {key!r} must be a list of names, got {entry[key]!r:.80}")
    external = entry.get("external_data") or {}
    if not isinstance(external, dict) or not all(
        isinstance(n, str) and n and Path(n).name == n and n not in (".", "..", file) and _is_hex_digest(d)
        for n, d in external.items()
    ):
        raise ModelFileError(f"{where}: graph {name!r} 'external_data' must map plain file names to sha256 hex digests")
    weights = {}
    for weight, place in entry["weights"].items():
        if not isinstance(place, dict):
            raise ModelFileError(f"{where}: graph {name!r} weight {weight!r:.80} must map to an object")
        _check_weight_place(place, f"{where}: graph {name!r} weight {weight!r:.80}")
        weights[weight] = WeightPlace.of(place)
    return GraphEntry(
        name=name,
        file=file,
        inputs=tensor_specs(inputs),
        outputs=tensor_specs(outputs),
        weights=MappingProxyType(weights),
        sha256=entry.get("sha256"),
        stages=tuple(entry.get("stages") or ()),
        custom_ops=tuple(entry.get("custom_ops") or ()),
        attention_op=entry.get("attention_op"),
        kv_cache=entry.get("kv_cache"),
        external_data=MappingProxyType(dict(external)),
        data=entry,
    )


def _check_input_spec(spec, where: str) -> None:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ModelFileError(f"{where}: an input spec must be an object with a 'name', got {spec!r:.80}")
    if spec.get("dtype") not in SPEC_DTYPES:
        raise ModelFileError(
            f"{where}: input {spec['name']!r} dtype {spec.get('dtype')!r:.40} is not one of {', '.join(SPEC_DTYPES)}"
        )
    shape = spec.get("shape")
    if not _is_shape(shape):
        raise ModelFileError(
            f"{where}: input {spec['name']!r} shape must be a list of sizes and axis names, got {shape!r:.80}"
        )


def _check_optional(fields: dict, where, owner: str, kinds: dict) -> None:
    """Optional fields are absent, null or of their kind."""
    for key, kind in kinds.items():
        value = fields.get(key)
        if value is not None and not isinstance(value, kind):
            raise ModelFileError(f"{where}: {owner} {key!r} must be a {kind.__name__} or absent, got {value!r:.80}")


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(
        (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d) for d in shape
    )


def _check_output_spec(spec: dict, where: str) -> None:
    """An output names itself; its dtype (default float32) and shape, when given, are what an input's may be."""
    if spec.get("dtype") is not None and spec["dtype"] not in SPEC_DTYPES:
        raise ModelFileError(
            f"{where}: output {spec['name']!r} dtype {spec['dtype']!r:.40} is not one of {', '.join(SPEC_DTYPES)}"
        )
    if spec.get("shape") is not None and not _is_shape(spec["shape"]):
        raise ModelFileError(
            f"{where}: output {spec['name']!r} shape must be a list of sizes and axis names, got {spec['shape']!r:.80}"
        )


def _check_weight_place(place: dict, where: str) -> None:
    if not isinstance(place.get("initializer"), str):
        raise ModelFileError(f"{where}: 'initializer' must be a name, got {place.get('initializer')!r:.80}")
    piece = place.get("slice")
    if piece is not None and not (
        isinstance(piece, list)
        and len(piece) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in piece)
    ):
        raise ModelFileError(f"{where}: 'slice' must be [axis, start, stop], got {piece!r:.80}")
    if place.get("quantized") is not None and not isinstance(place["quantized"], dict):
        raise ModelFileError(f"{where}: 'quantized' must be an object, got {place['quantized']!r:.80}")
