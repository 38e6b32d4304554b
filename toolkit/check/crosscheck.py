"""Cross-check: every backend's outputs against the float64 eager oracle, stage by stage."""

from __future__ import annotations

import copy
import platform
from dataclasses import dataclass, field

import numpy as np
import torch

from models.registry import get_family
from runners.compare import Comparison, ToleranceConfig, compare
from models.registry import has_cache, lm_defaults
from runners.eager import model_from_artifact
from runners.decoding.generate import CachedLM
from runners.registry import DEFAULT_BACKENDS, artifact_dtype, check_backend, create_runner
from artifact import Artifact, load_onnx
from models.presets import PRESETS
from artifact.errors import ConfigError, InputError
from models.artifacts import artifact_config
from exporters.quantize import INT8_ACTIVATIONS_LEVEL

DEFAULT_BATCH, DEFAULT_SEQUENCE = 2, 5


@dataclass
class BackendResult:
    name: str
    device: str
    comparison: Comparison
    seconds: float
    placement: dict | None = None  # GPU ONNX Runtime backends: runners.ort.PlacementAudit.to_dict()

    @property
    def passed(self) -> bool:
        placed = self.placement is None or self.placement["ok"] or self.placement.get("fallback_allowed", False)
        return bool(self.comparison) and placed

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
    # Comparisons against stored golden outputs (toolkit.check.golden), one per backend plus the oracle.
    golden: list[BackendResult] = field(default_factory=list)
    golden_info: dict = field(default_factory=dict)
    # Node-level divergence findings (toolkit.check.localize), filled by --localize.
    localizations: list = field(default_factory=list)
    # The arrays behind the numbers (feeds per graph, oracle outputs, each backend's outputs), kept for
    # golden files, localisation and plots; not serialised.
    arrays: dict = field(default_factory=dict, repr=False)
    dtype: str = "float32"  # the artifact's export dtype, which picks the tolerances

    @property
    def passed(self) -> bool:
        return bool(self.backends) and all(b.passed for b in self.backends) and all(g.passed for g in self.golden)

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
            "dtype": self.dtype,
            "inputs": self.inputs,
            "input_source": self.input_source,
            "backends": [
                {"name": b.name, "device": b.device, "passed": b.passed,
                 "first_divergence": b.first_divergence, "seconds": b.seconds, "placement": b.placement}
                for b in self.backends
            ],
            "results": results,
            "first_divergence": self.first_divergence,
            "calibration": self.calibration,
            "golden": None if not self.golden else {
                **self.golden_info,
                "passed": all(g.passed for g in self.golden),
                "results": [{"backend": g.name, **o.to_dict()} for g in self.golden for o in g.comparison.outputs],
            },
            "localizations": [loc.to_dict() for loc in self.localizations],
            "platform": platform.platform(),
        }


def default_inputs(artifact: Artifact, batch: int | None, sequence: int | None, seed: int) -> tuple[dict, str]:
    """The preset's fixed inputs when it has them and no size was asked for, else seeded random ones.

    Only external inputs are made: a graph input produced by an earlier graph
    (the decoder's `encoder_output`) is not.
    """
    preset = PRESETS.get(artifact.manifest.preset or "")
    if preset is not None and preset.inputs is not None and batch is None and sequence is None:
        return _cast_to_specs(preset.inputs(), artifact), f"fixed inputs of preset {preset.name!r}"
    config = artifact_config(artifact)
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
    specs = {s.name: s for g in artifact.graphs for s in g.input_specs}
    return {name: np.asarray(value).astype(specs[name].dtype) for name, value in inputs.items() if name in specs}


def graph_feed(graph, inputs: dict, produced: dict) -> dict:
    """A graph's feed: the user's inputs, earlier graphs' outputs cast to the declared dtype, and an
    empty KV cache (T_past = 0) for cache inputs the user left out."""
    feed = {}
    for spec in graph.input_specs:
        if spec.name in inputs:
            feed[spec.name] = inputs[spec.name]
        elif spec.name in produced:
            feed[spec.name] = np.asarray(produced[spec.name]).astype(spec.dtype)
    if "input_ids" in feed and not any(name.startswith("past.") for name in inputs):
        implied = lm_defaults(graph.input_specs, feed["input_ids"])
        feed.update({name: value for name, value in implied.items() if name not in inputs})
    return feed


def cross_check(
    artifact: Artifact,
    backends: tuple[str, ...] | list[str] = DEFAULT_BACKENDS,
    *,
    inputs: dict[str, np.ndarray] | None = None,
    batch: int | None = None,
    sequence: int | None = None,
    seed: int = 0,
    tolerances: ToleranceConfig | None = None,
    decode_steps: int = 0,
    allow_cpu_fallback: bool = False,
) -> CheckReport:
    """Run every backend on every graph and compare each stage with the float64 eager oracle.

    Graphs run in order; a later graph's inputs that an earlier graph produces
    (the decoder's `encoder_output`) come from the oracle, cast to float32, so
    each graph is judged on identical inputs.

    decode_steps > 0 (KV-cache artifacts): after the prefill every backend
    decodes that many steps through its own cache, fed the oracle's greedy
    tokens, and each step's logits are compared as `decode.{k}.logits`.

    GPU ONNX Runtime backends also get a placement audit (one profiled run): a compute node on the
    CPU fails the backend unless allow_cpu_fallback.
    """
    if not backends:
        raise ConfigError("no backends to check; name at least one, e.g. --backends eager,ort-cpu")
    if decode_steps and not has_cache(artifact.graphs[0].input_specs):
        raise ConfigError("--decode-steps needs a KV-cache artifact; export a language model with --variant serving")
    for name in backends:
        check_backend(name, artifact_dtype(artifact))  # fail on a typo before any model is built
    level = (artifact.manifest.quantization or {}).get("accuracy_level")
    if isinstance(level, int) and level >= INT8_ACTIVATIONS_LEVEL and tolerances is None:
        # The oracle applies the dequantized weights to float activations; this graph rounds the
        # activations to int8 first, so the default float tolerances would fail it on every run.
        raise ConfigError(f"{artifact.location}: quantized at --accuracy-level {level}, which rounds activations "
                          "to int8 inside MatMulNBits, so its outputs are not comparable with the float64 oracle at "
                          "float tolerances; check the same quantization made with --accuracy-level 0, or give "
                          "--tolerances with the error you accept")
    if inputs is None:
        inputs, source = default_inputs(artifact, batch, sequence, seed)
    else:
        source = "user-supplied"
    protos = {g.name: load_onnx(g.model_path) for g in artifact.graphs}
    oracle_model = model_from_artifact(artifact, protos).to(torch.float64)
    eager32_model = copy.deepcopy(oracle_model).to(torch.float32)
    reference, eager32_outputs, feeds = {}, {}, {}
    for graph in artifact.graphs:
        feeds[graph.name] = graph_feed(graph, inputs, reference)
        oracle = create_runner("eager-f64", artifact, graph.name, protos=protos, eager_model=oracle_model)
        reference.update(oracle.run(feeds[graph.name]))
        eager32 = create_runner("eager", artifact, graph.name, protos=protos, eager_model=eager32_model)
        eager32_outputs.update(eager32.run(feeds[graph.name]))
    stages = list(artifact.output_names)
    if decode_steps:
        lengths = [len(inputs["input_ids"][0]), decode_steps]
        if sum(lengths) > artifact_config(artifact).max_positions:
            raise InputError(f"prompt {lengths[0]} + {decode_steps} decode steps exceed max_positions="
                             f"{artifact_config(artifact).max_positions}")
        oracle = create_runner("eager-f64", artifact, protos=protos, eager_model=oracle_model)
        decoded, tokens = _decode(oracle, artifact, inputs["input_ids"], decode_steps)
        reference.update(decoded)
        eager32 = create_runner("eager", artifact, protos=protos, eager_model=eager32_model)
        eager32_outputs.update(_decode(eager32, artifact, inputs["input_ids"], decode_steps, tokens)[0])
        stages += list(decoded)
    # The eager model's own error at the export dtype is the yardstick for every backend's tolerance;
    # a non-finite one (float16 overflow in eager) must not make every tolerance infinite.
    calibration = {name: float(np.max(np.abs(eager32_outputs[name].astype(np.float64) - reference[name]), initial=0.0))
                   for name in stages}
    calibration = {name: value if np.isfinite(value) else 0.0 for name, value in calibration.items()}
    report = CheckReport(
        artifact=artifact.location,
        stages=stages,
        inputs={k: list(v.shape) for k, v in inputs.items()},
        input_source=source,
        calibration=calibration,
        arrays={"inputs": inputs, "feeds": feeds, "reference": reference, "outputs": {}},
        dtype=artifact_dtype(artifact),
    )
    for name in backends:
        outputs, seconds, device, placement = {}, 0.0, "", None
        for graph in artifact.graphs:
            model = eager32_model if name == "eager" else oracle_model if name == "eager-f64" else None
            runner = create_runner(name, artifact, graph.name, protos=protos, eager_model=model)
            outputs.update(runner.run(feeds[graph.name]))
            seconds += runner.last_inference_time or 0.0
            device = runner.device
            if getattr(runner, "binding_device", "cpu") != "cpu":
                audit = runner.placement(feeds[graph.name]).to_dict()
                if placement is None or (placement["ok"] and not audit["ok"]):
                    placement = dict(audit, graph=graph.name, fallback_allowed=allow_cpu_fallback)
        if decode_steps:
            outputs.update(_decode(runner, artifact, inputs["input_ids"], decode_steps, tokens)[0])
        comparison = compare(reference, outputs, dtype=artifact_dtype(artifact), tolerances=tolerances,
                             calibration=calibration, order=stages)
        report.backends.append(BackendResult(name, device, comparison, seconds, placement))
        report.arrays["outputs"][name] = outputs
    return report


def _decode(runner, artifact: Artifact, prompt: np.ndarray, steps: int, tokens: list | None = None):
    """Prefill `prompt` then decode `steps` tokens, greedily or replaying `tokens`; logits per step."""
    lm = CachedLM(runner, artifact_config(artifact).max_positions)
    logits = lm.step(prompt)[:, -1:]
    chosen, outputs = [], {}
    for k in range(steps):
        token = logits.argmax(-1) if tokens is None else tokens[k]  # (B, 1)
        chosen.append(token)
        logits = lm.step(np.asarray(token, dtype=np.int64))
        outputs[f"decode.{k}.logits"] = np.asarray(logits)
    return outputs, chosen
