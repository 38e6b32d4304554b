"""GPU backends: placement audit (pure, over profiles), error paths and options on any machine; the
CUDA runs themselves skip with their reason where CUDAExecutionProvider or torch.cuda is missing."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper

import toolkit.check.crosscheck as check_module
from artifact.errors import BackendUnavailableError, ModelFileError
from runners.decoding.generate import CachedLM
from runners.ort import (
    DISABLE_CPU_FALLBACK,
    SessionLoader,
    audit_placement,
    from_ortvalue,
    placement_line,
    provider_options,
    to_ortvalue,
)
from runners.registry import available_backends, check_backend, create_runner
from toolkit.check.crosscheck import cross_check
from toolkit.cli import main

ORT_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
TORCH_CUDA = torch.cuda.is_available()


def needs_ort_cuda(test):
    """A GPU test (marker `gpu`), skipped with the reason where onnxruntime-gpu or the GPU is missing."""
    skip = pytest.mark.skipif(
        not ORT_CUDA, reason="CUDAExecutionProvider not available (needs onnxruntime-gpu and an NVIDIA GPU)"
    )
    return pytest.mark.gpu(skip(test))


def needs_torch_cuda(test):
    skip = pytest.mark.skipif(not TORCH_CUDA, reason="torch.cuda not available (CPU build of torch or no GPU)")
    return pytest.mark.gpu(skip(test))


def event(node: str, op: str, provider: str, *types: str) -> dict:
    """One node event as onnxruntime's profiler writes it (Chrome trace format)."""
    return {
        "cat": "Node",
        "name": f"{node}_kernel_time",
        "ph": "X",
        "args": {"op_name": op, "provider": provider, "output_type_shape": [{t: [2, 3]} for t in types]},
    }


FABRICATED = [
    {"cat": "Session", "name": "model_run"},
    event("shape0", "Shape", "CPUExecutionProvider", "int64"),
    event("concat_dims", "Concat", "CPUExecutionProvider", "int64"),
    event("matmul", "MatMul", "CUDAExecutionProvider", "float16"),
    event("softmax", "Softmax", "CPUExecutionProvider", "float"),
    event("softmax", "Softmax", "CPUExecutionProvider", "float"),  # a second run repeats the event
    {"cat": "Node", "name": "matmul_fence_before", "args": {}},
]


def test_audit_flags_float_nodes_on_the_cpu_and_tolerates_shape_arithmetic():
    audit = audit_placement(FABRICATED, "CUDAExecutionProvider")
    assert [n.node for n in audit.offending] == ["softmax"]
    assert [n.node for n in audit.host_shape_nodes] == ["shape0", "concat_dims"]
    assert not audit.ok and len(audit.nodes) == 4
    summary = audit.summary()
    assert re.search(
        r"1 compute node\(s\) ran outside CUDAExecutionProvider: softmax \(Softmax -> float, "
        r"CPUExecutionProvider\).*--allow-cpu-fallback",
        summary,
    )
    data = audit.to_dict()
    assert data["offending"] == [
        {"node": "softmax", "op_type": "Softmax", "provider": "CPUExecutionProvider", "output_types": ["float"]}
    ]


def test_audit_for_tensorrt_accepts_cuda_fallback_but_not_cpu():
    events = [
        event("trt", "TRTKernel", "TensorrtExecutionProvider", "float"),
        event("gather", "Gather", "CUDAExecutionProvider", "float"),
    ]
    assert audit_placement(events, "TensorrtExecutionProvider").ok
    assert not audit_placement(
        events + [event("add", "Add", "CPUExecutionProvider", "float16")], "TensorrtExecutionProvider"
    ).ok


def test_audit_of_an_empty_profile_is_an_error_not_a_pass():
    with pytest.raises(ModelFileError, match="no node events"):
        audit_placement([{"cat": "Session", "name": "x"}], "CUDAExecutionProvider")


def test_audit_of_a_real_cpu_profile(exported):
    """A real onnxruntime profile: every node on the CPU, so a CUDA audit of it lists every compute node."""
    loader = SessionLoader(exported("block-small").model_path, "CPUExecutionProvider")
    runner = create_runner("ort-cpu", exported("block-small"))
    feed = {"hidden_states": np.random.default_rng(0).standard_normal((1, 3, 12)).astype(np.float32)}
    assert runner.placement(feed).ok
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        session = loader(profile_prefix=str(Path(tmp) / "p"))
        session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    audit = audit_placement(events, "CUDAExecutionProvider")
    ops = {n.op_type for n in audit.offending}
    assert "MatMul" in ops and "Softmax" in ops
    assert all(n.computes_floats for n in audit.offending)
    assert {n.op_type for n in audit.host_shape_nodes} <= {
        "Shape",
        "Gather",
        "Concat",
        "Unsqueeze",
        "Squeeze",
        "Slice",
        "Range",
        "Sub",
        "Add",
        "Reshape",
        "Cast",
        "Greater",
        "Mul",
        "Expand",
        "Equal",
        "Where",
        "Div",
    }


class FakeGpuRunner:
    """An ONNX Runtime runner whose profile put one Softmax on the CPU (what a GPU run could show)."""

    def __init__(self, inner):
        self.inner = inner
        self.device = "CUDAExecutionProvider (device 0, tf32 off)"
        self.last_inference_time = None

    def run(self, feed, trusted=()):
        out = self.inner.run(feed, trusted)
        self.last_inference_time = self.inner.last_inference_time
        return out

    def placement_audit(self, feed):
        return audit_placement(FABRICATED, "CUDAExecutionProvider")


@pytest.fixture
def fake_gpu(monkeypatch):
    real = check_module.create_runner

    def create(name, *args, **kwargs):
        runner = real(name, *args, **kwargs)
        return FakeGpuRunner(runner) if name == "ort-cpu" else runner

    monkeypatch.setattr(check_module, "create_runner", create)


def test_check_fails_on_cpu_placement_unless_fallback_is_allowed(exported, fake_gpu):
    artifact = exported("block-small")
    report = cross_check(artifact, ["ort-cpu"], batch=1, sequence=3)
    assert bool(report.backends[0].comparison)  # the numbers match ...
    assert not report.passed  # ... but a compute node ran on the CPU
    assert report.to_dict()["backends"][0]["placement"]["offending"][0]["op_type"] == "Softmax"
    allowed = cross_check(artifact, ["ort-cpu"], batch=1, sequence=3, allow_cpu_fallback=True)
    assert allowed.passed


def test_cli_check_lists_offending_nodes_and_allow_cpu_fallback(exported, fake_gpu):
    directory = str(exported("block-small").directory)
    result = CliRunner().invoke(main, ["check", directory, "--backends", "ort-cpu"])
    assert result.exit_code == 1, result.output
    assert re.search(
        r"placement ort-cpu: 1 compute node\(s\).*softmax \(Softmax, CPUExecutionProvider\).*FAIL", result.output
    )
    result = CliRunner().invoke(main, ["check", directory, "--backends", "ort-cpu", "--allow-cpu-fallback"])
    assert result.exit_code == 0, result.output
    assert "accepted (--allow-cpu-fallback)" in result.output


def test_placement_line_when_everything_is_on_the_gpu():
    ok = audit_placement(
        [event("m", "MatMul", "CUDAExecutionProvider", "float"), event("s", "Shape", "CPUExecutionProvider", "int64")],
        "CUDAExecutionProvider",
    )
    assert placement_line(ok.to_dict()) == (
        "all compute nodes on CUDAExecutionProvider (1 nodes; 1 integer shape node(s) on the host)"
    )


def test_cuda_provider_options_keep_tf32_off_unless_asked():
    assert provider_options("CUDAExecutionProvider") == {"device_id": "0", "use_tf32": "0"}
    assert provider_options("CUDAExecutionProvider", tf32=True, device_id=1) == {"device_id": "1", "use_tf32": "1"}
    assert provider_options("CPUExecutionProvider") == {}
    trt = SessionLoader("m.onnx", "TensorrtExecutionProvider")
    assert [p for p, _ in trt.providers] == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]


def test_strict_placement_sets_onnxruntimes_config_entry():
    options = SessionLoader("m.onnx", "CUDAExecutionProvider", strict_placement=True).options()
    assert options.get_session_config_entry(DISABLE_CPU_FALLBACK) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # a CPU session cannot refuse the CPU
        SessionLoader("m.onnx", "CPUExecutionProvider", strict_placement=True).options().get_session_config_entry(
            DISABLE_CPU_FALLBACK
        )


@pytest.mark.parametrize(
    "name,needs", [("ort-cuda", "onnxruntime-gpu"), ("ort-trt", "TensorRT"), ("eager-cuda", "CUDA build of torch")]
)
def test_missing_gpu_backends_say_what_they_need_and_what_is_available(name, needs, exported):
    if name in available_backends():
        pytest.skip(f"{name} is available here, so its unavailable-error cannot be shown")
    assert name not in available_backends()
    pattern = rf"backend '{name}'.*not available on this machine.*{re.escape(needs)}.*available here: eager"
    with pytest.raises(BackendUnavailableError, match=pattern):
        check_backend(name)
    with pytest.raises(BackendUnavailableError, match=pattern):
        create_runner(name, exported("block-small"))
    result = CliRunner().invoke(main, ["check", "--backends", f"eager,{name}"])
    assert result.exit_code == 2 and f"'{name}'" in result.output and "Traceback" not in result.output


def test_bfloat16_ortvalues_round_trip_through_their_bits():
    values = np.array([[1.5, -3.0, 1e30]], ml_dtypes.bfloat16)
    value = to_ortvalue(values)
    assert value.data_type() == "tensor(bfloat16)"
    np.testing.assert_array_equal(from_ortvalue(value), values)
    # Through a session: Cast bfloat16 -> float32 and back, outputs read from their host buffers.
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["f"], ["y"], to=TensorProto.BFLOAT16),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_output("y", "cpu")
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(from_ortvalue(binding.get_outputs()[0]), values)
    onnx.checker.check_model(model)


# --- on a GPU -------------------------------------------------------------------------------------------


@needs_ort_cuda
@pytest.mark.parametrize("preset", ["decoder-small", "vaswani-2017"])
def test_ort_cuda_matches_the_oracle_with_every_node_on_the_gpu(exported, preset):
    report = cross_check(exported(preset), ["ort-cuda"])
    backend = report.backends[0]
    assert "tf32 off" in backend.device
    assert backend.placement is not None and backend.placement["ok"], backend.placement
    assert report.passed, backend.first_divergence


@needs_ort_cuda
def test_ort_cuda_decode_keeps_the_cache_on_the_gpu(exported):
    runner = create_runner("ort-cuda", exported("decoder-small", "serving"))
    assert runner.binding_device == "cuda"
    lm = CachedLM(runner, 32)
    lm.step(np.array([[1, 2, 3]], np.int64))
    lm.step(np.array([[4]], np.int64))
    assert all("cuda" in value.device_name().lower() for value in lm.kv.values.values())
    reference = CachedLM(create_runner("eager-f64", exported("decoder-small", "serving")), 32)
    reference.step(np.array([[1, 2, 3]], np.int64))
    want = reference.step(np.array([[4]], np.int64))
    lm.reset()
    lm.step(np.array([[1, 2, 3]], np.int64))
    got = lm.step(np.array([[4]], np.int64))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@needs_torch_cuda
def test_eager_cuda_matches_the_oracle_with_tf32_off(exported):
    torch.backends.cuda.matmul.allow_tf32 = True  # the runner must turn it off for its own run
    report = cross_check(exported("decoder-small"), ["eager-cuda"])
    assert "cuda" in report.backends[0].device and "tf32 off" in report.backends[0].device
    assert report.passed, report.backends[0].first_divergence
    assert torch.backends.cuda.matmul.allow_tf32 is True  # and restore the caller's setting
    torch.backends.cuda.matmul.allow_tf32 = False
