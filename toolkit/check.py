"""Cross-check: every backend's outputs against the float64 eager oracle, stage by stage."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

import numpy as np

from models.registry import get_family
from runners.compare import Comparison, ToleranceConfig, compare
from runners.registry import DEFAULT_BACKENDS, check_backend, create_runner
from toolkit.artifacts import Artifact, load_onnx
from toolkit.configs import PRESETS
from toolkit.errors import ConfigError, InputError

DEFAULT_BATCH, DEFAULT_SEQUENCE = 2, 5


@dataclass
class BackendResult:
    name: str
    device: str
    comparison: Comparison
    seconds: float

    @property
    def passed(self) -> bool:
        return bool(self.comparison)

    @property
    def first_divergence(self) -> str | None:
        failure = self.comparison.first_failure
        return None if failure is None else failure.name


@dataclass
class CheckReport:
    artifact: str
    stages: list[str]
    inputs: dict[str, list[int]]
    input_source: str
    calibration: dict[str, float]
    backends: list[BackendResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.backends) and all(b.passed for b in self.backends)

    @property
    def first_divergence(self) -> dict | None:
        """The earliest failing stage in computation order, over all backends."""
        best = None
        for backend in self.backends:
            failure = backend.comparison.first_failure
            if failure is None:
                continue
            index = self.stages.index(failure.name)
            if best is None or index < best[0]:
                best = (index, backend.name, failure)
        if best is None:
            return None
        index, backend, failure = best
        return {"backend": backend, "stage": failure.name, "index": index, "reason": failure.reason,
                "max_abs": failure.to_dict()["max_abs"], "allowed": failure.allowed}

    def to_dict(self) -> dict:
        results = []
        for backend in self.backends:
            for output in backend.comparison.outputs:
                results.append({"backend": backend.name, **output.to_dict()})
        return {
            "passed": self.passed,
            "artifact": self.artifact,
            "reference": "eager-f64",
            "inputs": self.inputs,
            "input_source": self.input_source,
            "backends": [
                {"name": b.name, "device": b.device, "passed": b.passed,
                 "first_divergence": b.first_divergence, "seconds": b.seconds}
                for b in self.backends
            ],
            "results": results,
            "first_divergence": self.first_divergence,
            "calibration": self.calibration,
            "platform": platform.platform(),
        }


def default_inputs(artifact: Artifact, batch: int | None, sequence: int | None, seed: int) -> tuple[dict, str]:
    """The preset's fixed inputs when it has them and no size was asked for, else seeded random ones."""
    preset = PRESETS.get(artifact.manifest.get("preset") or "")
    if preset is not None and preset.inputs is not None and batch is None and sequence is None:
        return _cast_to_specs(preset.inputs(), artifact), f"fixed inputs of preset {preset.name!r}"
    config = artifact.config()
    batch = DEFAULT_BATCH if batch is None else batch
    sequence = min(DEFAULT_SEQUENCE, config.max_positions) if sequence is None else sequence
    for name, value in (("batch", batch), ("sequence length", sequence)):
        if value < 1:
            raise InputError(f"{name}: expected a positive integer, got {value}")
    if sequence > config.max_positions:
        raise InputError(f"sequence length {sequence} exceeds the model's max_positions={config.max_positions}")
    rng = np.random.default_rng(seed)
    inputs = get_family(artifact.family).random_inputs(config, batch, sequence, rng)
    return _cast_to_specs(inputs, artifact), f"random (seed {seed}, batch {batch}, sequence {sequence})"


def _cast_to_specs(inputs: dict, artifact: Artifact) -> dict:
    return {s["name"]: np.asarray(inputs[s["name"]]).astype(s["dtype"]) for s in artifact.input_specs if s["name"] in inputs}


def cross_check(
    artifact: Artifact,
    backends: tuple[str, ...] | list[str] = DEFAULT_BACKENDS,
    *,
    inputs: dict[str, np.ndarray] | None = None,
    batch: int | None = None,
    sequence: int | None = None,
    seed: int = 0,
    tolerances: ToleranceConfig | None = None,
) -> CheckReport:
    if not backends:
        raise ConfigError("no backends to check; name at least one, e.g. --backends eager,ort-cpu")
    for name in backends:
        check_backend(name)  # fail on a typo before any model is built
    if inputs is None:
        inputs, source = default_inputs(artifact, batch, sequence, seed)
    else:
        source = "user-supplied"
    proto = load_onnx(artifact.model_path)
    oracle = create_runner("eager-f64", artifact, proto)
    reference = oracle.run(inputs)
    eager32 = create_runner("eager", artifact, proto)
    eager32_outputs = eager32.run(inputs)
    # The float32 eager model's own error is the yardstick for every backend's tolerance.
    calibration = {name: float(np.max(np.abs(eager32_outputs[name].astype(np.float64) - reference[name]), initial=0.0))
                   for name in artifact.output_names}
    report = CheckReport(
        artifact=str(artifact.directory or artifact.model_path),
        stages=list(artifact.output_names),
        inputs={k: list(v.shape) for k, v in inputs.items()},
        input_source=source,
        calibration=calibration,
    )
    for name in backends:
        if name == "eager":
            runner, outputs = eager32, eager32_outputs
        else:
            runner = create_runner(name, artifact, proto)
            outputs = runner.run(inputs)
        comparison = compare(reference, outputs, dtype="float32", tolerances=tolerances,
                             calibration=calibration, order=report.stages)
        report.backends.append(BackendResult(name, runner.device, comparison, runner.last_inference_time or 0.0))
    return report
