"""ONNX Runtime backends: provider selection, device reporting, feed checks before the session, accuracy."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime
import pytest
import torch

from artifact.errors import BackendUnavailableError, InputError, ModelFileError
from models.presets import get_preset
from runners.ort import OrtRunner, SessionLoader, available_providers
from runners.registry import available_backends, check_backend, create_runner

CUDA_AVAILABLE = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def float64_oracle(preset: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The preset's model rebuilt from its seed (not from the artifact), in float64."""
    model = get_preset(preset).build().double()
    args = [torch.from_numpy(v).double() if v.dtype.kind == "f" else torch.from_numpy(v) for v in inputs.values()]
    with torch.no_grad():
        return {k: v.numpy() for k, v in model(*args).items()}


class ForbiddenSession:
    """Stands in for the InferenceSession: any call means the feed reached onnxruntime."""

    def run(self, *args, **kwargs):
        raise AssertionError("onnxruntime was called with a feed that should have been rejected")


@pytest.fixture(scope="module")
def block_runner(exported):
    return create_runner("ort-cpu", exported("block-small"))


def test_runner_reports_its_provider_and_time(exported):
    runner = create_runner("ort-cpu", exported("block-small"))
    assert runner.name == "ort-cpu"
    assert runner.device == "CPUExecutionProvider"
    assert runner.session.get_providers() == ["CPUExecutionProvider"]  # no silent extra fall-back provider
    assert runner.last_inference_time is None
    x = np.random.default_rng(0).standard_normal((2, 4, 12)).astype(np.float32)
    runner.run({"hidden_states": x})
    assert isinstance(runner.last_inference_time, float) and runner.last_inference_time >= 0.0


def test_a_session_without_prepacking_computes_the_same_outputs(exported):
    """prepack=False reaches ONNX Runtime as its session option (the quantize report's float session holds its
    weights once that way) and changes no output bit."""
    from runners.ort import DISABLE_PREPACKING

    artifact = exported("decoder-small")
    packed, plain = create_runner("ort-cpu", artifact), create_runner("ort-cpu", artifact, prepack=False)
    assert plain.loader.options().get_session_config_entry(DISABLE_PREPACKING) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: ONNX Runtime prepacks
        packed.loader.options().get_session_config_entry(DISABLE_PREPACKING)
    ids = np.random.default_rng(1).integers(0, get_preset("decoder-small").config.vocab_size, (2, 7))
    feed = {"input_ids": ids.astype(np.int64)}
    assert np.array_equal(packed.run(feed)["logits"], plain.run(feed)["logits"])


@pytest.mark.parametrize("preset,batch,seq", [("block-small", 2, 5), ("block-small", 1, 1), ("decoder-small", 3, 6)])
def test_outputs_match_float64_eager(exported, preset, batch, seq):
    artifact = exported(preset)
    config = get_preset(preset).config
    rng = np.random.default_rng(seq)
    if preset.startswith("block"):
        inputs = {"hidden_states": rng.standard_normal((batch, seq, config.width)).astype(np.float32)}
    else:
        inputs = {"input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64)}
    got = create_runner("ort-cpu", artifact).run(inputs)
    want = float64_oracle(preset, inputs)
    assert list(got) == artifact.output_names
    for name, value in got.items():
        assert value.dtype == np.float32, name
        assert value.shape == want[name].shape, name
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(value, want[name], rtol=0, atol=5e-5 * scale, err_msg=name)


BLOCK_BAD = {
    "wrong dtype": ({"hidden_states": np.zeros((1, 2, 12))}, r"'hidden_states'.*float32.*float64"),
    "wrong rank": ({"hidden_states": np.zeros((2, 12), np.float32)}, r"'hidden_states'.*rank 3.*rank 2"),
    "wrong width": ({"hidden_states": np.zeros((1, 2, 11), np.float32)}, r"'hidden_states'.*axis 2.*12.*11"),
    "missing": ({}, r"missing \['hidden_states'\]"),
    "extra": (
        {"hidden_states": np.zeros((1, 2, 12), np.float32), "attention_mask": np.ones((1, 2), np.float32)},
        r"unexpected \['attention_mask'\]",
    ),
    "empty": ({"hidden_states": np.zeros((1, 0, 12), np.float32)}, r"'hidden_states'.*axis 1.*empty"),
    "NaN": ({"hidden_states": np.full((1, 2, 12), np.nan, np.float32)}, r"'hidden_states'.*non-finite"),
    "Inf": ({"hidden_states": np.full((1, 2, 12), -np.inf, np.float32)}, r"'hidden_states'.*non-finite"),
    "too long": ({"hidden_states": np.zeros((1, 33, 12), np.float32)}, r"'hidden_states'.*33.*max_positions=32"),
}


@pytest.mark.parametrize("case", BLOCK_BAD)
def test_bad_block_feed_never_reaches_onnxruntime(block_runner, monkeypatch, case):
    feed, pattern = BLOCK_BAD[case]
    monkeypatch.setattr(block_runner, "session", ForbiddenSession())
    with pytest.raises(InputError, match=pattern):
        block_runner.run(feed)


DECODER_BAD = {
    "float ids": ({"input_ids": np.zeros((1, 3), np.float32)}, r"'input_ids'.*int64.*float32"),
    "id == vocab": ({"input_ids": np.array([[1, 96, 2]], np.int64)}, r"'input_ids'.*token id 96.*\[0, 96\)"),
    "negative id": ({"input_ids": np.array([[-3]], np.int64)}, r"'input_ids'.*token id -3"),
    "too long": ({"input_ids": np.zeros((2, 33), np.int64)}, r"'input_ids'.*33.*max_positions=32"),
}


@pytest.mark.parametrize("case", DECODER_BAD)
def test_bad_decoder_feed_never_reaches_onnxruntime(exported, monkeypatch, case):
    feed, pattern = DECODER_BAD[case]
    runner = create_runner("ort-cpu", exported("decoder-small"))
    monkeypatch.setattr(runner, "session", ForbiddenSession())
    with pytest.raises(InputError, match=pattern):
        runner.run(feed)


def test_unknown_backend_lists_known_and_available(exported):
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'ort-gpu'.*ort-cpu.*available here:.*ort-cpu"):
        create_runner("ort-gpu", exported("block-small"))


@pytest.mark.skipif(CUDA_AVAILABLE, reason="CUDAExecutionProvider is available here, so ort-cuda is not unavailable")
def test_cuda_backend_unavailable_on_cpu_machine(exported):
    assert "ort-cuda" not in available_backends()
    with pytest.raises(BackendUnavailableError, match=r"'ort-cuda'.*not available.*available here: .*ort-cpu"):
        check_backend("ort-cuda")
    with pytest.raises(BackendUnavailableError, match="ort-cuda"):
        create_runner("ort-cuda", exported("block-small"))


@pytest.mark.skipif(CUDA_AVAILABLE, reason="CUDAExecutionProvider is available here")
def test_session_loader_refuses_missing_provider_without_fallback(exported):
    loader = SessionLoader(exported("block-small").model_path, "CUDAExecutionProvider")
    with pytest.raises(
        BackendUnavailableError, match="CUDAExecutionProvider.*available providers: .*CPUExecutionProvider"
    ):
        loader()


def test_runner_refuses_a_session_on_another_provider():
    class FakeSession:
        def get_providers(self):
            return ["CPUExecutionProvider"]

    class FakeLoader:
        provider = "CUDAExecutionProvider"

        def __call__(self):
            return FakeSession()

    with pytest.raises(BackendUnavailableError, match="CPUExecutionProvider.*CUDAExecutionProvider"):
        OrtRunner(FakeLoader(), [], ["logits"], name="ort-cuda")


def test_session_loader_wraps_unloadable_files(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"definitely not onnx")
    with pytest.raises(ModelFileError, match="junk.onnx.*onnxruntime could not load"):
        SessionLoader(path, "CPUExecutionProvider")()


def test_without_onnxruntime_the_ort_backends_are_unavailable(exported, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` raise ImportError
    assert available_providers() == []
    names = available_backends()
    assert "ort-cpu" not in names and "ort-cuda" not in names
    assert {"eager", "eager-f64", "onnx-reference"} <= set(names)
    with pytest.raises(BackendUnavailableError, match="ort-cpu"):
        create_runner("ort-cpu", exported("block-small"))
    with pytest.raises(BackendUnavailableError, match="onnxruntime is not importable"):
        SessionLoader(exported("block-small").model_path, "CPUExecutionProvider")()
