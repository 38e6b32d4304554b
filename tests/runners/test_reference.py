"""The ONNX reference evaluator backend: accuracy, device reporting, feed checks, corrupt files."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from artifact import MANIFEST_FILE, MODEL_FILE
from artifact.errors import InputError, ModelFileError
from models.artifacts import artifact_config, open_artifact
from models.presets import get_preset
from runners.reference import ReferenceRunner
from runners.registry import create_runner


def float64_oracle(preset: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    model = get_preset(preset).build().double()
    args = [torch.from_numpy(v).double() if v.dtype.kind == "f" else torch.from_numpy(v) for v in inputs.values()]
    with torch.no_grad():
        return {k: v.numpy() for k, v in model(*args).items()}


class ForbiddenEvaluator:
    def run(self, *args, **kwargs):
        raise AssertionError("the reference evaluator was called with a feed that should have been rejected")


def test_runner_identity_and_time(exported):
    runner = create_runner("onnx-reference", exported("block-small"))
    assert isinstance(runner, ReferenceRunner)
    assert runner.name == "onnx-reference"
    assert "onnx.reference" in runner.device
    assert runner.last_inference_time is None
    runner.run({"hidden_states": np.zeros((1, 2, 12), np.float32)})
    assert isinstance(runner.last_inference_time, float) and runner.last_inference_time >= 0.0


@pytest.mark.parametrize("preset,batch,seq", [("block-small", 2, 4), ("decoder-small", 1, 5)])
def test_outputs_match_float64_eager(exported, preset, batch, seq):
    artifact = exported(preset)
    config = get_preset(preset).config
    rng = np.random.default_rng(7)
    if preset.startswith("block"):
        inputs = {"hidden_states": rng.standard_normal((batch, seq, config.width)).astype(np.float32)}
    else:
        inputs = {"input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64)}
    got = create_runner("onnx-reference", artifact).run(inputs)
    want = float64_oracle(preset, inputs)
    assert list(got) == artifact.output_names
    for name, value in got.items():
        assert value.dtype == np.float32 and value.shape == want[name].shape, name
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(value, want[name], rtol=0, atol=5e-5 * scale, err_msg=name)


def test_runner_from_an_in_memory_proto(exported):
    artifact = exported("block-small")
    proto = onnx.load(str(artifact.model_path))
    runner = ReferenceRunner(proto, artifact.input_specs, ["logits"], artifact_config(artifact))
    x = np.random.default_rng(1).standard_normal((1, 3, 12)).astype(np.float32)
    out = runner.run({"hidden_states": x})
    assert list(out) == ["logits"]
    np.testing.assert_allclose(
        out["logits"], float64_oracle("block-small", {"hidden_states": x})["logits"], rtol=0, atol=5e-4
    )


@pytest.mark.parametrize(
    "feed,pattern",
    [
        ({"hidden_states": np.zeros((1, 2, 12), np.float64)}, r"'hidden_states'.*float32.*float64"),
        ({"hidden_states": np.zeros((1, 2, 12, 1), np.float32)}, r"'hidden_states'.*rank 3.*rank 4"),
        ({"hidden_states": np.zeros((1, 2, 13), np.float32)}, r"'hidden_states'.*12.*13"),
        ({"x": np.zeros((1, 2, 12), np.float32)}, r"missing \['hidden_states'\].*unexpected \['x'\]"),
        ({"hidden_states": np.full((1, 2, 12), np.nan, np.float32)}, r"'hidden_states'.*non-finite"),
        ({"hidden_states": np.zeros((1, 40, 12), np.float32)}, r"'hidden_states'.*40.*max_positions=32"),
    ],
)
def test_bad_feed_never_reaches_the_evaluator(exported, monkeypatch, feed, pattern):
    runner = create_runner("onnx-reference", exported("block-small"))
    monkeypatch.setattr(runner, "evaluator", ForbiddenEvaluator())
    with pytest.raises(InputError, match=pattern):
        runner.run(feed)


def test_model_truncated_at_a_field_boundary_is_a_model_file_error(exported, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(exported("block-small").directory, target)
    data = (target / MODEL_FILE).read_bytes()
    proto = onnx.load_from_string(data)
    del proto.functions[-1]
    truncated = proto.SerializeToString()
    assert data.startswith(truncated) and len(truncated) < len(data)  # really a truncation of the file
    (target / MODEL_FILE).write_bytes(truncated)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    entry = manifest["graphs"][0] if "graphs" in manifest else manifest
    entry["sha256" if "graphs" in manifest else "model_sha256"] = hashlib.sha256(truncated).hexdigest()
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ModelFileError):
        create_runner("onnx-reference", open_artifact(target))
