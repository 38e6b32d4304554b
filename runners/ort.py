"""ONNX Runtime backends. onnxruntime is imported lazily so the rest of the toolkit works without it.

`ort-cpu` (CPUExecutionProvider), `ort-cuda` (CUDAExecutionProvider, package onnxruntime-gpu) and
`ort-trt` (TensorrtExecutionProvider, CUDA for the nodes TensorRT does not take). GPU sessions run
with TF32 off by default, so a float32 graph is compared at float32 precision; `tf32=True` is the
speed mode and the runner's `device` string says which one ran.

Placement audit: ONNX Runtime may place nodes of a CUDA session on the CPU. The CUDA provider
itself puts shape arithmetic there on purpose (integer tensors of a few elements); a node that
produces float tensors on the CPU is a compute node that silently left the GPU. `audit_placement`
reads a profiling run and lists those. (onnxruntime's `session.disable_cpu_ep_fallback=1` config
entry refuses a session with *any* CPU node, shape arithmetic included, and names none of them, so
it is offered as `strict_placement` rather than used by default.)
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.errors import BackendUnavailableError, ModelFileError
from artifact.format import SHARED_KV_CACHE, present_name
from runners.base import Runner, check_feed
from runners.decoding.cache import KVCache

PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-trt": "TensorrtExecutionProvider",
}
# Providers a session may place compute nodes on, per requested provider (TensorRT hands the nodes it
# cannot build to the CUDA provider, never to the CPU).
ALLOWED_PLACEMENT = {
    "CPUExecutionProvider": ("CPUExecutionProvider",),
    "CUDAExecutionProvider": ("CUDAExecutionProvider",),
    "TensorrtExecutionProvider": ("TensorrtExecutionProvider", "CUDAExecutionProvider"),
}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
DISABLE_PREPACKING = "session.disable_prepacking"  # onnxruntime_session_options_config_keys.h
DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"  # onnxruntime_session_options_config_keys.h
# Output element types of host-side shape arithmetic (Shape, Gather on shapes, Concat of dims, ...).
_INDEX_TYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool"})


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(
            f"onnxruntime is not importable ({exc}); install the `onnxruntime` package"
        ) from None
    return onnxruntime


def available_providers() -> list[str]:
    try:
        return list(_onnxruntime().get_available_providers())
    except BackendUnavailableError:
        return []


def provider_options(provider: str, *, tf32: bool = False, device_id: int = 0) -> dict[str, str]:
    """Provider options: the GPU's device id and, for CUDA, TF32 on or off (off for parity checks)."""
    if provider == "CUDAExecutionProvider":
        return {"device_id": str(device_id), "use_tf32": "1" if tf32 else "0"}
    if provider == "TensorrtExecutionProvider":
        return {"device_id": str(device_id)}
    return {}


class SessionLoader:
    """Builds an InferenceSession for exactly one provider: no silent fall-back to another.

    (ort-trt adds the CUDA provider behind TensorRT for the nodes TensorRT does not take; the
    placement audit still refuses any compute node on the CPU.)
    """

    def __init__(
        self,
        model_path: Path,
        provider: str,
        intra_op_threads: int = 0,
        *,
        tf32: bool = False,
        device_id: int = 0,
        strict_placement: bool = False,
        prepack: bool = True,
    ):
        self.model_path = Path(model_path)
        # Prepacking lays constant MatMul weights out for the kernels once, beside the initializers: faster calls,
        # about twice the weights' memory while the session lives (so a caller holding two sessions may opt out).
        self.prepack = prepack
        self.provider = provider
        self.intra_op_threads = intra_op_threads
        self.tf32 = tf32
        self.device_id = device_id
        self.strict_placement = strict_placement

    @property
    def providers(self) -> list:
        chain = [(self.provider, provider_options(self.provider, tf32=self.tf32, device_id=self.device_id))]
        if self.provider == "TensorrtExecutionProvider":
            chain.append(
                (
                    "CUDAExecutionProvider",
                    provider_options("CUDAExecutionProvider", tf32=self.tf32, device_id=self.device_id),
                )
            )
        return chain

    def options(self, profile_prefix: str | None = None):
        ort = _onnxruntime()
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.intra_op_threads
        options.log_severity_level = 3  # warnings about unused initializers are noise for users
        if self.strict_placement and self.provider != "CPUExecutionProvider":
            options.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")
        if not self.prepack:
            options.add_session_config_entry(DISABLE_PREPACKING, "1")
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        return options

    def __call__(self, profile_prefix: str | None = None):
        ort = _onnxruntime()
        available = ort.get_available_providers()
        for provider, _ in self.providers:
            if provider not in available:
                raise BackendUnavailableError(
                    f"execution provider {provider} is not available in this onnxruntime "
                    f"({ort.__version__}); available providers: {', '.join(available)}"
                    + ("; install onnxruntime-gpu (pip install '.[cuda]')" if provider in GPU_PROVIDERS else "")
                )
        try:
            return ort.InferenceSession(
                str(self.model_path), sess_options=self.options(profile_prefix), providers=self.providers
            )
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/NotImplemented types
            message = str(exc)
            if "Could not find an implementation for" in message:
                raise BackendUnavailableError(
                    f"{self.model_path}: {self.provider} has no kernel for a node of this graph "
                    f"({message.split('Could not find an implementation for', 1)[1].strip()}); "
                    "run this artifact's dtype on another backend (see `toolkit check --help`)"
                ) from None
            if DISABLE_CPU_FALLBACK in message or "fallback to CPU EP has been explicitly disabled" in message:
                raise BackendUnavailableError(
                    f"{self.model_path}: {self.provider} left nodes to the CPU and strict placement forbids it; "
                    "run without strict placement to see them listed by the placement audit"
                ) from None
            raise ModelFileError(f"{self.model_path}: onnxruntime could not load the model: {exc}") from None


class OrtRunner(Runner):
    def __init__(
        self, loader: SessionLoader, input_specs, output_names, config=None, name="ort-cpu", kv_cache: str | None = None
    ):
        super().__init__(input_specs, output_names, config)
        self.name = name
        self.kv_cache = kv_cache  # the graph entry's "kv_cache": SHARED_KV_CACHE allows BoundKVCache's shared buffers
        self.loader = loader
        self.session = loader()
        provider = self.session.get_providers()[0]
        if provider != loader.provider:
            raise BackendUnavailableError(f"{name}: session runs on {provider}, not the requested {loader.provider}")
        self.provider = provider
        self.tf32 = loader.tf32
        self.device_id = loader.device_id
        # Where IO binding puts inputs, outputs and the KV cache: the GPU for GPU providers.
        self.binding_device = "cuda" if provider in GPU_PROVIDERS else "cpu"
        self.device = (
            provider
            if provider not in GPU_PROVIDERS
            else f"{provider} (device {self.device_id}, tf32 {'on' if self.tf32 else 'off'})"
        )

    @property
    def metadata(self) -> dict:
        """What a report records about this backend: provider, options and the TF32 mode."""
        return {
            "provider": self.provider,
            "providers": [p for p, _ in self.loader.providers],
            "provider_options": dict(self.loader.providers[0][1]),
            "tf32": self.tf32 if self.binding_device == "cuda" else None,
            "binding_device": self.binding_device,
        }

    def _infer(self, feed):
        bfloat16 = any(v.dtype.name == "bfloat16" for v in feed.values()) or self._bfloat16_outputs
        if self.binding_device == "cpu" and not bfloat16:
            values = self.session.run(self.output_names, feed)
            return dict(zip(self.output_names, values, strict=False))
        # GPU (or bfloat16, which onnxruntime's numpy bridge lacks): inputs copied to the device once,
        # outputs left there by the kernels and copied back once.
        binding = self.session.io_binding()
        for name, value in feed.items():
            binding.bind_ortvalue_input(name, to_ortvalue(value, self.binding_device, self.device_id))
        for name in self.output_names:
            on_host = self.binding_device == "cpu" or name in self._bfloat16_outputs
            binding.bind_output(name, "cpu" if on_host else self.binding_device, 0 if on_host else self.device_id)
        self.session.run_with_iobinding(binding)
        return {
            name: from_ortvalue(value) for name, value in zip(self.output_names, binding.get_outputs(), strict=False)
        }

    @functools.cached_property
    def _bfloat16_outputs(self) -> set[str]:
        """Read once: the session's outputs do not change, and this is consulted on every step."""
        return {o.name for o in self.session.get_outputs() if o.type == "tensor(bfloat16)"}

    def placement(self, feed: dict) -> PlacementAudit:
        """Run `feed` once in a profiling session and audit where every node ran."""
        return profile_placement(self.loader, feed)

    def placement_audit(self, feed: dict) -> PlacementAudit | None:
        """A GPU session may leave nodes on the CPU, so its placement is audited; the CPU provider's is not."""
        return self.placement(feed) if self.binding_device != "cpu" else None

    def new_cache(self, max_positions: int) -> BoundKVCache:
        return BoundKVCache(self, max_positions)

    def decode_step(self, feed: dict[str, np.ndarray], cache: BoundKVCache) -> np.ndarray:
        """One step through IO binding: the cache lives where the provider computes (the GPU for ort-cuda)
        and never visits the host; only the new ids go in and the logits come out."""
        ids = feed["input_ids"]
        if cache.length == 0:  # validate the first feed fully; later ones only add our own cache
            check_feed(self.input_specs, {**feed, **cache.empty(ids.shape[0])}, self.config)
        elif ids.min() < 0 or ids.max() >= self.config.vocab_size:
            check_feed(
                self.input_specs,
                {
                    **feed,
                    "position_ids": np.zeros_like(ids),
                    "past_mask": np.ones((ids.shape[0], 0), dtype=np.int64),
                    **cache.empty(ids.shape[0]),
                },
                self.config,
            )
        binding = self.session.io_binding()
        for name, value in feed.items():
            binding.bind_ortvalue_input(name, to_ortvalue(value, self.binding_device, self.device_id))
        if cache.shared:
            cache.grow(ids.shape[0], cache.length + ids.shape[1])
        elif not cache.values:
            cache.values = {
                name: to_ortvalue(value, self.binding_device, self.device_id)
                for name, value in cache.empty(ids.shape[0]).items()
            }
        for name in cache.names:
            binding.bind_ortvalue_input(name, cache.buffers[name] if cache.shared else cache.values[name])
        for name in self.output_names:
            past = cache.past_of.get(name)
            if name == "logits":
                binding.bind_output(name, "cpu")  # the sampler needs them on the host
            elif cache.shared and past is not None:
                binding.bind_ortvalue_output(name, cache.buffers[past])  # written in place
            else:
                binding.bind_output(name, self.binding_device, self.device_id)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.last_inference_time = time.perf_counter() - start
        values = dict(zip(self.output_names, binding.get_outputs(), strict=False))
        cache.values = {name: values[present_name(name)] for name in cache.names}
        return from_ortvalue(values["logits"])


class BoundKVCache(KVCache):
    """The KV cache of an ONNX Runtime runner, in OrtValues on the provider's device.

    Graphs whose manifest says kv_cache SHARED_KV_CACHE (the ort lowering's GroupQueryAttention)
    take a past buffer longer than the history: rows past seqlens_k are ignored and the new keys
    are written in place. There the cache is one pre-allocated buffer per past.* input, bound as
    both the past input and the present output, so a step neither allocates nor copies it.
    """

    def __init__(self, runner: OrtRunner, max_positions: int):
        super().__init__(runner.input_specs, max_positions)
        self.device, self.device_id = runner.binding_device, runner.device_id
        self.shared = runner.kv_cache == SHARED_KV_CACHE
        self.past_of = {present_name(name): name for name in self.names}
        self.buffers: dict = {}  # shared: name -> OrtValue [batch, kv_heads, capacity, head_width]

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape()[2] if self.buffers else 0

    def grow(self, batch: int, needed: int) -> None:
        """Make the shared buffers hold `needed` positions for `batch` rows, keeping the history."""
        same_rows = bool(self.buffers) and self.buffers[self.names[0]].shape()[0] == batch
        if same_rows and self.capacity >= needed:
            return
        # Double on overflow, so a generation that did not reserve still grows O(log n) times.
        capacity = min(max(needed, self.planned, 2 * self.capacity if same_rows else 0), self.max_positions)
        keep = self.length if same_rows else 0
        for name, spec in self.specs.items():
            shape = [batch if d == "batch" else capacity if d == "past_sequence" else d for d in spec.shape]
            array = np.zeros(shape, dtype=spec.dtype)
            if keep:
                array[:, :, :keep] = from_ortvalue(self.buffers[name])[:, :, :keep]
            self.buffers[name] = to_ortvalue(array, self.device, self.device_id)


def to_ortvalue(array, device: str = "cpu", device_id: int = 0):
    """An OrtValue on `device` ("cpu" or "cuda") holding `array`; bfloat16 (ml_dtypes) goes through its bits."""
    ort = _onnxruntime()
    if array.dtype.name == "bfloat16":
        from onnx import TensorProto

        # onnxruntime cannot take ml_dtypes' bfloat16 directly; the host value is copied to the device on binding.
        bits = np.ascontiguousarray(array).view(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, device_id)


def from_ortvalue(value) -> np.ndarray:
    """A host numpy copy of an OrtValue; bfloat16 (which OrtValue.numpy() refuses) read from its host buffer."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    if value.device_name().lower() != "cpu":
        raise BackendUnavailableError("a bfloat16 output was left on the device; bind bfloat16 outputs to the host")
    import ctypes

    import ml_dtypes

    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    bits = np.frombuffer((ctypes.c_uint16 * count).from_address(value.data_ptr()), dtype=np.uint16).copy()
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


@dataclass(frozen=True)
class NodePlacement:
    node: str
    op_type: str
    provider: str
    output_types: tuple[str, ...]

    @property
    def computes_floats(self) -> bool:
        """False for shape arithmetic (only integer/bool outputs), which providers keep on the host on purpose."""
        return any(t not in _INDEX_TYPES for t in self.output_types) or not self.output_types


@dataclass
class PlacementAudit:
    """Where the nodes of one session ran. `offending`: compute nodes outside the allowed providers."""

    requested: str
    allowed: tuple[str, ...]
    nodes: list[NodePlacement] = field(default_factory=list)

    @property
    def offending(self) -> list[NodePlacement]:
        return [n for n in self.nodes if n.provider not in self.allowed and n.computes_floats]

    @property
    def host_shape_nodes(self) -> list[NodePlacement]:
        return [n for n in self.nodes if n.provider not in self.allowed and not n.computes_floats]

    @property
    def ok(self) -> bool:
        return not self.offending

    def summary(self, limit: int = 12) -> str:
        """One line: the offending nodes with op types and providers, or what ran where."""
        if self.ok:
            return (
                f"all {len(self.nodes) - len(self.host_shape_nodes)} compute node(s) on "
                f"{'/'.join(self.allowed)}; {len(self.host_shape_nodes)} shape node(s) on the host"
            )
        shown = ", ".join(
            f"{n.node} ({n.op_type} -> {'/'.join(n.output_types) or '?'}, {n.provider})" for n in self.offending[:limit]
        )
        more = f" and {len(self.offending) - limit} more" if len(self.offending) > limit else ""
        return (
            f"{len(self.offending)} compute node(s) ran outside {'/'.join(self.allowed)}: {shown}{more}; "
            "pass --allow-cpu-fallback to accept this"
        )

    def to_dict(self) -> dict:
        return {
            "requested": self.requested,
            "allowed": list(self.allowed),
            "ok": self.ok,
            "nodes": len(self.nodes),
            "offending": [vars(n) | {"output_types": list(n.output_types)} for n in self.offending],
            "host_shape_nodes": len(self.host_shape_nodes),
        }


def node_placements(events: list[dict]) -> list[NodePlacement]:
    """Each node's provider and output types from an onnxruntime profile (Chrome trace JSON events).

    A node appears once per run as a `Node` event named `<node>_kernel_time`; repeated runs repeat it.
    """
    seen: dict[str, NodePlacement] = {}
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        args = event.get("args") or {}
        if "provider" not in args:
            continue
        name = event["name"][: -len("_kernel_time")]
        types = tuple(t for shape in args.get("output_type_shape", []) for t in shape)
        seen.setdefault(name, NodePlacement(name, args.get("op_name", "?"), args["provider"], types))
    return list(seen.values())


def audit_placement(events: list[dict], requested: str) -> PlacementAudit:
    """Audit a profile for a session that asked for `requested`; a pure function over the events."""
    allowed = ALLOWED_PLACEMENT.get(requested, (requested,))
    nodes = node_placements(events)
    if not nodes:
        raise ModelFileError("the onnxruntime profile has no node events; cannot audit node placement")
    return PlacementAudit(requested, allowed, nodes)


def profile_placement(loader: SessionLoader, feed: dict) -> PlacementAudit:
    """One profiled run of `feed` through a fresh session like `loader`'s; the profile file is removed."""
    tmp = tempfile.mkdtemp(prefix="toolkit-profile-")
    try:
        session = loader(profile_prefix=str(Path(tmp) / "placement"))
        session.run(None, feed)
        path = session.end_profiling()
        events = json.loads(Path(path).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return audit_placement(events, loader.provider)


def placement_line(audit: dict) -> str:
    """One report line from PlacementAudit.to_dict() (plus the check's graph/fallback_allowed keys)."""
    allowed = "/".join(audit["allowed"])
    where = f" in graph {audit['graph']!r}" if audit.get("graph") else ""
    if audit["ok"]:
        return (
            f"all compute nodes{where} on {allowed} ({audit['nodes'] - audit['host_shape_nodes']} nodes; "
            f"{audit['host_shape_nodes']} integer shape node(s) on the host)"
        )
    nodes = ", ".join(f"{n['node']} ({n['op_type']}, {n['provider']})" for n in audit["offending"])
    verdict = (
        "accepted (--allow-cpu-fallback)"
        if audit.get("fallback_allowed")
        else "FAIL; pass --allow-cpu-fallback to accept"
    )
    return f"{len(audit['offending'])} compute node(s){where} not on {allowed}: {nodes}: {verdict}"
