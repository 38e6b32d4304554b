"""The machine a benchmark runs on: its read bandwidth (the decode bound), CPU, versions, load and peak RSS."""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path

import numpy as np

from artifact.format import TOOLKIT_VERSION


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


def probe_buffer_bytes() -> int:
    """Eight times the last-level cache (at least 256 MiB), so that a streaming read comes from memory,
    but at most a quarter of the memory available now: a VM can report its whole socket's cache
    (480 MiB on a 2-core Xeon guest), and a probe must not push the machine into swap."""
    from toolkit.memory import available_memory

    wanted = max(8 * llc_bytes(), 256 << 20)
    available = available_memory()
    return wanted if available is None else max(min(wanted, available // 4), 64 << 20)


def read_bandwidth_probes(threads: int, buffer_bytes: int | None = None, repeats: int = 5) -> dict[str, float]:
    """GB/s of two streaming reads over a buffer >> the LLC, each the best of `repeats`: a torch float32
    sum, and an ONNX Runtime float32 GEMV (1 x K times K x N, the access pattern of a decode step's
    weights). Neither alone is an upper bound: on a 2-core EPYC VM ONNX Runtime's GEMV streamed faster
    than torch's sum in some runs and slower in others, and a bound a backend beats is no bound."""
    import torch

    buffer_bytes = buffer_bytes or probe_buffer_bytes()
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
    from onnx import TensorProto, helper

    rows = 1024  # K: a weight of shape [K, N], read once per call
    cols = max(buffer_bytes // 4 // rows, 1)
    # The weight is bound as an input over numpy's memory (no copy per run), not stored as an
    # initializer: a probe buffer can exceed protobuf's 2 GiB message limit.
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "read_bandwidth",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [rows, cols]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cols])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, rows), dtype=np.float32)
    weight = np.ones((rows, cols), dtype=np.float32)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    binding.bind_ortvalue_input("w", ort.OrtValue.ortvalue_from_numpy(weight))
    binding.bind_output("y")

    def run(keep_alive=(x, weight)):  # the bound OrtValues borrow these arrays' memory
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    return run, rows * cols * 4


def machine_info(threads: int, read_bandwidth_gbs: float, probes: dict | None = None) -> dict:
    import onnx
    import torch

    versions = {
        "python": platform.python_version(),
        "toolkit": TOOLKIT_VERSION,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    # The load average says whether other work shared the cores during the run (then every figure is low).
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "read_bandwidth_gbs": read_bandwidth_gbs,
        "read_bandwidth_probes_gbs": probes or {},
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
        "versions": versions,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
