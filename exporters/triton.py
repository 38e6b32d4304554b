"""A Triton Inference Server model repository for the onnxruntime backend.

Layout: REPO/NAME/config.pbtxt and REPO/NAME/1/model.onnx (the artifact's graph, byte for byte, with its
external data file beside it when it has one), written atomically like an artifact. The config declares
the inputs and outputs with their Triton dtypes and dims (the batch axis is Triton's own, max_batch_size >
0; every symbolic axis is -1) and an instance group on CPU or GPU.

A serving graph with a KV cache (past.* inputs, present.* outputs) gets one of two layouts:

- "server" (the default): a sequence-batched model with implicit state. Each past.{i}.key/value input is a
  `sequence_batching.state` entry paired with its present.* output, so Triton keeps every sequence's cache
  between requests and feeds present back as past on the sequence's next request. Clients send only the
  new tokens: input_ids and position_ids [1, T] and past_mask [1, cache length]. position_ids and past_mask
  cannot be state, because Triton carries a state from a model output and the graph has none for them; the
  client knows both from the number of tokens it has sent. The logits come back; the cache does not.
- "client": the stateless layout with dynamic batching. Clients send the whole cache every step and get
  present.* back, so any replica can serve any step.

How the "server" layout fits what Triton does (core and onnxruntime_backend sources, docs/user_guide/
implicit_state_management.md):

- The initial state. On a request with sequence_start, Triton makes a fresh state whose shape is the state
  dims with every -1 replaced by 1 (core sequence_state.cc, SequenceStates::Initialize), whatever the
  initial_state's dims say, and fills it from initial_state. An empty cache (past_sequence 0) therefore
  cannot be expressed: the state would claim one row and hold none. So every sequence starts with one
  cache row that its client masks out (past_mask 0) on every request, zeroed (zero_data) because without
  initial_state it is uninitialized memory, and a masked row still multiplies its zero weight into its
  values (0 * NaN is NaN). The graph already takes padding rows of a batched cache in past_mask, and the
  row stays first in the cache (present = concat(past, new)), so it costs one row per sequence and
  changes no logit beyond rounding (tests/exporters/test_triton.py decodes both ways). Each request is
  one row (batch 1), as the starting state is.
- No control inputs. The onnxruntime backend refuses to load a config whose CONTROL_SEQUENCE_* inputs the
  ONNX graph does not have ("configuration specified sequence control ..., but model does not provide that
  input") and counts them among the graph's inputs; this graph needs none, since Triton itself resets the
  state on sequence_start and frees it after sequence_end. The flags travel with each request.
- Strategy "oldest", max_batch_size > 1: each instance holds `sequences` candidate sequences (the bound on
  the caches it keeps in memory; more wait in Triton's backlog) and a dynamic batcher forms batches from
  their ready requests. Triton batches requests only when every variable-size input has the same shape
  (core backend_model.cc, enforce_equal_shape_tensors), and past_mask is one, so a batch only ever holds
  sequences with equally long caches: their states concatenate on the batch axis. Sequences of different
  lengths run one per execution, which is correct but unbatched.
- max_sequence_idle_microseconds: Triton's default is 1 s, after which an idle sequence's slot and cache
  are freed; clients pause longer than that between turns, so the default here is 60 s.
- What it saves is the network: the cache still grows by a copy every step inside the server (the graph's
  concat, then the backend's copy of present into Triton's state buffer). Triton's growable state memory
  needs use_same_buffer_for_input_output, which this graph cannot use: present's rows sit at other offsets
  than past's, so writing it over past would overwrite rows not yet read.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from artifact import Artifact, swap_in
from artifact.errors import ExportError, ModelFileError
from artifact.format import TensorSpec, is_cache_input, present_name

TRITON_DTYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "int64": "TYPE_INT64",
    "bool": "TYPE_BOOL",
}
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
KV_CACHE_LAYOUTS = ("server", "client")
CACHE_AXIS = "past_sequence"  # the growing axis of every past.* input
INITIAL_SLOTS = 1  # the masked, zeroed cache rows a sequence starts with (see the module docstring)
SEQUENCE_IDLE_US = 60_000_000


def _dims(shape) -> list[int]:
    # Triton owns the leading batch axis (max_batch_size > 0); every other symbolic axis is -1.
    return [-1 if isinstance(d, str) or d <= 0 else int(d) for d in shape[1:]]


def _dtype(spec: TensorSpec) -> str:
    dtype = TRITON_DTYPES.get(spec.dtype)
    if dtype is None:
        raise ExportError(f"tensor {spec.name!r}: dtype {spec.dtype} has no Triton equivalent")
    return dtype


def _batched(spec: TensorSpec) -> TensorSpec:
    if not spec.shape or spec.shape[0] != "batch":
        raise ExportError(f"tensor {spec.name!r}: the first axis must be the batch axis for Triton batching")
    return spec


def _list(values) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def _tensor(spec: TensorSpec) -> str:
    spec = _batched(spec)
    return f'  {{\n    name: "{spec.name}"\n    data_type: {_dtype(spec)}\n    dims: {_list(_dims(spec.shape))}\n  }}'


def _state(past: TensorSpec, outputs: dict[str, TensorSpec]) -> str:
    """The state entry that carries `past` from its present.* output to the sequence's next request."""
    present = outputs.get(present_name(past.name))
    if present is None:
        raise ExportError(f"cache input {past.name!r} has no {present_name(past.name)!r} output to carry it")
    dims = _dims(_batched(past).shape)
    if present.dtype != past.dtype or _dims(_batched(present).shape) != dims:
        raise ExportError(
            f"{past.name!r} {past.dtype} {dims} and {present.name!r} {present.dtype} "
            f"{_dims(present.shape)} differ; Triton state needs one dtype and dims for both"
        )
    initial = []
    for d in past.shape[1:]:
        if d == CACHE_AXIS:
            initial.append(INITIAL_SLOTS)
        elif isinstance(d, str):
            raise ExportError(f"cache input {past.name!r}: axis {d!r} has no size to start a sequence with")
        else:
            initial.append(d)
    dtype = _dtype(past)
    return (
        "    {\n"
        f'      input_name: "{past.name}"\n'
        f'      output_name: "{present.name}"\n'
        f"      data_type: {dtype}\n"
        f"      dims: {_list(dims)}\n"
        "      initial_state {\n"
        f"        data_type: {dtype}\n"
        f"        dims: {_list(initial)}\n"
        "        zero_data: true\n"
        '        name: "one masked cache row"\n'
        "      }\n"
        "    }"
    )


def kv_cache_layout(artifact: Artifact, kv_cache: str | None = None) -> str | None:
    """Where the Triton model keeps the graph's KV cache: "server", "client", or None for a graph without one.
    kv_cache None picks "server" when there is a cache."""
    if kv_cache is not None and kv_cache not in KV_CACHE_LAYOUTS:
        raise ExportError(f"triton KV cache {kv_cache!r}: choose one of {', '.join(KV_CACHE_LAYOUTS)}")
    if not any(is_cache_input(TensorSpec.of(s).name) for s in artifact.graph().input_specs):
        if kv_cache is not None:
            raise ExportError(
                f"--triton-cache {kv_cache}: the graph has no KV cache (past.* inputs); export a language model "
                "with --variant serving, or drop --triton-cache"
            )
        return None
    return kv_cache or "server"


def config_pbtxt(
    artifact: Artifact,
    name: str,
    *,
    device: str = "cpu",
    instances: int = 1,
    max_batch_size: int = 8,
    max_queue_delay_us: int = 100,
    kv_cache: str | None = None,
    sequences: int | None = None,
    sequence_idle_us: int = SEQUENCE_IDLE_US,
) -> str:
    """config.pbtxt for the artifact's graph. kv_cache: "server" (implicit state) or "client" (stateless) for
    a graph with a KV cache, None for "server" there and the plain layout for a graph without one.
    sequences: candidate sequences per instance in the "server" layout (default max_batch_size)."""
    graph = artifact.graph()
    if device not in KINDS:
        raise ExportError(f"triton device {device!r}: choose one of {', '.join(KINDS)}")
    specs = [TensorSpec.of(s) for s in graph.input_specs]
    outputs = [TensorSpec.of(s) for s in graph.entry.outputs]
    cache = [s for s in specs if is_cache_input(s.name)]
    stateful = kv_cache_layout(artifact, kv_cache) == "server"
    if sequences is not None and not stateful:
        raise ExportError("--triton-sequences sizes the server-side KV cache; it needs --triton-cache server")
    if stateful:
        states = ",\n".join(_state(s, {o.name: o for o in outputs}) for s in cache)
        carried = {present_name(s.name) for s in cache}
        specs = [s for s in specs if not is_cache_input(s.name)]
        outputs = [o for o in outputs if o.name not in carried]
        scheduling = (
            "sequence_batching {\n"
            f"  max_sequence_idle_microseconds: {sequence_idle_us}\n"
            "  oldest {\n"
            f"    max_candidate_sequences: {sequences or max_batch_size}\n"
            f"    max_queue_delay_microseconds: {max_queue_delay_us}\n"
            "  }\n"
            f"  state [\n{states}\n  ]\n"
            "}\n"
        )
    else:
        scheduling = f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}\n"
    inputs = ",\n".join(_tensor(s) for s in specs)
    outs = ",\n".join(_tensor(s) for s in outputs)
    return (
        f'name: "{name}"\n'
        'backend: "onnxruntime"\n'
        f"max_batch_size: {max_batch_size}\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outs}\n]\n"
        f"instance_group [\n  {{\n    count: {instances}\n    kind: {KINDS[device]}\n  }}\n]\n" + scheduling
    )


def write_triton_repo(artifact: Artifact, repo: str | Path, name: str, **options) -> Path:
    """Write REPO/NAME (config.pbtxt + 1/model.onnx); an existing NAME is replaced only if it is a model dir."""
    if len(artifact.graphs) != 1:
        raise ExportError(
            "a Triton repository takes single-graph artifacts; export the encoder-decoder's graphs as separate models"
        )
    repo = Path(repo)
    target = repo / name
    if target.exists() and not (target / "config.pbtxt").is_file():
        raise ModelFileError(f"{target} exists and is not a Triton model directory; choose another --triton-repo")
    text = config_pbtxt(artifact, name, **options)
    repo.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=repo))
    try:
        (tmp / "1").mkdir()
        graph = artifact.graph()
        shutil.copyfile(graph.model_path, tmp / "1" / "model.onnx")
        # The graph names its external data file relative to itself, so the file keeps its name beside it.
        for data in graph.entry.external_data:
            shutil.copyfile(graph.model_path.parent / data, tmp / "1" / data)
        (tmp / "config.pbtxt").write_text(text)
        swap_in(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
